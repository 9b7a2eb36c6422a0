"""The registry of layer types a ModelSpec may use: shape, parameter count, MACs and constructor of each."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from fedge.errors import UserError
from fedge.plugins import load_methods
from fedge.registry import Registry

Shape = tuple[int, ...]


class SpecError(UserError, ValueError):
    """A ModelSpec (or one of its layers) is malformed; the message names the block and the mismatch."""


@dataclass(frozen=True)
class LayerSpec:
    """One layer: a registered type name and its JSON-serialisable arguments."""

    type: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "args": dict(self.args)}


@dataclass(frozen=True)
class LayerType:
    """How one layer type behaves; `params` and `macs` are per sample, computed from arguments alone.

    MACs count multiply-accumulates of convolutions and matrix products only (the convention of
    thop/ptflops and of `torch.utils.flop_counter`, which reports 2 FLOPs per MAC); element-wise
    ops (BN, activations, pooling, residual adds) are not counted.

    `activations` counts the elements per sample a training step keeps for backward; by default the layer's
    output, once (composite layers sum their parts' outputs).
    """

    out_shape: Callable[[dict[str, Any], Shape], Shape]
    build: Callable[[dict[str, Any], Shape], nn.Module]
    params: Callable[[dict[str, Any], Shape], int] = lambda a, s: 0
    macs: Callable[[dict[str, Any], Shape], int] = lambda a, s: 0
    activations: Callable[[dict[str, Any], Shape], int] | None = None

    def activation_elements(self, args: dict[str, Any], shape: Shape) -> int:
        """Elements per sample this layer keeps for backward (its output once, unless `activations` says)."""
        if self.activations is not None:
            return self.activations(args, shape)
        return math.prod(self.out_shape(args, shape))


# the built-in types below, and those of the methods' `models` modules (FedMN's `modular`, fedge.plugins) on first read
LAYER_TYPES: Registry[LayerType] = Registry("layer type", SpecError, partial(load_methods, "models"))
register_layer = LAYER_TYPES.add
layer_type = LAYER_TYPES.get  # an unknown name raises SpecError listing the known ones


def _need(shape: Shape, rank: int, what: str) -> None:
    if len(shape) != rank:
        raise SpecError(f"{what} needs a {rank}-d input per sample, got shape {list(shape)}")


def _conv_out(size: int, k: int, stride: int, pad: int) -> int:
    out = (size + 2 * pad - k) // stride + 1
    if out < 1:
        raise SpecError(f"kernel {k} (stride {stride}, padding {pad}) does not fit a spatial size of {size}")
    return out


# --- convolution, normalisation, linear -------------------------------------------------------


def _conv_shape(a: dict[str, Any], s: Shape) -> Shape:
    _need(s, 3, "conv2d")
    c, h, w = s
    groups = a.get("groups", 1)
    if c % groups or a["out_channels"] % groups:
        raise SpecError(f"conv2d groups={groups} must divide in_channels={c} and out_channels={a['out_channels']}")
    k, st, p = a["kernel_size"], a.get("stride", 1), a.get("padding", 0)
    return (a["out_channels"], _conv_out(h, k, st, p), _conv_out(w, k, st, p))


def _conv_params(a: dict[str, Any], s: Shape) -> int:
    per_out = s[0] // a.get("groups", 1) * a["kernel_size"] ** 2
    return a["out_channels"] * per_out + (a["out_channels"] if a.get("bias", True) else 0)


def _conv_macs(a: dict[str, Any], s: Shape) -> int:
    c, h, w = _conv_shape(a, s)
    return c * h * w * (s[0] // a.get("groups", 1)) * a["kernel_size"] ** 2


def _conv_build(a: dict[str, Any], s: Shape) -> nn.Module:
    return nn.Conv2d(
        s[0],
        a["out_channels"],
        a["kernel_size"],
        stride=a.get("stride", 1),
        padding=a.get("padding", 0),
        groups=a.get("groups", 1),
        bias=a.get("bias", True),
    )


register_layer("conv2d", LayerType(_conv_shape, _conv_build, _conv_params, _conv_macs))


def _same(a: dict[str, Any], s: Shape) -> Shape:
    return s


def _bn_build(a: dict[str, Any], s: Shape) -> nn.Module:
    _need(s, 3, "bn2d")
    return nn.BatchNorm2d(s[0])


register_layer("bn2d", LayerType(_same, _bn_build, lambda a, s: 2 * s[0]))


def _linear_shape(a: dict[str, Any], s: Shape) -> Shape:
    _need(s, 1, "linear")
    return (a["out_features"],)


register_layer(
    "linear",
    LayerType(
        _linear_shape,
        lambda a, s: nn.Linear(s[0], a["out_features"], bias=a.get("bias", True)),
        lambda a, s: s[0] * a["out_features"] + (a["out_features"] if a.get("bias", True) else 0),
        lambda a, s: s[0] * a["out_features"],
    ),
)

# --- element-wise and shape layers ------------------------------------------------------------

register_layer("relu", LayerType(_same, lambda a, s: nn.ReLU()))
register_layer("relu6", LayerType(_same, lambda a, s: nn.ReLU6()))
register_layer("hardswish", LayerType(_same, lambda a, s: nn.Hardswish()))
register_layer("dropout", LayerType(_same, lambda a, s: nn.Dropout(a.get("p", 0.5))))
register_layer("flatten", LayerType(lambda a, s: (math.prod(s),), lambda a, s: nn.Flatten()))


class Scaler(nn.Module):
    """HeteroFL's Scaler (Diao et al. 2021, §3.1): x / rate, so that a submodel of width rate, each of whose units
    sums over a rate-fraction of the full model's inputs, keeps the full model's activation scale. HeteroFL applies
    it in training only, where static BatchNorm absorbs the scale at inference; before layers without BatchNorm (most
    of our zoo) a submodel evaluated without it is at chance, so ours divides in evaluation too and the submodel is
    one function in training, evaluation and export."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.rate

    def extra_repr(self) -> str:
        return f"rate={self.rate:g}"


def _scaler_rate(a: dict[str, Any]) -> float:
    rate = a.get("rate")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
        raise SpecError(f"scaler rate must be a number in (0, 1], got {rate!r}")
    return float(rate)


register_layer("scaler", LayerType(lambda a, s: (_scaler_rate(a), s)[1], lambda a, s: Scaler(_scaler_rate(a))))


def _pool_shape(a: dict[str, Any], s: Shape) -> Shape:
    _need(s, 3, "pooling")
    k = a["kernel_size"]
    st = a.get("stride", k)
    return (s[0], _conv_out(s[1], k, st, 0), _conv_out(s[2], k, st, 0))


register_layer(
    "maxpool", LayerType(_pool_shape, lambda a, s: nn.MaxPool2d(a["kernel_size"], a.get("stride", a["kernel_size"])))
)
register_layer(
    "avgpool", LayerType(_pool_shape, lambda a, s: nn.AvgPool2d(a["kernel_size"], a.get("stride", a["kernel_size"])))
)


def _adaptive_shape(a: dict[str, Any], s: Shape) -> Shape:
    _need(s, 3, "adaptive_avgpool")
    return (s[0], a.get("output_size", 1), a.get("output_size", 1))


register_layer(
    "adaptive_avgpool", LayerType(_adaptive_shape, lambda a, s: nn.AdaptiveAvgPool2d(a.get("output_size", 1)))
)

# --- composite layers: defined as sequences of primitive layers -------------------------------


def _chain(layers: list[LayerSpec], s: Shape) -> list[tuple[LayerSpec, Shape]]:
    """Pair each layer with its input shape, raising SpecError where the chain breaks."""
    out = []
    for layer in layers:
        out.append((layer, s))
        s = layer_type(layer.type).out_shape(layer.args, s)
    return out


def _chain_out(layers: list[LayerSpec], s: Shape) -> Shape:
    for layer in layers:
        s = layer_type(layer.type).out_shape(layer.args, s)
    return s


def _sum(layers: list[LayerSpec], s: Shape, what: str) -> int:
    return sum(getattr(layer_type(ly.type), what)(ly.args, shp) for ly, shp in _chain(layers, s))


def _sum_activations(layers: list[LayerSpec], s: Shape) -> int:
    return sum(layer_type(ly.type).activation_elements(ly.args, shp) for ly, shp in _chain(layers, s))


def _build_seq(layers: list[LayerSpec], s: Shape) -> nn.Sequential:
    return nn.Sequential(*(layer_type(ly.type).build(ly.args, shp) for ly, shp in _chain(layers, s)))


def _conv_bn(out: int, k: int, stride: int = 1, groups: int = 1, act: str | None = "relu") -> list[LayerSpec]:
    layers = [
        LayerSpec(
            "conv2d",
            {
                "out_channels": out,
                "kernel_size": k,
                "stride": stride,
                "padding": k // 2,
                "groups": groups,
                "bias": False,
            },
        ),
        LayerSpec("bn2d"),
    ]
    return layers + ([LayerSpec(act)] if act else [])


def _depthwise_separable(a: dict[str, Any], s: Shape) -> list[LayerSpec]:
    """MobileNetV1 unit: 3×3 depthwise conv-BN-ReLU, then 1×1 pointwise conv-BN-ReLU."""
    _need(s, 3, "depthwise_separable")
    return _conv_bn(s[0], 3, a.get("stride", 1), groups=s[0]) + _conv_bn(a["out_channels"], 1)


def _inverted_residual_main(a: dict[str, Any], s: Shape) -> list[LayerSpec]:
    """MobileNetV2/V3 unit body: optional 1×1 expansion, k×k depthwise, optional SE, 1×1 projection."""
    _need(s, 3, "inverted_residual")
    hidden, act = a["hidden_channels"], a.get("activation", "relu6")
    layers = _conv_bn(hidden, 1, act=act) if hidden != s[0] else []
    layers += _conv_bn(hidden, a.get("kernel_size", 3), a.get("stride", 1), groups=hidden, act=act)
    if a.get("se_channels"):
        layers.append(LayerSpec("squeeze_excite", {"hidden_channels": a["se_channels"]}))
    return layers + _conv_bn(a["out_channels"], 1, act=None)


class Residual(nn.Module):
    """y = body(x) + x when shapes allow it (stride 1, same channels), else y = body(x)."""

    def __init__(self, body: nn.Sequential, residual: bool) -> None:
        super().__init__()
        self.body = body
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y + x if self.residual else y


def _composite(
    expand: Callable[[dict[str, Any], Shape], list[LayerSpec]], residual: Callable[[dict[str, Any], Shape], bool]
) -> LayerType:
    return LayerType(
        out_shape=lambda a, s: _chain_out(expand(a, s), s),
        build=lambda a, s: Residual(_build_seq(expand(a, s), s), residual(a, s)),
        params=lambda a, s: _sum(expand(a, s), s, "params"),
        macs=lambda a, s: _sum(expand(a, s), s, "macs"),
        activations=lambda a, s: _sum_activations(expand(a, s), s) + (math.prod(s) if residual(a, s) else 0),
    )


register_layer("depthwise_separable", _composite(_depthwise_separable, lambda a, s: False))
register_layer(
    "inverted_residual",
    _composite(_inverted_residual_main, lambda a, s: a.get("stride", 1) == 1 and a["out_channels"] == s[0]),
)


class SqueezeExcite(nn.Module):
    """MobileNetV3 squeeze-and-excite: x · hardsigmoid(W2 ReLU(W1 avgpool(x)))."""

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, hidden, 1)
        self.expand = nn.Conv2d(hidden, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.mean(dim=(2, 3), keepdim=True)  # = adaptive_avg_pool2d(x, 1), whose backward ExecuTorch lacks
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(scale))))


def _se_params(a: dict[str, Any], s: Shape) -> int:
    c, h = s[0], a["hidden_channels"]
    return c * h + h + h * c + c


register_layer(
    "squeeze_excite",
    LayerType(
        lambda a, s: (_need(s, 3, "squeeze_excite"), s)[1],
        lambda a, s: SqueezeExcite(s[0], a["hidden_channels"]),
        _se_params,
        lambda a, s: 2 * s[0] * a["hidden_channels"],
    ),
)

# --- stitching layers (pFedHR Eq. 2 / pFedClub §3.2: ReLU(Wᵀx + b) between mismatched blocks) --


class ConvStitch(nn.Module):
    """ReLU(1×1 conv) over channels, then a parameter-free resize to the target spatial size.

    Deviation from the papers' flattened linear map: a 1×1 conv is the same linear map applied per
    position, which keeps stitches small (C_in·C_out weights instead of (C·H·W)²).
    """

    def __init__(self, in_channels: int, out_shape: Shape) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, out_shape[0], 1)
        self.size = (out_shape[1], out_shape[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.proj(x))
        if tuple(y.shape[-2:]) == self.size:
            return y
        if y.shape[-2] >= self.size[0] and y.shape[-1] >= self.size[1]:
            return F.adaptive_avg_pool2d(y, self.size)
        return F.interpolate(y, size=self.size, mode="nearest")


class LinearStitch(nn.Module):
    """ReLU(Wᵀ flatten(x) + b), reshaped to the target shape (a feature vector or a conv map).

    With relu=False it is Wᵀx + b: the stitch that produces the logits must not clip them at zero
    (a deviation from the papers' ReLU(Wᵀx + b), which would make every negative logit 0).
    """

    def __init__(self, in_features: int, out_shape: Shape, relu: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, math.prod(out_shape))
        self.out_shape = tuple(out_shape)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x.flatten(1))
        y = F.relu(y) if self.relu else y
        return y.reshape(y.shape[0], *self.out_shape)


def _stitch_target(a: dict[str, Any], s: Shape) -> Shape:
    target = tuple(a["out_shape"])
    if len(target) not in (1, 3):
        raise SpecError(f"stitch out_shape must be (features,) or (C, H, W), got {list(target)}")
    return target


def _stitch_is_conv(a: dict[str, Any], s: Shape) -> bool:
    return len(s) == 3 and len(_stitch_target(a, s)) == 3


def _stitch_params(a: dict[str, Any], s: Shape) -> int:
    out = _stitch_target(a, s)
    if _stitch_is_conv(a, s):
        return s[0] * out[0] + out[0]
    return math.prod(s) * math.prod(out) + math.prod(out)


def _stitch_macs(a: dict[str, Any], s: Shape) -> int:
    out = _stitch_target(a, s)
    if _stitch_is_conv(a, s):
        return s[0] * out[0] * s[1] * s[2]
    return math.prod(s) * math.prod(out)


def _stitch_build(a: dict[str, Any], s: Shape) -> nn.Module:
    out = _stitch_target(a, s)
    return ConvStitch(s[0], out) if _stitch_is_conv(a, s) else LinearStitch(math.prod(s), out, a.get("relu", True))


register_layer("stitch", LayerType(_stitch_target, _stitch_build, _stitch_params, _stitch_macs))
