"""pFedHR candidate search (its Alg. 1): every candidate passes R1-R4, over many seeds and real zoo pools."""

import numpy as np
import pytest

from server.blocks import split_blocks
from server.pfedhr_candidates import (
    PFedHROptions,
    block_operations,
    classifier_keys,
    operation_of,
    pfedhr_candidates,
    rule_violation,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def uploads(zoo_uploads):
    return zoo_uploads


def random_pool(uploads, rng, k=4):
    """2-6 clients with random zoo models, split into blocks; groups follow depth with random shifts."""
    names = sorted(uploads)
    pool = []
    for c in range(int(rng.integers(2, 7))):
        pool += split_blocks(f"c{c}", uploads[names[int(rng.integers(len(names)))]])
    depth = {b.client: b.index + 1 for b in pool}
    if rng.random() < 0.5:
        groups = {b.key: min(k - 1, int(k * b.index / depth[b.client] + rng.random() * 0.8)) for b in pool}
    else:
        groups = {b.key: int(rng.integers(k)) for b in pool}
    return pool, groups


def check_rules(candidate, pool, groups, options):
    """R1-R4 and the length / classifier constraints, checked from the specs independently."""
    spec = {b.key: b.spec for b in pool}
    last = {b.client: max(x.index for x in pool if x.client == b.client) for b in pool}
    assert options.min_blocks <= len(candidate) <= options.max_blocks
    assert all(a[1] < b[1] for a, b in zip(candidate, candidate[1:])), "R1 layer order"
    kinds = ["conv" if len(spec[k].out_shape) == 3 else "fc" for k in candidate]
    assert kinds == sorted(kinds, key=["conv", "fc"].index), "R2 conv before fc"
    assert set(kinds) == {"conv", "fc"}, "R3 all operation types"
    assert {groups[k] for k in candidate} == set(groups.values()), "R4 all groups"
    assert candidate[-1][1] == last[candidate[-1][0]], "ends with a classifier"
    assert spec[candidate[-1]].out_shape == (10,)


def test_operation_types_from_shapes(uploads):
    ops = [operation_of(b.spec) for b in split_blocks("a", uploads["cnn1"])]
    assert ops == ["conv", "conv", "fc", "fc"]
    blocks = split_blocks("a", uploads["mobilenet_v2"])
    assert classifier_keys(blocks) == frozenset({("a", len(blocks) - 1)})


@pytest.mark.parametrize("seed", range(40))
def test_every_candidate_satisfies_r1_to_r4_on_random_zoo_pools(uploads, seed):
    rng = np.random.default_rng(seed)
    pool, groups = random_pool(uploads, rng)
    options = PFedHROptions(num_candidates=6)
    candidates = pfedhr_candidates(groups, block_operations(pool), rng, options, classifier_keys(pool))
    assert len(candidates) == len(set(candidates)) <= 6
    for candidate in candidates:
        check_rules(candidate, pool, groups, options)


def test_pools_yield_candidates_most_of_the_time(uploads):
    found = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        pool, groups = random_pool(uploads, rng)
        found += bool(pfedhr_candidates(groups, block_operations(pool), rng, PFedHROptions(), classifier_keys(pool)))
    assert found >= 30


def test_same_rng_same_candidates(uploads):
    pool, groups = random_pool(uploads, np.random.default_rng(3))
    ops, heads = block_operations(pool), classifier_keys(pool)
    runs = [pfedhr_candidates(groups, ops, np.random.default_rng(s), PFedHROptions(), heads) for s in (9, 9, 10)]
    assert runs[0] == runs[1] and len(runs[0]) == 4
    assert runs[0] != runs[2]


def test_hand_made_pool():
    # model a: conv conv fc fc; model b: conv fc. Groups: early convs 0, late conv 1, fcs 2.
    ops = {("a", 0): "conv", ("a", 1): "conv", ("a", 2): "fc", ("a", 3): "fc", ("b", 0): "conv", ("b", 1): "fc"}
    groups = {("a", 0): 0, ("b", 0): 0, ("a", 1): 1, ("a", 2): 2, ("a", 3): 2, ("b", 1): 2}
    options = PFedHROptions(num_candidates=10, min_blocks=3, max_blocks=4)
    heads = frozenset({("a", 3), ("b", 1)})
    candidates = pfedhr_candidates(groups, ops, np.random.default_rng(0), options, heads)
    # R4 needs a,1 (alone in group 1), R1 then needs an index-0 conv first and indices > 1 after;
    # a classifier last leaves a,3 (b,1 has index 1): x, a1, [a2,] a3 for x in {a0, b0}.
    expected = [(x, ("a", 1)) + mid + (("a", 3),) for x in (("a", 0), ("b", 0)) for mid in ((("a", 2),), ())]
    assert sorted(candidates) == sorted(expected)
    assert rule_violation((("a", 0), ("a", 1), ("b", 1)), groups, ops, options, heads) == "R1"
    assert rule_violation((("a", 0), ("a", 2), ("a", 3)), groups, ops, options, heads) == "R4"
    assert rule_violation((("a", 0), ("a", 1), ("a", 2)), groups, ops, options, heads) == "classifier"
    ops_bad = {**ops, ("a", 2): "conv", ("a", 1): "fc"}
    assert rule_violation((("a", 0), ("a", 1), ("a", 2), ("a", 3)), groups, ops_bad, options, heads) == "R2"
    convs_only = (("a", 0), ("a", 1))
    assert rule_violation(convs_only, groups, ops, PFedHROptions(min_blocks=2), None) == "R3"


def test_too_many_groups_for_the_length_gives_no_candidates():
    ops = {("a", i): "conv" if i < 3 else "fc" for i in range(6)}
    groups = {("a", i): i for i in range(6)}  # K = 6 > max_blocks = 4: R4 cannot hold
    assert pfedhr_candidates(groups, ops, np.random.default_rng(0), PFedHROptions(max_blocks=4)) == []
    assert pfedhr_candidates({}, {}, np.random.default_rng(0)) == []


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no operation type"):
        pfedhr_candidates({("a", 0): 0}, {}, np.random.default_rng(0))
    with pytest.raises(ValueError, match="unknown operation"):
        pfedhr_candidates({("a", 0): 0}, {("a", 0): "pool"}, np.random.default_rng(0))
    with pytest.raises(ValueError, match="min_blocks"):
        PFedHROptions(min_blocks=5, max_blocks=4)
