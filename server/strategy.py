"""The server half of a strategy (plan and aggregate hooks) and the strategy registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.messages import ClientInfo, Result, Task, Weights
from fedge.registry import Registry
from fedge.errors import UserError


class StrategyError(UserError, ValueError):
    """A strategy cannot run on this fleet or configuration; the message says what to change."""


@dataclass(frozen=True)
class StrategyConfig:
    """What every strategy gets from the run configuration (each strategy reads the fields it needs)."""

    local_epochs: int
    batch_size: int
    lr: float
    seed: int
    device: str = "cpu"
    eta: float = C.PFEDCLUB_PLUS_ETA
    clusters: int = C.CLUSTERS
    ablation: str = "none"
    cmsr_index: str = C.CMSR_INDEX
    kd_lambda: float = C.KD_LAMBDA
    finetune_epochs: int = C.FINETUNE_EPOCHS
    max_candidates: int = C.MAX_CANDIDATES
    sgd_lr: float = C.SGD_LR
    sgd_momentum: float = C.SGD_MOMENTUM
    max_client_share: float = C.MAX_CLIENT_SHARE


@dataclass(frozen=True)
class PublicData:
    """The server's public set (pFedClub: 8 % of the data); labels are None for the unlabeled setting."""

    x: torch.Tensor
    y: torch.Tensor | None


class Strategy:
    """Hooks the round loop calls. Strategies never loop over rounds and never touch the transport."""

    name = "base"
    # A personalized strategy's final accuracy covers only clients that trained at least once
    # (a never-selected client has no personalized model); a global-model strategy covers all.
    personalized = True

    def __init__(self, config: StrategyConfig, public: PublicData | None = None) -> None:
        self.config = config
        self.public = public
        self.clients: dict[str, ClientInfo] = {}

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        """Called once with the registered fleet; raise StrategyError if the fleet does not fit."""
        self.clients = dict(clients)

    def train_config(self, upload: bool) -> dict[str, Any]:
        """The JSON config of a local-training task (epochs, batch, Adam's lr, the executorch runtime's SGD lr and
        momentum, seed, whether to upload weights)."""
        c = self.config
        return {"epochs": c.local_epochs, "batch_size": c.batch_size, "lr": c.lr, "sgd_lr": c.sgd_lr,
                "sgd_momentum": c.sgd_momentum, "seed": c.seed, "upload": upload}

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        """The task for each active client this round. A failed round is planned again, so planning must not
        change anything `state()` returns."""
        raise NotImplementedError

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        """Fold the replies that arrived (possibly none) into the server state."""
        raise NotImplementedError

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        """Evaluation tasks; by default each client evaluates its own current model."""
        return {cid: Task("evaluate", rnd) for cid in clients}

    def record(self, rnd: int, client: str) -> dict[str, Any]:
        """Extra per-client fields for metrics.jsonl (e.g. teacher size); none by default."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Extra fields for summary.json; none by default."""
        return {}

    def final_models(self) -> dict[str, dict[str, Weights]]:
        """The server-side models a finished run leaves per client, by role (e.g. {"3": {"teacher": ...}});
        written to the run folder and exported after the last round. None by default."""
        return {}

    def state(self) -> Tree:
        """Everything later rounds and the summary need, as a checkpoint tree (fedge.checkpoint); by default
        nothing. A run resumed from it must continue bit-identically."""
        return {}

    def load_state(self, state: Tree) -> None:
        """Restore what `state()` returned, after `setup` with the same fleet; by default there is nothing to
        restore. A tree that does not fit this strategy and fleet raises StrategyError."""


STRATEGIES: Registry[type[Strategy]] = Registry("strategy", StrategyError)


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator adding a strategy under `name` (which becomes its `name` attribute)."""
    def add(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        return STRATEGIES.add(name, cls)
    return add


def create_strategy(name: str, config: StrategyConfig, public: PublicData | None = None) -> Strategy:
    """Instantiate a registered strategy; an unknown name raises StrategyError listing the known ones."""
    return STRATEGIES.get(name)(config, public)
