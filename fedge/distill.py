"""The distillation loss CE + λ·KL of pFedClub Eq. (5) and the validity of λ and T: one definition for the eager
client (edge_client.training) and the ExecuTorch training program (export.training_program)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from fedge.constants import KD_TEMPERATURE


def check_kd_settings(kd_lambda: float, temperature: float) -> None:
    """ValueError unless λ is finite and >= 0 (0 = plain CE) and the temperature T is finite and > 0."""
    if not (math.isfinite(kd_lambda) and kd_lambda >= 0):
        raise ValueError(f"kd_lambda must be a finite number >= 0, got {kd_lambda}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def kd_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float | torch.Tensor = KD_TEMPERATURE
) -> torch.Tensor:
    """KL(q_student ‖ p_teacher) of softmax(logits / T), averaged over the batch, times T² (Hinton et al.).

    pFedClub Eq. (5) writes KL(β_m(x), β̂_m(x)) with the student first; we read it literally as
    D_KL(student ‖ teacher), as issue 3 states. (Deep Mutual Learning [36], which the paper cites,
    uses the reverse direction; swapping the two log-probabilities below gives it.) T may be a 0-dim
    tensor. Shapes must be equal (never broadcast), else ValueError.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {list(student_logits.shape)} and teacher logits "
            f"{list(teacher_logits.shape)} differ in shape"
        )
    log_q = F.log_softmax(student_logits / temperature, dim=1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=1)
    return F.kl_div(log_p, log_q, reduction="batchmean", log_target=True) * temperature**2


def kd_terms(
    logits: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor,
    kd_lambda: float | torch.Tensor,
    temperature: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE + λ·KL, CE, KL) of pFedClub Eq. (5), KL as in `kd_kl`. λ and T may be 0-dim tensors (the training
    program takes them as inputs, so one program serves every round); λ = 0 gives plain CE. Bad shapes raise
    ValueError (kd_kl); λ and T are not checked here (check_kd_settings)."""
    ce = F.cross_entropy(logits, y)
    kl = kd_kl(logits, teacher_logits, temperature)
    return ce + kd_lambda * kl, ce, kl


def kd_loss(
    logits: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor,
    kd_lambda: float | torch.Tensor,
    temperature: float | torch.Tensor,
) -> torch.Tensor:
    """CE + λ·KL of pFedClub Eq. (5) (see kd_terms)."""
    return kd_terms(logits, y, teacher_logits, kd_lambda, temperature)[0]
