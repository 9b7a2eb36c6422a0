"""pFedMe's task configuration, which both its halves share."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedge.tasks import TaskConfigError, TrainTask


@dataclass(frozen=True)
class MoreauTask(TrainTask):
    """A `pfedme_train` task: TrainTask's epochs, batch size and seed, and Algorithm 1's λ (the Moreau envelope's
    regularization), K (steps solving Eq. 7 per batch), the personal step size and η (the local model's step size);
    plain SGD steps (TrainTask's lr is not used)."""

    lamda: float = 15.0
    inner_steps: int = 5
    personal_lr: float = 0.01
    eta: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not all(v > 0 and math.isfinite(v) for v in (self.lamda, self.personal_lr, self.eta)):
            raise TaskConfigError(f"lamda, personal_lr and eta must be finite numbers > 0, got {self}")
        if not 1 <= self.inner_steps <= 1000:
            raise TaskConfigError(f"inner_steps must be in 1..1000, got {self.inner_steps}")
