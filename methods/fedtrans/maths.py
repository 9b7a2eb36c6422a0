"""FedTrans's equations as pure functions (Zhu et al., MLSys 2024): the degree of convergence (Eq. 1), utility-based
model assignment (Eqs. 2-3), the joint utility update (Eq. 4), model similarity from lineage (§4.2) and the soft
aggregation weights (Eq. 5)."""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

import numpy as np

Lineage = Mapping[str, "str | None"]  # a child's tensor name -> its parent's tensor it came from (None: new)


def degree_of_convergence(losses: Sequence[float], gamma: int, delta: int) -> float | None:
    """Eq. (1): DoC = (1/γ) Σ_{i=1..γ} (L(i − δ) − L(i)) / δ over the γ newest rounds of the loss curve `losses`
    (oldest first); None until it holds γ + δ rounds. A loss falling linearly by s per round has DoC = s.
    ValueError for γ < 1 or δ < 1."""
    if gamma < 1 or delta < 1:
        raise ValueError(f"DoC needs γ >= 1 and δ >= 1, got γ={gamma}, δ={delta}")
    n = len(losses)
    if n < gamma + delta:
        return None
    return sum((losses[i - delta] - losses[i]) / delta for i in range(n - gamma, n)) / gamma


def assignment_probabilities(utilities: Sequence[float]) -> list[float]:
    """Eq. (3): p_k = exp(U_k) / Σ_k exp(U_k) over a client's compatible models (computed shifted by the maximum,
    which leaves it unchanged). ValueError for no utilities or a non-finite one."""
    if not utilities or not all(math.isfinite(u) for u in utilities):
        raise ValueError(f"assignment needs finite utilities, got {list(utilities)}")
    top = max(utilities)
    weights = [math.exp(u - top) for u in utilities]
    total = sum(weights)
    return [w / total for w in weights]


def sample_model(utilities: Sequence[float], compatible: Sequence[int], rng: np.random.Generator) -> int:
    """Eq. (2): n = Sample(p^c, compatible models), p^c from Eq. (3) over `utilities` (indexed by model) restricted to
    the `compatible` model indices. ValueError when none is compatible."""
    if not compatible:
        raise ValueError("a client with no compatible model cannot be assigned one")
    p = assignment_probabilities([utilities[k] for k in compatible])
    return int(compatible[int(rng.choice(len(compatible), p=p))])


def standardized(losses: Mapping[str, float]) -> dict[str, float]:
    """The round's training losses as z-scores across its clients (Eq. (4)'s standardized L^c); all 0 when fewer
    than two clients or no spread."""
    if len(losses) < 2:
        return {cid: 0.0 for cid in losses}
    mean, spread = statistics.fmean(losses.values()), statistics.pstdev(losses.values())
    return {cid: (x - mean) / spread if spread > 0 else 0.0 for cid, x in losses.items()}


def update_utilities(
    utilities: Mapping[str, Sequence[float]],
    assigned: Mapping[str, int],
    z: Mapping[str, float],
    similarity: Sequence[Sequence[float]],
    compatible: Mapping[str, Sequence[int]],
) -> dict[str, list[float]]:
    """Eq. (4): for every client c that trained this round and every compatible model k,
    U_k^c ← U_k^c − L^c · sim(M_k, M*), with M* the model c trained and L^c its standardized loss. Other clients'
    and other models' utilities are unchanged; returns new lists."""
    out = {cid: list(u) for cid, u in utilities.items()}
    for cid, star in assigned.items():
        if cid not in z:
            continue
        for k in compatible[cid]:
            out[cid][k] -= z[cid] * similarity[k][star]
    return out


def lineage_map(lineages: Sequence[Lineage], child: int, ancestor: int) -> dict[str, str | None]:
    """Model `child`'s tensor names → the tensor of model `ancestor` (<= child) each descends from (None for one
    inserted after `ancestor`), composing the chain's one-step lineages: `lineages[k]` maps model k's tensor names
    to model k − 1's (lineages[0] maps model 0's names to themselves). ValueError unless 0 <= ancestor <= child."""
    if not 0 <= ancestor <= child < len(lineages):
        raise ValueError(f"model {ancestor} is not an ancestor of model {child} in a chain of {len(lineages)}")
    names: dict[str, str | None] = {name: name for name in lineages[child]}
    for k in range(child, ancestor, -1):
        names = {n: None if p is None else lineages[k][p] for n, p in names.items()}
    return names


def model_similarity(cells: Mapping[str, int], ancestors: Mapping[str, int | None]) -> float:
    """§4.2's sim(M_i, M_j) for model M_j (j >= i) against its ancestor M_i: the mean over M_j's cells (its conv and
    linear weights, `cells`: name → parameters) of the matching degree mc(l) = #param(l') / #param(l) of the cell l'
    of M_i that l descends from (1 when unchanged, below 1 when widened), 0 for a cell inserted after M_i
    (`ancestors`: name → l' parameters or None). Ours: the paper "cumulates" mc; the mean keeps sim in [0, 1]
    and sim(M, M) = 1, as Eq. (4) requires (the authors divide by the row maximum instead)."""
    if not cells:
        raise ValueError("a model without cells has no similarity")
    return statistics.fmean(
        0.0 if ancestors.get(name) is None else min(1.0, ancestors[name] / size)  # type: ignore[operator]
        for name, size in cells.items()
    )


def soft_weights(
    target: int,
    trained: Sequence[int],
    similarity: Sequence[Sequence[float]],
    eta: float,
    age: int,
    large_to_small: bool = False,
) -> dict[int, float]:
    """Eq. (5)'s weight of each model i that trained this round in the aggregate of model j = `target`:
    η^{1(i≠j)·t} · sim(M_i, M_j), with t = `age` (rounds since M_j was made), over i <= j (small→large sharing
    only; `large_to_small` admits every i, the paper's Table 1 ablation), normalised to sum to one (Eq. (5)'s
    denominator omits η, so its weights would not). Models with weight 0 are left out; {} when none remains."""
    raw = {
        i: (eta ** (age if i != target else 0)) * similarity[i][target]
        for i in trained
        if i <= target or large_to_small
    }
    raw = {i: w for i, w in raw.items() if w > 0}
    total = sum(raw.values())
    return {i: w / total for i, w in raw.items()}
