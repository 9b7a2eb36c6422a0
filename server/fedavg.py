"""`fedavg` (McMahan et al. 2017): example-weighted averaging of one shared architecture."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from fedge.checkpoint import Tree
from fedge.messages import ClientInfo, Result, Task, Weights
from fedge.seeding import derive_seed
from fedge.spec import build
from fedge.weights import State
from server.strategy import Strategy, StrategyError, register_strategy


def weighted_average(states: Sequence[State], weights: Sequence[float]) -> State:
    """Σ_k w_k θ_k / Σ_k w_k per tensor; integer buffers (BN counters) take the maximum.

    Raises ValueError when there is nothing to average or the weights do not sum to a positive number.
    """
    total = float(sum(weights))
    if not states or total <= 0:
        raise ValueError("weighted_average needs at least one state with positive weight")
    out = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            out[name] = sum(s[name].double() * (w / total) for s, w in zip(states, weights)).to(first.dtype)
        else:
            out[name] = torch.stack([s[name] for s in states]).max(0).values
    return out


@register_strategy("fedavg")
class FedAvg(Strategy):
    """Homogeneous fleets only: the server holds one global model, sends it, averages the replies."""

    personalized = False

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        archs = [info.spec.with_origin(None) for info in clients.values()]
        if any(a != archs[0] for a in archs):
            names = sorted({info.spec.name for info in clients.values()})
            raise StrategyError(f"fedavg needs every client on the same model, but this fleet has {names}; "
                                f"use a single-model zoo (e.g. --zoo cnn1) or a heterogeneous strategy")
        spec = archs[0]
        torch.manual_seed(derive_seed(self.config.seed, "fedavg-init"))
        self.global_model = Weights(spec, build(spec).state_dict())

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        models = {"global": self.global_model}
        return {cid: Task("train", rnd, self.train_config(upload=True), models) for cid in active}

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        replies = [r for r in results.values() if "local" in r.models]
        if not replies:
            return
        states = [r.models["local"].state for r in sorted(replies, key=lambda r: r.client_id)]
        counts = [r.num_examples for r in sorted(replies, key=lambda r: r.client_id)]
        self.global_model = Weights(self.global_model.spec, weighted_average(states, counts))

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        return {cid: Task("evaluate", rnd, models={"global": self.global_model}) for cid in clients}

    def state(self) -> Tree:
        """The global model."""
        return {"global": self.global_model}

    def load_state(self, state: Tree) -> None:
        """Take the checkpoint's global model; one of another architecture raises StrategyError."""
        model = state["global"]
        if model.spec != self.global_model.spec:
            raise StrategyError(f"checkpoint holds a global {model.spec.name!r}, this fleet trains "
                                f"{self.global_model.spec.name!r}")
        self.global_model = model
