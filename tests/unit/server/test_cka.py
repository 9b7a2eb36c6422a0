"""Linear CKA: invariances, hand-computed values, the vectorised matrix, the minibatch estimator, Eq. (1)."""

from __future__ import annotations

import math

import pytest
import torch

from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import Weights
from methods.reassembly.cka import (
    block_similarity,
    choose_method,
    cka_matrix,
    linear_cka,
    minibatch_block_similarity,
    minibatch_cka_matrix,
    unbiased_gram,
)
from methods.reassembly.features import BlockFeatures, block_features

pytestmark = pytest.mark.timeout(120)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _centred_orthonormal(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """k orthonormal columns (n, k), each orthogonal to the constant vector (hence already centred)."""
    a = torch.cat([torch.ones(n, 1), torch.randn(n, k, generator=_gen(seed))], dim=1).double()
    q, _ = torch.linalg.qr(a)
    return q[:, 1:]


def _orthogonal(d: int, seed: int = 1) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=_gen(seed)))
    return q * torch.sign(torch.diagonal(r))


def test_identical_features_give_one() -> None:
    x = torch.randn(50, 8, generator=_gen())
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-9)
    assert torch.allclose(cka_matrix([x, x.clone()]), torch.ones(2, 2), atol=1e-6)


def test_invariant_to_orthogonal_transform_and_isotropic_scaling() -> None:
    x, y = torch.randn(60, 12, generator=_gen(2)), torch.randn(60, 5, generator=_gen(3))
    y = y + x[:, :5]  # correlated, so the value is not trivially 0 or 1
    base = linear_cka(x, y)
    q = _orthogonal(12)
    assert 0.2 < base < 0.95
    assert linear_cka(x @ q, y) == pytest.approx(base, abs=1e-6)
    assert linear_cka(3.7 * x, 0.2 * y) == pytest.approx(base, abs=1e-6)
    assert linear_cka(x, x @ q * 5.0) == pytest.approx(1.0, abs=1e-6)
    m = cka_matrix([x, x @ q, 2.5 * x, y])
    assert m[0, 1].item() == pytest.approx(1.0, abs=1e-5) and m[0, 2].item() == pytest.approx(1.0, abs=1e-5)
    assert m[1, 3].item() == pytest.approx(base, abs=1e-5)


def test_features_with_zero_cross_covariance_give_zero() -> None:
    u = _centred_orthonormal(40, 6)
    x = u[:, :3] @ torch.randn(3, 7, generator=_gen(4)).double()
    y = u[:, 3:] @ torch.randn(3, 4, generator=_gen(5)).double()
    assert float((x.T @ y).abs().max()) < 1e-10  # centred XᵀY = 0 by construction
    assert linear_cka(x, y) == pytest.approx(0.0, abs=1e-9)
    # a constant offset changes nothing: centring removes it
    assert linear_cka(x + 3.0, y - 1.0) == pytest.approx(0.0, abs=1e-9)
    assert cka_matrix([x.float(), y.float()])[0, 1].item() == pytest.approx(0.0, abs=1e-5)


def test_hand_computed_values_and_not_invariant_to_general_linear_maps() -> None:
    # X = [a, b] orthonormal and centred; Y = X·diag(1, 2) = [a, 2b]:
    # XᵀX = I, YᵀY = diag(1, 4), YᵀX = diag(1, 2) → CKA = 5 / (√2·√17) = 5/√34 ≈ 0.8575 (not 1: CKA is
    # not invariant to invertible non-orthogonal maps, unlike CCA).
    u = _centred_orthonormal(30, 2)
    y = u @ torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert linear_cka(u, y) == pytest.approx(5 / math.sqrt(34), abs=1e-9)
    # X = [a, b], Y = [a]: ‖YᵀX‖² = 1, ‖XᵀX‖ = √2, ‖YᵀY‖ = 1 → 1/√2.
    assert linear_cka(u, u[:, :1]) == pytest.approx(1 / math.sqrt(2), abs=1e-9)
    m = cka_matrix([u.float(), y.float(), u[:, :1].float()])
    assert m[0, 1].item() == pytest.approx(5 / math.sqrt(34), abs=1e-5)
    assert m[0, 2].item() == pytest.approx(1 / math.sqrt(2), abs=1e-5)


@pytest.mark.parametrize("method", ["gram", "feature", "auto"])
@pytest.mark.parametrize("limit", [1, 1 << 30])
def test_cka_matrix_equals_pairwise_loop(method: str, limit: int) -> None:
    g = _gen(7)
    base = torch.randn(80, 6, generator=g)
    feats = [base @ torch.randn(6, d, generator=g) + 0.5 * torch.randn(80, d, generator=g) for d in (3, 10, 1, 25)]
    feats.append(torch.relu(feats[1]) * 100.0 + 7.0)
    m = cka_matrix(feats, method=method, memory_limit_bytes=limit)
    loop = torch.tensor([[linear_cka(a, b) for b in feats] for a in feats], dtype=torch.float32)
    assert m.shape == (5, 5) and m.dtype == torch.float32 and m.device.type == "cpu"
    assert torch.allclose(m, loop, atol=1e-5)
    assert torch.equal(m, m.T)
    assert torch.allclose(m.diagonal(), torch.ones(5), atol=1e-6)


def test_choose_method_picks_the_cheaper_form() -> None:
    assert choose_method(400, [64] * 50) == "gram"  # N < ΣD
    assert choose_method(100_000, [16, 32]) == "feature"  # N ≫ ΣD


def test_constant_features_give_zero_not_nan() -> None:
    y = torch.randn(20, 3, generator=_gen(8))
    const = torch.full((20, 4), 2.5)
    assert linear_cka(const, y) == 0.0 and linear_cka(y, torch.zeros(20, 2)) == 0.0
    for method in ("gram", "feature"):
        m = cka_matrix([y, const, torch.zeros(20, 1)], method=method)
        assert not torch.isnan(m).any()
        assert torch.allclose(m, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)
    mb = minibatch_cka_matrix([[y[:10], const[:10]], [y[10:], const[10:]]])
    assert torch.allclose(mb, torch.tensor([[1.0, 0.0], [0.0, 0.0]]), atol=1e-6)


def test_bad_inputs_raise() -> None:
    x = torch.randn(10, 3)
    with pytest.raises(ValueError, match="samples"):
        linear_cka(x, torch.randn(9, 3))
    with pytest.raises(ValueError, match="samples"):
        cka_matrix([x, torch.randn(11, 2)])
    with pytest.raises(ValueError, match="2-D"):
        linear_cka(torch.randn(10), x)
    with pytest.raises(ValueError, match="NaN"):
        cka_matrix([x, torch.full((10, 2), float("nan"))])
    with pytest.raises(ValueError, match="at least 2"):
        linear_cka(x[:1], x[:1])
    with pytest.raises(ValueError, match="method"):
        cka_matrix([x], method="rbf")
    with pytest.raises(ValueError, match="no minibatches"):
        minibatch_cka_matrix([])
    with pytest.raises(ValueError, match="at least 4"):
        minibatch_cka_matrix([[x[:3]]])
    assert cka_matrix([]).shape == (0, 0)


def test_unbiased_gram_matches_song_et_al_formula() -> None:
    # HSIC_1 = [tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1/((n−1)(n−2)) − 2/(n−2)·1ᵀK̃L̃1] / (n(n−3)), K̃ = K with zero diagonal.
    n = 9
    x, y = torch.randn(n, 4, generator=_gen(9)).double(), torch.randn(n, 3, generator=_gen(10)).double()
    k, lm = (x @ x.T).fill_diagonal_(0.0), (y @ y.T).fill_diagonal_(0.0)
    one = torch.ones(n, dtype=torch.float64)
    expected = (
        torch.trace(k @ lm)
        + (one @ k @ one) * (one @ lm @ one) / ((n - 1) * (n - 2))
        - 2 / (n - 2) * (one @ k @ lm @ one)
    ) / (n * (n - 3))
    got = unbiased_gram(x, torch.float64) @ unbiased_gram(y, torch.float64) / (n * (n - 3))
    assert float(got) == pytest.approx(float(expected), rel=1e-9)


def test_unbiased_hsic_mean_matches_population_value() -> None:
    # X ~ N(0, I_3), Y = 0.5·X + N(0, I_3): linear-kernel HSIC = ‖Cov(X, Y)‖²_F = ‖0.5·I‖² = 0.75.
    # The biased estimator ‖XcᵀYc‖²/(n−1)² at n = 10 overshoots by ≈ tr Σx·tr Σy / n ≈ 1.1.
    g, n, draws = _gen(11), 10, 4000
    x = torch.randn(draws, n, 3, generator=g, dtype=torch.float64)
    y = 0.5 * x + torch.randn(draws, n, 3, generator=g, dtype=torch.float64)
    unbiased = torch.stack(
        [unbiased_gram(a, torch.float64) @ unbiased_gram(b, torch.float64) for a, b in zip(x, y)]
    ) / (n * (n - 3))
    xc, yc = x - x.mean(1, keepdim=True), y - y.mean(1, keepdim=True)
    biased = (xc.transpose(1, 2) @ yc).pow(2).sum((1, 2)) / (n - 1) ** 2
    se = float(unbiased.std()) / math.sqrt(draws)
    assert abs(float(unbiased.mean()) - 0.75) < 4 * se
    assert float(biased.mean()) - 0.75 > 0.5


def test_minibatch_cka_close_to_full_on_large_n() -> None:
    g = _gen(12)
    base = torch.randn(4000, 8, generator=g)
    feats = [base @ torch.randn(8, d, generator=g) + torch.randn(4000, d, generator=g) for d in (4, 16, 32)]
    feats.append(torch.randn(4000, 8, generator=g))  # independent of the others: CKA ≈ 0
    full = cka_matrix(feats)
    batches = ([f[s : s + 500] for f in feats] for s in range(0, 4000, 500))
    mb = minibatch_cka_matrix(batches)
    assert torch.allclose(mb, full, atol=0.02)
    assert torch.allclose(mb.diagonal(), torch.ones(4), atol=1e-6)
    assert float(mb[:3, 3].abs().max()) < 0.02


def test_block_similarity_is_eq1_sum_in_zero_two() -> None:
    g = _gen(13)
    xs = [torch.randn(30, d, generator=g) for d in (2, 5, 5, 9)]
    blocks = [BlockFeatures(xs[0], xs[1]), BlockFeatures(xs[1], xs[2]), BlockFeatures(xs[2], xs[3])]
    s = block_similarity(blocks)
    expected = cka_matrix(xs[:3]) + cka_matrix(xs[1:])
    assert torch.allclose(s, expected)
    assert s.shape == (3, 3) and float(s.min()) >= 0.0 and float(s.max()) <= 2.0 + 1e-6
    assert torch.allclose(s.diagonal(), torch.full((3,), 2.0), atol=1e-5)
    unshared = [BlockFeatures(b.inputs.clone(), b.outputs.clone()) for b in blocks]
    assert torch.allclose(block_similarity(unshared), s, atol=1e-6)
    with pytest.raises(ValueError, match="samples"):
        block_similarity([blocks[0], BlockFeatures(xs[0][:20], xs[1][:20])])


def test_minibatch_block_similarity_approaches_the_full_one():
    torch.manual_seed(0)
    spec = create("cnn1", (1, 8, 8), 10)
    weights = Weights(spec, build(spec).state_dict())
    x = torch.randn(2048, 1, 8, 8)
    full = block_similarity(block_features(weights, x))
    mini = minibatch_block_similarity(block_features(weights, xb) for xb in x.split(512))
    assert mini.shape == full.shape == (4, 4)
    assert torch.allclose(mini, full, atol=0.05)
