"""Functional grouping of blocks: determinism, planted groups, edge cases, identical blocks never split."""

from __future__ import annotations

import pytest
import torch

from fedge.model import zoo
from fedge.model.spec import build
from fedge.wire.messages import Weights
from methods.reassembly.cka import block_similarity
from methods.reassembly.features import block_features
from methods.reassembly.grouping import group_blocks

pytestmark = pytest.mark.timeout(120)


def _renumbered(labels: torch.Tensor) -> list[int]:
    seen: dict[int, int] = {}
    return [seen.setdefault(int(v), len(seen)) for v in labels]


def _planted(sizes: list[int], seed: int, noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-diagonal similarity in [0, 2] (within ≈ 1.6, across ≈ 0.3, plus noise), rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    truth = truth[torch.randperm(len(truth), generator=g)]
    b = len(truth)
    s = torch.where(truth[:, None] == truth[None, :], 1.6, 0.3) + noise * torch.rand(b, b, generator=g)
    s = (s + s.T) / 2
    s.fill_diagonal_(2.0)
    return s, truth


def _random_similarity(b: int, seed: int) -> torch.Tensor:
    v = torch.randn(b, 6, generator=torch.Generator().manual_seed(seed))
    v = v / v.norm(dim=1, keepdim=True)
    return 1.0 + v @ v.T  # PSD-shifted kernel in [0, 2] with diagonal 2


def test_hand_made_two_pairs() -> None:
    s = torch.tensor([[2.0, 1.9, 0.1, 0.0], [1.9, 2.0, 0.0, 0.1], [0.1, 0.0, 2.0, 1.8], [0.0, 0.1, 1.8, 2.0]])
    for seed in range(5):
        assert group_blocks(s, k=2, seed=seed).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("seed", range(10))
def test_planted_groups_are_recovered_exactly(seed: int) -> None:
    s, truth = _planted([5, 7, 4], seed)
    labels = group_blocks(s, k=3, seed=seed)
    assert labels.dtype == torch.int64 and labels.shape == (16,)
    assert labels.tolist() == _renumbered(truth)


def test_deterministic_for_a_seed() -> None:
    s = _random_similarity(30, seed=3)
    a, b = group_blocks(s, k=4, seed=11), group_blocks(s, k=4, seed=11)
    assert torch.equal(a, b)
    assert sorted(set(a.tolist())) == [0, 1, 2, 3]
    assert a.tolist() == _renumbered(a)  # numbered by first appearance


def test_k_larger_than_b_gives_singletons() -> None:
    s = _random_similarity(3, seed=0)
    assert group_blocks(s, k=5, seed=0).tolist() == [0, 1, 2]


def test_exactly_k_non_empty_groups_even_for_identical_blocks() -> None:
    # All blocks identical: every seeding collides, clusters empty out and must be re-seeded.
    s = torch.full((6, 6), 2.0)
    labels = group_blocks(s, k=4, seed=0)
    assert sorted(set(labels.tolist())) == [0, 1, 2, 3]
    assert labels.tolist() == _renumbered(labels)


def test_k_one_and_empty_input() -> None:
    assert group_blocks(_random_similarity(5, 1), k=1, seed=0).tolist() == [0] * 5
    empty = group_blocks(torch.zeros(0, 0), k=4, seed=0)
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_bad_inputs_raise() -> None:
    s = _random_similarity(4, 2)
    with pytest.raises(ValueError, match="at least 1"):
        group_blocks(s, k=0, seed=0)
    with pytest.raises(ValueError, match="square"):
        group_blocks(torch.zeros(3, 4), k=2, seed=0)
    with pytest.raises(ValueError, match="symmetric"):
        group_blocks(s + torch.triu(torch.ones(4, 4), 1), k=2, seed=0)
    with pytest.raises(ValueError, match="NaN"):
        group_blocks(torch.full((2, 2), float("nan")), k=2, seed=0)


def test_identical_blocks_of_two_clients_share_a_group() -> None:
    # Two clients with the same cnn1 weights plus a cnn2: block j of both copies has similarity 2 with
    # each other (Eq. (1)), so kernel k-means must never separate them.
    spec1, spec2 = zoo.create("cnn1", (1, 28, 28), 10), zoo.create("cnn2", (1, 28, 28), 10)
    torch.manual_seed(0)
    w1, w2 = Weights(spec1, build(spec1).state_dict()), Weights(spec2, build(spec2).state_dict())
    x = torch.randn(48, 1, 28, 28, generator=torch.Generator().manual_seed(5))
    f1 = block_features(w1, x)
    feats = f1 + block_features(w1, x) + block_features(w2, x)
    s = block_similarity(feats)
    for seed in range(3):
        labels = group_blocks(s, k=4, seed=seed)
        assert labels[:4].tolist() == labels[4:8].tolist()
        assert sorted(set(labels.tolist())) == [0, 1, 2, 3]
