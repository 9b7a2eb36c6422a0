"""`fedavg` (McMahan et al. 2017): example-weighted averaging of one shared architecture."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.config import ConfigError
from fedge.model.spec import build, parameter_names
from fedge.seeding import derive_seed
from fedge.wire.messages import ClientInfo, Result, Task, Weights
from fedge.wire.payloads import Expected
from server.aggregation import capped_shares, combine
from server.strategy import Strategy, StrategyError, StrategyOptions, option, register_strategy

log = logging.getLogger(__name__)


def checkpoint_global(current: Weights, state: Tree) -> Weights:
    """The global model a checkpoint's strategy state holds; one of another architecture than `current` (the one
    this fleet trains) raises StrategyError."""
    model = state["global"]
    if model.spec != current.spec:
        raise StrategyError(f"checkpoint holds a global {model.spec.name!r}, this fleet trains {current.spec.name!r}")
    return model


@dataclass(frozen=True)
class FedAvgOptions(StrategyOptions):
    """FedAvg's one option: how much of a round's average one client may get (its example count is its word)."""

    max_client_share: float = option(
        C.MAX_CLIENT_SHARE,
        "largest share of a round's average one client may get, in (0, 1]; 1 gives McMahan's plain example weights",
    )

    def __post_init__(self) -> None:
        if not 0 < self.max_client_share <= 1:
            raise ConfigError(
                f"max_client_share must be in (0, 1] (1: FedAvg's plain example weights), got {self.max_client_share}"
            )


@register_strategy("fedavg", FedAvgOptions)
class FedAvg(Strategy):
    """Homogeneous fleets only: the server holds one global model, sends it, averages the replies."""

    personalized = False
    update_of = {"local": "global"}

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        archs = [info.spec.with_origin(None) for info in clients.values()]
        if any(a != archs[0] for a in archs):
            names = sorted({info.spec.name for info in clients.values()})
            raise StrategyError(
                f"fedavg needs every client on the same model, but this fleet has {names}; "
                f"use a single-model zoo (e.g. --zoo cnn1) or a heterogeneous strategy"
            )
        spec = archs[0]
        self.shares: dict[str, float] = {}  # the last aggregation's share per client
        torch.manual_seed(derive_seed(self.config.seed, "fedavg-init"))
        self.global_model = Weights(spec, build(spec).state_dict())

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        self.shares = {}
        models = {"global": self.global_model}
        return {cid: Task("train", rnd, self.train_task(upload=True).to_config(), models) for cid in active}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """A training reply carries the client's model, of the global architecture; an evaluation only metrics."""
        return Expected(models={"local": self.global_model.spec}) if task.type == "train" else Expected()

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        replies = sorted((r for r in results.values() if "local" in r.models), key=lambda r: r.client_id)
        if not replies:
            return
        counts = [r.num_examples for r in replies]
        shares = capped_shares(counts, self.options.max_client_share)
        if self.config.aggregation.weighted:
            self.shares = {r.client_id: share for r, share in zip(replies, shares)}
        if self.shares and any(abs(share - count / sum(counts)) > 1e-12 for share, count in zip(shares, counts)):
            log.info(
                "round %d: aggregation shares capped at max_client_share=%g: %s",
                rnd,
                self.options.max_client_share,
                {cid: round(x, 4) for cid, x in self.shares.items()},
            )
        parts = [(r.models["local"].state, share) for r, share in zip(replies, shares)]
        spec = self.global_model.spec
        state = combine(self.global_model.state, parts, self.config.aggregation, parameter_names(spec))
        self.global_model = Weights(spec, state)

    def record(self, rnd: int, client: str) -> dict[str, float]:
        """The client's share of this round's average (its example count's, capped at max_client_share), where the
        run's aggregator weighs by shares."""
        return {"aggregation_share": self.shares[client]} if client in self.shares else {}

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        return {cid: Task("evaluate", rnd, models={"global": self.global_model}) for cid in clients}

    def state(self) -> Tree:
        """The global model."""
        return {"global": self.global_model}

    def load_state(self, state: Tree) -> None:
        """Take the checkpoint's global model; one of another architecture raises StrategyError."""
        self.global_model = checkpoint_global(self.global_model, state)
