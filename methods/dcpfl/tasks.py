"""DC-PFL's task configuration, which both its halves (and FedGH's) share."""

from __future__ import annotations

from dataclasses import dataclass

from fedge.tasks import TaskConfigError, TrainTask


@dataclass(frozen=True)
class DCTrainTask(TrainTask):
    """A `dc_train` task (DC-PFL, FedGH): local training as TrainTask, plus λ of DC-PFL Eq. (4) (the weight of the
    auxiliary loss L_kd toward the global class means the task carries; 0 = CE alone, Eq. (2)) and whether to
    upload each class's covariance (Eq. 7) beside its mean and count (FedGH uploads means only)."""

    aux_lambda: float = 0.0
    covariance: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.aux_lambda >= 0:
            raise TaskConfigError(f"aux_lambda must be >= 0, got {self.aux_lambda}")
