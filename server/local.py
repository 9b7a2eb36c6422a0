"""`local`: every client trains alone on its own data; the baseline any federation must beat."""

from __future__ import annotations

from typing import Mapping, Sequence

from fedge.messages import Result, Task
from server.strategy import Strategy, register_strategy


@register_strategy("local")
class Local(Strategy):
    """No communication of weights: plan local training, aggregate nothing. Works for any zoo."""

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        return {cid: Task("train", rnd, self.train_task(upload=False).to_config()) for cid in active}

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        return None
