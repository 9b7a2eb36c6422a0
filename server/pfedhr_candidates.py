"""pFedHR's reassembly candidate search (its Alg. 1, rules R1-R4) as a seeded sampler over block keys.

Layer-wise decomposition (pFedHR §3.1.2) is `server.blocks.split_blocks`: a "layer" here is one
block of a client's spec, as pFedHR §4.2 itself builds blocks ("Conv" = conv + pool + BN + ReLU,
"FC" = linear + ReLU + dropout) and its supplement asks for block-wise decomposition on real models.
Each block gets an operation type from its output: a feature map (C, H, W) is "conv", a vector is
"fc", so O = {conv, fc} and the operation order of R2 is conv → fc.

What the paper leaves open, and what is chosen here:
- Alg. 1 lines 8-14 scan the groups in label order 1..K and take every pair that passes R1-R2,
  which ties the candidates to arbitrary K-means labels and yields one fixed set; here each
  extension step draws uniformly from all pool blocks that pass R1-R2 (the same rules), starting
  from every eligible pair in turn (lines 2-7, in an rng-shuffled order), so the pool is diverse
  and reproducible from `rng`. Lines 15-19 (R3, R4) are then checked as written.
- M (the number of candidates) and the lengths are not fixed by the paper; the defaults follow
  the authors' code (`sample_models(min_layers=4, max_layers=6, expected=4)`): M = 4, 4-6 blocks.
- `classifier_last` (on by default; not a pFedHR rule): the last block must be some client's
  classifier (the last block of its model). Otherwise the final stitch, ReLU(Wᵀx + b), would clip
  the logits at zero.
- R1 compares raw block indices, like the paper; R4 counts the group labels present in `groups`
  (an empty K-means cluster has no label there). When the rules cannot be met (e.g. K >
  max_blocks) the result is empty, as the supplement says Alg. 1 may return an empty C_t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

import numpy as np

from fedge.constants import PFEDHR_ATTEMPTS_PER_CANDIDATE, PFEDHR_MAX_BLOCKS, PFEDHR_MIN_BLOCKS
from fedge.spec import BlockSpec
from server.blocks import Key, PoolBlock

Candidate = tuple[Key, ...]

CONV, FC = "conv", "fc"
OPERATION_ORDER: tuple[str, ...] = (CONV, FC)  # R2: an fc block is never followed by a conv block


@dataclass(frozen=True)
class PFedHROptions:
    """pFedHR candidate search settings; invalid values raise ValueError.

    num_candidates: M, the most candidates returned (authors' code: 4); min_blocks, max_blocks:
    candidate length bounds (authors' code: 4 and 6); classifier_last: the last block must be a
    classifier (ours, see the module docstring); attempts_per_candidate: sampling budget, the
    search stops after num_candidates * attempts_per_candidate walks.
    """

    num_candidates: int = 4  # the authors' expected_num_models
    min_blocks: int = PFEDHR_MIN_BLOCKS
    max_blocks: int = PFEDHR_MAX_BLOCKS
    classifier_last: bool = True
    attempts_per_candidate: int = PFEDHR_ATTEMPTS_PER_CANDIDATE

    def __post_init__(self) -> None:
        if self.num_candidates < 1 or self.attempts_per_candidate < 1:
            raise ValueError(f"num_candidates and attempts_per_candidate must be >= 1, got {self}")
        if not 1 <= self.min_blocks <= self.max_blocks:
            raise ValueError(f"need 1 <= min_blocks <= max_blocks, got {self.min_blocks}, {self.max_blocks}")


def operation_of(spec: BlockSpec) -> str:
    """A block's operation type O (pFedHR §3.1.2): "conv" if it outputs a feature map, else "fc"."""
    return CONV if len(spec.out_shape) == 3 else FC


def block_operations(blocks: Iterable[PoolBlock]) -> dict[Key, str]:
    """The operation type of every pool block, by key."""
    return {b.key: operation_of(b.spec) for b in blocks}


def classifier_keys(blocks: Iterable[PoolBlock]) -> frozenset[Key]:
    """The last block of every client's model (the block that outputs its logits)."""
    last: dict[str, int] = {}
    for b in blocks:
        last[b.client] = max(last.get(b.client, -1), b.index)
    return frozenset(last.items())


def rule_violation(
    candidate: Sequence[Key],
    groups: Mapping[Key, int],
    operations: Mapping[Key, str],
    options: PFedHROptions = PFedHROptions(),
    classifiers: Collection[Key] | None = None,
) -> str | None:
    """The first rule `candidate` breaks ("R1".."R4", "length", "classifier"), or None if it passes all.

    R1 (Alg. 1 line 10): strictly increasing block indices; R2 (line 11): operation types in
    OPERATION_ORDER; R3 (line 16): every operation type of the pool present; R4 (line 17): every
    group label of the pool present. "classifier" is checked only when options.classifier_last and
    `classifiers` is given. A key missing from `groups` or `operations` raises KeyError.
    """
    if not options.min_blocks <= len(candidate) <= options.max_blocks:
        return "length"
    rank = [OPERATION_ORDER.index(operations[k]) for k in candidate]
    if any(b[1] <= a[1] for a, b in zip(candidate, candidate[1:])):
        return "R1"
    if any(b < a for a, b in zip(rank, rank[1:])):
        return "R2"
    if {operations[k] for k in candidate} != set(operations[k] for k in groups):
        return "R3"
    if {groups[k] for k in candidate} != set(groups.values()):
        return "R4"
    if options.classifier_last and classifiers is not None and candidate[-1] not in classifiers:
        return "classifier"
    return None


def _check(groups: Mapping[Key, int], operations: Mapping[Key, str]) -> None:
    missing = [k for k in groups if k not in operations]
    if missing:
        raise ValueError(f"blocks {missing[:3]} have a group but no operation type")
    unknown = sorted({operations[k] for k in groups} - set(OPERATION_ORDER))
    if unknown:
        raise ValueError(f"unknown operation types {unknown}; pFedHR rule R2 orders {OPERATION_ORDER}")


def _walk(
    start: Key,
    keys: Sequence[Key],
    rank: Mapping[Key, int],
    length: int,
    rng: np.random.Generator,
    classifiers: Collection[Key] | None,
) -> Candidate:
    """Extend `start` (Alg. 1 lines 8-14) by uniform draws among blocks passing R1 and R2.

    With `classifiers`, the block at position `length` must be one, and a classifier ends the walk.
    """
    path = [start]
    while len(path) < length and not (classifiers is not None and path[-1] in classifiers):
        last = path[-1]
        nxt = [k for k in keys if k[1] > last[1] and rank[k] >= rank[last]]
        if classifiers is not None and len(path) == length - 1:
            nxt = [k for k in nxt if k in classifiers]
        if not nxt:
            break
        path.append(nxt[int(rng.integers(len(nxt)))])
    return tuple(path)


def pfedhr_candidates(
    groups: Mapping[Key, int],
    operations: Mapping[Key, str],
    rng: np.random.Generator,
    options: PFedHROptions = PFedHROptions(),
    classifiers: Collection[Key] | None = None,
) -> list[Candidate]:
    """Up to M distinct candidates passing R1-R4 (pFedHR Alg. 1), shared by all clients of the round.

    Starts are the pool blocks whose operation type comes first in the pool's order (no other
    start can pass R2 and R3), visited in an rng-shuffled cycle; each walk draws a target length
    in [min_blocks, max_blocks], extends by `_walk`, and is kept if `rule_violation` passes it
    and it is new. Pass `classifiers` (see `classifier_keys`) to apply options.classifier_last.
    Returns [] for an empty pool or when no walk within the budget passes. Deterministic given
    the rng state. Raises ValueError for a grouped block without an operation type or an
    operation type outside OPERATION_ORDER.
    """
    _check(groups, operations)
    if not groups:
        return []
    keys = sorted(groups, key=lambda k: (k[1], k[0]))
    rank = {k: OPERATION_ORDER.index(operations[k]) for k in keys}
    first = min(rank.values())
    starts = [keys[i] for i in rng.permutation(len(keys)) if rank[keys[i]] == first]
    heads = classifiers if options.classifier_last else None
    found: dict[Candidate, None] = {}
    for attempt in range(options.num_candidates * options.attempts_per_candidate):
        length = int(rng.integers(options.min_blocks, options.max_blocks + 1))
        path = _walk(starts[attempt % len(starts)], keys, rank, length, rng, heads)
        if rule_violation(path, groups, operations, options, heads) is None:
            found[path] = None
            if len(found) == options.num_candidates:
                break
    return list(found)
