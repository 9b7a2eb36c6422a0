"""Functional grouping of blocks: kernel k-means on the CKA block similarity (pFedClub §3.2.1, pFedHR Eq. (4))."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from fedge.constants import CLUSTERS, GROUPING_ITERATIONS, GROUPING_RESTARTS, SYMMETRY_ATOL

log = logging.getLogger(__name__)

# Method, and where it departs from the papers / the authors' code (one line each):
# - kernel k-means with the Eq. (1) similarity S as kernel: linear CKA is the inner product of normalised
#   centred N×N Gram matrices, so S is a PSD kernel and d²(i, j) = S_ii + S_jj − 2 S_ij is a true squared
#   distance in that Gram space. A cluster centre is the mean of its members' normalised Grams: what the
#   authors meant by averaging features, made well defined (all Grams are N×N whatever the feature width),
#   unlike their element-wise mean of zero/one-padded features of different widths.
# - the objective is Σ d²(block, centre) (k-means) instead of pFedHR Eq. (4)'s Σ 1/sim, which is infinite
#   for unrelated blocks (sim = 0); the assignment "most similar centre" is the same in spirit.
# - k-means++ seeding from `seed` and a few restarts instead of K uniformly drawn blocks.
# - stop when assignments no longer change (at most `iterations`), not a fixed 10 rounds.
# - an empty cluster is re-seeded with the block farthest from its centre, so exactly min(K, B) non-empty
#   groups come back (the authors dropped empty clusters, and their sampler then crashed, notes §1.5).


def _check(similarity: Tensor, k: int) -> Tensor:
    if k < 1:
        raise ValueError(f"number of groups k must be at least 1, got {k}")
    if similarity.dim() != 2 or similarity.shape[0] != similarity.shape[1]:
        raise ValueError(f"similarity must be a square (B, B) matrix, got shape {list(similarity.shape)}")
    s = similarity.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(s).all()):
        raise ValueError("similarity contains NaN or Inf")
    if s.numel() and float((s - s.T).abs().max()) > SYMMETRY_ATOL:
        raise ValueError("similarity must be symmetric (CKA is); got an asymmetric matrix")
    return (s + s.T) / 2


def _seed(s: Tensor, diag: Tensor, k: int, gen: torch.Generator) -> Tensor:
    """k-means++ in the kernel space: first block uniform, each next one ∝ squared distance to the nearest."""
    b = s.shape[0]
    d2 = (diag[:, None] + diag[None, :] - 2 * s).clamp(min=0.0)
    chosen = [int(torch.randint(b, (1,), generator=gen))]
    nearest = d2[chosen[0]].clone()
    for _ in range(1, k):
        total = float(nearest.sum())
        if total > 0:
            nxt = int(torch.multinomial(nearest / total, 1, generator=gen))
        else:  # every block coincides with a chosen one: take the first unchosen
            nxt = next(i for i in range(b) if i not in chosen)
        chosen.append(nxt)
        nearest = torch.minimum(nearest, d2[nxt])
    return _assign(d2[:, torch.tensor(chosen)])


def _distances(s: Tensor, diag: Tensor, labels: Tensor, k: int) -> Tensor:
    """(B, k) squared kernel distance of every block to every cluster mean; +inf for an empty cluster."""
    onehot = torch.nn.functional.one_hot(labels, k).to(s.dtype)  # (B, k)
    size = onehot.sum(0)
    safe = size.clamp(min=1.0)
    cross = (s @ onehot) / safe  # mean similarity to each cluster
    within = (onehot * (s @ onehot)).sum(0) / safe**2  # ‖centre‖²
    d2 = (diag[:, None] - 2 * cross + within[None, :]).clamp(min=0.0)
    return torch.where(size[None, :] > 0, d2, torch.full_like(d2, float("inf")))


def _assign(d2: Tensor) -> Tensor:
    return torch.argmin(d2, dim=1)  # ties go to the lowest cluster index


def _fill_empty(labels: Tensor, d2: Tensor, k: int) -> Tensor:
    """Move the block farthest from its own centre into each empty cluster (never emptying another)."""
    labels = labels.clone()
    for c in range(k):
        counts = torch.bincount(labels, minlength=k)
        if counts[c] > 0:
            continue
        own = d2.gather(1, labels[:, None]).squeeze(1).clone()
        own[counts[labels] <= 1] = -1.0  # singletons cannot give their block away
        labels[int(torch.argmax(own))] = c
    return labels


def _renumber(labels: Tensor) -> Tensor:
    """Relabel 0..k'-1 in order of first appearance."""
    mapping: dict[int, int] = {}
    return torch.tensor([mapping.setdefault(int(v), len(mapping)) for v in labels], dtype=torch.int64)


def _run(s: Tensor, diag: Tensor, k: int, iterations: int, gen: torch.Generator) -> tuple[Tensor, float]:
    labels = _seed(s, diag, k, gen)
    for _ in range(max(1, iterations)):
        d2 = _distances(s, diag, labels, k)
        new = _fill_empty(_assign(d2), d2, k)
        if torch.equal(new, labels):
            break
        labels = new
    d2 = _distances(s, diag, labels, k)
    return labels, float(d2.gather(1, labels[:, None]).sum())


def group_blocks(
    similarity: Tensor,
    k: int = CLUSTERS,
    seed: int = 0,
    iterations: int = GROUPING_ITERATIONS,
    restarts: int = GROUPING_RESTARTS,
) -> Tensor:
    """Group B blocks into min(k, B) functionality groups from their (B, B) similarity (pFedClub Eq. (1)).

    Kernel k-means (see the module comments for why and how it departs from the papers), k-means++ seeded
    from `seed`, best of `restarts`; deterministic for a given seed. Returns labels (B,) int64 in 0..k'-1,
    numbered by first appearance, every group non-empty, on CPU (the similarity may live on any device; the
    B×B work is tiny and done on CPU in float64). B = 0 gives an empty tensor. Raises ValueError for
    k < 1, a non-square, non-symmetric or non-finite similarity, or restarts < 1.
    """
    s = _check(similarity, k)
    if restarts < 1:
        raise ValueError(f"restarts must be at least 1, got {restarts}")
    b = s.shape[0]
    if b == 0:
        return torch.zeros(0, dtype=torch.int64)
    k = min(k, b)
    diag = s.diagonal().clone()
    gen = torch.Generator().manual_seed(seed)
    best, best_cost = None, float("inf")
    for _ in range(restarts):
        labels, cost = _run(s, diag, k, iterations, gen)
        if cost < best_cost - 1e-12:
            best, best_cost = labels, cost
    log.debug("group_blocks: B=%d k=%d objective=%.4f", b, k, best_cost)
    return _renumber(best)
