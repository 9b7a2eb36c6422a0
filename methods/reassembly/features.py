"""Block features on public data: each block's input and output, one vector per public sample (pFedClub Eq. (1))."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fedge.constants import CONV_FEATURES, FEATURE_BATCH_SIZE
from fedge.model.weights import load_module
from fedge.wire.messages import Weights

log = logging.getLogger(__name__)

CONV_FEATURE_MODES = ("pool", "flatten")


@dataclass(frozen=True)
class BlockFeatures:
    """One block's input (N, D_in) and output (N, D_out) features on N public samples, float32 on CPU.

    Consecutive blocks share storage: block i+1's `inputs` is the same tensor as block i's `outputs`.
    """

    inputs: Tensor
    outputs: Tensor


def to_vectors(x: Tensor, conv_features: str = CONV_FEATURES) -> Tensor:
    """A batch of block activations (n, ...) as feature vectors (n, D).

    Conv maps (n, C, H, W) become per-channel global means (n, C) with "pool" (what the authors' code did,
    original-code-notes §1.4) or (n, C·H·W) with "flatten". Vectors (n, D) are kept as they are: an fc
    block gets its own features, not the previous conv block's (the authors' bug). Any other rank is
    flattened. Raises ValueError for an unknown mode.

    Why "pool" by default: (1) cost — flattened maps reach D = 25,088 (cnn4 cov1, mobilenet_v1 dws1 at
    28×28): for five Zoo-I models at N = 3,300 that is 3.3 GB of features and ~1 min of CKA on 2 CPU cores,
    against 64 MB and ~2 s pooled (bench/bench_cka.py); (2) meaning — per-channel means ask "which channels
    respond to which samples", comparable across blocks of different spatial size, whereas flattened-map
    CKA is dominated by spatial layout; (3) it is what the authors' code did for conv maps.
    """
    if conv_features not in CONV_FEATURE_MODES:
        raise ValueError(f"unknown conv_features {conv_features!r}; use one of {CONV_FEATURE_MODES}")
    if x.dim() == 4 and conv_features == "pool":
        return x.mean(dim=(2, 3))
    return x.reshape(x.shape[0], -1)


def _vector_dim(shape: tuple[int, ...], conv_features: str) -> int:
    if len(shape) == 3 and conv_features == "pool":
        return shape[0]
    return math.prod(shape)


def block_features(
    weights: Weights,
    x_public: Tensor,
    batch_size: int = FEATURE_BATCH_SIZE,
    device: torch.device | str = "cpu",
    conv_features: str = CONV_FEATURES,
) -> list[BlockFeatures]:
    """Run `weights`' model block by block over x_public (N, *input_shape) and keep every block's in/out.

    Eval mode, no grad, batches of `batch_size` on `device`; results are float32 on CPU (see to_vectors for
    how maps become vectors). Returns one BlockFeatures per block, in block order. Raises ValueError for an
    input whose per-sample shape differs from the spec's, an empty public set, batch_size < 1, an unknown
    conv_features mode, or a state dict that does not fit the spec.
    """
    spec = weights.spec
    if x_public.dim() < 1 or tuple(x_public.shape[1:]) != tuple(spec.input_shape) or x_public.shape[0] == 0:
        raise ValueError(
            f"public data of shape {list(x_public.shape)} does not fit model {spec.name!r}: "
            f"need (N ≥ 1, {', '.join(map(str, spec.input_shape))})"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if conv_features not in CONV_FEATURE_MODES:
        raise ValueError(f"unknown conv_features {conv_features!r}; use one of {CONV_FEATURE_MODES}")
    model = load_module(spec, weights.state, device).eval()
    n = x_public.shape[0]
    shapes = [spec.input_shape] + [b.out_shape for b in spec.blocks]
    bounds = [torch.empty(n, _vector_dim(tuple(s), conv_features), dtype=torch.float32) for s in shapes]
    with torch.no_grad():
        for s in range(0, n, batch_size):
            x = x_public[s : s + batch_size].to(device=device, dtype=torch.float32)
            bounds[0][s : s + x.shape[0]] = to_vectors(x, conv_features).cpu()
            for i in range(len(spec.blocks)):
                x = model.run_block(i, x)
                bounds[i + 1][s : s + x.shape[0]] = to_vectors(x, conv_features).float().cpu()
    log.debug(
        "block_features %s: %d blocks, N=%d, %.1f MB",
        spec.name,
        len(spec.blocks),
        n,
        sum(b.numel() for b in bounds) * 4 / 2**20,
    )
    return [BlockFeatures(bounds[i], bounds[i + 1]) for i in range(len(spec.blocks))]
