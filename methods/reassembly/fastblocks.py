"""A faster runner of a candidate whose frozen blocks are fixed: BatchNorm folded into the layer before it, and
channels-last convolutions; the trainable blocks are the candidate's own modules.

During stitch fine-tuning (pFedClub Eq. (2)-(3)) every block but the stitches is frozen and in eval mode, where
BatchNorm is the affine map y = γ (x − μ) / √(σ² + ε) + β of fixed running statistics. After a Conv2d (or Linear)
whose output feeds nothing else it folds exactly into that layer, per output channel (a depthwise conv's too):
W' = W · s, b' = (b − μ) · s + β with s = γ / √(σ² + ε). Only a Conv2d → BatchNorm2d or Linear → BatchNorm1d pair
of consecutive layers of one nn.Sequential is folded (a Residual's body, an inverted residual's included); a
BatchNorm anywhere else stays as it is. The folded copy computes only: its weights are not the model's and are
never exported (`FastBlocks.state_dict` refuses), and the original module is never written to.
"""

from __future__ import annotations

import copy
from typing import Any, Collection

import torch
from torch import nn

from fedge.model.spec import ModelSpec, SpecModel

_FOLDABLE = ((nn.Conv2d, nn.BatchNorm2d), (nn.Linear, nn.BatchNorm1d))


class FastBlocks(nn.Module):
    """Runs a SpecModel's blocks like `SpecModel.run_block`, frozen blocks folded and (optionally) channels-last.

    `blocks[i]` is the original module's block i when i is trainable (the same parameter objects, so an optimizer
    over either trains both) and a folded copy otherwise. Frozen blocks always run in eval mode: `train()` sets
    only the trainable blocks' mode.
    """

    def __init__(self, spec: ModelSpec, blocks: nn.ModuleList, frozen: Collection[int], channels_last: bool) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = blocks
        self.frozen = tuple(sorted(frozen))
        # frozen blocks that convolve: their 4-d inputs are made channels-last (a no-op when they already are)
        self._to_channels_last = frozenset(
            i for i in self.frozen if channels_last and any(isinstance(m, nn.Conv2d) for m in blocks[i].modules())
        )

    def run_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Block i alone on a batch of its inputs: the original's output up to float rounding.

        A channels-last block takes its 4-d input channels-last and gives its 4-d output contiguous unless block
        i + 1 is channels-last too, so the other blocks see the formats they would in the original; gradients
        cross each switch in the format of the side they go to (a mismatch slows the backward of ReLU and pooling).
        """
        return self.block_output(i, self.blocks[i](self.block_input(i, x)))

    def block_input(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x as block i takes it: channels-last when the block is and x is 4-d (run_block's first half)."""
        return _Reformat.apply(x, torch.channels_last) if i in self._to_channels_last and x.dim() == 4 else x

    def block_output(self, i: int, y: torch.Tensor) -> torch.Tensor:
        """Block i's output as block i + 1 takes it: a channels-last block's 4-d output made contiguous unless the
        next block is channels-last too (run_block's second half)."""
        if i in self._to_channels_last and y.dim() == 4 and i + 1 not in self._to_channels_last:
            return _Reformat.apply(y, torch.contiguous_format)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.blocks)):
            x = self.run_block(i, x)
        return x

    def train(self, mode: bool = True) -> FastBlocks:
        super().train(mode)
        for i in self.frozen:
            self.blocks[i].eval()
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: folded weights are not the model's; export the original module's state instead."""
        raise TypeError("FastBlocks holds folded copies of frozen blocks; take the state dict of the original module")


class _Reformat(torch.autograd.Function):
    """x in `memory_format` (same values); its gradient goes back in x's own format."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        ctx.channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        return x.contiguous(memory_format=memory_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        fmt = torch.channels_last if ctx.channels_last else torch.contiguous_format
        return grad.contiguous(memory_format=fmt), None


def fast_blocks(module: SpecModel, trainable: Collection[int], channels_last: bool = True) -> FastBlocks:
    """A runner of `module` with its trainable blocks shared and every other block a folded, frozen copy.

    Frozen copies are in eval mode with requires_grad False (gradients still flow through them to their inputs),
    every Conv2d/Linear → BatchNorm pair folded (`fold_batchnorm`) and, with `channels_last`, their conv weights
    channels-last. `module` and its state dict are left untouched. Raises ValueError for a trainable index outside
    the module's blocks.
    """
    n = len(module.blocks)
    wanted = set(trainable)
    if any(not 0 <= i < n for i in wanted):
        raise ValueError(
            f"model {module.spec.name!r} has {n} blocks; trainable indices {sorted(wanted)} are not all in"
        )
    frozen = [i for i in range(n) if i not in wanted]
    blocks = [module.blocks[i] if i in wanted else fold_batchnorm(module.blocks[i], channels_last) for i in range(n)]
    return FastBlocks(module.spec, nn.ModuleList(blocks), frozen, channels_last)


def fold_batchnorm(block: nn.Module, channels_last: bool = False) -> nn.Module:
    """A frozen copy of `block` (eval mode, requires_grad False) computing what `block` does in eval mode, with
    every BatchNorm that directly follows a Conv2d/Linear in one nn.Sequential folded into it (the BatchNorm
    dropped); with `channels_last`, 4-d conv weights channels-last. A BatchNorm without running statistics is
    kept (eval mode normalises it by batch statistics, which no weight can hold). A Linear → BatchNorm1d fold
    assumes (N, features) inputs, the only ones the spec's `linear` layer takes. `block` is not modified."""
    out = _fold(copy.deepcopy(block)).eval().requires_grad_(False)
    if channels_last:
        for m in out.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last)
    return out


def _fold(module: nn.Module) -> nn.Module:
    """`module` (a private copy) with its Sequentials' Conv/Linear → BatchNorm pairs folded, innermost first."""
    for name, child in list(module.named_children()):
        setattr(module, name, _fold(child))
    if not isinstance(module, nn.Sequential):
        return module
    layers = list(module)
    kept: list[nn.Module] = []
    for layer in layers:
        if kept and _foldable(kept[-1], layer):
            _fold_into(kept[-1], layer)
        else:
            kept.append(layer)
    return module if len(kept) == len(layers) else nn.Sequential(*kept)


def _foldable(layer: nn.Module, bn: nn.Module) -> bool:
    pair = any(type(layer) is a and type(bn) is b for a, b in _FOLDABLE)
    if not pair or bn.running_mean is None or bn.running_var is None:
        return False
    out = layer.out_channels if isinstance(layer, nn.Conv2d) else layer.out_features
    return bn.num_features == out


@torch.no_grad()
def _fold_into(layer: nn.Conv2d | nn.Linear, bn: nn.BatchNorm2d | nn.BatchNorm1d) -> None:
    """layer := bn ∘ layer with bn's running statistics, computed in float64 where the device has it."""
    w = layer.weight
    dtype = w.dtype if w.device.type == "mps" else torch.float64
    var, mean = bn.running_var.to(dtype), bn.running_mean.to(dtype)
    gamma = bn.weight.to(dtype) if bn.weight is not None else torch.ones_like(var)
    beta = bn.bias.to(dtype) if bn.bias is not None else torch.zeros_like(var)
    scale = gamma / torch.sqrt(var + bn.eps)
    bias = layer.bias.to(dtype) if layer.bias is not None else torch.zeros_like(var)
    new_w = (w.to(dtype) * scale.reshape(-1, *([1] * (w.dim() - 1)))).to(w.dtype)
    layer.weight = nn.Parameter(new_w, requires_grad=False)
    layer.bias = nn.Parameter(((bias - mean) * scale + beta).to(w.dtype), requires_grad=False)
