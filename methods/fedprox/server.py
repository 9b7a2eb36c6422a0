"""`fedprox` (Li et al., MLSys 2020, Algorithm 2): FedAvg's server with a proximal client objective.

Each round the server sends the global model w^t to the selected clients; each returns a γ-inexact minimiser of
h_k(w; w^t) = F_k(w) + μ/2·‖w − w^t‖² (Eq. 2, methods/fedprox/client.py), and the server averages them as FedAvg
does (example-weighted, the shares capped at `max_client_share`; Algorithm 2's plain mean over devices sampled ∝ p_k
has the same expectation). Clients that do less work (fewer epochs: stragglers) are still averaged, as Algorithm 2
allows; fedge's round deadline decides who replies.

Where fedge chooses (docs/deviations.md): μ defaults to 0.01 (none of the five seed papers reports it; FedProx tunes
it over {0.001, 0.01, 0.1, 1}); clients train with the run's optimizer (Adam at `lr`, as every fedge strategy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from fedge.config import ConfigError
from fedge.wire.messages import ClientInfo, Task
from fedge.wire.payloads import Expected
from methods.fedavg.server import FedAvg, FedAvgOptions
from methods.fedprox.tasks import ProxTrainTask
from server.strategy import option, register_strategy, torch_profiles


@dataclass(frozen=True)
class FedProxOptions(FedAvgOptions):
    """FedAvg's option and μ of Eq. (2)."""

    mu: float = option(0.01, "μ of Eq. (2): weight of the proximal term μ/2·‖w − w^t‖²; 0 = FedAvg (paper: tuned)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.mu >= 0 and math.isfinite(self.mu)):
            raise ConfigError(f"mu must be a finite number >= 0 (0: FedAvg's local training), got {self.mu}")


@register_strategy("fedprox", FedProxOptions)
class FedProx(FedAvg):
    """Homogeneous fleets only: FedAvg's global model, averaging and checkpoint; the clients' `prox_train`."""

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        torch_profiles(self.name, clients, "trains with a proximal term on every client")
        super().setup(clients)

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        self.shares = {}
        settings = self.train_task(upload=True, kind=ProxTrainTask, mu=self.options.mu)
        models = {"global": self.global_model}
        return {cid: Task("prox_train", rnd, settings.to_config(), models) for cid in active}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """A training reply carries the client's model, of the global architecture; an evaluation only metrics."""
        return Expected(models={"local": self.global_model.spec}) if task.type == "prox_train" else Expected()
