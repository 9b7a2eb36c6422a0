"""Local training and evaluation loops in eager PyTorch (the Raspberry Pi / Jetson runtime)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedge.constants import EVAL_BATCH_SIZE


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one local training run."""

    epochs: int
    batch_size: int
    lr: float
    seed: int


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig) -> float:
    """Train in place with Adam and cross-entropy; returns the mean loss of the last epoch.

    Raises ValueError when the data are empty or the loss becomes non-finite.
    """
    if len(x) == 0:
        raise ValueError("no training data")
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # dropout draws from the global generator
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    model.train()
    last = math.nan
    for _ in range(cfg.epochs):
        total, count = 0.0, 0
        for idx in torch.randperm(len(x), generator=gen).split(cfg.batch_size):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
        last = total / count
        if not math.isfinite(last):
            raise ValueError(f"training diverged: loss is {last}")
    return last


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
