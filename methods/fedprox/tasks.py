"""FedProx's task configuration, which both its halves share."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedge.tasks import TaskConfigError, TrainTask


@dataclass(frozen=True)
class ProxTrainTask(TrainTask):
    """A `prox_train` task: local training as TrainTask on the objective h_k(w; w^t) = F_k(w) + μ/2·‖w − w^t‖² of
    FedProx Eq. (2), w^t the global model the task carries; μ = 0 is FedAvg's local training."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.mu >= 0 and math.isfinite(self.mu)):
            raise TaskConfigError(f"mu must be a finite number >= 0, got {self.mu}")
