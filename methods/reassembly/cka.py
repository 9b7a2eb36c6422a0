"""Linear CKA between block features: one pair, all pairs at once, the unbiased minibatch estimator, and Eq. (1)."""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from fedge.constants import CKA_MEMORY_LIMIT_BYTES, DEGENERATE_RTOL, GRAM_CHUNK_ELEMENTS
from fedge.model.spec import Device
from methods.reassembly.features import BlockFeatures

log = logging.getLogger(__name__)


def _check_2d(features: Sequence[Tensor], min_rows: int) -> int:
    """The common number of rows; ValueError for a non-2-D, row-mismatched, too-short or non-finite input."""
    n = None
    for i, x in enumerate(features):
        if not isinstance(x, Tensor) or x.dim() != 2:
            raise ValueError(
                f"features {i}: expected a 2-D (N, D) tensor, got shape "
                f"{list(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
            )
        if n is None:
            n = x.shape[0]
        elif x.shape[0] != n:
            raise ValueError(f"features {i} has {x.shape[0]} samples, features 0 has {n}: CKA needs the same samples")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"features {i} contain NaN or Inf")
    if n is not None and n < min_rows:
        raise ValueError(f"CKA needs at least {min_rows} samples, got {n}")
    return n or 0


def centre(x: Tensor, dtype: torch.dtype = torch.float32, rtol: float = DEGENERATE_RTOL) -> tuple[Tensor, bool]:
    """Column-centred copy of x (N, D) in `dtype` (mean taken in float64) and whether x is degenerate.

    Degenerate means every sample has (numerically) the same feature vector: ‖X − mean‖_F ≤ rtol·‖X‖_F
    (or X has no columns). A degenerate block is returned as zeros, so every CKA involving it is 0.
    """
    mean = x.sum(0, dtype=torch.float64) / max(x.shape[0], 1)
    xc = (x.to(torch.float64) - mean) if dtype == torch.float64 else (x.to(dtype) - mean.to(dtype))
    raw = torch.linalg.vector_norm(x, dtype=torch.float64)
    degenerate = x.shape[1] == 0 or bool(torch.linalg.vector_norm(xc, dtype=torch.float64) <= rtol * raw)
    return (torch.zeros_like(xc) if degenerate else xc), degenerate


def linear_cka(x: Tensor, y: Tensor, dtype: torch.dtype = torch.float64) -> float:
    """Linear CKA (Kornblith et al. 2019) of x (N, Dx) and y (N, Dy), biased HSIC with centring, in `dtype`.

    CKA = ‖YcᵀXc‖²_F / (‖XcᵀXc‖_F ‖YcᵀYc‖_F) (feature-space form) or, when N² is cheaper than Dx·Dy,
    ⟨Kx, Ky⟩ / (‖Kx‖‖Ky‖) with Kx = XcXcᵀ (Gram form); both give the same value. Result in [0, 1]; 0 when
    either input is degenerate (constant over samples). Raises ValueError for non-2-D or non-finite inputs,
    a sample-count mismatch, or N < 2. This is the reference the vectorised functions are tested against.
    """
    _check_2d([x, y], min_rows=2)
    xc, dx = centre(x, dtype)
    yc, dy = centre(y.to(x.device), dtype)
    if dx or dy:
        return 0.0
    n, p, q = xc.shape[0], xc.shape[1], yc.shape[1]
    if n * n * (p + q) < n * (p * q + p * p + q * q):
        kx, ky = xc @ xc.T, yc @ yc.T
        hsic, nx, ny = (kx * ky).sum(), torch.linalg.matrix_norm(kx), torch.linalg.matrix_norm(ky)
    else:
        hsic = torch.linalg.matrix_norm(yc.T @ xc) ** 2
        nx, ny = torch.linalg.matrix_norm(xc.T @ xc), torch.linalg.matrix_norm(yc.T @ yc)
    return float((hsic / (nx * ny)).clamp(0.0, 1.0))


def _hsic_gram(xs: list[Tensor], limit: int) -> Tensor:
    """Σ over row chunks of A Aᵀ with A = stacked flattened Gram rows: H_ij = ⟨XiXiᵀ, XjXjᵀ⟩_F, (B, B).

    Row chunks are as large as `limit` allows (fat Gram GEMMs are ~3× faster than thin ones); the product
    A Aᵀ is then summed over slices of GRAM_CHUNK_ELEMENTS columns in float64, because one float32 dot
    product over all N² entries loses ~1e-3 relative accuracy at N = 3,300.
    """
    b, n = len(xs), xs[0].shape[0]
    rows = max(1, min(n, limit // max(1, 4 * b * n)))
    buf = torch.empty(b, rows * n, dtype=xs[0].dtype, device=xs[0].device)
    h = torch.zeros(b, b, dtype=torch.float64, device=xs[0].device)
    for r0 in range(0, n, rows):
        r = min(rows, n - r0)
        a = buf[:, : r * n]
        for i, x in enumerate(xs):
            torch.matmul(x[r0 : r0 + r], x.T, out=a[i].view(r, n))
        for c0 in range(0, r * n, GRAM_CHUNK_ELEMENTS):
            c = a[:, c0 : c0 + GRAM_CHUNK_ELEMENTS]
            h += (c @ c.T).to(torch.float64)
    return h


def _hsic_feature(xs: list[Tensor], limit: int) -> Tensor:
    """H_ij = ‖XjᵀXi‖²_F for all pairs from Z = [X1 … XB]: column chunks of ZᵀZ, squared, summed per block."""
    z = torch.cat(xs, dim=1)  # (N, P)
    seg = torch.cat([torch.full((x.shape[1],), i, device=z.device) for i, x in enumerate(xs)])
    b, p = len(xs), z.shape[1]
    cols = max(1, min(p, limit // max(1, 20 * p)))  # float32 product, float64 sum and its square
    h = torch.zeros(b, b, dtype=torch.float64, device=z.device)
    n = z.shape[0]
    for c0 in range(0, p, cols):
        c = sum(
            (z[r0 : r0 + GRAM_CHUNK_ELEMENTS, c0 : c0 + cols].T @ z[r0 : r0 + GRAM_CHUNK_ELEMENTS]).to(torch.float64)
            for r0 in range(0, n, GRAM_CHUNK_ELEMENTS)
        )
        sq = c**2  # (cols, P)
        per_block = torch.zeros(sq.shape[0], b, dtype=torch.float64, device=z.device)
        per_block.index_add_(1, seg, sq)
        h.index_add_(0, seg[c0 : c0 + cols], per_block)
    return h


def choose_method(n: int, dims: Sequence[int]) -> str:
    """'gram' or 'feature', whichever needs fewer multiply-adds for B blocks of N samples and dims D_i.

    Gram form: N²·ΣD (the Grams) + B²·N² (one (B×N²)·(N²×B) product). Feature form: N·(ΣD)² (ZᵀZ).
    Gram wins when N·(ΣD + B²) < (ΣD)²: pooled Zoo-I rounds (ΣD ≈ 5k over ~57 distinct tensors) switch
    to the feature form near N ≈ 3,000; flattened maps (ΣD ≈ 260k) always use the Gram form.
    """
    p, b = sum(dims), len(dims)
    return "gram" if n * n * (p + b * b) <= n * p * p else "feature"


def _normalise(h: Tensor) -> Tensor:
    """CKA_ij = H_ij / sqrt(H_ii H_jj), symmetrised, 0 where a diagonal entry is not positive."""
    h = (h + h.T) / 2
    d = h.diagonal().clamp(min=0.0).sqrt()
    denom = d[:, None] * d[None, :]
    return torch.where(denom > 0, h / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(h))


def cka_matrix(
    features: Sequence[Tensor],
    *,
    method: str = "auto",
    device: Device = "cpu",
    dtype: torch.dtype = torch.float32,
    memory_limit_bytes: int = CKA_MEMORY_LIMIT_BYTES,
) -> Tensor:
    """Linear CKA of every pair of B feature matrices X_i (N, D_i), all at once: (B, B) float32 on CPU.

    Each X_i is centred once (Kornblith et al. 2019, biased HSIC); HSIC for all pairs comes from one product
    of flattened Gram matrices (method 'gram') or one ZᵀZ over concatenated features ('feature'); 'auto'
    picks the cheaper (choose_method). Work is chunked so no buffer exceeds `memory_limit_bytes`
    (approximately). Symmetric; diagonal 1 except for degenerate (constant) blocks, whose row and
    column are 0. Raises ValueError on a non-2-D or non-finite input, differing N, N < 2, or an unknown
    method. B = 0 gives a (0, 0) tensor.
    """
    if method not in ("auto", "gram", "feature"):
        raise ValueError(f"unknown CKA method {method!r}; use 'auto', 'gram' or 'feature'")
    n = _check_2d(features, min_rows=2)
    if not features:
        return torch.zeros(0, 0)
    xs = [centre(x.to(device), dtype)[0] for x in features]
    if method == "auto":
        method = choose_method(n, [x.shape[1] for x in xs])
    log.debug("cka_matrix: B=%d N=%d ΣD=%d method=%s", len(xs), n, sum(x.shape[1] for x in xs), method)
    h = _hsic_gram(xs, memory_limit_bytes) if method == "gram" else _hsic_feature(xs, memory_limit_bytes)
    return _normalise(h).clamp(0.0, 1.0).to(torch.float32).cpu()


def unbiased_gram(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The U-centred Gram matrix of x (n, D), n ≥ 4 (Székely & Rizzo 2014), flattened to (n²,).

    ⟨ũ(Kx), ũ(Ky)⟩ / (n(n−3)) is the unbiased HSIC_1 estimator (Song et al. 2012) used by minibatch CKA.
    Raises ValueError for n < 4 (the estimator divides by n − 3).
    """
    n = x.shape[0]
    if n < 4:
        raise ValueError(f"unbiased HSIC needs at least 4 samples per minibatch, got {n}")
    xc = x.to(dtype)
    gram = (xc @ xc.T).to(torch.float64).fill_diagonal_(0.0)
    means = gram.sum(0) / (n - 2)
    means = means - means.sum() / (2 * (n - 1))
    gram = (gram - means[:, None] - means[None, :]).fill_diagonal_(0.0)
    return gram.reshape(-1)


def minibatch_cka_matrix(
    feature_batches: Iterable[Sequence[Tensor]], *, device: Device = "cpu", dtype: torch.dtype = torch.float32
) -> Tensor:
    """Minibatch linear CKA (Nguyen, Raghu & Kornblith 2021) of B blocks: (B, B) float32 on CPU.

    Each item of `feature_batches` holds the B blocks' features on one minibatch (n_b, D_i). Unbiased
    HSIC_1 is summed over minibatches for all pairs at once, and CKA_ij = ΣHSIC_ij / sqrt(ΣHSIC_ii ΣHSIC_jj).
    Unlike averaging per-batch biased CKA (pFedHR's code), this converges to full-data CKA as batches
    accumulate, with memory O(B·n_b²). Values lie in [−1, 1] (small negatives are estimation noise);
    a block whose summed self-HSIC is not positive gets 0. Raises ValueError for an empty iterable, a batch
    with a different B than the first, mismatched n within a batch, n < 4, or non-finite features.
    """
    h: Tensor | None = None
    for k, batch in enumerate(feature_batches):
        n = _check_2d(batch, min_rows=4)
        if h is None:
            h = torch.zeros(len(batch), len(batch), dtype=torch.float64, device=device)
        if len(batch) != h.shape[0]:
            raise ValueError(f"minibatch {k} has {len(batch)} blocks, the first had {h.shape[0]}")
        if not batch:
            continue
        grams = torch.stack([unbiased_gram(x.to(device), dtype) for x in batch])  # (B, n²), float64
        h += (grams @ grams.T) / (n * (n - 3))
    if h is None:
        raise ValueError("minibatch_cka_matrix got no minibatches")
    return _normalise(h).clamp(-1.0, 1.0).to(torch.float32).cpu()


def block_similarity(
    features: Sequence[BlockFeatures],
    *,
    device: Device = "cpu",
    method: str = "auto",
    memory_limit_bytes: int = CKA_MEMORY_LIMIT_BYTES,
) -> Tensor:
    """sim(B_i, B_j) = CKA(x_i, x_j) + CKA(B_i(x_i), B_j(x_j)) for all block pairs: (B, B) float32 in [0, 2].

    pFedClub Eq. (1) / pFedHR Eq. (3) (whose distance is the reciprocal of this). Feature tensors shared
    between blocks (block i+1's input is block i's output, see block_features) are centred and turned into
    Grams once: one cka_matrix over the distinct tensors serves both terms. Raises ValueError when the
    blocks were not fed the same number of public samples (see cka_matrix).
    """
    tensors, ins, outs = _distinct(features)
    c = cka_matrix(tensors, method=method, device=device, memory_limit_bytes=memory_limit_bytes)
    return c[ins][:, ins] + c[outs][:, outs]


def _distinct(features: Sequence[BlockFeatures]) -> tuple[list[Tensor], Tensor, Tensor]:
    """The distinct feature tensors of the blocks, and each block's input and output index among them."""
    distinct: dict[int, int] = {}
    tensors: list[Tensor] = []
    for t in (t for f in features for t in (f.inputs, f.outputs)):
        if id(t) not in distinct:
            distinct[id(t)] = len(tensors)
            tensors.append(t)
    ins = torch.tensor([distinct[id(f.inputs)] for f in features], dtype=torch.int64)
    outs = torch.tensor([distinct[id(f.outputs)] for f in features], dtype=torch.int64)
    return tensors, ins, outs


def minibatch_block_similarity(batches: Iterable[Sequence[BlockFeatures]], *, device: Device = "cpu") -> Tensor:
    """Eq. (1) for all block pairs from minibatch CKA, for public sets too large to hold as features.

    Each item holds the same blocks' features on one minibatch of public data (as block_features gives
    them). Values lie in [−2, 2]. Raises ValueError like minibatch_cka_matrix.
    """
    index: list[tuple[Tensor, Tensor]] = []

    def distinct_batches() -> Iterator[list[Tensor]]:
        for features in batches:
            tensors, ins, outs = _distinct(features)
            index[:] = [(ins, outs)]
            yield tensors

    c = minibatch_cka_matrix(distinct_batches(), device=device)
    ins, outs = index[0]
    return c[ins][:, ins] + c[outs][:, outs]
