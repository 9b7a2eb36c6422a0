"""`fedavg+` (Jiang, Konečný, Rush, Kannan 2019, "FedAvg with local tuning"; a baseline of FedMN Table II): FedAvg's
rounds (its tasks, averaging and checkpoint, methods/fedavg/server.py); every evaluation first fine-tunes the global
model on the client's own training data for `tune_epochs` epochs (methods/fedavg_plus/client.py) and evaluates that
personalized copy. The global model is never changed by the tuning.

Where fedge chooses (docs/deviations.md): the tuning runs the run's local training (Adam at `lr`, its batch size);
FedMN takes FedAvg+'s numbers from FedEM's benchmark, which tunes one local epoch: `tune_epochs` defaults to 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from fedge.config import ConfigError
from fedge.wire.messages import Task
from methods.fedavg.server import FedAvg, FedAvgOptions
from methods.fedavg_plus.tasks import TuneEvaluateTask
from server.strategy import option, register_strategy


@dataclass(frozen=True)
class FedAvgPlusOptions(FedAvgOptions):
    """FedAvg's option and the local tuning's epochs."""

    tune_epochs: int = option(1, "epochs of local tuning of the global model before each evaluation (FedEM's: 1)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.tune_epochs <= 1000:
            raise ConfigError(
                f"tune_epochs must be in 1..1000 (plain FedAvg: --strategy fedavg), got {self.tune_epochs}"
            )


@register_strategy("fedavg+", FedAvgPlusOptions)
class FedAvgPlus(FedAvg):
    """FedAvg whose clients are evaluated on the global model after tuning it locally."""

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        settings = self.train_task(upload=False, kind=TuneEvaluateTask)
        config = dataclasses.replace(settings, epochs=self.options.tune_epochs).to_config()
        return {cid: Task("tune_evaluate", rnd, config, {"global": self.global_model}) for cid in clients}
