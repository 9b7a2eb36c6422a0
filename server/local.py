"""`local`: every client trains alone on its own data; the baseline any federation must beat.

As the papers run it (DC-PFL's and FedGH's Local-T): every client trains its own model every round, selected or
not, so over T rounds it gets the same T x E local epochs as a client of a federation where all take part. Option
`every_round=false` trains only the round's selected clients (a client then trains in about active/N of the
rounds, and one never selected never trains: a weaker baseline than the papers')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from fedge.messages import Result, Task, client_order
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

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        trains = sorted(self.clients, key=client_order) if self.options.every_round else active
        return {cid: Task("train", rnd, self.train_task(upload=False).to_config()) for cid in trains}

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        """Every client that trained this round evaluates (all of them under Local-T)."""
        return super().evaluation(rnd, sorted(self.clients, key=client_order) if self.options.every_round else clients)

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        return None
