"""DC-PFL's server equations (Tang et al., IJCAI 2024) and FedGH's header training as pure functions: the checks
of a statistics upload, global classifier training on class means (Eqs. 8-9), count-weighted pooling (Eqs. 10-11),
Gaussian virtual features and calibration (Eq. 12)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from fedge import constants as C
from fedge.class_stats import ClassStats


def statistics_rejection(stats: ClassStats, num_examples: int) -> tuple[str, str] | None:
    """(reason code, message) for the first problem of an upload whose shapes, dtypes and finiteness were already
    checked, else None: class counts that are negative or do not sum to the reply's example count (the client's
    training-set size, which the coordinator bounds by its registration; `statistics_counts`), a mean entry beyond
    M = C.MAX_FEATURE_MAGNITUDE or a covariance entry beyond M² (`statistics_magnitude`), a covariance of a class
    with two or more samples that is not symmetric (`statistics_asymmetric`) or has an eigenvalue below
    −C.PSD_TOLERANCE times its largest, or none computable (`statistics_not_psd`); the tolerances are relative, for
    float32 rounding."""
    counts = stats.counts.tolist()  # Python ints: a sum of int64 tensors could wrap around
    if any(n < 0 or n > num_examples for n in counts) or sum(counts) != num_examples:
        return "statistics_counts", f"class counts {counts} must be >= 0 and sum to its {num_examples} examples"
    present = [c for c, n in enumerate(counts) if n > 0]
    limit = C.MAX_FEATURE_MAGNITUDE
    for c in present:
        parts = [("mean", stats.means[c], limit)]
        if stats.covariances is not None:
            parts.append(("covariance", stats.covariances[c], limit**2))  # a covariance is in squared units
        for what, t, bound in parts:
            biggest = float(t.abs().max())
            if biggest > bound:
                return "statistics_magnitude", f"class {c}'s {what} has an entry of {biggest:.3g}, beyond {bound:g}"
    if stats.covariances is None:
        return None
    for c in (c for c in present if counts[c] > 1):
        cov = stats.covariances[c].double()
        scale = max(float(cov.abs().max()), torch.finfo(torch.float32).tiny)
        if float((cov - cov.T).abs().max()) > C.SYMMETRY_TOLERANCE * scale:
            return "statistics_asymmetric", f"the covariance of class {c} is not symmetric"
        try:
            eig = torch.linalg.eigvalsh(cov)
        except torch.linalg.LinAlgError:
            return "statistics_not_psd", f"the covariance of class {c} has no computable eigenvalues"
        if float(eig[0]) < -C.PSD_TOLERANCE * max(float(eig[-1]), scale):
            return (
                "statistics_not_psd",
                f"the covariance of class {c} has eigenvalue {float(eig[0]):.3g} (largest {float(eig[-1]):.3g}): "
                "not positive semi-definite",
            )
    return None


def ce_step(head: nn.Module, z: torch.Tensor, y: torch.Tensor, lr: float) -> float:
    """One plain SGD step φ ← φ − η ∇ mean_i CE(g_φ(z_i), y_i), in place; the loss before the step. Eq. (8) with
    the loss of Eq. (9) when z are one client's class means µ_c,k (CE averaged over its |C_k| classes); one step of
    Eq. (12) when z are the virtual features."""
    head.eval()  # a head's dropout (MobileNetV2's) stays off: the steps are deterministic, as a resume needs
    head.zero_grad(set_to_none=True)
    loss = F.cross_entropy(head(z.to(torch.float32)), y)
    loss.backward()
    with torch.no_grad():
        for p in head.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    head.zero_grad(set_to_none=True)
    return float(loss.detach())


def pool(parts: Sequence[ClassStats], num_classes: int) -> ClassStats:
    """Eqs. (10)-(11) in float64, per class over the parts holding it: N_c = Σ_k n_k, µ_c = Σ_k n_k µ_k / N_c,
    Σ_c = Σ_k (n_k−1)/(N_c−1) Σ_k + Σ_k n_k/(N_c−1) µ_k µ_kᵀ − N_c/(N_c−1) µ_c µ_cᵀ (the unbiased covariance of
    all their features together), computed as Σ_k [(n_k−1) Σ_k + n_k (µ_k−µ_c)(µ_k−µ_c)ᵀ] / (N_c−1), which is
    equal and does not cancel; N_c = 1 gives Σ_c = 0, N_c = 0 zeros. Covariances only when every part has them."""
    d = parts[0].means.shape[1]
    counts = torch.zeros(num_classes, dtype=torch.int64)
    means = torch.zeros(num_classes, d, dtype=torch.float64)
    with_cov = all(p.covariances is not None for p in parts)
    covs = torch.zeros(num_classes, d, d, dtype=torch.float64) if with_cov else None
    for c in range(num_classes):
        held = [(int(p.counts[c]), p) for p in parts if int(p.counts[c]) > 0]
        if not held:
            continue
        n = sum(k for k, _ in held)
        mu = sum(k * p.means[c].double() for k, p in held) / n
        counts[c], means[c] = n, mu
        if covs is not None and n > 1:
            total = torch.zeros(d, d, dtype=torch.float64)
            for k, p in held:  # Eq. (11) in its centred form (the same sum, without cancelling large means)
                shift = p.means[c].double() - mu
                total += (k - 1) * p.covariances[c].double() + k * torch.outer(shift, shift)  # type: ignore[index]
            covs[c] = (total + total.T) / (2 * (n - 1))
    return ClassStats(counts, means, covs)


def updated(previous: ClassStats, pooled: ClassStats) -> ClassStats:
    """The global statistics after a round: each class the round's replies held takes its pooled statistics, a class
    they did not hold keeps its previous ones (new tensors; `previous` is left as it is)."""
    fresh = pooled.counts > 0

    def take(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        out = old.clone()
        out[fresh] = new[fresh]
        return out

    covs = previous.covariances, pooled.covariances
    return ClassStats(
        take(previous.counts, pooled.counts),
        take(previous.means, pooled.means),
        None if covs[0] is None or covs[1] is None else take(*covs),
    )


def virtual_counts(counts: torch.Tensor, total: int) -> torch.Tensor:
    """|G_c| for each class: `total` split in proportion to the class counts |D_c| / Σ|D_c| (§4.4) by largest
    remainder, so they sum to `total` exactly; classes with no samples get none."""
    counts = counts.to(torch.float64)
    exact = total * counts / counts.sum()
    out = exact.floor().to(torch.int64)
    rest = total - int(out.sum())
    order = sorted(range(len(counts)), key=lambda c: (-(float(exact[c]) - int(out[c])), c))
    for c in order[:rest]:
        out[c] += 1
    return out


def gaussian_samples(mean: torch.Tensor, cov: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """n draws from N(µ, Σ) in float64: µ + V diag(√λ) ε with Σ = V diag(λ) Vᵀ (eigen-decomposition; eigenvalues
    clamped at 0, so a singular Σ gives samples in the subspace it spans), ε ~ N(0, I) from `generator`."""
    cov = cov.double()
    try:
        eig, vecs = torch.linalg.eigh(cov)
    except torch.linalg.LinAlgError:  # LAPACK did not converge: retry with a jitter far below the spread
        jitter = 1e-9 * max(float(cov.diagonal().abs().mean()), 1e-12)
        eig, vecs = torch.linalg.eigh(cov + jitter * torch.eye(len(cov), dtype=torch.float64))
    scale = vecs * eig.clamp(min=0).sqrt()
    eps = torch.randn(n, len(mean), generator=generator, dtype=torch.float64)
    return mean.double() + eps @ scale.T


def virtual_features(stats: ClassStats, total: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.4: the virtual features G = ∪_c G_c, |G_c| from virtual_counts, each drawn from N(µ_c, Σ_c); (z, y) in
    float32 / int64, classes in order."""
    assert stats.covariances is not None
    sizes = virtual_counts(stats.counts, total)
    zs, ys = [], []
    for c in torch.nonzero(sizes).flatten().tolist():
        n = int(sizes[c])
        zs.append(gaussian_samples(stats.means[c], stats.covariances[c], n, generator))
        ys.append(torch.full((n,), c, dtype=torch.int64))
    return torch.cat(zs).float(), torch.cat(ys)


def calibrate(head: nn.Module, z: torch.Tensor, y: torch.Tensor, steps: int, lr: float) -> list[float]:
    """Eq. (12): `steps` full-batch SGD steps on L_cali = 1/|G| Σ_(z,y)∈G CE(g_φ(z), y), in place; the loss before
    each step."""
    return [ce_step(head, z, y, lr) for _ in range(steps)]
