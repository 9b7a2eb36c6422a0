"""How a round's uploads become one tensor per name: example-weighted averages with capped shares, and the robust
aggregators users know from Flower (coordinate-wise median, trimmed mean, Krum, multi-Krum), for every strategy
that averages (FedAvg, HeteroFL, FedTrans's per-model averages of Eq. (5), FedMN's blocks and router).

Every function takes parts that cover the top-left slice of a base tensor (server/slices.py): a same-architecture
average is the case where every part covers the whole of it, HeteroFL's submodels the case where they do not.
What each aggregator defends against and what it costs on honest fleets is in docs/security.md (bench/robust.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from fedge import constants as C
from fedge.config import check_aggregation
from fedge.model.weights import State
from server.slices import region, sliced_average


@dataclass(frozen=True)
class Aggregation:
    """The run's aggregator (`--set aggregator=...`): `mean` (the strategy's own example-weighted average, shares
    capped), `median` (coordinate-wise, FedMedian), `trimmed_mean` (coordinate-wise, dropping `trim_fraction` of the
    values at each end, FedTrimmedAvg's β), `krum` (the one upload closest to its n - f - 2 nearest others, Blanchard
    et al. 2017) or `multi_krum` (the example-weighted average of the n - f uploads with the best Krum scores);
    `byzantine` is Krum's f; with n <= 2f + 2 uploads, where Krum's choice is arbitrary (a tie of two), the round
    takes the coordinate-wise median instead. ConfigError for an unknown aggregator or a value out of range."""

    kind: str = C.DEFAULT_AGGREGATOR
    trim_fraction: float = C.TRIM_FRACTION
    byzantine: int = C.KRUM_BYZANTINE

    def __post_init__(self) -> None:
        check_aggregation(self.kind, self.trim_fraction, self.byzantine)

    @property
    def weighted(self) -> bool:
        """Whether the clients' shares (example counts, capped) weigh in: the mean and multi-Krum's average."""
        return self.kind in ("mean", "multi_krum")


def capped_shares(weights: Sequence[float], cap: float) -> list[float]:
    """Each weight's share of the total, no share above `cap` (reliability-notes §6.8: self-reported example
    counts set the weights, so one client's share is capped): shares over the cap are set to it and the rest of
    the mass is split over the others in proportion to their weights, repeatedly (water-filling). With
    len(weights) * cap <= 1 no split fits and every share is equal. ValueError for no or non-positive weights."""
    if not weights or min(weights) <= 0:
        raise ValueError(f"capped_shares needs positive weights, got {list(weights)}")
    n = len(weights)
    if cap * n <= 1:
        return [1 / n] * n
    capped: set[int] = set()
    while True:
        free = sum(w for i, w in enumerate(weights) if i not in capped)
        mass = 1 - cap * len(capped)
        shares = [cap if i in capped else mass * w / free for i, w in enumerate(weights)]
        over = {i for i, share in enumerate(shares) if i not in capped and share > cap}
        if not over:
            return shares
        capped |= over


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


def combine(
    base: State, parts: Sequence[tuple[State, float]], how: Aggregation, learned: Collection[str] | None = None
) -> State:
    """The robust aggregate of `parts` (state, share) over `base` (the model the parts were trained from; each
    part tensor covers the top-left slice of base's tensor of its name, a part may lack a tensor): `mean` is
    sliced_average; `median` and `trimmed_mean` work element by element over the parts holding the element
    (unweighted, as Flower's); `krum` and `multi_krum` pick parts by their updates of the `learned` tensors
    (krum_selection) and average the picked ones. An element no part holds keeps base's value; integer buffers take
    the largest value present. ValueError for no parts, a non-positive share or a part that does not fit base."""
    if not parts:
        raise ValueError("combine needs at least one part")
    if any(not w > 0 for _, w in parts):
        raise ValueError(f"combine needs positive shares, got {[w for _, w in parts]}")
    kind = how.kind
    if kind in ("krum", "multi_krum") and len(parts) < 2 * how.byzantine + 3:
        kind = "median"  # Krum needs n > 2f + 2 to pick anything but an arbitrary part (Blanchard et al., Lemma 1)
    if kind in ("krum", "multi_krum"):
        return average(base, [parts[i] for i in krum_selection(base, parts, how, learned)])
    if kind == "mean":
        return average(base, parts)
    out: State = {}
    for name, old in base.items():
        held = [state[name] for state, _ in parts if name in state]
        if not old.is_floating_point() or not held:
            out[name] = sliced_average({name: old}, [({name: t}, 1.0) for t in held])[name]
            continue
        out[name] = coordinate_statistic(old, held, kind, how.trim_fraction).to(old.dtype)
    return out


def average(base: State, parts: Sequence[tuple[State, float]]) -> State:
    """The parts' weighted average: weighted_average when every part holds all of base (one architecture),
    sliced_average otherwise (HeteroFL's submodels, FedMN's blocks)."""
    full = all(
        state.keys() == base.keys() and all(state[n].shape == t.shape for n, t in base.items()) for state, _ in parts
    )
    if full:
        return weighted_average([state for state, _ in parts], [w for _, w in parts])
    return sliced_average(base, parts)


def coordinate_statistic(
    base: torch.Tensor, held: Sequence[torch.Tensor], kind: str, trim_fraction: float
) -> torch.Tensor:
    """Per element of `base`, the median (the mean of the two middle values for an even count) or the trimmed
    mean (floor(trim_fraction x count) values dropped at each end) of the values the `held` tensors (top-left
    slices) give it, in float64; base's value where none does."""
    stack = torch.full((len(held), *base.shape), float("nan"), dtype=torch.float64)
    for i, t in enumerate(held):
        stack[(i, *region(t.shape, base.shape))] = t.double()
    values, _ = torch.sort(stack, dim=0)  # NaN (not held) sorts last
    count = (~torch.isnan(stack)).sum(0)
    rank = torch.arange(len(held)).view(-1, *([1] * base.dim()))
    if kind == "median":
        keep = (rank == (count - 1) // 2) | (rank == count // 2)
    else:
        cut = torch.floor(count.double() * trim_fraction).long()
        keep = (rank >= cut) & (rank < count - cut)
    kept = torch.where(keep, values, torch.zeros_like(values))
    mean = kept.sum(0) / keep.sum(0).clamp_min(1)
    return torch.where(count > 0, mean, base.double())


def krum_selection(
    base: State, parts: Sequence[tuple[State, float]], how: Aggregation, learned: Collection[str] | None = None
) -> list[int]:
    """Krum's pick (one index) or multi-Krum's (the n - f best, at least one), by score: the summed squared
    distances from a part's update (part - base) to its n - f - 2 nearest others' (at least one; Blanchard et al.
    2017, Flower's `aggregate_krum`), over the `learned` tensors (None: every floating tensor; BatchNorm's running
    statistics would outweigh the weights). Parts of different sizes (HeteroFL's slices) are compared on the
    elements both hold, the mean squared difference scaled to the whole model's size, so that narrow parts are not
    closer for holding less. Ties go to the earlier part."""
    n = len(parts)
    if n == 1:
        return [0]
    names = [k for k, t in base.items() if t.is_floating_point() and (learned is None or k in learned)]
    size = sum(base[k].numel() for k in names)
    updates = [
        {k: state[k].double() - base[k][region(state[k].shape, base[k].shape)].double() for k in names if k in state}
        for state, _ in parts
    ]
    distances = torch.zeros(n, n, dtype=torch.float64)
    for i, j in itertools.combinations(range(n), 2):
        squares, count = 0.0, 0
        for k in updates[i].keys() & updates[j].keys():
            a, b = updates[i][k], updates[j][k]
            shape = [min(x, y) for x, y in zip(a.shape, b.shape)]
            squares += float((a[region(shape, a.shape)] - b[region(shape, b.shape)]).square().sum())
            count += math.prod(shape)
        distances[i, j] = distances[j, i] = squares / count * size if count else math.inf
    closest = max(1, n - how.byzantine - 2)
    scores = [float(torch.sort(distances[i])[0][1 : closest + 1].sum()) for i in range(n)]
    order = sorted(range(n), key=lambda i: (scores[i], i))
    picked = 1 if how.kind == "krum" else max(1, n - how.byzantine)
    return sorted(order[:picked])
