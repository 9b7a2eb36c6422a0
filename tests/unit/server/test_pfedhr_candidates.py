"""pFedHR candidate search (its Alg. 1): hand-derived scans, R3/R4 rejections, determinism, real zoo pools."""

import random

import numpy as np
import pytest

from methods.pfedhr.candidates import CandidateSearch, block_operations, depth_order, operation_of, pfedhr_candidates
from methods.reassembly.blocks import split_blocks

pytestmark = pytest.mark.timeout(120)
CONV, FC = "conv", "fc"


def keys(text):
    """ "a0 b2" → (("a", 0), ("b", 2))."""
    return tuple((k[0], int(k[1:])) for k in text.split())


def pool(spec):
    """{"a0": (group, op), ...} → (groups, operations) keyed by (client, index)."""
    groups = {keys(k)[0]: g for k, (g, _) in spec.items()}
    return groups, {keys(k)[0]: op for k, (_, op) in spec.items()}


# a: conv fc; b: conv conv fc; c: conv conv conv conv fc
HAND = {
    "a0": (0, CONV), "b0": (0, CONV), "c0": (0, CONV),
    "a1": (1, FC), "b1": (1, CONV), "c1": (1, CONV), "c2": (1, CONV),
    "b2": (2, FC), "c3": (2, CONV), "c4": (2, FC),
}  # fmt: skip


def test_hand_built_pool_gives_exactly_the_first_pair_per_group_scan_of_alg_1():
    # Scan order a0 b0 c0 | a1 b1 c1 c2 | b2 c3 c4; each group gives its first pair passing R1-R2.
    # start a0: G0 none (index 0); G1 a1 (conv → fc); G2 b2 → a0 a1 b2, kept; b0 and c0 likewise.
    # a1 (fc): G1's c2 is conv after fc (R2); G2 b2 → a1 b2: fc only, R3.
    # b1, c1: G1 c2, G2 c3 (b2's index 2 is not > 2) → conv only, R3. c2: c3 → R3. b2: c4 → R3 (c3: R2).
    # c3: c4 → groups {2}: R4. c4 alone: R3.
    groups, ops = pool(HAND)
    assert pfedhr_candidates(groups, ops) == CandidateSearch(
        candidates=(keys("a0 a1 b2"), keys("b0 a1 b2"), keys("c0 a1 b2")),
        generated=10,
        failed_r3=6,
        failed_r4=1,
    )


def test_hand_built_pool_gives_exactly_the_every_pair_scan_of_alg_1():
    # Scan order (groups 0, 1, 2; inside a group by (index, client)): a0 b0 c0 | a1 b1 c1 c2 | b2 c3 c4.
    # start a0: a1 (idx 1 > 0, conv → fc); b1 c1 R1; c2 R2 (conv after fc); b2 (idx 2, fc); c3 R2; c4 → a0 a1 b2 c4
    # start b0, c0: the same tail → b0 a1 b2 c4, c0 a1 b2 c4
    # start a1 (fc): b2 c4 → a1 b2 c4, only fc: R3
    # start b1 (conv, idx 1): c2 c3 c4 → b1 c2 c3 c4, groups {1, 2}: R4; c1 likewise: R4
    # start c2: c3 c4 → groups {1, 2}: R4; b2: c4 → R3; c3: c4 → groups {2}: R4; c4 alone: R3
    groups, ops = pool(HAND)
    search = pfedhr_candidates(groups, ops, scan="every")
    assert search == CandidateSearch(
        candidates=(keys("a0 a1 b2 c4"), keys("b0 a1 b2 c4"), keys("c0 a1 b2 c4")),
        generated=10,
        failed_r3=3,
        failed_r4=4,
    )


def test_the_scan_includes_groups_before_the_start_and_r4_drops_a_candidate_missing_a_group():
    # a: conv fc; b: conv fc. G0 = a0 a1, G1 = b0 b1; order a0 a1 | b0 b1.
    # a0: a1 → (a0, a1) has both operations but only group 0: R4. a1, b1: fc alone: R3.
    # b0 (in G1): the scan starts again at G0 (k' = 1..K) and takes a1 → (b0, a1): kept.
    groups, ops = pool({"a0": (0, CONV), "a1": (0, FC), "b0": (1, CONV), "b1": (1, FC)})
    assert pfedhr_candidates(groups, ops) == CandidateSearch((keys("b0 a1"),), 4, 2, 1)


def test_r3_drops_a_candidate_missing_an_operation_even_when_it_uses_every_group():
    # a: conv conv; b: one fc block. G0 = a0 b0, G1 = a1; order a0 b0 a1.
    # a0: b0 R1, a1 → (a0, a1): groups {0, 1} but no fc: R3. b0: a1 is conv after fc (R2) → (b0): R3. a1: R3.
    groups, ops = pool({"a0": (0, CONV), "b0": (0, FC), "a1": (1, CONV)})
    assert pfedhr_candidates(groups, ops) == CandidateSearch((), 3, 3, 0)


def test_more_groups_than_any_candidate_can_use_gives_no_candidates():
    # indices 0..3 only, so a candidate has at most 4 blocks (R1) but there are K = 5 groups (R4)
    groups, ops = pool({"a0": (0, CONV), "a1": (1, CONV), "a2": (2, CONV), "a3": (3, FC), "b0": (4, CONV)})
    search = pfedhr_candidates(groups, ops)
    assert search.candidates == () and search.failed_r4 > 0
    assert pfedhr_candidates({}, {}) == CandidateSearch((), 0, 0, 0)


def test_same_input_same_output_whatever_the_dict_order():
    groups, ops = pool(HAND)
    items = list(groups.items())
    random.Random(4).shuffle(items)
    shuffled = dict(items)
    assert pfedhr_candidates(groups, ops) == pfedhr_candidates(groups, ops) == pfedhr_candidates(shuffled, ops)


def test_numeric_client_order_inside_a_group():
    # clients "10" and "2" both have a conv at index 1 in G1: "2" comes first (numeric order), so it is taken
    groups, ops = pool({"x0": (0, CONV), "x2": (2, FC)})
    groups |= {("10", 1): 1, ("2", 1): 1}
    ops |= {("10", 1): CONV, ("2", 1): CONV}
    assert pfedhr_candidates(groups, ops).candidates == ((("x", 0), ("2", 1), ("x", 2)),)


def test_depth_order_numbers_groups_from_input_to_output():
    # relative depths (index + 0.5) / depth: a (4 blocks) .125 .375 .625 .875; b (2 blocks) .25 .75
    # label 7 = {a0, a1}: .25; label 3 = {a2, b0}: .4375; label 5 = {a3, b1}: .8125 → 7, 3, 5 become 0, 1, 2
    labels = dict(zip(keys("a0 a1 a2 a3 b0 b1"), (7, 7, 3, 5, 3, 5)))
    assert depth_order(labels) == dict(zip(keys("a0 a1 a2 a3 b0 b1"), (0, 0, 1, 2, 1, 2)))
    tie = dict(zip(keys("a0 a1 b0 b1"), (9, 4, 4, 9)))  # both labels have mean depth .5: the lower label first
    assert depth_order(tie) == dict(zip(keys("a0 a1 b0 b1"), (1, 0, 0, 1)))
    assert depth_order({}) == {}


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no operation type"):
        pfedhr_candidates({("a", 0): 0}, {})
    with pytest.raises(ValueError, match="unknown operation"):
        pfedhr_candidates({("a", 0): 0}, {("a", 0): "pool"})


def test_operation_types_from_shapes(zoo_uploads):
    assert [operation_of(b.spec) for b in split_blocks("a", zoo_uploads["cnn1"])] == [CONV, CONV, FC, FC]


@pytest.mark.parametrize("seed", range(20))
def test_every_candidate_satisfies_r1_to_r4_on_random_zoo_pools(zoo_uploads, seed):
    """2-6 clients with random zoo models and random groups; the rules checked from the specs independently."""
    rng = np.random.default_rng(seed)
    names = sorted(zoo_uploads)
    blocks = [b for c in range(int(rng.integers(2, 7))) for b in split_blocks(str(c), zoo_uploads[rng.choice(names)])]
    groups = depth_order({b.key: int(rng.integers(4)) for b in blocks})
    spec = {b.key: b.spec for b in blocks}
    search = pfedhr_candidates(groups, block_operations(blocks))
    assert search.generated == len(blocks) == len(search.candidates) + search.failed_r3 + search.failed_r4
    assert len(set(search.candidates)) == len(search.candidates)
    for candidate in search.candidates:
        assert all(a[1] < b[1] for a, b in zip(candidate, candidate[1:])), "R1 layer order"
        kinds = [CONV if len(spec[k].out_shape) == 3 else FC for k in candidate]
        assert kinds == sorted(kinds, key=[CONV, FC].index), "R2 conv before fc"
        assert set(kinds) == {CONV, FC}, "R3 all operation types"
        assert {groups[k] for k in candidate} == set(groups.values()), "R4 all groups"


def test_depth_ordered_cnn_pool_yields_candidates(zoo_uploads):
    blocks = [b for c, name in enumerate(("cnn1", "cnn2", "cnn3")) for b in split_blocks(str(c), zoo_uploads[name])]
    depth = {b.client: b.index + 1 for b in blocks}
    groups = {b.key: int(4 * b.index / depth[b.client]) for b in blocks}  # 4 groups by relative depth
    search = pfedhr_candidates(depth_order(groups), block_operations(blocks))
    assert {c[0] for c in search.candidates} >= {("0", 0), ("1", 0), ("2", 0)}  # each model's first block starts one
