"""FedTrans's equations on worked examples: Eq. (1) DoC, Eqs. (2)-(3) sampling, Eq. (4) utilities, Eq. (5) weights,
§4.2 similarity and lineage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from methods.fedtrans.maths import (
    assignment_probabilities,
    degree_of_convergence,
    lineage_map,
    model_similarity,
    sample_model,
    soft_weights,
    standardized,
    update_utilities,
)
from server.slices import sliced_average


@pytest.mark.parametrize("slope", [0.5, 0.01, -0.2])
def test_doc_of_a_linear_loss_curve_is_its_slope(slope):
    losses = [3.0 - slope * t for t in range(40)]
    assert degree_of_convergence(losses, gamma=10, delta=20) == pytest.approx(slope, rel=1e-12)


def test_doc_needs_gamma_plus_delta_rounds_before_it_exists():
    losses = [1.0 / (t + 1) for t in range(30)]
    assert degree_of_convergence(losses[:29], gamma=10, delta=20) is None
    doc = degree_of_convergence(losses, gamma=10, delta=20)
    # hand-computed: the 10 newest rounds i = 20..29, each slope (L(i-20) - L(i)) / 20
    want = sum((1 / (i - 20 + 1) - 1 / (i + 1)) / 20 for i in range(20, 30)) / 10
    assert doc == pytest.approx(want)


def test_eq3_is_a_softmax_of_the_utilities():
    p = assignment_probabilities([0.0, math.log(3.0)])
    assert p == pytest.approx([0.25, 0.75])
    assert sum(assignment_probabilities([1000.0, 999.0, -5.0])) == pytest.approx(1.0)


def test_eq2_samples_only_compatible_models_at_eq3_frequencies():
    utilities = [0.0, math.log(2.0), 5.0, math.log(3.0)]
    compatible = [0, 1, 3]  # model 2 (utility 5, the most likely if allowed) is beyond this client
    rng = np.random.default_rng(0)
    draws = [sample_model(utilities, compatible, rng) for _ in range(30000)]
    counts = np.bincount(draws, minlength=4) / len(draws)
    assert counts[2] == 0
    assert counts[[0, 1, 3]] == pytest.approx([1 / 6, 2 / 6, 3 / 6], abs=0.01)


def test_a_client_with_no_compatible_model_raises():
    with pytest.raises(ValueError, match="no compatible"):
        sample_model([0.0], [], np.random.default_rng(0))


def test_eq4_worked_example():
    # three clients; losses 1, 2, 3 → z = -1.2247, 0, 1.2247 (population std)
    z = standardized({"a": 1.0, "b": 2.0, "c": 3.0})
    assert z["a"] == pytest.approx(-math.sqrt(1.5)) and z["b"] == 0 and z["c"] == pytest.approx(math.sqrt(1.5))
    sim = [[1.0, 0.5], [0.5, 1.0]]
    utilities = {"a": [0.0, 0.0], "b": [0.1, 0.2], "c": [0.0, 0.0], "d": [7.0, 7.0]}
    out = update_utilities(
        utilities,
        assigned={"a": 0, "b": 1, "c": 1},
        z=z,
        similarity=sim,
        compatible={"a": [0, 1], "b": [0, 1], "c": [0]},
    )
    s = math.sqrt(1.5)
    assert out["a"] == pytest.approx([0 + s * 1.0, 0 + s * 0.5])  # low loss on M0: both rise, M1 by sim 0.5
    assert out["b"] == pytest.approx([0.1, 0.2])  # average loss: unchanged
    assert out["c"] == pytest.approx([-s * 0.5, 0.0])  # high loss on M1; M1 is beyond c, so only M0 moves
    assert out["d"] == [7.0, 7.0]  # did not train this round
    assert utilities["a"] == [0.0, 0.0]  # inputs untouched


def test_standardized_losses_of_one_client_or_no_spread_are_zero():
    assert standardized({"a": 5.0}) == {"a": 0.0}
    assert standardized({"a": 2.0, "b": 2.0}) == {"a": 0.0, "b": 0.0}


def test_eq5_weights_share_small_to_large_only_decay_and_sum_to_one():
    sim = [[1.0, 0.6, 0.3], [0.6, 1.0, 0.5], [0.3, 0.5, 1.0]]
    w = soft_weights(2, [0, 1, 2], sim, eta=0.5, age=2)
    raw = {0: 0.25 * 0.3, 1: 0.25 * 0.5, 2: 1.0}
    assert w == pytest.approx({i: v / sum(raw.values()) for i, v in raw.items()})
    assert sum(w.values()) == pytest.approx(1.0)
    assert soft_weights(0, [0, 1, 2], sim, eta=0.5, age=2) == {0: 1.0}  # no large → small sharing
    both = soft_weights(0, [0, 1, 2], sim, eta=0.5, age=0, large_to_small=True)
    assert set(both) == {0, 1, 2}
    assert soft_weights(1, [2], sim, eta=0.5, age=1) == {}  # only a larger model trained


def test_eq5_on_constant_inputs_returns_that_constant():
    """Every trained model's average is the constant c on the slices they cover: the aggregate is c there."""
    sim = [[1.0, 0.4], [0.4, 1.0]]
    target = {"w": torch.full((4, 6), -3.0), "b": torch.full((4,), -3.0)}
    small = {"w": torch.full((2, 3), 1.5), "b": torch.full((2,), 1.5)}
    large = {"w": torch.full((4, 6), 1.5), "b": torch.full((4,), 1.5)}
    weights = soft_weights(1, [0, 1], sim, eta=0.9, age=3)
    out = sliced_average(target, [(small, weights[0]), (large, weights[1])])
    assert torch.equal(out["w"], torch.full((4, 6), 1.5)) and torch.equal(out["b"], torch.full((4,), 1.5))


def test_lineage_composes_along_the_chain_and_inserted_tensors_have_no_ancestor():
    lineages = [
        {"a.weight": "a.weight", "b.weight": "b.weight"},
        {"a.weight": "a.weight", "n.weight": None, "b2.weight": "b.weight"},
        {"a.weight": "a.weight", "n.weight": "n.weight", "b3.weight": "b2.weight", "m.weight": None},
    ]
    assert lineage_map(lineages, 2, 0) == {
        "a.weight": "a.weight",
        "n.weight": None,
        "b3.weight": "b.weight",
        "m.weight": None,
    }
    assert lineage_map(lineages, 2, 1)["n.weight"] == "n.weight"
    assert lineage_map(lineages, 1, 1) == {n: n for n in lineages[1]}
    with pytest.raises(ValueError):
        lineage_map(lineages, 0, 1)


def test_similarity_is_the_mean_matching_degree_of_the_cells():
    cells = {"a": 100, "b": 200, "c": 50}  # a unchanged, b widened from 50, c inserted
    assert model_similarity(cells, {"a": 100, "b": 50, "c": None}) == pytest.approx((1 + 0.25 + 0) / 3)
    assert model_similarity(cells, {"a": 100, "b": 200, "c": 50}) == 1.0
