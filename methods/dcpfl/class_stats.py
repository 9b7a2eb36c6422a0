"""Per-class feature statistics of DC-PFL §4.2 (and FedGH's prototypes): what a client computes over its data
and uploads instead of features, under the names both halves use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The named tensors a `dc_train` reply carries.
MEANS, COVARIANCES, COUNTS = "class_means", "class_covariances", "class_counts"
# The named tensors a `dc_train` task carries for the auxiliary loss: the global means and which classes have one.
GLOBAL_MEANS, KNOWN_CLASSES = "global_means", "known_classes"


@dataclass(frozen=True)
class ClassStats:
    """Per class c: the count |D_c|, the mean µ_c (Eq. 6) and the unbiased covariance Σ_c (Eq. 7), in float64.
    A class with no samples has a zero mean and covariance; one with one sample a zero covariance (not NaN)."""

    counts: torch.Tensor  # (C,) int64
    means: torch.Tensor  # (C, d) float64
    covariances: torch.Tensor | None  # (C, d, d) float64, or None when only means were asked for (FedGH)


def class_statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int, covariance: bool = True) -> ClassStats:
    """Eqs. (6)-(7) over features z (n, d) with labels y (n,): per-class count, mean and unbiased covariance
    Σ_c = 1/(|D_c|-1) Σ (z-µ_c)(z-µ_c)ᵀ, computed in float64 and made exactly symmetric."""
    z = z.detach().double()
    d = z.shape[1]
    counts = torch.bincount(y, minlength=num_classes)[:num_classes].to(torch.int64)
    means = torch.zeros(num_classes, d, dtype=torch.float64)
    covs = torch.zeros(num_classes, d, d, dtype=torch.float64) if covariance else None
    for c in torch.nonzero(counts).flatten().tolist():
        zc = z[y == c]
        means[c] = zc.mean(0)
        if covs is not None and len(zc) > 1:
            centred = zc - means[c]
            cov = centred.T @ centred / (len(zc) - 1)
            covs[c] = (cov + cov.T) / 2
    return ClassStats(counts, means, covs)
