"""Local training and evaluation loops in eager PyTorch (the Raspberry Pi / Jetson runtime)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from fedge.constants import EVAL_BATCH_SIZE, KD_DIRECTION, KD_LAMBDA, KD_TEMPERATURE, SGD_LR, SGD_MOMENTUM
from fedge.distill import check_kd_settings, kd_kl, kd_terms
from fedge.model.weights import load_module
from fedge.wire.messages import Weights


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one local training run; `lr` is Adam's (torch runtime), `sgd_*` are the executorch runtime's."""

    epochs: int
    batch_size: int
    lr: float
    seed: int
    sgd_lr: float = SGD_LR
    sgd_momentum: float = SGD_MOMENTUM


@dataclass(frozen=True)
class Distillation:
    """A distillation target for `fit`: the teacher's logits on every training sample (row i ↔ x[i]).

    `kd_lambda` is λ of pFedClub Eq. (5) / pFedHR Eq. (6) (the papers use 0.2); `temperature` T softens
    both distributions (1.0 = the papers' plain softmax); `kd_direction` orders the KL (fedge.distill.kd_kl:
    "teacher_student" = KL(teacher ‖ student), or "student_teacher").
    """

    teacher_logits: torch.Tensor
    kd_lambda: float = KD_LAMBDA
    temperature: float = KD_TEMPERATURE
    kd_direction: str = KD_DIRECTION


@dataclass(frozen=True)
class TrainStats:
    """Mean losses of the last epoch: the optimised total, its CE part, and the (unweighted) auxiliary part (the KL
    of distillation, DC-PFL's L_kd)."""

    loss: float
    ce: float
    kd: float


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig) -> float:
    """Train in place with Adam and cross-entropy; returns the mean loss of the last epoch.

    Raises ValueError when the data are empty or the loss becomes non-finite.
    """
    return fit(model, x, y, cfg).loss


def check_distillation(kd: Distillation, x: torch.Tensor) -> None:
    """ValueError unless the teacher logits match the data and λ, T and the direction are valid."""
    if kd.teacher_logits.dim() != 2 or len(kd.teacher_logits) != len(x):
        raise ValueError(f"teacher logits must be (num_samples={len(x)}, classes), got {list(kd.teacher_logits.shape)}")
    check_kd_settings(kd.kd_lambda, kd.temperature, kd.kd_direction)


def check_fit_inputs(x: torch.Tensor, kd: Distillation | None) -> None:
    """ValueError when there are no training data, or `kd` does not fit them (check_distillation)."""
    if len(x) == 0:
        raise ValueError("no training data")
    if kd is not None:
        check_distillation(kd, x)


# One batch's (loss to optimise, its cross-entropy part, its unweighted auxiliary part) from the batch's indices.
Objective = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def ce_kd_objective(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kd: Distillation | None) -> Objective:
    """CE, plus λ·KL to the teacher when `kd` is given (pFedClub Eq. (5)); with λ = 0 exactly CE, the KL then
    measured without gradient."""

    def terms(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ce_kd_terms(model(x[idx]), y[idx], None if kd is None else kd.teacher_logits[idx], kd)

    return terms


def ce_kd_terms(
    logits: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor | None, kd: Distillation | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch's (loss, CE, KL) for `ce_kd_objective`: CE + λ·KL to the batch's teacher logits when `kd` has
    λ > 0, else CE with the KL measured without gradient (0 without `kd`)."""
    if kd is not None and kd.kd_lambda > 0:
        return kd_terms(logits, y, teacher_logits, kd.kd_lambda, kd.temperature, kd.kd_direction)
    ce = F.cross_entropy(logits, y)
    kl = torch.zeros((), device=logits.device)
    if kd is not None:
        with torch.no_grad():
            kl = kd_kl(logits, teacher_logits, kd.temperature, kd.kd_direction)
    return ce, ce, kl


def fit(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    kd: Distillation | None = None,
    after_backward: Callable[[], None] | None = None,
    objective: Objective | None = None,
) -> TrainStats:
    """Train in place with Adam on CE, plus λ·KL to a teacher when `kd` is given (pFedClub Eq. (5)), or on the
    batch losses `objective` gives (DC-PFL's CE + λ·L_kd, methods/dcpfl/client.py). `after_backward` is called
    after every step's backward pass, before the optimiser steps (FedTrans reads the gradients there).

    Without `kd` (or with λ = 0) the updates are exactly those of plain CE training; the KL is then
    still measured (without gradient) when teacher logits are given. Raises ValueError when the data
    are empty, the teacher logits do not match the data, λ < 0, T ≤ 0, an unknown KL direction, or the loss
    becomes non-finite.
    """
    check_fit_inputs(x, kd)
    terms = objective or ce_kd_objective(model, x, y, kd)
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # dropout draws from the global generator
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model.train()
    stats = TrainStats(math.nan, math.nan, 0.0)
    for _ in range(cfg.epochs):
        total, ce_sum, kd_sum, count = 0.0, 0.0, 0.0, 0
        for idx in torch.randperm(len(x), generator=gen).split(cfg.batch_size):
            opt.zero_grad(set_to_none=True)
            loss, ce, aux = terms(idx)
            loss.backward()
            if after_backward is not None:
                after_backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            ce_sum += float(ce.detach()) * len(idx)
            kd_sum += float(aux.detach()) * len(idx)
            count += len(idx)
        stats = TrainStats(total / count, ce_sum / count, kd_sum / count)
        if not math.isfinite(stats.loss):
            raise ValueError(f"training diverged: loss is {stats.loss}")
    return stats


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's logits on x in eval mode, in batches; empty data raise ValueError."""
    if len(x) == 0:
        raise ValueError("no data to predict on")
    model.eval()
    return torch.cat([model(xb) for xb in x.split(EVAL_BATCH_SIZE)])


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on the given data; empty data raise ValueError."""
    if len(x) == 0:
        raise ValueError("no evaluation data")
    model.eval()
    correct, loss = 0, 0.0
    for xb, yb in zip(x.split(EVAL_BATCH_SIZE), y.split(EVAL_BATCH_SIZE)):
        logits = model(xb)
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    return correct / len(x), loss / len(x)


class Trainer(Protocol):
    """A runtime's local training loop: what a task handler calls, whichever runtime the device has."""

    runtime: str

    def fit(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, kd: Distillation | None = None
    ) -> TrainStats: ...

    def teacher_logits(self, teacher: Weights, x: torch.Tensor) -> torch.Tensor: ...


class TorchTrainer:
    """The `torch` runtime (Raspberry Pi, Jetson, servers): eager PyTorch, Adam, teacher logits in eager."""

    runtime = "torch"

    def fit(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, kd: Distillation | None = None
    ) -> TrainStats:
        return fit(model, x, y, cfg, kd)

    def teacher_logits(self, teacher: Weights, x: torch.Tensor) -> torch.Tensor:
        """The teacher's logits on x (weights already checked against their spec)."""
        return predict(load_module(teacher.spec, teacher.state), x)
