"""Aggregation of models of different sizes on overlapping top-left slices (HeteroFL; FedTrans Eq. (5) crops a
smaller model's weights into a larger one's the same way)."""

from __future__ import annotations

from typing import Sequence

import torch

from fedge.model.weights import State


def region(small: torch.Size | Sequence[int], large: torch.Size | Sequence[int]) -> tuple[slice, ...]:
    """The top-left slice of a tensor of shape `large` that one of shape `small` covers ([:d1, :d2, ...]).
    ValueError when the ranks differ or `small` is larger in some dimension."""
    if len(small) != len(large) or any(s > g for s, g in zip(small, large)):
        raise ValueError(f"a tensor of shape {list(small)} does not fit the top-left of one of shape {list(large)}")
    return tuple(slice(0, s) for s in small)


def crop(tensor: torch.Tensor, shape: torch.Size | Sequence[int]) -> torch.Tensor:
    """The top-left [:d1, :d2, ...] slice of `tensor` of the given shape (HeteroFL's submodel weights)."""
    return tensor[region(shape, tensor.shape)]


def sliced_average(base: State, parts: Sequence[tuple[State, float]]) -> State:
    """Element-wise weighted average of every part's tensors over the top-left slice each covers of `base`'s tensor
    of the same name (Σ_k w_k θ_k / Σ_k w_k per element, over the parts that hold that element); an element no
    part covers keeps `base`'s value. A part may lack a tensor (it covers none of it). Integer buffers (BatchNorm's
    num_batches_tracked) take the largest value present. ValueError for a non-positive weight or a part tensor that
    does not fit `base`'s."""
    if any(not w > 0 for _, w in parts):
        raise ValueError(f"sliced_average needs positive weights, got {[w for _, w in parts]}")
    out: State = {}
    for name, old in base.items():
        held = [(state[name], w) for state, w in parts if name in state]
        if not old.is_floating_point():
            out[name] = torch.stack([old] + [t for t, _ in held if t.shape == old.shape]).max(0).values
            continue
        total = torch.zeros_like(old, dtype=torch.float64)
        count = torch.zeros_like(old, dtype=torch.float64)
        for tensor, w in held:
            where = region(tensor.shape, old.shape)
            total[where] += tensor.double() * w
            count[where] += w
        mean = torch.where(count > 0, total / count.clamp_min(1e-300), old.double())
        out[name] = mean.to(old.dtype)
    return out
