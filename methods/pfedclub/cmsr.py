"""pFedClub's CMSR candidate search (Alg. 1) over block keys and group labels: no tensors, seeded by a Generator.

A block key is `(client id, block index)` with 0-based indices (the paper counts from 1; the order
constraint `u > q` is the same under the shift). `groups` maps every block key of the round's pool
to its functional group label (§3.2.1). The module answers one question: which block sequences are
client m's candidates c_{m,1..S_m}. Stitching and sizes are `methods.reassembly.assemble`'s job.

What the paper leaves open, and what is chosen here (each is also said where it is implemented):
- line 20 "use C_m to generate candidates that satisfy the order condition": candidates are the
  *maximal* order-satisfying paths through the per-step sets C_m[r] (one block per step, strictly
  increasing indices, starting at the anchor); a path that dead-ends before the last searched step
  is kept and completed by Step 3 (lines 21-22 test the length per candidate, so lengths may differ);
- line 20 keeps every path; their number can explode (≈ G_k^{R_m}, §3.2.2: 3 to 56,378 per client
  on five Zoo I uploads). An optional cap `max_candidates` keeps k of them drawn uniformly (seeded), so
  the kept candidates have the composition of Alg. 1's whole set. §3.2.2's "random subsets" are random
  block combinations *instead of* CMSR; these are a sample *of* CMSR's candidates. (A rule that ranks
  candidates by Eq. (1) to the client's blocks, as we did before, keeps mostly the client's own blocks:
  sim(k, k) is the maximum.);
- ablation `max` (Table 3): the most similar block of the group *other than* B_m,1 itself (B_m,1
  is trivially the most similar to itself, which would make `max` the identity); ties → first in
  (index, client) order. Ablation `min`: the smallest index; ties (B_m,1 and other models' first
  blocks, "either itself or other models' first block") are broken uniformly at random;
- ablation `noc`: Step 2 takes the whole group at every step and generation drops `u > q`, so
  every candidate has R_m blocks and completion never triggers; `nbc`: paths are returned as they
  are, possibly shorter than R_m (a final stitch then maps to the classes);
- "index" is the raw block index, as in the paper; `index="relative"` (not in the paper) compares
  (index + 1) / depth instead, with a model's depth read from `groups` (max index + 1).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from fedge import constants as C
from methods.reassembly.blocks import Key

Candidate = tuple[Key, ...]
Position = Fraction | int
Prune = Callable[[Candidate], bool]  # prune(prefix): True drops the prefix and all its extensions

ANCHORS = ("random", "max", "min")
INDEX_MODES = ("raw", "relative")


@dataclass(frozen=True)
class CmsrOptions:
    """Switches for the paper's ablations (pFedClub Table 3); the defaults are full pFedClub.

    anchor: "random" (Step 1, Alg. 1 line 5), "max" (pFedClub_max) or "min" (pFedClub_min);
    order_constraint: False is pFedClub_noc; completion: False is pFedClub_nbc;
    index: "raw" (the paper) or "relative" (position / depth; our option, not in the paper).
    An unknown anchor or index mode raises ValueError.
    """

    anchor: str = "random"
    order_constraint: bool = True
    completion: bool = True
    index: str = "raw"

    def __post_init__(self) -> None:
        if self.anchor not in ANCHORS:
            raise ValueError(f"CMSR anchor must be one of {ANCHORS}, got {self.anchor!r}")
        if self.index not in INDEX_MODES:
            raise ValueError(f"CMSR index mode must be one of {INDEX_MODES}, got {self.index!r}")


def block_positions(groups: Mapping[Key, int], mode: str = "raw") -> dict[Key, Position]:
    """The position each block is compared by in the order constraint (pFedClub Alg. 1 line 13).

    "raw": the block index u itself. "relative": (u + 1) / depth of u's model, depth = its largest
    index in `groups` + 1, as an exact Fraction. An unknown mode raises ValueError.
    """
    if mode == "raw":
        return {key: key[1] for key in groups}
    if mode != "relative":
        raise ValueError(f"CMSR index mode must be one of {INDEX_MODES}, got {mode!r}")
    depth: dict[str, int] = defaultdict(int)
    for client, index in groups:
        depth[client] = max(depth[client], index + 1)
    return {(c, i): Fraction(i + 1, depth[c]) for c, i in groups}


def _check_pool(client: str, num_blocks: int, groups: Mapping[Key, int]) -> list[Key]:
    """Client m's own keys B_m,1..R_m, after checking that the pool holds exactly those of m."""
    if num_blocks < 1:
        raise ValueError(f"client {client!r} has {num_blocks} blocks; CMSR needs a model with at least one")
    bad = [k for k in groups if not (isinstance(k, tuple) and len(k) == 2 and k[1] >= 0)]
    if bad:
        raise ValueError(f"block keys must be (client, index >= 0) pairs, got {bad[:3]}")
    own = [(client, r) for r in range(num_blocks)]
    missing = [k for k in own if k not in groups]
    if missing:
        raise ValueError(f"client {client!r}'s blocks {missing[:3]} have no group; group every block of the pool")
    extra = sorted(k for k in groups if k[0] == client and k[1] >= num_blocks)
    if extra:
        raise ValueError(f"groups hold blocks {extra[:3]} of client {client!r}, whose model has {num_blocks} blocks")
    return own


def group_members(groups: Mapping[Key, int], position: Mapping[Key, Position]) -> dict[int, list[Key]]:
    """Each group label's blocks sorted by (position, client, index): the order candidates are ranked in.

    `search_steps` and the path count rely on this order. A key of `groups` missing from
    `position` raises KeyError.
    """
    members: dict[int, list[Key]] = defaultdict(list)
    for key, label in groups.items():
        members[label].append(key)
    for keys in members.values():
        keys.sort(key=lambda k: (position[k], k[0], k[1]))
    return members


def select_anchor(
    first: Key,
    group: Sequence[Key],
    position: Mapping[Key, Position],
    rng: np.random.Generator,
    anchor: str = "random",
    similarity: Callable[[Key, Key], float] | None = None,
) -> Key:
    """Step 1 (pFedClub Alg. 1 lines 3-7): the substitute of B_m,1 = `first`, from its group `group`.

    "random": uniform over the group, B_m,1 included (chosen with probability 1/|G_k|, §3.2.2).
    "max": argmax of similarity(block, first) (Eq. (1)) over the group without `first`; `first`
    itself only when it is alone; ties go to the earliest block in `group`. "min": the smallest
    position, ties uniform at random. Raises ValueError for an empty group, a group without
    `first`, "max" without `similarity`, or a similarity that is not a finite number.
    """
    if first not in group:
        raise ValueError(f"the anchor group must contain the client's first block {first}")
    if anchor == "random":
        return group[int(rng.integers(len(group)))]
    if anchor == "min":
        lowest = min(position[k] for k in group)
        ties = [k for k in group if position[k] == lowest]
        return ties[int(rng.integers(len(ties)))]
    if anchor != "max":
        raise ValueError(f"CMSR anchor must be one of {ANCHORS}, got {anchor!r}")
    if similarity is None:
        raise ValueError("anchor='max' (pFedClub_max) needs a similarity function (Eq. (1))")
    others = [k for k in group if k != first] or [first]
    scores = [float(similarity(k, first)) for k in others]
    if not all(np.isfinite(scores)):
        raise ValueError(f"similarity to {first} must be finite, got {dict(zip(others, scores))}")
    return others[int(np.argmax(scores))]


def search_steps(
    own: Sequence[Key],
    anchor: Key,
    groups: Mapping[Key, int],
    members: Mapping[int, Sequence[Key]],
    position: Mapping[Key, Position],
    order_constraint: bool = True,
) -> list[tuple[Key, ...]]:
    """Step 2 (pFedClub Alg. 1 lines 8-18): C_m[1] = (anchor,), then C_m[r] for r = 2.. while non-empty.

    C_m[r] holds the blocks u of B_m,r's group with position(u) > q (line 13), and q ← min over
    C_m[r] (line 18); the search stops at the first empty C_m[r] (lines 16-17). Without the order
    constraint C_m[r] is B_m,r's whole group and the search never stops early.
    """
    steps: list[tuple[Key, ...]] = [(anchor,)]
    q = position[anchor]
    for key in own[1:]:
        group = members[groups[key]]
        allowed = tuple(k for k in group if not order_constraint or position[k] > q)
        if not allowed:
            break
        steps.append(allowed)
        q = min(position[k] for k in allowed)
    return steps


class _Paths:
    """The maximal order-satisfying paths through `steps`: counted, listed in lexicographic order, and unranked.

    Each step is sorted by position, so a block's successors are a suffix of the next step and path counts
    are suffix sums: O(total blocks in the steps) work, however many paths there are. Path number i (in
    lexicographic step-index order, 0 <= i < total) is found from the counts alone (`path`), which is how a
    cap draws a uniform sample of Alg. 1's candidates without listing them.
    """

    def __init__(self, steps: Sequence[tuple[Key, ...]], position: Mapping[Key, Position], order: bool) -> None:
        self.steps, self.order = steps, order
        self.pos = [[position[k] for k in step] for step in steps]
        self.suffix: list[list[int]] = [[] for _ in steps]  # suffix[r][j]: paths through blocks j.. of step r
        for r in range(len(steps) - 1, -1, -1):
            suffix = [0] * (len(steps[r]) + 1)
            for j in range(len(steps[r]) - 1, -1, -1):
                suffix[j] = suffix[j + 1] + (self._after(r, self.pos[r][j]) or 1)
            self.suffix[r] = suffix

    def _start(self, r: int, pos: Position) -> int:
        """Index in step r + 1 of the first successor of a block at `pos` in step r."""
        return bisect.bisect_right(self.pos[r + 1], pos) if self.order else 0

    def _after(self, r: int, pos: Position) -> int:
        """Number of maximal paths continuing after a block at `pos` in step r (0: it ends them)."""
        return self.suffix[r + 1][self._start(r, pos)] if r + 1 < len(self.steps) else 0

    @property
    def total(self) -> int:
        return self.suffix[0][0]

    def path(self, i: int) -> Candidate:
        """Path number i of the lexicographic order (0 <= i < total), found from the counts in O(depth x width)."""
        if not 0 <= i < self.total:
            raise IndexError(f"path {i} of {self.total}")
        j, out = 0, [self.steps[0][0]]
        for r in range(len(self.steps) - 1):
            if not self._after(r, self.pos[r][j]):
                break
            start = self._start(r, self.pos[r][j])
            nxt = self.suffix[r + 1]
            j = start
            while i >= nxt[start] - nxt[j + 1]:  # paths through successors start..j come first
                j += 1
            i -= nxt[start] - nxt[j]
            out.append(self.steps[r + 1][j])
        return tuple(out)

    def all(self, prune: Prune | None = None) -> Iterator[Candidate]:
        """Every maximal path in lexicographic order; `prune(prefix)` True drops the prefix and its extensions
        (it must be monotone: a pruned prefix never has an acceptable extension)."""

        def walk(r: int, j: int, prefix: Candidate) -> Iterator[Candidate]:
            if not self._after(r, self.pos[r][j]):
                yield prefix
                return
            for k in range(self._start(r, self.pos[r][j]), len(self.steps[r + 1])):
                longer = prefix + (self.steps[r + 1][k],)
                if prune is None or not prune(longer):
                    yield from walk(r + 1, k, longer)

        yield from walk(0, 0, (self.steps[0][0],))

    def pruned(self, path: Candidate, prune: Prune | None) -> bool:
        """Whether `all(prune)` would leave `path` out: some prefix of two or more blocks is pruned."""
        return prune is not None and any(prune(path[:n]) for n in range(2, len(path) + 1))


def _below(n: int, rng: np.random.Generator) -> int:
    """A uniform integer in [0, n), for any n >= 1 (path counts can exceed int64: rejection on random bits)."""
    if n < 2**62:
        return int(rng.integers(n))
    bits = n.bit_length()
    while True:
        words = rng.integers(0, 2**32, size=-(-bits // 32), dtype=np.uint64)
        value = sum(int(wd) << (32 * k) for k, wd in enumerate(words)) >> (32 * len(words) - bits)
        if value < n:
            return value


def _random_order(total: int, rng: np.random.Generator) -> Iterator[int]:
    """Path numbers 0..total-1 in a uniformly random order, deterministic given `rng`: a shuffle, or, when there
    are too many to shuffle, uniform draws with repeats skipped."""
    if total <= C.CMSR_SHUFFLE_LIMIT:
        yield from (int(i) for i in rng.permutation(total))
        return
    seen: set[int] = set()
    while len(seen) < total:
        i = _below(total, rng)
        if i not in seen:
            seen.add(i)
            yield i


def _uniform_sample(
    paths: _Paths,
    k: int,
    rng: np.random.Generator,
    finish: Callable[[Candidate], Candidate],
    prune: Prune | None,
    accept: Callable[[Candidate], bool] | None,
) -> tuple[list[Candidate], int]:
    """k candidates drawn uniformly without replacement from those `prune` and `accept` let through, and how many
    drawn ones were refused: the first k acceptable ones of a random order of all paths. When a budget of
    CMSR_MAX_DRAWS_PER_CANDIDATE x k draws runs out first (acceptable candidates are rare: a tight pFedClub+
    bound), every acceptable candidate is listed (pruning whole prefixes) and k are drawn from them, so the
    sample is uniform either way."""
    kept: list[tuple[int, Candidate]] = []
    rejected = 0
    budget = C.CMSR_MAX_DRAWS_PER_CANDIDATE * k
    for drawn, i in enumerate(_random_order(paths.total, rng)):
        if drawn == budget:
            listed = [c for c in map(finish, paths.all(prune)) if accept is None or accept(c)]
            pick = sorted(rng.choice(len(listed), size=min(k, len(listed)), replace=False)) if listed else []
            return [listed[int(j)] for j in pick], rejected
        path = paths.path(i)
        candidate = finish(path)
        if paths.pruned(path, prune) or (accept is not None and not accept(candidate)):
            rejected += 1
            continue
        kept.append((i, candidate))
        if len(kept) == k:
            break
    return [c for _, c in sorted(kept)], rejected


def composition(client: str, candidates: Sequence[Candidate]) -> tuple[float | None, list[int]]:
    """The share of the candidates' blocks that are the client's own (None without candidates), and the histogram
    of foreign blocks per candidate (entry f: how many candidates have f blocks of other models)."""
    foreign = [sum(key[0] != client for key in c) for c in candidates]
    blocks = sum(len(c) for c in candidates)
    histogram = [0] * (max(foreign, default=-1) + 1)
    for f in foreign:
        histogram[f] += 1
    return (1 - sum(foreign) / blocks if blocks else None), histogram


@dataclass(frozen=True)
class CmsrResult:
    """One client's CMSR search: the candidates kept (in lexicographic step order), how many CMSR paths exist
    in all (Alg. 1 line 20), how many were looked at and refused by `prune` or `accept` (of those listed, or of
    those drawn under a cap), and the Step 1 anchor."""

    candidates: list[Candidate]
    total: int
    rejected: int
    anchor: Key


def cmsr_search(
    client: str,
    num_blocks: int,
    groups: Mapping[Key, int],
    rng: np.random.Generator,
    options: CmsrOptions = CmsrOptions(),
    similarity: Callable[[Key, Key], float] | None = None,
    max_candidates: int | None = None,
    prune: Prune | None = None,
    accept: Callable[[Candidate], bool] | None = None,
) -> CmsrResult:
    """Client m's CMSR candidates (pFedClub Alg. 1): block-key sequences, with the counts a run records.

    Step 1 picks one anchor (lines 3-7) shared by all candidates; Step 2 builds C_m[2..] (lines
    8-18); line 20 takes the maximal paths anchor → C_m[2] → ... with strictly increasing
    positions; Step 3 (lines 21-22) appends the client's own B_m,j+1..R_m to a path of j < R_m
    blocks. max_candidates None keeps every candidate (Alg. 1); a cap k keeps k candidates drawn
    uniformly at random, without replacement, from Alg. 1's (`_uniform_sample`), so the kept ones are
    composed as the whole set is (own blocks, foreign blocks, truncated paths), whatever the ablation;
    they are drawn from `rng` after the anchor, without listing the others. `similarity` (Eq. (1)) is
    only read by anchor "max". `prune(prefix)` (monotone) and `accept(candidate)` are the caller's extra
    constraints (§3.2.2: "can easily incorporate other types of constraints"; pFedClub+ bounds the
    stitched size with them); a candidate they refuse counts as rejected. Candidates come in
    lexicographic step order.

    Raises ValueError when num_blocks < 1, when one of the client's blocks has no group or `groups` holds
    client blocks beyond num_blocks, for a malformed key, max_candidates < 1, or anchor "max" without a
    (finite) similarity.
    """
    if max_candidates is not None and max_candidates < 1:
        raise ValueError(f"max_candidates must be >= 1 or None, got {max_candidates}")
    own = _check_pool(client, num_blocks, groups)
    position = block_positions(groups, options.index)
    members = group_members(groups, position)
    anchor = select_anchor(own[0], members[groups[own[0]]], position, rng, options.anchor, similarity)
    steps = search_steps(own, anchor, groups, members, position, options.order_constraint)
    paths = _Paths(steps, position, options.order_constraint)

    def finish(path: Candidate) -> Candidate:  # Step 3, lines 21-22 (not under the nbc ablation)
        return path + tuple(own[len(path) :]) if options.completion else path

    if max_candidates is not None and max_candidates < paths.total:
        kept, rejected = _uniform_sample(paths, max_candidates, rng, finish, prune, accept)
        return CmsrResult(kept, paths.total, rejected, anchor)
    every = [finish(p) for p in paths.all(prune)]
    kept = [c for c in every if accept is None or accept(c)]
    return CmsrResult(kept, paths.total, len(every) - len(kept), anchor)
