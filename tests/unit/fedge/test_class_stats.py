"""The client's per-class statistics (DC-PFL Eqs. 6-7) against torch.mean / torch.cov on each class's rows."""

import pytest
import torch

from methods.dcpfl.class_stats import class_statistics

pytestmark = pytest.mark.timeout(60)
C, D = 6, 5
SIZES = {0: 9, 1: 1, 3: 14, 4: 2, 5: 6}  # class 2 absent, class 1 one sample


def labelled_features(dtype=torch.float64):
    """Shuffled features with class-dependent offsets and scales, labels as in SIZES."""
    gen = torch.Generator().manual_seed(0)
    y = torch.cat([torch.full((n,), c) for c, n in SIZES.items()])
    y = y[torch.randperm(len(y), generator=gen)]
    z = torch.randn(len(y), D, generator=gen, dtype=torch.float64) * (1 + y[:, None]) + 10 * y[:, None]
    return z.to(dtype), y


def test_eqs_6_and_7_equal_torch_mean_and_unbiased_cov_per_class():
    z, y = labelled_features()
    s = class_statistics(z, y, C)
    assert s.counts.dtype == torch.int64 and s.counts.tolist() == [SIZES.get(c, 0) for c in range(C)]
    assert s.means.dtype == s.covariances.dtype == torch.float64
    assert s.means.shape == (C, D) and s.covariances.shape == (C, D, D)
    for c, n in SIZES.items():
        rows = z[y == c]
        torch.testing.assert_close(s.means[c], torch.mean(rows, 0), rtol=0, atol=1e-12)
        if n > 1:
            torch.testing.assert_close(s.covariances[c], torch.cov(rows.T, correction=1), rtol=0, atol=1e-12)
            assert float(s.covariances[c].diagonal().min()) > 0
    assert torch.equal(s.covariances, s.covariances.transpose(1, 2))  # exactly symmetric


def test_an_absent_class_is_zeros_and_a_one_sample_class_has_zero_covariance_not_nan():
    z, y = labelled_features()
    s = class_statistics(z, y, C)
    assert s.counts[2] == 0 and not s.means[2].any() and not s.covariances[2].any()
    assert torch.equal(s.means[1], z[y == 1][0])
    assert not s.covariances[1].any()
    assert torch.isfinite(s.means).all() and torch.isfinite(s.covariances).all()


def test_float32_features_are_summed_in_float64_and_means_only_leaves_covariances_out():
    z, y = labelled_features(torch.float32)
    s = class_statistics(z, y, C, covariance=False)
    assert s.covariances is None and s.means.dtype == torch.float64
    for c in SIZES:
        torch.testing.assert_close(s.means[c], z[y == c].double().mean(0), rtol=0, atol=1e-12)
