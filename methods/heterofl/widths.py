"""Width-scaled submodels of a ModelSpec (HeteroFL's model rate r, Diao et al. 2021 §3.1): every hidden width
times r, so that the submodel's tensors are the top-left slices of the full model's; and HeteroFL's Scaler layers
for such a submodel."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from fedge.model.layers import LayerSpec, Shape, SpecError, layer_type
from fedge.model.spec import ModelSpec, make_block

# Layer types with no width of their own: their output channels follow their input's.
FOLLOWING = frozenset(
    {"bn2d", "relu", "relu6", "hardswish", "dropout", "flatten", "maxpool", "avgpool", "adaptive_avgpool", "scaler"}
)
# Layer types without a tensor in the state dict: a Scaler inserted before them renames no tensor.
STATELESS = FOLLOWING - {"bn2d"}


def scaled(width: int, rate: float) -> int:
    """⌈rate · width⌉, at least 1 (HeteroFL rounds hidden sizes up); the product is rounded to 9 decimals first,
    so that 0.1 · 30 is 3 and not 4."""
    return max(1, math.ceil(round(rate * width, 9)))


def _tied(full: int, full_in: int, sub_in: int, rate: float) -> int:
    """A width whose equality with the layer's input decides the structure (an expansion conv exists when the
    hidden width differs from the input's; a residual when the output's equals it): scaled, but equal to the
    submodel's input exactly when the full widths are equal. SpecError when no width in 1..full is left."""
    if full == full_in:
        return sub_in
    width = scaled(full, rate)
    if width != sub_in:
        return width
    if width + 1 <= full:
        return width + 1
    if width > 1:
        return width - 1
    raise SpecError(f"width {full} at rate {rate:g} cannot differ from its input's {sub_in}")


def _scaled_args(layer: LayerSpec, full_in: Shape, sub_in: Shape, rate: float, logits: bool) -> dict[str, Any]:
    a, kind = dict(layer.args), layer.type
    if kind in FOLLOWING:
        return a
    if kind == "linear":
        return a if logits else a | {"out_features": scaled(a["out_features"], rate)}
    if kind == "conv2d":
        groups = a.get("groups", 1)
        if groups == 1:
            return a | {"out_channels": scaled(a["out_channels"], rate)}
        if groups == full_in[0]:  # depthwise: one group per input channel, `out_channels // groups` filters each
            return a | {"groups": sub_in[0], "out_channels": a["out_channels"] // groups * sub_in[0]}
        raise SpecError(f"scale_width scales depthwise and ungrouped convolutions only, not groups={groups}")
    if kind == "depthwise_separable":
        return a | {"out_channels": scaled(a["out_channels"], rate)}
    if kind == "inverted_residual":
        hidden = _tied(a["hidden_channels"], full_in[0], sub_in[0], rate)
        if a.get("stride", 1) == 1:
            out = _tied(a["out_channels"], full_in[0], sub_in[0], rate)
        else:
            out = scaled(a["out_channels"], rate)
        se = scaled(a["se_channels"], rate) if a.get("se_channels") else a.get("se_channels", 0)
        return (
            a | {"hidden_channels": hidden, "out_channels": out} | ({"se_channels": se} if "se_channels" in a else {})
        )
    if kind == "squeeze_excite":
        return a | {"hidden_channels": scaled(a["hidden_channels"], rate)}
    raise SpecError(f"scale_width does not know how to scale a layer of type {kind!r}")


def _logits_at(spec: ModelSpec) -> tuple[int, int]:
    found = [(i, j) for i, b in enumerate(spec.blocks) for j, ly in enumerate(b.layers) if ly.type == "linear"]
    if not found:
        raise SpecError(f"model {spec.name!r} has no linear layer to give its logits; scale_width needs one")
    return found[-1]


def scale_width(spec: ModelSpec, rate: float) -> ModelSpec:
    """The submodel of `spec` at model rate `rate` (HeteroFL §3.1): the output width of every conv2d and linear,
    and inside composite layers depthwise_separable's out_channels and inverted_residual's hidden, out and SE
    widths, becomes ⌈rate · width⌉ (at least 1); input widths follow from the previous layer, a depthwise conv keeps
    one group per channel and the last linear keeps num_classes. Where an inverted residual's structure depends
    on two widths being equal (its expansion conv, its residual add), they are kept equal or unequal as in
    `spec`, one channel up or down. Every tensor of the result is a top-left slice of `spec`'s of the same
    name. The name gets `@rate`; rate 1 returns `spec` itself. SpecError for a rate outside (0, 1] or a layer it
    cannot scale (a stitch, a grouped conv that is not depthwise)."""
    if isinstance(rate, bool) or not 0 < rate <= 1:
        raise SpecError(f"model rate must be in (0, 1], got {rate!r}")
    if rate == 1:
        return spec
    logits = _logits_at(spec)
    blocks, full, sub = [], tuple(spec.input_shape), tuple(spec.input_shape)
    for i, block in enumerate(spec.blocks):
        layers, sub_in = [], sub
        for j, layer in enumerate(block.layers):
            args = _scaled_args(layer, full, sub, rate, (i, j) == logits)
            layers.append(LayerSpec(layer.type, args))
            full = tuple(layer_type(layer.type).out_shape(layer.args, full))
            sub = tuple(layer_type(layer.type).out_shape(args, sub))
        blocks.append(make_block(block.name, layers, sub_in, block.origin))
    return ModelSpec(f"{spec.name}@{rate:g}", tuple(spec.input_shape), spec.num_classes, tuple(blocks))


def with_scalers(spec: ModelSpec, rate: float) -> ModelSpec:
    """`spec` with a Scaler(rate) (x / rate while training) right after every conv2d and linear but the logits
    layer, as HeteroFL puts one after every hidden layer, where nothing with state follows in its block: not
    before a BatchNorm, which normalises the scale away while training and whose running statistics would then
    be of x / rate while inference sees x (HeteroFL avoids that with static BN, which fedge does not use). So no
    tensor is renamed: the result's state dict is `spec`'s. Rate 1 returns `spec`; SpecError outside (0, 1]."""
    if isinstance(rate, bool) or not 0 < rate <= 1:
        raise SpecError(f"model rate must be in (0, 1], got {rate!r}")
    if rate == 1:
        return spec
    logits = _logits_at(spec)
    blocks = []
    for i, block in enumerate(spec.blocks):
        layers: list[LayerSpec] = []
        for j, layer in enumerate(block.layers):
            layers.append(layer)
            after = block.layers[j + 1 :]
            if layer.type in ("conv2d", "linear") and (i, j) != logits and all(ly.type in STATELESS for ly in after):
                layers.append(LayerSpec("scaler", {"rate": rate}))
        blocks.append(replace(block, layers=tuple(layers)))
    return replace(spec, blocks=tuple(blocks))
