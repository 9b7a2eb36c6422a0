"""`local`: every client trains alone on its own data; the baseline any federation must beat.

As the papers run it (DC-PFL's and FedGH's Local-T): every client trains its own model every round, selected or
not, so over T rounds it gets the same T x E local epochs as a client of a federation where all take part. Option
`every_round=false` trains only the round's selected clients (a client then trains in about active/N of the
rounds, and one never selected never trains: a weaker baseline than the papers')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from fedge.wire.messages import ClientInfo, Result, Task, client_order
from server.strategy import Strategy, StrategyOptions, option, register_strategy


@dataclass(frozen=True)
class LocalOptions(StrategyOptions):
    """Which clients train in a round."""

    every_round: bool = option(
        True,
        "every client trains every round, selected or not (the papers' Local-T); false: only the round's "
        "selected clients train",
    )


@register_strategy("local", LocalOptions)
class Local(Strategy):
    """No communication of weights: plan local training, aggregate nothing. Works for any zoo."""

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        self.trained: set[str] = set()  # the clients whose training this round was accepted

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        trains = sorted(self.clients, key=client_order) if self.options.every_round else active
        return {cid: Task("train", rnd, self.train_task(upload=False).to_config()) for cid in trains}

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        """The clients the round loop asks for (the round's selected; after the last round every client that ever
        trained) and, under Local-T, every client that trained this round."""
        return super().evaluation(rnd, sorted(set(clients) | self.trained, key=client_order))

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        self.trained = set(results)
