"""CMSR (pFedClub Alg. 1) on hand-built pools: the Figure 2 walk-through, ablations, caps, edge cases."""

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from server.cmsr import (
    CmsrOptions,
    block_positions,
    cmsr_candidates,
    group_members,
    sample_ranks,
    search_steps,
)

pytestmark = pytest.mark.timeout(120)


def w(client: int, block: int) -> tuple[str, int]:
    """The paper's w_{client,block} (1-based block numbers) as a pool key (0-based index)."""
    return str(client), block - 1


def paper(candidates):
    """Candidates written back in the paper's 1-based (client, block) numbering."""
    return [[(int(c), i + 1) for c, i in cand] for cand in candidates]


# Figure 2 / §3.2.2: client 1 has 4 blocks, client 2 and 3 have 3, client 4 has 5; K = 4 groups.
FIGURE2 = {
    1: [w(1, 1), w(2, 1), w(3, 1), w(4, 2)],
    2: [w(1, 2), w(2, 2), w(2, 3), w(3, 2), w(3, 3), w(4, 1)],
    3: [w(1, 3), w(4, 4), w(4, 5)],
    4: [w(1, 4), w(4, 3)],
}
GROUPS = {key: label for label, keys in FIGURE2.items() for key in keys}
SEED_PICKING_W42 = 0  # rng.integers(4) with default_rng(0) picks the 4th of group 1 = w_{4,2}


def similar_to(target):
    return lambda key, first: 1.0 if key == target else 0.5


def test_figure2_walkthrough_with_random_anchor():
    candidates = cmsr_candidates("1", 4, GROUPS, np.random.default_rng(SEED_PICKING_W42))
    # anchor w4,2 (q = 2); block 2's substitutes w2,3 and w3,3 (u > 2, q ← 3); block 3's w4,4 and
    # w4,5 (q ← 4); group 4 has only indices <= 4, so the search stops and w1,4 completes the model.
    assert paper(candidates) == [
        [(4, 2), (2, 3), (4, 4), (1, 4)],
        [(4, 2), (2, 3), (4, 5), (1, 4)],
        [(4, 2), (3, 3), (4, 4), (1, 4)],
        [(4, 2), (3, 3), (4, 5), (1, 4)],
    ]


def test_figure2_search_steps_stop_at_the_fourth_block():
    position = block_positions(GROUPS)
    own = [w(1, r) for r in range(1, 5)]
    steps = search_steps(own, w(4, 2), GROUPS, group_members(GROUPS, position), position)
    # C[1] = anchor; C[2] = {w2,3, w3,3} (u > 2); C[3] = {w4,4, w4,5} (u > 3); group 4 = {w1,4, w4,3}
    # has no index > 4 = min(C[3]), so Step 2 breaks (Alg. 1 lines 16-17) before block 4.
    assert [[(int(c), i + 1) for c, i in step] for step in steps] == [[(4, 2)], [(2, 3), (3, 3)], [(4, 4), (4, 5)]]
    free = search_steps(own, w(4, 2), GROUPS, group_members(GROUPS, position), position, order_constraint=False)
    assert [len(step) for step in free] == [1, 6, 3, 2]


def test_figure2_with_max_anchor_gives_the_same_candidates():
    by_seed = cmsr_candidates(
        "1", 4, GROUPS, np.random.default_rng(5), CmsrOptions(anchor="max"), similarity=similar_to(w(4, 2))
    )
    assert by_seed == cmsr_candidates("1", 4, GROUPS, np.random.default_rng(SEED_PICKING_W42))


def test_figure2_without_completion_stops_after_the_third_block():
    candidates = cmsr_candidates("1", 4, GROUPS, np.random.default_rng(SEED_PICKING_W42), CmsrOptions(completion=False))
    assert paper(candidates) == [
        [(4, 2), (2, 3), (4, 4)],
        [(4, 2), (2, 3), (4, 5)],
        [(4, 2), (3, 3), (4, 4)],
        [(4, 2), (3, 3), (4, 5)],
    ]


def test_dead_end_paths_are_completed_with_the_clients_own_blocks():
    # anchor w2,1 (index 1): C[2] = {w1,2 w2,2 w3,2 w2,3 w3,3} (q ← 2), C[3] = {w1,3 w4,4 w4,5}
    # (q ← 3), C[4] = {w1,4}. Only paths through w1,3 reach w1,4 by search; the others stop at
    # block 3 and are completed by w1,4. Paths pairing an index-3 block with w1,3 break the order.
    candidates = cmsr_candidates(
        "1", 4, GROUPS, np.random.default_rng(0), CmsrOptions(anchor="max"), similarity=similar_to(w(2, 1))
    )
    second = [(1, 2), (2, 2), (3, 2)]
    expected = []
    for b in second:
        expected += [[(2, 1), b, (1, 3), (1, 4)], [(2, 1), b, (4, 4), (1, 4)], [(2, 1), b, (4, 5), (1, 4)]]
    for b in [(2, 3), (3, 3)]:
        expected += [[(2, 1), b, (4, 4), (1, 4)], [(2, 1), b, (4, 5), (1, 4)]]
    assert paper(candidates) == expected


def substituted_indices_increase(candidate, client, num_blocks):
    """True when the searched prefix (everything before the completion tail) has increasing indices."""
    tail = 0
    while tail < len(candidate) and candidate[len(candidate) - 1 - tail] == (client, num_blocks - 1 - tail):
        tail += 1
    head = candidate[: max(1, len(candidate) - tail)]
    return all(a[1] < b[1] for a, b in zip(head, head[1:]))


@pytest.mark.parametrize("seed", range(20))
def test_order_constraint_holds_for_every_candidate(seed):
    for candidate in cmsr_candidates("1", 4, GROUPS, np.random.default_rng(seed)):
        assert len(candidate) == 4
        assert substituted_indices_increase(candidate, "1", 4)
        assert [GROUPS[k] for k in candidate[:3]] == [1, 2, 3]


def test_without_order_constraint_an_out_of_order_candidate_appears():
    candidates = cmsr_candidates(
        "1", 4, GROUPS, np.random.default_rng(SEED_PICKING_W42), CmsrOptions(order_constraint=False)
    )
    assert len(candidates) == 6 * 3 * 2  # the whole groups 2, 3 and 4 at blocks 2, 3 and 4
    assert [(4, 2), (4, 1), (1, 3), (4, 3)] in paper(candidates)
    assert all(len(c) == 4 and [GROUPS[k] for k in c] == [1, 2, 3, 4] for c in candidates)


def test_random_anchor_picks_the_clients_own_first_block_with_probability_one_over_group_size():
    rng = np.random.default_rng(123)
    anchors = Counter(cmsr_candidates("1", 4, GROUPS, rng, max_candidates=1)[0][0] for _ in range(4000))
    assert set(anchors) == set(FIGURE2[1])
    assert abs(anchors[w(1, 1)] / 4000 - 0.25) < 0.03


def test_min_anchor_takes_a_smallest_index_block_itself_or_another_models_first():
    anchors = {
        cmsr_candidates("1", 4, GROUPS, np.random.default_rng(s), CmsrOptions(anchor="min"))[0][0] for s in range(40)
    }
    assert anchors == {w(1, 1), w(2, 1), w(3, 1)}


def test_max_anchor_takes_the_most_similar_other_block_and_needs_a_similarity():
    scores = {w(2, 1): 1.5, w(3, 1): 1.9, w(4, 2): 1.2, w(1, 1): 2.0}
    candidates = cmsr_candidates(
        "1", 4, GROUPS, np.random.default_rng(0), CmsrOptions(anchor="max"), similarity=lambda key, first: scores[key]
    )
    assert {c[0] for c in candidates} == {w(3, 1)}
    with pytest.raises(ValueError, match="similarity"):
        cmsr_candidates("1", 4, GROUPS, np.random.default_rng(0), CmsrOptions(anchor="max"))
    with pytest.raises(ValueError, match="finite"):
        cmsr_candidates(
            "1",
            4,
            GROUPS,
            np.random.default_rng(0),
            CmsrOptions(anchor="max"),
            similarity=lambda key, first: float("nan"),
        )


def big_pool(clients=8, depth=10, k=3, seed=0):
    """Groups that follow depth, as CKA groups tend to: block i lands in group i*k//depth, with
    each model's group boundaries shifted by one block at random."""
    rng = np.random.default_rng(seed)
    shift = rng.integers(0, 2, size=clients)
    return {(str(c), i): min(k - 1, (i + int(shift[c])) * k // depth) for c in range(clients) for i in range(depth)}


def test_same_seed_same_candidates_and_other_seeds_differ():
    groups = big_pool()
    runs = [cmsr_candidates("0", 10, groups, np.random.default_rng(s), max_candidates=25) for s in (1, 1, 6)]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 25 and len(runs[2]) == 25  # both seeds' anchors leave millions of paths
    assert runs[0] != runs[2]


def test_max_candidates_keeps_a_distinct_subset_of_all_candidates():
    groups = big_pool(clients=4, depth=6)
    options = CmsrOptions(anchor="min")
    everything = cmsr_candidates("0", 6, groups, np.random.default_rng(3), options)
    assert len(everything) > 30
    capped = cmsr_candidates("0", 6, groups, np.random.default_rng(3), options, max_candidates=30)
    assert len(capped) == 30 == len(set(capped))
    assert set(capped) <= set(everything)
    assert capped == [c for c in everything if c in set(capped)]  # same (rank) order
    assert cmsr_candidates("0", 6, groups, np.random.default_rng(3), options, max_candidates=10**6) == everything


def test_huge_candidate_spaces_are_sampled_without_listing_them():
    groups = {(str(c), i): 0 for c in range(60) for i in range(40)}  # one group: ~60^39 paths
    candidates = cmsr_candidates(
        "0", 40, groups, np.random.default_rng(1), max_candidates=5, options=CmsrOptions(order_constraint=False)
    )
    assert len(candidates) == 5 and all(len(c) == 40 for c in candidates)


def test_sample_ranks_is_uniform_and_distinct():
    rng = np.random.default_rng(0)
    counts = Counter(r for _ in range(3000) for r in sample_ranks(10, 3, rng))
    assert set(counts) == set(range(10)) and all(abs(n / 3000 - 0.3) < 0.04 for n in counts.values())
    big = sample_ranks(10**40, 50, rng)
    assert len(set(big)) == 50 and max(big) < 10**40 and big == sorted(big)


def test_one_client_pool_yields_its_own_model():
    own = [("solo", i) for i in range(4)]
    distinct = {k: i for i, k in enumerate(own)}
    assert cmsr_candidates("solo", 4, distinct, np.random.default_rng(0)) == [tuple(own)]
    shared = {k: i % 2 for i, k in enumerate(own)}  # groups {0, 2} and {1, 3}
    candidates = cmsr_candidates("solo", 4, shared, np.random.default_rng(0), CmsrOptions(anchor="min"))
    # q=0: C[2] = {1, 3}; via 1: C[3] = {2}, then {3}; via 3: dead end, completed with blocks 2, 3.
    assert candidates == [tuple(own), (own[0], own[3], own[2], own[3])]


def test_relative_index_compares_depth_normalised_positions():
    groups = {("a", 0): 0, ("a", 1): 1, ("b", 0): 0, ("b", 1): 0, ("b", 2): 1, ("b", 3): 1}
    assert block_positions(groups, "relative")[("b", 1)] == Fraction(2, 4)
    # anchor b,1: raw index 1 leaves b,2 and b,3 (u > 1) but not a,1; relative 2/4 < 2/2 lets a,1 in.
    pick_b1 = CmsrOptions(anchor="max")
    sim = similar_to(("b", 1))
    raw = cmsr_candidates("a", 2, groups, np.random.default_rng(0), pick_b1, similarity=sim)
    rel = cmsr_candidates(
        "a", 2, groups, np.random.default_rng(0), CmsrOptions(anchor="max", index="relative"), similarity=sim
    )
    assert raw == [(("b", 1), ("b", 2)), (("b", 1), ("b", 3))]
    assert rel == [(("b", 1), ("b", 2)), (("b", 1), ("a", 1)), (("b", 1), ("b", 3))]


def test_bad_input_is_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="at least one"):
        cmsr_candidates("1", 0, GROUPS, rng)
    with pytest.raises(ValueError, match="no group"):
        cmsr_candidates("9", 2, GROUPS, rng)
    with pytest.raises(ValueError, match="has 3 blocks"):
        cmsr_candidates("1", 3, GROUPS, rng)
    with pytest.raises(ValueError, match="max_candidates"):
        cmsr_candidates("1", 4, GROUPS, rng, max_candidates=0)
    with pytest.raises(ValueError, match="anchor"):
        CmsrOptions(anchor="best")
