"""FedMN's task configuration, which both its halves share."""

from __future__ import annotations

from dataclasses import dataclass

from fedge import constants as C
from fedge.tasks import TaskConfigError, TrainTask


@dataclass(frozen=True)
class ModularTrainTask(TrainTask):
    """A `modular_train` task (FedMN): local training as TrainTask, the relaxed Bernoulli's temperature τ of Eq. (5)
    this round, the router's SGD learning rate, and whether the route is learnt (false: every path on, the router
    untouched: the warm-up, or a client whose route the server does not know yet)."""

    route_temperature: float = 1.0
    router_lr: float = C.ROUTER_LR
    learn_routing: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.route_temperature > 0 and self.router_lr > 0):
            raise TaskConfigError(
                f"route_temperature and router_lr must be > 0, got {self.route_temperature}, {self.router_lr}"
            )
