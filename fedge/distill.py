"""The distillation loss CE + λ·KL of pFedClub Eq. (5) and the validity of λ, T and the KL's direction: one
definition for the eager client (edge_client.training) and the ExecuTorch training program (export.training_program)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from fedge.constants import KD_DIRECTION, KD_DIRECTIONS, KD_TEMPERATURE


def check_kd_settings(kd_lambda: float, temperature: float, direction: str = KD_DIRECTION) -> None:
    """ValueError unless λ is finite and >= 0 (0 = plain CE), the temperature T is finite and > 0, and the
    direction is one of KD_DIRECTIONS."""
    if not (math.isfinite(kd_lambda) and kd_lambda >= 0):
        raise ValueError(f"kd_lambda must be a finite number >= 0, got {kd_lambda}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    direction_weight(direction)


def direction_weight(direction: str) -> float:
    """The training program's `kd_direction` input: 1.0 for "teacher_student", 0.0 for "student_teacher";
    ValueError naming the valid directions otherwise."""
    if direction not in KD_DIRECTIONS:
        raise ValueError(f"kd_direction must be one of {', '.join(KD_DIRECTIONS)}, got {direction!r}")
    return 1.0 if direction == "teacher_student" else 0.0


def kd_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float | torch.Tensor = KD_TEMPERATURE,
    direction: str | torch.Tensor = KD_DIRECTION,
) -> torch.Tensor:
    """The KL of pFedClub Eq. (5) / pFedHR Eq. (6) between p_teacher and q_student = softmax(logits / T),
    averaged over the batch, times T² (Hinton et al.).

    direction "teacher_student" (the default): KL(p_teacher ‖ q_student), the teacher's distribution as the
    target; "student_teacher": KL(q_student ‖ p_teacher), Eq. (5) read literally (student first). Eq. (5)'s
    notation is ambiguous; the method it follows (Deep Mutual Learning [36]) and the authors' code use the
    teacher as the target, hence the default. The training program passes a 0-dim tensor w instead
    (direction_weight: 1 or 0) and gets w·KL(p ‖ q) + (1 − w)·KL(q ‖ p), so one program serves both. T may be a
    0-dim tensor. Unequal shapes (never broadcast) or an unknown direction raise ValueError.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {list(student_logits.shape)} and teacher logits "
            f"{list(teacher_logits.shape)} differ in shape"
        )
    log_q = F.log_softmax(student_logits / temperature, dim=1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=1)
    if isinstance(direction, torch.Tensor):
        return (direction * _kl(log_p, log_q) + (1 - direction) * _kl(log_q, log_p)) * temperature**2
    if direction_weight(direction):
        return _kl(log_p, log_q) * temperature**2
    return _kl(log_q, log_p) * temperature**2


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a ‖ b) from log-probabilities, averaged over the batch: F.kl_div(log_b, log_a, "batchmean",
    log_target=True) written out (the same forward bits on CPU), since vmap has no batching rule for kl_div
    (edge_client/batched.py trains many students at once)."""
    return (log_a.exp() * (log_a - log_b)).sum() / log_a.shape[0]


def kd_terms(
    logits: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor,
    kd_lambda: float | torch.Tensor,
    temperature: float | torch.Tensor,
    direction: str | torch.Tensor = KD_DIRECTION,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE + λ·KL, CE, KL) of pFedClub Eq. (5), KL as in `kd_kl` (direction included). λ, T and the direction
    may be 0-dim tensors (the training program takes them as inputs, so one program serves every round); λ = 0
    gives plain CE. Bad shapes or an unknown direction raise ValueError (kd_kl); λ and T are not checked here
    (check_kd_settings)."""
    ce = F.cross_entropy(logits, y)
    kl = kd_kl(logits, teacher_logits, temperature, direction)
    return ce + kd_lambda * kl, ce, kl


def kd_loss(
    logits: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor,
    kd_lambda: float | torch.Tensor,
    temperature: float | torch.Tensor,
    direction: str | torch.Tensor = KD_DIRECTION,
) -> torch.Tensor:
    """CE + λ·KL of pFedClub Eq. (5) (see kd_terms)."""
    return kd_terms(logits, y, teacher_logits, kd_lambda, temperature, direction)[0]
