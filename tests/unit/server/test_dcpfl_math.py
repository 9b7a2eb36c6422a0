"""DC-PFL's server equations: pooling (Eqs. 10-11) against the statistics of all features together, Gaussian
virtual features, virtual counts, the SGD steps of Eqs. 8 and 12, the checks of a statistics upload alone and
against its round, and capped shares in pooling."""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn import functional as F

from fedge import constants as K
from fedge.model.spec import build
from fedge.model.zoo import create
from methods.dcpfl.class_stats import ClassStats, class_statistics
from methods.dcpfl.heads import head_spec
from methods.dcpfl.maths import (
    calibrate,
    ce_step,
    gaussian_samples,
    pool,
    scale_rejections,
    statistics_rejection,
    virtual_counts,
    virtual_features,
)

pytestmark = pytest.mark.timeout(120)
C, D = 7, 4
# Samples of each class on each of three parts: class 1 has one sample on two parts (pooled: 2), class 3 lives
# on part 1 only, class 4's pooled total is 1, class 6 is nowhere; class 5 has one sample on part 2.
PARTS = [
    {0: 10, 1: 1, 2: 3, 5: 4},
    {0: 4, 1: 1, 3: 8},
    {0: 7, 2: 5, 4: 1, 5: 1},
]


def part_features(seed):
    """Features of PARTS[seed] with class-dependent means and scales (not centred: Eq. 11's mean terms count)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.cat([torch.full((n,), c) for c, n in PARTS[seed].items()])
    mix = torch.randn(D, D, generator=gen, dtype=torch.float64)
    z = torch.randn(len(y), D, generator=gen, dtype=torch.float64) @ mix * (1 + y[:, None]) + 5 * y[:, None] - 3
    return z, y


def cnn1_head(seed=0):
    """cnn1's head (one linear, 128 -> 10) as a model of its own, seeded."""
    torch.manual_seed(seed)
    return build(head_spec(create("cnn1", (1, 8, 8), 10)))


def test_pooling_equals_the_mean_and_unbiased_covariance_of_all_features_together():
    data = [part_features(k) for k in range(len(PARTS))]
    pooled = pool([class_statistics(z, y, C) for z, y in data], C)
    z = torch.cat([z for z, _ in data])
    y = torch.cat([y for _, y in data])
    assert pooled.counts.tolist() == [21, 2, 8, 8, 1, 5, 0]
    for c in range(C):
        rows = z[y == c]
        if len(rows) == 0:
            assert not pooled.means[c].any() and not pooled.covariances[c].any()
            continue
        torch.testing.assert_close(pooled.means[c], rows.mean(0), rtol=0, atol=1e-8)
        want = torch.cov(rows.T) if len(rows) > 1 else torch.zeros(D, D, dtype=torch.float64)
        torch.testing.assert_close(pooled.covariances[c], want, rtol=0, atol=1e-8)
    assert pooled.covariances[1].abs().max() > 1  # two one-sample parts pool to a real covariance
    assert torch.equal(pooled.covariances, pooled.covariances.transpose(1, 2))


def test_pooling_float32_uploads_is_done_in_float64_and_means_only_parts_give_no_covariance():
    data = [part_features(k) for k in range(len(PARTS))]
    parts = [class_statistics(z, y, C) for z, y in data]
    uploads = [ClassStats(p.counts, p.means.float(), p.covariances.float()) for p in parts]
    pooled = pool(uploads, C)
    assert pooled.means.dtype == pooled.covariances.dtype == torch.float64
    torch.testing.assert_close(pooled.covariances, pool(parts, C).covariances, rtol=1e-5, atol=1e-4)
    means_only = pool([parts[0], ClassStats(parts[1].counts, parts[1].means, None)], C)
    assert means_only.covariances is None and means_only.counts.tolist()[:4] == [14, 2, 3, 8]


def correlated(d=3):
    mean = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)[:d]
    a = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.6, 0.0], [-0.5, 0.3, 1.2]], dtype=torch.float64)[:d, :d]
    return mean, a @ a.T * 2  # strongly correlated off-diagonal entries


def test_virtual_samples_match_mu_and_sigma_within_sampling_error():
    """200,000 draws: each mean coordinate within 5 standard errors sqrt(Σ_ii/n), each covariance entry within 5
    standard errors of a Gaussian sample covariance, sqrt((Σ_ii Σ_jj + Σ_ij²)/n) (about 0.02 here); 5 SE makes a
    chance failure (~1e-6 per entry) negligible while a wrong square root or a transposed factor is off by > 0.3."""
    mean, cov = correlated()
    n = 200_000
    x = gaussian_samples(mean, cov, n, torch.Generator().manual_seed(0))
    assert x.shape == (n, 3) and x.dtype == torch.float64
    var = cov.diagonal()
    assert ((x.mean(0) - mean).abs() < 5 * (var / n).sqrt()).all()
    se = ((torch.outer(var, var) + cov**2) / n).sqrt()
    assert ((torch.cov(x.T) - cov).abs() < 5 * se).all()
    assert float(se.max()) < 0.03


def test_the_same_seed_gives_the_same_samples():
    mean, cov = correlated()
    a = gaussian_samples(mean, cov, 50, torch.Generator().manual_seed(3))
    b = gaussian_samples(mean, cov, 50, torch.Generator().manual_seed(3))
    c = gaussian_samples(mean, cov, 50, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_singular_covariance_gives_samples_in_its_subspace_and_no_nan():
    gen = torch.Generator().manual_seed(1)
    basis = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    cov = basis @ basis.T - 1e-12 * torch.eye(6, dtype=torch.float64)  # rank 3, the other eigenvalues just below 0
    assert float(torch.linalg.eigvalsh(cov)[0]) < 0
    mean = torch.arange(6, dtype=torch.float64)
    x = gaussian_samples(mean, cov, 5000, gen)
    assert torch.isfinite(x).all()
    q, _ = torch.linalg.qr(basis, mode="complete")
    null = q[:, 3:]  # orthonormal basis of the null space
    assert float(((x - mean) @ null).abs().max()) < 1e-6
    assert float(((x - mean) @ q[:, :3]).std(0).min()) > 0.5  # and it does spread inside the subspace


def test_virtual_counts_by_hand():
    assert virtual_counts(torch.tensor([1, 1, 1]), 10).tolist() == [4, 3, 3]  # ties: the lowest class first
    assert virtual_counts(torch.tensor([2, 0, 1]), 1000).tolist() == [667, 0, 333]
    assert virtual_counts(torch.tensor([0, 5, 0]), 7).tolist() == [0, 7, 0]


@given(st.lists(st.integers(0, 500), min_size=1, max_size=12).filter(any), st.integers(1, 5000))
def test_virtual_counts_sum_to_the_total_in_proportion_to_the_counts(counts, total):
    out = virtual_counts(torch.tensor(counts), total)
    assert out.dtype == torch.int64 and int(out.sum()) == total
    exact = [total * c / sum(counts) for c in counts]
    assert all(abs(o - e) < 1 for o, e in zip(out.tolist(), exact))
    assert all(o == 0 for o, c in zip(out.tolist(), counts) if c == 0)


def test_virtual_features_are_drawn_per_class_in_those_counts():
    data = [part_features(k) for k in range(len(PARTS))]
    pooled = pool([class_statistics(z, y, C) for z, y in data], C)
    z, y = virtual_features(pooled, 1000, torch.Generator().manual_seed(0))
    assert z.dtype == torch.float32 and y.dtype == torch.int64 and z.shape == (1000, D)
    assert torch.bincount(y, minlength=C).tolist() == virtual_counts(pooled.counts, 1000).tolist()
    assert torch.isfinite(z).all()
    assert torch.allclose(z[y == 4], pooled.means[4].float().expand(int((y == 4).sum()), D))  # one sample: Σ = 0
    assert torch.allclose(z[y == 0].double().mean(0), pooled.means[0], atol=1.0)


def test_ce_step_is_one_plain_sgd_step_and_lowers_the_loss():
    h = cnn1_head()
    gen = torch.Generator().manual_seed(5)
    z, y = torch.randn(6, 128, generator=gen), torch.tensor([0, 1, 2, 3, 0, 9])
    ref = copy.deepcopy(h)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    want_loss = F.cross_entropy(ref(z), y)
    want_loss.backward()
    opt.step()
    loss = ce_step(h, z.double(), y, 0.05)  # float64 means (Eq. 10) are taken as float32
    assert loss == pytest.approx(float(want_loss.detach()), rel=1e-6)
    for (name, p), q in zip(h.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        assert p.grad is None
    with torch.no_grad():
        assert float(F.cross_entropy(h(z), y)) < loss


def test_calibration_lowers_eq_12s_loss_step_by_step():
    data = [part_features(k) for k in range(len(PARTS))]
    pooled = pool([class_statistics(z, y, C) for z, y in data], C)
    z, y = virtual_features(pooled, 500, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    h = torch.nn.Linear(D, C)
    before = {k: v.clone() for k, v in h.state_dict().items()}
    losses = calibrate(h, z, y, 30, 0.01)
    assert len(losses) == 30
    assert all(b < a for a, b in zip(losses, losses[1:]))
    with torch.no_grad():
        assert float(F.cross_entropy(h(z), y)) < losses[-1] < losses[0] * 0.9
    assert any(not torch.equal(v, h.state_dict()[k]) for k, v in before.items())


# --- statistics_rejection: what a client may upload


def good_upload(covariance=True):
    """What the client sends: class_statistics in float64, then float32. 500-d ReLU features (FedGH's
    representation) of 10 classes with 1..120 samples, most fewer than d, so their covariances are singular and
    float32 rounding makes eigenvalues slightly negative."""
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 2, 5, 40, 120, 0, 3, 60, 9, 10]
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])
    z = torch.relu(torch.randn(len(y), 500, generator=gen) * 20 + 5 * torch.randn(500, generator=gen))
    s = class_statistics(z.float(), y, 10, covariance)
    return ClassStats(s.counts, s.means.float(), None if s.covariances is None else s.covariances.float())


def test_a_good_float32_upload_passes():
    s = good_upload()
    assert float(torch.linalg.eigvalsh(s.covariances[4].double())[0]) < 0  # the tolerance is needed here
    assert statistics_rejection(s, num_examples=250) is None
    assert statistics_rejection(good_upload(covariance=False), num_examples=250) is None


def replaced(s, counts=None, means=None, covariances=None):
    return ClassStats(
        s.counts if counts is None else counts,
        s.means if means is None else means,
        s.covariances if covariances is None else covariances,
    )


def code(s, num_examples=250):
    problem = statistics_rejection(s, num_examples)
    return None if problem is None else problem[0]


def test_an_asymmetric_covariance_is_refused():
    s = good_upload()
    covs = s.covariances.clone()
    covs[3, 0, 1] += 1e-3 * float(covs[3].abs().max())
    assert code(replaced(s, covariances=covs)) == "statistics_asymmetric"


def test_a_covariance_with_a_negative_eigenvalue_beyond_tolerance_is_refused():
    s = good_upload()
    eig, vecs = torch.linalg.eigh(s.covariances[4].double())
    for factor, want in ((-1e-2, "statistics_not_psd"), (-1e-6, None)):
        eig2 = eig.clone()
        eig2[0] = factor * float(eig[-1])
        covs = s.covariances.clone()
        bad = vecs @ torch.diag(eig2) @ vecs.T
        covs[4] = ((bad + bad.T) / 2).float()
        assert code(replaced(s, covariances=covs)) == want, factor
    problem = statistics_rejection(replaced(s, covariances=-s.covariances), 250)
    assert problem[0] == "statistics_not_psd" and "class 1" in problem[1]  # class 1: the first with 2+


@pytest.mark.parametrize(
    "counts",
    [
        [1, 2, 5, 40, 120, 0, 3, 60, 9, 11],  # 251 > the reply's 250 examples
        [1, 2, 5, 40, 120, 0, 3, 60, 9, 9],  # 249: counts that leave out examples
        [1, 2, 5, 40, 120, -1, 3, 60, 9, 11],  # sums to 250 with a negative count
        [0] * 10,
        [2**63 - 1, 2**63 - 1, 252, 0, 0, 0, 0, 0, 0, 0],  # an int64 sum wraps around to 250
    ],
    ids=["above the example count", "below it", "negative", "all zero", "int64 wrap-around"],
)
def test_impossible_counts_are_refused(counts):
    s = good_upload()
    assert int(s.counts.sum()) == 250
    problem = statistics_rejection(replaced(s, counts=torch.tensor(counts)), 250)
    assert problem[0] == "statistics_counts" and "250" in problem[1]


def test_a_huge_mean_or_covariance_entry_is_refused():
    s = good_upload()
    means = s.means.clone()
    means[2, 7] = 10 * K.MAX_FEATURE_MAGNITUDE
    assert code(replaced(s, means=means)) == "statistics_magnitude"
    covs = s.covariances.clone()
    covs[4] *= 2 * K.MAX_FEATURE_MAGNITUDE / float(covs[4].abs().max())
    assert code(replaced(s, covariances=covs)) is None  # a covariance is in squared units: 2M is within M²
    covs[4] *= K.MAX_FEATURE_MAGNITUDE
    assert code(replaced(s, covariances=covs)) == "statistics_magnitude"
    means_only = good_upload(covariance=False)
    assert code(replaced(means_only, means=means)) == "statistics_magnitude"
    means[5, 0] = 10 * K.MAX_FEATURE_MAGNITUDE  # class 5 has no samples: its rows are not used, not checked
    means[2, 7] = 0
    assert code(replaced(s, means=means)) is None


# ---------------------------------------------------------------------------------------------- against the round


def stats(classes):
    """2-d statistics of 3 classes: {class: (count, mean, covariance diagonal)}."""
    counts, means, covs = torch.zeros(3, dtype=torch.int64), torch.zeros(3, 2), torch.zeros(3, 2, 2)
    for c, (n, mean, diag) in classes.items():
        counts[c], means[c], covs[c] = n, torch.tensor(mean), torch.diag(torch.tensor(diag))
    return ClassStats(counts, means, covs)


# Class 0 on three honest replies: mean norms 5, 10, 7; spreads √tr Σ 2, 4, 3.
HONEST = {
    "a": stats({0: (2, (3.0, 4.0), (1.0, 3.0))}),
    "b": stats({0: (2, (6.0, 8.0), (4.0, 12.0))}),
    "c": stats({0: (3, (0.0, 7.0), (9.0, 0.0))}),
}


def test_a_class_held_by_three_or_more_is_bounded_by_ten_times_their_median():
    """Class 0 held by 4 (with the liar d): median norm (7 + 10) / 2 = 8.5, bound 85; median spread (3 + 4) / 2
    = 3.5, bound 35. Only the bound decides: the honest replies pass however small d's values."""
    assert scale_rejections(HONEST) == {}
    assert scale_rejections(HONEST | {"d": stats({0: (2, (0.0, 84.9), (1.0, 1.0))})}) == {}
    refused = scale_rejections(HONEST | {"d": stats({0: (2, (0.0, 85.1), (1.0, 1.0))})})
    assert set(refused) == {"d"} and refused["d"][0] == "statistics_scale"
    assert "85.1, over 10 x 8.5, the median of the 4 replies holding it" in refused["d"][1]
    assert scale_rejections(HONEST | {"d": stats({0: (2, (0.0, 1.0), (34.9**2, 0.0))})}) == {}
    refused = scale_rejections(HONEST | {"d": stats({0: (2, (0.0, 1.0), (35.1**2, 0.0))})})
    assert "spread" in refused["d"][1] and "over 10 x 3.5" in refused["d"][1]
    assert scale_rejections(HONEST | {"d": stats({0: (2, (0.0, 1e-6), (0.0, 0.0))})}) == {}


def test_a_class_fewer_hold_is_bounded_by_the_rounds_scale_else_the_servers_statistics():
    """d alone holds class 2: the round's scale is the median of the replies' own medians 5, 10, 7, and d's norm
    (8.5 with d's 86 among them: bound 85). With two replies, class 2 is bounded by the server's global statistics
    (norm 5: bound 50), and by nothing without them."""
    refused = scale_rejections(HONEST | {"d": stats({2: (1, (0.0, 86.0), (0.0, 0.0))})})
    assert "86, over 10 x 8.5, the round's scale over 4 replies" in refused["d"][1]
    assert scale_rejections(HONEST | {"d": stats({2: (1, (0.0, 84.0), (0.0, 0.0))})}) == {}
    known = stats({2: (5, (3.0, 4.0), (1.0, 3.0))})
    pair = {"a": HONEST["a"], "d": stats({2: (1, (0.0, 51.0), (0.0, 0.0))})}
    assert "51, over 10 x 5, the server's global statistics" in scale_rejections(pair, known)["d"][1]
    assert scale_rejections(pair | {"d": stats({2: (1, (0.0, 49.0), (0.0, 0.0))})}, known) == {}
    assert scale_rejections(pair) == {}
    with pytest.raises(ValueError):
        scale_rejections(HONEST, factor=0)


def test_pooling_caps_each_clients_share_of_a_class():
    """1-d, class 0: A has 3 samples (mean 0, variance 1), B one (mean 4). Counts: µ = 1. Shares capped at 0.5:
    both weigh 2 of N = 4, µ = (2·0 + 2·4) / 4 = 2, Σ = [(2−1)·1 + 2·(0−2)² + 0 + 2·(4−2)²] / 3 = 17/3."""
    a = ClassStats(torch.tensor([3]), torch.tensor([[0.0]]), torch.tensor([[[1.0]]]))
    b = ClassStats(torch.tensor([1]), torch.tensor([[4.0]]), torch.tensor([[[0.0]]]))
    assert float(pool([a, b], 1).means[0, 0]) == pytest.approx(1.0)
    capped = pool([a, b], 1, max_share=0.5)
    assert int(capped.counts[0]) == 4 and float(capped.means[0, 0]) == pytest.approx(2.0)
    assert float(capped.covariances[0, 0, 0]) == pytest.approx(17 / 3)
    # a cap that binds no one changes nothing
    same = pool([a, b], 1, max_share=0.8)
    assert torch.equal(same.means, pool([a, b], 1).means) and torch.equal(same.covariances, pool([a, b], 1).covariances)
    with pytest.raises(ValueError):
        pool([a, b], 1, max_share=0)
