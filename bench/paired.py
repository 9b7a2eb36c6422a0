"""Paired per-seed differences: the one ground on which fedge's result pages claim a direction.

Two methods run with the same seeds see the same data splits, model initialisations and client schedules, so their
difference seed by seed removes what the seeds vary. A direction is claimed only when that difference has the same
sign in every seed (two seeds at least); otherwise it is "within noise", however far apart the means are.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

HOLDS, FAILS, NOISE = "HOLDS", "does NOT hold", "within noise"


@dataclass(frozen=True)
class Paired:
    """a − b seed by seed."""

    diffs: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.diffs)

    @property
    def sign(self) -> int:
        """+1 if a > b in every seed, −1 if a < b in every seed, 0 otherwise (signs differ, a tie, or fewer
        than two seeds)."""
        if len(self.diffs) < 2:
            return 0
        if all(d > 0 for d in self.diffs):
            return 1
        if all(d < 0 for d in self.diffs):
            return -1
        return 0

    def text(self, digits: int = 2) -> str:
        """ "+1.20, −0.40, +2.00 per seed (mean +0.93)"."""
        each = ", ".join(f"{d:+.{digits}f}" for d in self.diffs)
        return f"{each} per seed (mean {self.mean:+.{digits}f})"


def paired(a: Sequence[float | None], b: Sequence[float | None]) -> Paired:
    """The differences a[i] − b[i] of two runs' values listed in the same seed order; a seed missing from either
    (None) is left out. ValueError if the lists are of different lengths: they cannot be of the same seeds."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same seeds: {len(a)} against {len(b)}")
    return Paired(tuple(x - y for x, y in zip(a, b) if x is not None and y is not None))


def verdict(a_label: str, a: Sequence[float | None], b_label: str, b: Sequence[float | None], digits: int = 2) -> str:
    """One line on the claim "a > b": HOLDS or does NOT hold when the paired difference has one sign in every
    seed, within noise otherwise, with the per-seed differences beside it."""
    p = paired(a, b)
    if not p.diffs:
        return f"- n/a: {a_label} > {b_label} (no seed has both)"
    word = {1: HOLDS, -1: FAILS, 0: NOISE}[p.sign]
    return f"- {word}: {a_label} > {b_label}, {a_label} − {b_label} = {p.text(digits)}"
