"""Per-FedAvg's task configuration, which both its halves share."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedge.tasks import TaskConfigError, TrainTask


@dataclass(frozen=True)
class MetaTask(TrainTask):
    """A `meta_train` or `meta_evaluate` task: TrainTask's epochs, batch size and seed, the inner step size α and
    the outer β of Algorithm 1 (plain SGD steps: TrainTask's lr is not used)."""

    alpha: float = 0.01
    beta: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        if not all(v > 0 and math.isfinite(v) for v in (self.alpha, self.beta)):
            raise TaskConfigError(f"alpha and beta must be finite numbers > 0, got {self.alpha}, {self.beta}")
