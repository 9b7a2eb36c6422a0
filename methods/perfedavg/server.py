"""`perfedavg` (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020, Algorithm 1; a homogeneous baseline of pFedClub and pFedHR
Table 2): FedAvg's server (its averaging and checkpoint, methods/fedavg/server.py) with the clients' local MAML
steps (`meta_train`, methods/perfedavg/client.py); every evaluation personalizes the global model by one step of
size α on the client's own data (`meta_evaluate`).

Where fedge chooses (docs/deviations.md): the first-order version (Per-FedAvg (FO)), as the implementations the
comparing papers ran; α = 0.01 and β = 0.001 (options `inner_lr`, `outer_lr`) (none of the seed papers reports
them); the run's local epochs give τ: one meta step per pair of batches of each epoch; torch clients only (an
ExecuTorch training program takes no meta step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fedge.config import ConfigError
from fedge.wire.messages import ClientInfo, Task
from fedge.wire.payloads import Expected
from methods.fedavg.server import FedAvg, FedAvgOptions
from methods.perfedavg.tasks import MetaTask
from server.strategy import option, register_strategy, torch_profiles


@dataclass(frozen=True)
class PerFedAvgOptions(FedAvgOptions):
    """FedAvg's option and the step sizes of Algorithm 1."""

    # named for what they are, not α and β: `alpha` is the run's Dirichlet key, which `--set alpha=` would set instead
    inner_lr: float = option(0.01, "α: the inner SGD step, and the personalization step at evaluation (Eq. 8)")
    outer_lr: float = option(0.001, "β: the outer (meta) SGD step of Algorithm 1 line 8")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not all(v > 0 and math.isfinite(v) for v in (self.inner_lr, self.outer_lr)):
            raise ConfigError(f"inner_lr and outer_lr must be finite numbers > 0, got {self.inner_lr}, {self.outer_lr}")


@register_strategy("perfedavg", PerFedAvgOptions)
class PerFedAvg(FedAvg):
    """FedAvg of the clients' meta steps; evaluation after one personalization step."""

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        torch_profiles(self.name, clients, "takes meta steps of plain SGD on every client")
        super().setup(clients)

    def settings(self, upload: bool) -> dict[str, Any]:
        """A MetaTask's config with this run's local training and the options' α and β."""
        o = self.options
        return self.train_task(upload, MetaTask, alpha=o.inner_lr, beta=o.outer_lr).to_config()

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        self.shares = {}
        config = self.settings(upload=True)
        return {cid: Task("meta_train", rnd, config, {"global": self.global_model}) for cid in active}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """A training reply carries the client's model, of the global architecture; an evaluation only metrics."""
        return Expected(models={"local": self.global_model.spec}) if task.type == "meta_train" else Expected()

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        config = self.settings(upload=False)
        return {cid: Task("meta_evaluate", rnd, config, {"global": self.global_model}) for cid in clients}
