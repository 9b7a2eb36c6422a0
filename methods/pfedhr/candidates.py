"""pFedHR's reassembly candidate search: its Alg. 1, a deterministic greedy scan under rules R1-R4.

Layer-wise decomposition (pFedHR §3.1.2) is `methods.reassembly.blocks.split_blocks`: a "layer" here is one
block of a client's spec, as pFedHR §4.2 itself builds blocks ("Conv" = conv + pool + BN + ReLU,
"FC" = linear + ReLU + dropout) and its supplement asks for block-wise decomposition on real models.
Each block gets an operation type from its output: a feature map (C, H, W) is "conv", a vector is
"fc", so O = {conv, fc} and the operation order of R2 is conv → fc.

Alg. 1 as written (`pfedhr_candidates`): for each group k = 1..K and each layer-operation pair q of
G_k (lines 2-7), c_q starts as [q]; then for k' = 1..K the pairs of G_k' are checked in order against
R1 (block index larger than that of the last block added) and R2 (never fc followed by conv), and a
passing pair is appended (lines 8-14); c_q is kept if R3 (its operation types are all of the pool's)
and R4 (it uses all K groups) hold (lines 15-19). Lines 9-14 ("check a pair from G_k' ... if True,
add the pair ...; move to the next pair") read two ways, both offered (`scan`):
- "first" (default): each G_k' gives the first pair that passes, then the scan moves to G_k'+1, so a
  candidate has at most K + 1 blocks, like the 5-layer candidate of the supplement's Fig. 7 (K = 4)
  and the authors' 4-6 block candidates;
- "every": each G_k' gives every pair that passes. Greedy on depth, it exhausts the deep blocks early:
  on Zoo I digits runs it kept 0 of 18 and 1 of 24 candidates, so most rounds have no teacher.
Every c_q begins with its own pair, so the kept candidates are distinct without deduplication. M is
whatever remains (§3.1.1: "not a fixed number"), possibly 0 (the supplement: a large K can leave C_t
empty). There is no random choice.

Where the paper is silent, our choices:
- groups are scanned in ascending label order; K-means labels are arbitrary, so the strategy first
  renumbers them by `depth_order` (mean relative depth of their blocks: the scan runs input → output);
- pairs inside a group are scanned by (block index, client id in numeric order);
- k' runs over all K groups, k itself included (the box loops k' = 1..K);
- K in R4 is the number of group labels present in `groups` (an empty K-means cluster has none);
- R1 compares raw block indices, like the paper.
No rule asks for a classifier last: a candidate ending in a hidden fc block gets a final stitch to
the classes, which has no ReLU (`methods.reassembly.assemble`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from fedge.model.spec import BlockSpec
from fedge.wire.messages import client_order
from methods.reassembly.blocks import Key, PoolBlock

Candidate = tuple[Key, ...]

CONV, FC = "conv", "fc"
OPERATION_ORDER: tuple[str, ...] = (CONV, FC)  # R2: an fc block is never followed by a conv block


@dataclass(frozen=True)
class CandidateSearch:
    """What one run of Alg. 1 did: the kept candidates C_t (M = len(candidates)), in scan order, and how
    many c_q it built (one per layer-operation pair) and dropped at R3 and at R4 (R3 is checked first)."""

    candidates: tuple[Candidate, ...]
    generated: int
    failed_r3: int
    failed_r4: int


def operation_of(spec: BlockSpec) -> str:
    """A block's operation type O (pFedHR §3.1.2): "conv" if it outputs a feature map, else "fc"."""
    return CONV if len(spec.out_shape) == 3 else FC


def block_operations(blocks: Iterable[PoolBlock]) -> dict[Key, str]:
    """The operation type of every pool block, by key."""
    return {b.key: operation_of(b.spec) for b in blocks}


def depth_order(groups: Mapping[Key, int]) -> dict[Key, int]:
    """The groups renumbered 0..K-1 by the mean relative depth of their blocks (ours: the paper's "1..K"
    has no order, K-means labels are arbitrary); ties keep the old label order.

    A block's relative depth is (index + 0.5) / depth of its model, the depth being one more than the
    largest index of that client in `groups` (the strategy passes every block of every upload).
    """
    depth: dict[str, int] = defaultdict(int)
    for client, index in groups:
        depth[client] = max(depth[client], index + 1)
    members: dict[int, list[float]] = defaultdict(list)
    for (client, index), label in groups.items():
        members[label].append((index + 0.5) / depth[client])
    ranked = sorted(members, key=lambda label: (statistics.fmean(members[label]), label))
    new = {label: i for i, label in enumerate(ranked)}
    return {key: new[label] for key, label in groups.items()}


def _check(groups: Mapping[Key, int], operations: Mapping[Key, str]) -> None:
    missing = [k for k in groups if k not in operations]
    if missing:
        raise ValueError(f"blocks {missing[:3]} have a group but no operation type")
    unknown = sorted({operations[k] for k in groups} - set(OPERATION_ORDER))
    if unknown:
        raise ValueError(f"unknown operation types {unknown}; pFedHR rule R2 orders {OPERATION_ORDER}")


def _scan_order(groups: Mapping[Key, int]) -> list[Key]:
    """All pairs in Alg. 1's order: groups by ascending label, inside a group by (block index, client)."""
    return sorted(groups, key=lambda k: (groups[k], k[1], client_order(k[0])))


def _extend(start: Key, order: Sequence[Key], rank: Mapping[Key, int], groups: Mapping[Key, int] | None) -> Candidate:
    """Alg. 1 lines 8-14: append the pairs of `order` that pass R1 (index) and R2 (operation order); with
    `groups`, only the first such pair of each group (scan "first"), else every one (scan "every")."""
    path, done = [start], set()
    for key in order:
        last = path[-1]
        if groups is not None and groups[key] in done:
            continue
        if key[1] > last[1] and rank[key] >= rank[last]:
            path.append(key)
            if groups is not None:
                done.add(groups[key])
    return tuple(path)


SCANS = ("first", "every")


def pfedhr_candidates(groups: Mapping[Key, int], operations: Mapping[Key, str], scan: str = "first") -> CandidateSearch:
    """pFedHR Alg. 1 over the pool: one c_q per pair, kept if it passes R3 and R4; shared by all clients.

    `groups` maps every pool block to its group label (scanned in ascending label order: pass it through
    `depth_order` first for the depth order), `operations` every block to "conv" or "fc". Deterministic:
    the result depends only on the two mappings' contents, not on their insertion order. An empty pool
    gives no candidates. `scan` is how many pairs each group G_k' gives (module docstring). Raises ValueError
    for a grouped block without an operation type, an operation type outside OPERATION_ORDER, or an unknown
    scan.
    """
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}, got {scan!r}")
    _check(groups, operations)
    order = _scan_order(groups)
    rank = {k: OPERATION_ORDER.index(operations[k]) for k in order}
    all_operations, all_groups = {operations[k] for k in order}, set(groups.values())
    kept: list[Candidate] = []
    failed_r3 = failed_r4 = 0
    for start in order:  # lines 2-7: every pair of G_1, then of G_2, ...
        candidate = _extend(start, order, rank, groups if scan == "first" else None)
        if {operations[k] for k in candidate} != all_operations:  # line 16, R3
            failed_r3 += 1
        elif {groups[k] for k in candidate} != all_groups:  # line 17, R4
            failed_r4 += 1
        else:
            kept.append(candidate)
    return CandidateSearch(tuple(kept), len(order), failed_r3, failed_r4)
