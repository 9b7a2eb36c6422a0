"""DC-PFL's server equations (Tang et al., IJCAI 2024) and FedGH's header training as pure functions: the checks
of a statistics upload, alone and against the round, global classifier training on class means (Eqs. 8-9),
count-weighted pooling with capped shares (Eqs. 10-11), Gaussian virtual features and calibration (Eq. 12)."""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from fedge import constants as C
from methods.dcpfl.class_stats import ClassStats
from server.aggregation import capped_shares


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


def class_scales(stats: ClassStats) -> tuple[dict[int, float], dict[int, float]]:
    """The scale of each class an upload holds, in feature units: the mean's norm ‖µ_c‖ for every class with a
    sample, the spread √tr Σ_c for every class with two or more (none without covariances; a trace below 0, from
    float rounding of a checked PSD matrix, counts as 0)."""
    counts = stats.counts.tolist()
    norms = {c: float(stats.means[c].double().norm()) for c, n in enumerate(counts) if n > 0}
    if stats.covariances is None:
        return norms, {}
    covs = stats.covariances
    return norms, {c: math.sqrt(max(float(covs[c].double().trace()), 0.0)) for c, n in enumerate(counts) if n > 1}


def scale_rejections(
    replies: Mapping[str, ClassStats],
    known: ClassStats | None = None,
    factor: float = C.STATISTICS_SCALE_FACTOR,
    quorum: int = C.STATISTICS_MIN_REPLIES,
) -> dict[str, tuple[str, str]]:
    """Client → ("statistics_scale", message) for each reply (statistics already checked by statistics_rejection)
    holding a class whose mean norm or spread (class_scales) exceeds `factor` x its reference, the first one found
    in class order. The reference of class c: the median over the replies whose value of it exists when at least
    `quorum` do (one liar moves it no further than the honest values around it); else, with at least `quorum`
    replies, the round's scale: the median over the replies of each one's median over its classes; else c's value
    in `known` (the server's global statistics, DC-PFL), if it has one; else none and c is not checked. A reference
    of 0 checks nothing. ValueError for factor <= 0 or quorum < 1."""
    if not factor > 0 or quorum < 1:
        raise ValueError(f"scale_rejections needs factor > 0 and quorum >= 1, got {factor} and {quorum}")
    scales = {cid: class_scales(s) for cid, s in replies.items()}
    known_scales = class_scales(known) if known is not None else ({}, {})
    out: dict[str, tuple[str, str]] = {}
    for q, what in enumerate(("mean norm", "spread (√tr Σ)")):
        values = {cid: pair[q] for cid, pair in scales.items()}
        medians = [statistics.median(v.values()) for v in values.values() if v]
        wide = statistics.median(medians) if len(medians) >= quorum else None
        for cid in sorted(values):
            for c, value in sorted(values[cid].items()):
                held = [v[c] for v in values.values() if c in v]
                if len(held) >= quorum:
                    ref, source = statistics.median(held), f"the median of the {len(held)} replies holding it"
                elif wide is not None:
                    ref, source = wide, f"the round's scale over {len(medians)} replies"
                elif c in known_scales[q]:
                    ref, source = known_scales[q][c], "the server's global statistics of the class"
                else:
                    continue
                if ref > 0 and value > factor * ref and cid not in out:
                    out[cid] = (
                        "statistics_scale",
                        f"class {c}'s {what} is {value:.4g}, over {factor:g} x {ref:.4g}, {source}",
                    )
    return out


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


def pool(parts: Sequence[ClassStats], num_classes: int, max_share: float = 1.0) -> ClassStats:
    """Eqs. (10)-(11) in float64, per class over the parts holding it: N_c = Σ_k n_k, µ_c = Σ_k n_k µ_k / N_c,
    Σ_c = Σ_k (n_k−1)/(N_c−1) Σ_k + Σ_k n_k/(N_c−1) µ_k µ_kᵀ − N_c/(N_c−1) µ_c µ_cᵀ (the unbiased covariance of
    all their features together), computed as Σ_k [(n_k−1) Σ_k + n_k (µ_k−µ_c)(µ_k−µ_c)ᵀ] / (N_c−1), which is
    equal and does not cancel; N_c = 1 gives Σ_c = 0, N_c = 0 zeros. Covariances only when every part has them.
    Counts are the clients' word, so no part's share n_k / N_c of a class may exceed `max_share` (capped_shares;
    1: the paper's weights): a capped class pools with n_k replaced by share_k · N_c (each >= 1, so the
    covariance weights stay >= 0), N_c itself unchanged. ValueError for max_share outside (0, 1]."""
    if not 0 < max_share <= 1:
        raise ValueError(f"pool needs max_share in (0, 1], got {max_share}")
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
        if max_share < 1:  # deviation (docs/deviations.md): the paper weights by the reported counts alone
            shares = capped_shares([k for k, _ in held], max_share)
            if any(abs(share * n - k) > 1e-9 * n for share, (k, _) in zip(shares, held)):
                held = [(share * n, p) for share, (_, p) in zip(shares, held)]  # type: ignore[misc]
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
