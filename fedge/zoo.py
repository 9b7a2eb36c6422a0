"""The model zoo: pFedClub's CNN1–CNN4 and MobileNetV1/V2/V3-Small as registered ModelSpec factories.

Choices the paper leaves open (pFedClub Appendix B gives layer order and kernel sizes, no widths):
- every k×k convolution pads by k//2 ("same"), so spatial size changes only at max-pools. The paper's
  CNN3 is impossible at 32×32 without padding (five 5×5 convs and three pools: 32→28→14→10→5→1, then
  a 5×5 conv on 1×1), and CNN2's third 5×5 conv does not fit 28×28 either; padding makes all fit.
- widths: CNN1 16-32 / 128; CNN2 16-32-64 / 128; CNN3 16-32-64-64-128 / 256-128-64;
  CNN4 32-32-64-64-128-128 / 256-128-64 (classifier widths are FC1..FC3 outputs).
- flatten sits at the start of FC1, so FC1 maps the last conv map to a vector.
- MobileNets for 28×28 / 32×32 inputs (the CIFAR adaptation): stride-1 stem and first unit, three
  stride-2 stages (32→16→8→4), width 0.5 for V1/V2 and 1.0 for V3-Small; V2 uses fewer repeats
  (1-2-2-2-1-1-1 units) to keep CPU training cheap. Blocks: stem, one block per unit, head, classifier.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from fedge.errors import UserError
from fedge.layers import LayerSpec as L
from fedge.registry import Registry
from fedge.spec import ModelSpec, make_spec

Factory = Callable[[int, int, int], ModelSpec]


class ZooError(UserError, ValueError):
    """Unknown model or zoo name, or an input the model cannot take; the message lists valid names."""


MODELS: Registry[Factory] = Registry("model", ZooError)
register_model = MODELS.register  # decorator: `(in_channels, image_size, num_classes) -> ModelSpec`


def create(name: str, input_shape: Sequence[int], num_classes: int) -> ModelSpec:
    """Build the spec of a zoo model for a (C, H, W) input; unknown names raise ZooError."""
    factory = MODELS.get(name)
    c, h, w = input_shape
    if h != w:
        raise ZooError(f"zoo models take square images, got {h}x{w}")
    return factory(c, h, num_classes)


def _conv(out: int, k: int, stride: int = 1, bias: bool = True) -> L:
    return L("conv2d", {"out_channels": out, "kernel_size": k, "stride": stride, "padding": k // 2, "bias": bias})


RELU, BN, POOL, FLAT = L("relu"), L("bn2d"), L("maxpool", {"kernel_size": 2}), L("flatten")


def _fc(out: int, relu: bool = True, dropout: float | None = None, flatten: bool = False) -> list[L]:
    layers = [FLAT] if flatten else []
    layers += [L("linear", {"out_features": out})] + ([RELU] if relu else [])
    return layers + ([L("dropout", {"p": dropout})] if dropout else [])


@register_model("cnn1")
def cnn1(in_channels: int, image_size: int, num_classes: int) -> ModelSpec:
    """pFedClub App. B CNN1: Cov1, Cov2 {Conv5-ReLU-Pool}, FC1 {Linear-ReLU}, Dropout, FC2."""
    return make_spec(
        "cnn1",
        (in_channels, image_size, image_size),
        num_classes,
        [
            ("cov1", [_conv(16, 5), RELU, POOL]),
            ("cov2", [_conv(32, 5), RELU, POOL]),
            ("fc1", _fc(128, dropout=0.5, flatten=True)),
            ("fc2", _fc(num_classes, relu=False)),
        ],
    )


@register_model("cnn2")
def cnn2(in_channels: int, image_size: int, num_classes: int) -> ModelSpec:
    """pFedClub App. B CNN2: CNN1 plus Cov3 {Conv5-ReLU} before FC1."""
    return make_spec(
        "cnn2",
        (in_channels, image_size, image_size),
        num_classes,
        [
            ("cov1", [_conv(16, 5), RELU, POOL]),
            ("cov2", [_conv(32, 5), RELU, POOL]),
            ("cov3", [_conv(64, 5), RELU]),
            ("fc1", _fc(128, dropout=0.5, flatten=True)),
            ("fc2", _fc(num_classes, relu=False)),
        ],
    )


@register_model("cnn3")
def cnn3(in_channels: int, image_size: int, num_classes: int) -> ModelSpec:
    """pFedClub App. B CNN3: five Conv5 blocks (pools after 1, 2, 4) and FC1 (dropout) .. FC4."""
    return make_spec(
        "cnn3",
        (in_channels, image_size, image_size),
        num_classes,
        [
            ("cov1", [_conv(16, 5), RELU, POOL]),
            ("cov2", [_conv(32, 5), RELU, POOL]),
            ("cov3", [_conv(64, 5), RELU]),
            ("cov4", [_conv(64, 5), RELU, POOL]),
            ("cov5", [_conv(128, 5), RELU]),
            ("fc1", _fc(256, dropout=0.5, flatten=True)),
            ("fc2", _fc(128)),
            ("fc3", _fc(64)),
            ("fc4", _fc(num_classes, relu=False)),
        ],
    )


@register_model("cnn4")
def cnn4(in_channels: int, image_size: int, num_classes: int) -> ModelSpec:
    """pFedClub App. B CNN4: six conv blocks (BN in 1, 3, 5; pools in 2, 4, 6) and FC1 .. FC4."""
    return make_spec(
        "cnn4",
        (in_channels, image_size, image_size),
        num_classes,
        [
            ("cov1", [_conv(32, 5), BN, RELU]),
            ("cov2", [_conv(32, 3), RELU, POOL]),
            ("cov3", [_conv(64, 3), BN, RELU]),
            ("cov4", [_conv(64, 5), RELU, POOL, L("dropout", {"p": 0.05})]),
            ("cov5", [_conv(128, 3), BN, RELU]),
            ("cov6", [_conv(128, 3), RELU, POOL]),
            ("fc1", _fc(256, dropout=0.1, flatten=True)),
            ("fc2", _fc(128)),
            ("fc3", _fc(64)),
            ("fc4", _fc(num_classes, relu=False)),
        ],
    )


def _stem(out: int, act: str) -> list[L]:
    return [_conv(out, 3, bias=False), BN, L(act)]


@register_model("mobilenet_v1")
def mobilenet_v1(in_channels: int, image_size: int, num_classes: int) -> ModelSpec:
    """MobileNetV1 (Howard et al. 2017), width 0.5, stride-1 stem, 8 depthwise-separable units."""
    units = [(32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (256, 1)]
    blocks = [("stem", _stem(16, "relu"))]
    blocks += [
        (f"dws{i + 1}", [L("depthwise_separable", {"out_channels": c, "stride": s})]) for i, (c, s) in enumerate(units)
    ]
    blocks += [("classifier", [L("adaptive_avgpool"), FLAT, L("linear", {"out_features": num_classes})])]
    return make_spec("mobilenet_v1", (in_channels, image_size, image_size), num_classes, blocks)


def _make_divisible(v: float, divisor: int = 8) -> int:
    """Round channels as torchvision's MobileNets do (never below 90 % of v)."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


@register_model("mobilenet_v2")
def mobilenet_v2(in_channels: int, image_size: int, num_classes: int) -> ModelSpec:
    """MobileNetV2 (Sandler et al. 2018), width 0.5, inverted residuals with ReLU6, 10 units."""
    # (expansion t, channels c, repeats n, first stride s), widths already scaled by 0.5
    cfg = [(1, 8, 1, 1), (6, 12, 2, 1), (6, 16, 2, 2), (6, 32, 2, 2), (6, 48, 1, 1), (6, 80, 1, 2), (6, 160, 1, 1)]
    blocks, cin = [("stem", _stem(16, "relu6"))], 16
    for t, c, n, s in cfg:
        for r in range(n):
            args = {"out_channels": c, "hidden_channels": cin * t, "stride": s if r == 0 else 1}
            blocks.append((f"ir{len(blocks)}", [L("inverted_residual", args)]))
            cin = c
    blocks += [
        ("head", [_conv(640, 1, bias=False), BN, L("relu6"), L("adaptive_avgpool"), FLAT]),
        ("classifier", [L("dropout", {"p": 0.2}), L("linear", {"out_features": num_classes})]),
    ]
    return make_spec("mobilenet_v2", (in_channels, image_size, image_size), num_classes, blocks)


@register_model("mobilenet_v3")
def mobilenet_v3(in_channels: int, image_size: int, num_classes: int) -> ModelSpec:
    """MobileNetV3-Small (Howard et al. 2019), width 1.0; stem and first unit at stride 1."""
    # (kernel, expansion channels, out channels, squeeze-excite, activation, stride)
    cfg = [
        (3, 16, 16, True, "relu", 1),
        (3, 72, 24, False, "relu", 2),
        (3, 88, 24, False, "relu", 1),
        (5, 96, 40, True, "hardswish", 2),
        (5, 240, 40, True, "hardswish", 1),
        (5, 240, 40, True, "hardswish", 1),
        (5, 120, 48, True, "hardswish", 1),
        (5, 144, 48, True, "hardswish", 1),
        (5, 288, 96, True, "hardswish", 2),
        (5, 576, 96, True, "hardswish", 1),
        (5, 576, 96, True, "hardswish", 1),
    ]
    blocks = [("stem", _stem(16, "hardswish"))]
    for i, (k, exp, out, se, act, s) in enumerate(cfg):
        args = {
            "out_channels": out,
            "hidden_channels": exp,
            "kernel_size": k,
            "stride": s,
            "activation": act,
            "se_channels": _make_divisible(exp / 4) if se else 0,
        }
        blocks.append((f"bneck{i + 1}", [L("inverted_residual", args)]))
    blocks += [
        (
            "head",
            [
                _conv(576, 1, bias=False),
                BN,
                L("hardswish"),
                L("adaptive_avgpool"),
                FLAT,
                L("linear", {"out_features": 1024}),
                L("hardswish"),
                L("dropout", {"p": 0.2}),
            ],
        ),
        ("classifier", [L("linear", {"out_features": num_classes})]),
    ]
    return make_spec("mobilenet_v3", (in_channels, image_size, image_size), num_classes, blocks)


# pFedClub §4.1: how many of N=50 clients get each model (Zoo I, II, III).
ZOOS: dict[str, dict[str, int]] = {
    "I": {"cnn1": 8, "cnn2": 7, "cnn3": 7, "cnn4": 7, "mobilenet_v1": 7, "mobilenet_v2": 7, "mobilenet_v3": 7},
    "II": {"mobilenet_v1": 16, "mobilenet_v2": 17, "mobilenet_v3": 17},
    "III": {"cnn1": 12, "cnn2": 12, "cnn3": 12, "cnn4": 14},
}


def assign_models(zoo: str, num_clients: int, seed: int) -> list[str]:
    """Model name for each client 0..N-1: a zoo preset's proportions (scaled from N=50 by largest
    remainder) randomly placed by `seed`; one model name for a homogeneous fleet; or comma-separated model
    names given to clients in turn (client i gets name i mod k, like the run's `profiles`).

    Raises ZooError for an unknown zoo or model name or a non-positive N.
    """
    if num_clients < 1:
        raise ZooError(f"number of clients must be positive, got {num_clients}")
    names = zoo.split(",")
    if all(n in MODELS for n in names):
        return [names[i % len(names)] for i in range(num_clients)]
    if zoo not in ZOOS:
        raise ZooError(
            f"unknown zoo {zoo!r}; use one of {', '.join(ZOOS)}, a model name, or comma-separated model "
            f"names ({', '.join(MODELS)})"
        )
    weights = ZOOS[zoo]
    total = sum(weights.values())
    exact = {m: num_clients * w / total for m, w in weights.items()}
    counts = {m: int(v) for m, v in exact.items()}
    by_remainder = sorted(weights, key=lambda m: (-(exact[m] - counts[m]), list(weights).index(m)))
    for m in by_remainder[: num_clients - sum(counts.values())]:
        counts[m] += 1
    names = [m for m in weights for _ in range(counts[m])]
    order = np.random.default_rng(seed).permutation(num_clients)
    return [names[i] for i in order]
