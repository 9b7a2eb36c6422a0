"""CMSR (pFedClub Alg. 1) on hand-built pools: the Figure 2 walk-through, ablations, the uniform cap."""

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from methods.pfedclub.cmsr import (
    CmsrOptions,
    _Paths,
    block_positions,
    cmsr_search,
    composition,
    group_members,
    search_steps,
)

pytestmark = pytest.mark.timeout(120)


def cmsr_candidates(*args, **kwargs):
    """The candidate list of `cmsr_search`."""
    return cmsr_search(*args, **kwargs).candidates


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
    anchors = Counter(cmsr_search("1", 4, GROUPS, rng).anchor for _ in range(4000))
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
    groups = big_pool(clients=4, depth=6)
    runs = [cmsr_candidates("0", 6, groups, np.random.default_rng(s)) for s in (1, 1, 0)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # another anchor


def test_every_candidate_is_kept_and_counted_without_a_cap():
    # Alg. 1 line 20 keeps all; the issue measured 4 random ones of up to 4,806 kept before.
    groups = big_pool(clients=4, depth=6)
    result = cmsr_search("0", 6, groups, np.random.default_rng(3), CmsrOptions(anchor="min"))
    assert result.total == len(result.candidates) == len(set(result.candidates)) > 30
    assert result.rejected == 0


def block_sim(groups):
    """An Eq. (1)-like similarity: 2 for a block with itself, else higher for closer depth in the same group."""
    return lambda a, b: 2.0 if a == b else (groups[a] == groups[b]) / (1 + abs(a[1] - b[1])) + int(b[0]) / 100


def test_paths_are_numbered_in_listing_order():
    groups = big_pool(clients=4, depth=6)
    for options in (CmsrOptions(), CmsrOptions(order_constraint=False), CmsrOptions(completion=False)):
        position = block_positions(groups)
        own = [("0", r) for r in range(6)]
        for anchor in group_members(groups, position)[groups[own[0]]]:
            steps = search_steps(
                own, anchor, groups, group_members(groups, position), position, options.order_constraint
            )
            paths = _Paths(steps, position, options.order_constraint)
            assert [paths.path(i) for i in range(paths.total)] == list(paths.all())
            with pytest.raises(IndexError):
                paths.path(paths.total)


def capped_and_whole(groups, client, depth, options, k, seeds, **kwargs):
    """Over many rounds (seeds): the kept candidates under a cap k, and each round's whole candidate set weighted
    by the share of it a uniform cap keeps (k / total), as (own-block share, foreign-block histogram) pairs."""
    kept, expected_hist, expected_own, blocks = [], Counter(), 0.0, 0.0
    for seed in seeds:
        whole = cmsr_candidates(client, depth, groups, np.random.default_rng(seed), options, **kwargs)
        capped = cmsr_candidates(
            client, depth, groups, np.random.default_rng(seed), options, max_candidates=k, **kwargs
        )
        assert len(capped) == min(k, len(whole)) and set(capped) <= set(whole)
        kept += capped
        weight = len(capped) / len(whole)
        _, hist = composition(client, whole)
        expected_hist.update({f: weight * n for f, n in enumerate(hist)})
        expected_own += weight * sum(sum(key[0] == client for key in c) for c in whole)
        blocks += weight * sum(len(c) for c in whole)
    return kept, expected_hist, expected_own / blocks


def assert_same_composition(client, kept, expected_hist, expected_own):
    own, hist = composition(client, kept)
    for f in set(range(len(hist))) | set(expected_hist):
        observed = hist[f] if f < len(hist) else 0
        assert abs(observed - expected_hist[f]) <= 4 * expected_hist[f] ** 0.5 + 1, (f, hist, expected_hist)
    assert own == pytest.approx(expected_own, abs=0.03)


@pytest.mark.parametrize("k", [1, 4, 16])
def test_a_cap_keeps_the_composition_of_every_candidate(k):
    # The own-block share and foreign-block histogram of capped candidates match Alg. 1's whole set within
    # sampling error. The cap this replaced (the k most similar to the client's blocks by Eq. (1)) kept mostly
    # the client's own blocks: sim(k, k) = 2 is the maximum, so it fails here (own share 0.78, 0.71, 0.58 at
    # k = 1, 4, 16 against 0.345 for the whole set; the uniform draw keeps 0.344, 0.354, 0.350).
    groups = big_pool(clients=5, depth=6, seed=2)
    kept, expected_hist, expected_own = capped_and_whole(
        groups, "0", 6, CmsrOptions(), k, range(300), similarity=block_sim(groups)
    )
    assert_same_composition("0", kept, expected_hist, expected_own)


@pytest.mark.parametrize("ablation", ["noc", "nbc", "max", "min"])
def test_ablations_draw_from_their_own_candidate_sets_by_the_same_rule(ablation):
    options = {
        "noc": CmsrOptions(order_constraint=False),
        "nbc": CmsrOptions(completion=False),
        "max": CmsrOptions(anchor="max"),
        "min": CmsrOptions(anchor="min"),
    }[ablation]
    kept, expected_hist, expected_own = capped_and_whole(
        GROUPS, "1", 4, options, 2, range(200), similarity=similar_to(w(2, 1))
    )
    assert_same_composition("1", kept, expected_hist, expected_own)
    if ablation == "noc":  # unconstrained mixtures stay: a candidate that breaks the order is kept
        assert any(not substituted_indices_increase(c, "1", 4) for c in kept)
    if ablation == "nbc":  # truncated candidates, which define nbc, are kept
        assert any(len(c) < 4 for c in kept)


def test_a_cap_is_seeded_and_listed_in_step_order():
    groups = big_pool(clients=4, depth=6)
    options = CmsrOptions(anchor="min")
    everything = cmsr_candidates("0", 6, groups, np.random.default_rng(3), options)
    capped = cmsr_search("0", 6, groups, np.random.default_rng(3), options, max_candidates=7)
    assert capped.total == len(everything) and len(capped.candidates) == 7
    assert capped.candidates == [c for c in everything if c in set(capped.candidates)]
    assert cmsr_search("0", 6, groups, np.random.default_rng(3), options, max_candidates=7) == capped
    assert cmsr_search("0", 6, groups, np.random.default_rng(4), options, max_candidates=7) != capped
    assert cmsr_search("0", 6, groups, np.random.default_rng(3), options, max_candidates=10**6).candidates == everything


def test_constraints_prune_prefixes_and_reject_candidates():
    never_w23 = cmsr_search("1", 4, GROUPS, np.random.default_rng(SEED_PICKING_W42), prune=lambda p: w(2, 3) in p)
    assert paper(never_w23.candidates) == [[(4, 2), (3, 3), (4, 4), (1, 4)], [(4, 2), (3, 3), (4, 5), (1, 4)]]
    with_w44 = [[(4, 2), (2, 3), (4, 4), (1, 4)], [(4, 2), (3, 3), (4, 4), (1, 4)]]
    picked = Counter()
    for seed in range(200):
        only_w44 = cmsr_search(
            "1",
            4,
            GROUPS,
            np.random.default_rng([SEED_PICKING_W42, seed]),
            accept=lambda c: w(4, 4) in c,
            max_candidates=1,
        )
        if only_w44.anchor == w(4, 2):  # the rounds whose anchor is Figure 2's
            assert paper(only_w44.candidates)[0] in with_w44 and only_w44.total == 4
            picked[tuple(paper(only_w44.candidates)[0])] += 1
    assert len(picked) == 2  # either acceptable candidate can be drawn
    last = cmsr_search("1", 4, GROUPS, np.random.default_rng(SEED_PICKING_W42), accept=lambda c: w(3, 3) in c)
    assert last.rejected == 2 and len(last.candidates) == 2


def test_rare_acceptable_candidates_are_still_found_under_a_cap():
    # one acceptable candidate among thousands: the draws run out of budget, then the acceptable ones are listed
    groups = big_pool(clients=6, depth=8)
    everything = cmsr_candidates("0", 8, groups, np.random.default_rng(1))
    target = everything[len(everything) // 2]
    result = cmsr_search("0", 8, groups, np.random.default_rng(1), accept=lambda c: c == target, max_candidates=2)
    assert len(everything) > 64 * 2 and result.candidates == [target]


def test_huge_candidate_spaces_are_capped_without_listing_them():
    groups = {(str(c), i): 0 for c in range(60) for i in range(40)}  # one group: ~60^39 paths
    result = cmsr_search(
        "0", 40, groups, np.random.default_rng(1), CmsrOptions(order_constraint=False), max_candidates=5
    )
    assert len(set(result.candidates)) == 5 and all(len(c) == 40 for c in result.candidates)
    assert result.total == 2400**39
    _, hist = composition("0", result.candidates)
    assert sum(hist[:30]) == 0  # a uniform draw: ~39 of 40 blocks foreign, not the client's own


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
