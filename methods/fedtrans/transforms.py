"""Function-preserving transformations of a ModelSpec and its weights: FedTrans §4.1 widen and deepen of a *Cell*.

Widen is Net2Wider (Net2Net, Chen et al. 2015) by a factor of two with full replication, the mapping of the
FedTrans authors' code (new unit j + C is a copy of unit j), without their noise: the copies are exact and the
symmetry is broken in the consumer instead, whose duplicated input columns are split a·W and (1 − a)·W with a
per-unit a drawn from SPLIT_RANGE. Deepen inserts an identity-initialised layer of the cell's type, followed by
the cell's ReLU-type activation, right after that activation (Net2DeeperNet); its input is non-negative, so the
identity layer and the activation pass it through unchanged. The authors' deepen inserted a fresh BatchNorm,
which is not function-preserving; there is none here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from fedge.model.layers import LayerSpec, Shape, layer_type
from fedge.model.spec import ModelSpec, make_block
from fedge.model.weights import State, WeightsError, check_state, tensor_shapes

# The consumer's share a of a duplicated input column is drawn uniformly from this range per unit (the copy gets
# 1 − a). Away from 0.5 so that the two copies get different gradients; away from 0 and 1 so neither copy is dead.
SPLIT_RANGE = (0.25, 0.75)
# Layers a widened unit passes through unchanged (element-wise per channel or shape-only); anything else but a
# consumer stops a widen.
PASS_THROUGH = frozenset(
    {"relu", "relu6", "hardswish", "bn2d", "maxpool", "avgpool", "adaptive_avgpool", "dropout", "flatten"}
)
# Activations whose output is non-negative, after which an identity layer (and the same activation) is exact.
RELU_TYPES = frozenset({"relu", "relu6"})
_BN_TENSORS = ("weight", "bias", "running_mean", "running_var")
_WIDTH_ARG = {"conv2d": "out_channels", "linear": "out_features"}

Position = tuple[int, int]  # (block index, layer index)


class TransformError(ValueError):
    """A transformation cannot be applied: not a cell, no valid consumer or activation, or state not of the spec."""


@dataclass(frozen=True)
class Cell:
    """A transformable layer (FedTrans' *Cell*): a top-level conv2d (groups 1) or hidden linear of a spec."""

    block: int
    layer: int

    @property
    def name(self) -> str:
        """The layer's state-dict prefix, `blocks.<block>.<layer>` (indices shift when a layer is inserted)."""
        return f"blocks.{self.block}.{self.layer}"


@dataclass(frozen=True)
class Transformed:
    """A transformed model and how it relates to its parent.

    `lineage` maps every tensor name of `state` to the parent tensor it was made from (None for an inserted
    layer's). `cell_match` is FedTrans §4.2's matching degree mc of every cell of `spec`, keyed by cell name:
    #param(parent cell) / #param(this cell), i.e. 1.0 for a cell whose weights are unchanged in shape, below 1
    for a widened cell or one whose inputs were widened, and 0.0 for an inserted cell.
    """

    spec: ModelSpec
    state: State
    lineage: dict[str, str | None]
    cell_match: dict[str, float]


def _walk(spec: ModelSpec) -> Iterator[tuple[Position, LayerSpec, Shape]]:
    """Every top-level layer in order with its position and per-sample input shape."""
    for b, block in enumerate(spec.blocks):
        shape = tuple(block.in_shape)
        for j, ly in enumerate(block.layers):
            yield (b, j), ly, shape
            shape = tuple(layer_type(ly.type).out_shape(ly.args, shape))


def _is_weighted(ly: LayerSpec) -> bool:
    return ly.type == "linear" or (ly.type == "conv2d" and ly.args.get("groups", 1) == 1)


def _logits(spec: ModelSpec) -> Position | None:
    """The last linear layer if only pass-through layers follow it (it gives the logits), else None."""
    found = None
    for pos, ly, _ in _walk(spec):
        if ly.type == "linear":
            found = pos
        elif ly.type not in PASS_THROUGH:
            found = None
    return found


def cells(spec: ModelSpec) -> list[Cell]:
    """The transformable cells of `spec` in order: every top-level conv2d with groups == 1 and every top-level
    linear except the logits layer (the last linear, never widened). Layers inside composite layers
    (depthwise_separable, inverted_residual, squeeze_excite, stitch) are not cells, so a MobileNet has only its
    stem and head layers as cells; a model made only of composite layers has none (an empty list)."""
    logits = _logits(spec)
    return [Cell(*pos) for pos, ly, _ in _walk(spec) if _is_weighted(ly) and pos != logits]


def _check_cell(spec: ModelSpec, cell: Cell) -> None:
    if cell not in cells(spec):
        raise TransformError(
            f"{cell!r} is not a cell of model {spec.name!r}; its cells are {[c.name for c in cells(spec)]}"
        )


def _widen_plan(spec: ModelSpec, cell: Cell) -> tuple[list[Position], Position]:
    """The BatchNorms between the cell and its consumer, and the consumer; TransformError if there is none."""
    _check_cell(spec, cell)
    bns: list[Position] = []
    for pos, ly, _ in _walk(spec):
        if pos <= (cell.block, cell.layer):
            continue
        if _is_weighted(ly):
            return bns, pos
        if ly.type not in PASS_THROUGH:
            raise TransformError(
                f"cannot widen {cell.name} of {spec.name!r}: its output feeds a {ly.type!r} layer at "
                f"blocks.{pos[0]}.{pos[1]}; only a conv2d (groups 1) or linear consumer can take widened inputs"
            )
        if ly.type == "bn2d":
            bns.append(pos)
    raise TransformError(f"cannot widen {cell.name} of {spec.name!r}: it gives the model's output")


def can_widen(spec: ModelSpec, cell: Cell) -> bool:
    """Whether `widen` applies: only pass-through layers lie between the cell and a conv2d (groups 1) or linear
    consumer. A `cell` that is not a cell of `spec` raises TransformError."""
    try:
        _widen_plan(spec, cell)
    except TransformError:
        _check_cell(spec, cell)
        return False
    return True


def _deepen_plan(spec: ModelSpec, cell: Cell) -> tuple[int, LayerSpec]:
    """Where (layer index in the cell's block) the identity layer goes and its activation; TransformError if none."""
    _check_cell(spec, cell)
    layers = spec.blocks[cell.block].layers
    kind = layers[cell.layer]
    k = kind.args.get("kernel_size", 1)
    if kind.type == "conv2d" and k % 2 == 0:
        raise TransformError(f"cannot deepen {cell.name} of {spec.name!r}: an even kernel ({k}) has no 'same' padding")
    for j in range(cell.layer + 1, len(layers)):
        if layers[j].type in RELU_TYPES:
            return j + 1, LayerSpec(layers[j].type)
        if layers[j].type not in PASS_THROUGH or layers[j].type == "flatten":
            break
    raise TransformError(
        f"cannot deepen {cell.name} of {spec.name!r}: no relu/relu6 follows it in block {cell.block} before "
        f"another weighted or shape-changing layer, so an identity layer there would not be exact"
    )


def can_deepen(spec: ModelSpec, cell: Cell) -> bool:
    """Whether `deepen` applies: a relu or relu6 follows the cell in its block, with only pass-through layers
    (no flatten) between, and a conv cell has an odd kernel. A non-cell raises TransformError."""
    try:
        _deepen_plan(spec, cell)
    except TransformError:
        _check_cell(spec, cell)
        return False
    return True


def _rebuild(spec: ModelSpec, blocks: list[list[LayerSpec]], suffix: str) -> ModelSpec:
    """`spec` with each block's layers replaced, shapes recomputed, names and origins kept."""
    built, shape = [], tuple(spec.input_shape)
    for b, layers in zip(spec.blocks, blocks):
        block = make_block(b.name, layers, shape, b.origin)
        built.append(block)
        shape = block.out_shape
    return ModelSpec(f"{spec.name}+{suffix}", tuple(spec.input_shape), spec.num_classes, tuple(built))


def _checked_copy(spec: ModelSpec, state: State) -> State:
    try:
        check_state(spec, state)
    except WeightsError as e:
        raise TransformError(f"state is not that of model {spec.name!r}: {e}") from None
    return {k: v.detach().clone() for k, v in state.items()}


def _cell_params(spec: ModelSpec) -> dict[str, tuple[Position, int]]:
    inputs = {pos: (ly, shape) for pos, ly, shape in _walk(spec)}
    out = {}
    for c in cells(spec):
        ly, shape = inputs[(c.block, c.layer)]
        out[c.name] = ((c.block, c.layer), layer_type(ly.type).params(ly.args, shape))
    return out


def _finish(parent: ModelSpec, child: ModelSpec, state: State, source: dict[Position, Position | None]) -> Transformed:
    """Lineage and cell_match from `source` (child layer position → parent position, None if inserted)."""
    expected = {k: shape for k, (shape, _) in tensor_shapes(child).items()}
    if expected != {k: tuple(t.shape) for k, t in state.items()}:  # a bug here, not bad input
        raise AssertionError(f"transformed state of {child.name!r} does not match its spec")
    lineage: dict[str, str | None] = {}
    for name in state:
        _, b, j, rest = name.split(".", 3)
        src = source.get((int(b), int(j)), (int(b), int(j)))
        lineage[name] = None if src is None else f"blocks.{src[0]}.{src[1]}.{rest}"
    parent_params = {pos: n for pos, n in _cell_params(parent).values()}
    cell_match = {}
    for name, (pos, n) in _cell_params(child).items():
        src = source.get(pos, pos)
        cell_match[name] = 0.0 if src is None else parent_params[src] / n
    return Transformed(child, state, lineage, cell_match)


def widen(spec: ModelSpec, state: State, cell: Cell, rng: torch.Generator | None = None) -> Transformed:
    """Widen `cell` ×2 (FedTrans §4.1; Net2Wider, Chen et al. 2015), preserving the model's function.

    Every unit (conv out channel / linear out feature, with its bias) is copied once: new unit j + C copies
    unit j. BatchNorms between the cell and its consumer copy weight, bias and running statistics the same
    way; pass-through layers (PASS_THROUGH) are crossed, across blocks too. The consumer (the next conv2d with
    groups 1 or linear) gets each duplicated input column split a·W[:, j] and (1 − a)·W[:, j], a drawn per unit
    from SPLIT_RANGE with `rng` (torch's global generator if None); after a flatten each channel's run of H·W
    columns is duplicated whole. The output equals the parent's up to float rounding.

    Raises TransformError if `cell` is not a cell of `spec`, no valid consumer follows it (a composite layer or
    the model's output does), or `state` does not match `spec` (names, shapes, dtypes, finiteness).
    """
    bns, consumer = _widen_plan(spec, cell)
    new = _checked_copy(spec, state)
    producer = spec.blocks[cell.block].layers[cell.layer]
    width = producer.args[_WIDTH_ARG[producer.type]]
    mapping = torch.arange(width).repeat(2)

    def duplicate(prefix: str, names: tuple[str, ...]) -> None:
        for n in names:
            if f"{prefix}.{n}" in new:
                new[f"{prefix}.{n}"] = new[f"{prefix}.{n}"][mapping].clone()

    duplicate(cell.name, ("weight", "bias"))
    for b, j in bns:
        duplicate(f"blocks.{b}.{j}", _BN_TENSORS)
    key = f"blocks.{consumer[0]}.{consumer[1]}.weight"
    w = new[key]
    lo, hi = SPLIT_RANGE
    a = lo + (hi - lo) * torch.rand(width, generator=rng, dtype=torch.float64)
    share = torch.cat([a, 1 - a]).to(w.dtype)
    cols = w.reshape(w.shape[0], width, -1)  # a conv's (kh·kw) or a flattened channel's (H·W) run per unit
    new[key] = (cols[:, mapping] * share.view(1, -1, 1)).reshape(w.shape[0], 2 * w.shape[1], *w.shape[2:])

    blocks = [list(b.layers) for b in spec.blocks]
    args = dict(producer.args, **{_WIDTH_ARG[producer.type]: 2 * width})
    blocks[cell.block][cell.layer] = LayerSpec(producer.type, args)
    return _finish(spec, _rebuild(spec, blocks, "wide"), new, {})


def deepen(spec: ModelSpec, state: State, cell: Cell) -> Transformed:
    """Deepen after `cell` (FedTrans §4.1; Net2DeeperNet, Chen et al. 2015), preserving the model's function.

    Right after the first relu/relu6 that follows the cell in its block, insert a layer of the cell's type with
    identity weights and zero bias, then the same activation: for a conv, a conv2d C→C with the cell's (odd)
    kernel, stride 1 and padding k//2, Dirac-initialised; for a linear, a Linear n→n initialised to the identity.
    Its input is non-negative, so both pass it through exactly. Layers after it in the block shift by two.

    Raises TransformError if `cell` is not a cell of `spec`, no relu/relu6 follows it in its block (see
    can_deepen), a conv cell has an even kernel, or `state` does not match `spec`.
    """
    at, act = _deepen_plan(spec, cell)
    new = _checked_copy(spec, state)
    producer = spec.blocks[cell.block].layers[cell.layer]
    width = producer.args[_WIDTH_ARG[producer.type]]
    dtype = new[f"{cell.name}.weight"].dtype
    if producer.type == "conv2d":
        k = producer.args["kernel_size"]
        inserted = LayerSpec("conv2d", {"out_channels": width, "kernel_size": k, "stride": 1, "padding": k // 2})
        weight = torch.nn.init.dirac_(torch.empty(width, width, k, k, dtype=dtype))
    else:
        inserted = LayerSpec("linear", {"out_features": width})
        weight = torch.eye(width, dtype=dtype)

    b = cell.block
    shifted: State = {}
    for name, t in new.items():
        _, bi, j, rest = name.split(".", 3)
        if int(bi) == b and int(j) >= at:
            name = f"blocks.{b}.{int(j) + 2}.{rest}"
        shifted[name] = t
    shifted[f"blocks.{b}.{at}.weight"] = weight
    shifted[f"blocks.{b}.{at}.bias"] = torch.zeros(width, dtype=dtype)

    blocks = [list(blk.layers) for blk in spec.blocks]
    blocks[b][at:at] = [inserted, act]
    source: dict[Position, Position | None] = {(b, at): None, (b, at + 1): None}
    source.update({(b, j + 2): (b, j) for j in range(at, len(spec.blocks[b].layers))})
    return _finish(spec, _rebuild(spec, blocks, "deep"), shifted, source)
