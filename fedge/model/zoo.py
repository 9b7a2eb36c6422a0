"""The model zoo: pFedClub's CNN1–CNN4 and MobileNetV1/V2/V3-Small as registered ModelSpec factories, at two
width presets.

Choices the paper leaves open (pFedClub Appendix B gives layer order and kernel sizes, no widths):
- every k×k convolution pads by k//2 ("same"), so spatial size changes only at max-pools. The paper's
  CNN3 is impossible at 32×32 without padding (five 5×5 convs and three pools: 32→28→14→10→5→1, then
  a 5×5 conv on 1×1), and CNN2's third 5×5 conv does not fit 28×28 either; padding makes all fit.
- flatten sits at the start of FC1, so FC1 maps the last conv map to a vector.
- MobileNets for 28×28 / 32×32 inputs (the CIFAR adaptation): stride-1 stem and first unit, three
  stride-2 stages (32→16→8→4 or 28→14→7→4). Blocks: stem, one block per unit, head, classifier.

Width presets (a run's `widths` key; only widths differ, the layer structure above is the same):
- `cpu` (default, shrunk for CPU runs): CNN1 16-32 / 128; CNN2 16-32-64 / 128; CNN3 16-32-64-64-128 /
  256-128-64; CNN4 32-32-64-64-128-128 / 256-128-64 (conv channels / hidden FC widths FC1..). MobileNetV1
  width 0.5 with 8 units; MobileNetV2 width 0.5 with fewer repeats (1-2-2-2-1-1-1 units), head 640;
  MobileNetV3-Small width 1.0.
- `paper`: the CNNs take the channel counts of the authors' released code (24club tools.py): CNN1 10-64 / 50;
  CNN2 = their CNN2_1 (CNN1 plus conv3 128), 10-64-128 / 50; CNN3 6-16-32-64-128 / 1024-128-64; CNN4
  32-64-128-128-256-256 / 1024-512-256. The paper's CNN4 has FC1..FC4 where the code's CNN4 has three FCs
  (1024, 512, classifier): we keep the paper's four and take FC1..FC3 = 1024-512-256 from the code's CNN4_1,
  which has exactly those four. Their kernels (k3 throughout CNN4) and unpadded convs are not taken: only widths.
  MobileNetV1 width 1.0 (stem 32; 13 units 64, 128, 128, 256, 256, 512×6, 1024, 1024; the 1024 unit keeps
  stride 1 so that three stride-2 stages remain); MobileNetV2 width 1.0 with the standard (t, c, n, s) table
  (the 24-channel stage at stride 1 instead of 2) and head 1280; MobileNetV3-Small is the same as `cpu`, which
  is already the standard one (width 1.0, the paper's bneck table, SE widths, head 576 → 1024 → classifier:
  1,528,106 parameters at 3×32×32 / 10 classes = torchvision's 2,542,856 less 1024·990 + 990 of its 1000-class
  classifier).

Parameters (and forward MACs per sample), 10 classes (`fedge zoo --widths paper --input 3x32x32` prints them):
                cpu 1×28×28         cpu 3×32×32         paper 1×28×28       paper 3×32×32
  cnn1            215,370 (  3.0 M)   277,610 (  4.8 M)   173,684 (  3.5 M)   222,184 (  5.1 M)
  cnn2            467,338 (  5.7 M)   591,018 (  8.3 M)   535,412 ( 13.7 M)   631,912 ( 18.4 M)
  cnn3            708,874 ( 12.5 M)   939,050 ( 18.2 M) 1,592,374 (  6.9 M) 2,510,178 ( 10.7 M)
  cnn4            689,898 ( 42.7 M)   920,874 ( 57.5 M) 4,408,010 (156.2 M) 6,244,618 (206.5 M)
  mobilenet_v1    210,570 (  6.0 M)   210,858 (  7.3 M) 3,216,650 ( 61.1 M) 3,217,226 ( 65.4 M)
  mobilenet_v2    323,466 ( 11.7 M)   323,754 ( 14.4 M) 2,236,106 ( 72.9 M) 2,236,682 ( 88.0 M)
  mobilenet_v3  1,527,818 ( 14.7 M) 1,528,106 ( 17.5 M) 1,527,818 ( 14.7 M) 1,528,106 ( 17.5 M)
Paper-width MobileNetV1/V2 (3.2 M / 2.2 M; torchvision's 3,504,872 less its 1000-class classifier's 1,281,000
plus 12,810 is V2's 2,236,682) are 3.5-19x CNN1/CNN2 (0.17-0.63 M), so a MobileNet client can be given a smaller
teacher (pFedClub Fig. 3b, ϕ < 0); at cpu widths MobileNetV1/V2 are smaller than CNN2. Paper-width CNN4 exceeds
the max_macs of the android-mid-range and android-flagship profiles, and android-low-end and rpi-zero-2w take
only CNN1; the default fleet (rpi-4, rpi-5,
jetson-orin-nano) takes every model at both presets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import numpy as np

from fedge import constants as C
from fedge.errors import UserError
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import ModelSpec, make_spec
from fedge.plugins import load_methods
from fedge.registry import Registry

Factory = Callable[[int, int, int, str], ModelSpec]


class ZooError(UserError, ValueError):
    """Unknown model, zoo or width preset, or an input the model cannot take; the message lists valid names."""


MODELS: Registry[Factory] = Registry("model", ZooError)
register_model = MODELS.register  # decorator: `(in_channels, image_size, num_classes, widths) -> ModelSpec`


@dataclass(frozen=True)
class Family:
    """Models named by a pattern rather than one by one (mlp<depth>, FedMN's fedmn_<units>_<encoder>): `pattern`
    (fully matched), `build(match, (C, H, W), num_classes, widths)` and `known(match)`, whether a matching name is a
    model (e.g. its encoder exists)."""

    pattern: re.Pattern[str]
    build: Callable[[re.Match[str], tuple[int, int, int], int, str], ModelSpec]
    known: Callable[[re.Match[str]], bool] = lambda match: True


# mlp<depth> below; a method package's `models` module may add its own (fedge.plugins), loaded on first read
FAMILIES: Registry[Family] = Registry("model family", ZooError, partial(load_methods, "models"))


def family_of(name: str) -> tuple[Family, re.Match[str]] | None:
    """The model family whose pattern `name` matches, with the match; None for none."""
    for family in (FAMILIES.get(key) for key in FAMILIES):
        match = family.pattern.fullmatch(name)
        if match is not None:
            return family, match
    return None


def check_widths(widths: str) -> str:
    """`widths` if it names a width preset (constants.WIDTHS), else ZooError listing them."""
    if widths not in C.WIDTHS:
        raise ZooError(f"unknown widths {widths!r}; use one of {', '.join(C.WIDTHS)}")
    return widths


def create(name: str, input_shape: Sequence[int], num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
    """Build the spec of a zoo model for a (C, H, W) input at a width preset; unknown names or widths raise
    ZooError."""
    found = family_of(name) if name not in MODELS else None
    factory = MODELS.get(name) if found is None else None
    check_widths(widths)
    c, h, w = input_shape
    if h != w:
        raise ZooError(f"zoo models take square images, got {h}x{w}")
    if found is not None:
        family, match = found
        return family.build(match, (c, h, w), num_classes, widths)
    return factory(c, h, num_classes, widths)


def is_model(name: str) -> bool:
    """Whether `name` is a zoo model: a registered one, or one of a family (an MLP, mlp<depth>; a FedMN modular
    network, fedmn_<units>_<encoder>, methods/fedmn/models.py) that the family knows."""
    if name in MODELS:
        return True
    found = family_of(name)
    return found is not None and found[0].known(found[1])


def _conv(out: int, k: int, stride: int = 1, bias: bool = True, padding: int | None = None) -> L:
    pad = k // 2 if padding is None else padding
    return L("conv2d", {"out_channels": out, "kernel_size": k, "stride": stride, "padding": pad, "bias": bias})


RELU, BN, POOL, FLAT = L("relu"), L("bn2d"), L("maxpool", {"kernel_size": 2}), L("flatten")


def _fc(out: int, relu: bool = True, dropout: float | None = None, flatten: bool = False) -> list[L]:
    layers = [FLAT] if flatten else []
    layers += [L("linear", {"out_features": out})] + ([RELU] if relu else [])
    return layers + ([L("dropout", {"p": dropout})] if dropout else [])


# Per width preset: the CNN's conv output channels (Cov1..) and hidden FC widths (FC1.., before the classifier).
CNN_WIDTHS: dict[str, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = {
    "cnn1": {"cpu": ((16, 32), (128,)), "paper": ((10, 64), (50,))},
    "cnn2": {"cpu": ((16, 32, 64), (128,)), "paper": ((10, 64, 128), (50,))},
    "cnn3": {"cpu": ((16, 32, 64, 64, 128), (256, 128, 64)), "paper": ((6, 16, 32, 64, 128), (1024, 128, 64))},
    "cnn4": {
        "cpu": ((32, 32, 64, 64, 128, 128), (256, 128, 64)),
        "paper": ((32, 64, 128, 128, 256, 256), (1024, 512, 256)),
    },
}


def _cnn_widths(model: str, widths: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return CNN_WIDTHS[model][check_widths(widths)]


@register_model("cnn1")
def cnn1(in_channels: int, image_size: int, num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
    """pFedClub App. B CNN1: Cov1, Cov2 {Conv5-ReLU-Pool}, FC1 {Linear-ReLU}, Dropout, FC2."""
    (c1, c2), (f1,) = _cnn_widths("cnn1", widths)
    return make_spec(
        "cnn1",
        (in_channels, image_size, image_size),
        num_classes,
        [
            ("cov1", [_conv(c1, 5), RELU, POOL]),
            ("cov2", [_conv(c2, 5), RELU, POOL]),
            ("fc1", _fc(f1, dropout=0.5, flatten=True)),
            ("fc2", _fc(num_classes, relu=False)),
        ],
    )


@register_model("cnn2")
def cnn2(in_channels: int, image_size: int, num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
    """pFedClub App. B CNN2: CNN1 plus Cov3 {Conv5-ReLU} before FC1."""
    (c1, c2, c3), (f1,) = _cnn_widths("cnn2", widths)
    return make_spec(
        "cnn2",
        (in_channels, image_size, image_size),
        num_classes,
        [
            ("cov1", [_conv(c1, 5), RELU, POOL]),
            ("cov2", [_conv(c2, 5), RELU, POOL]),
            ("cov3", [_conv(c3, 5), RELU]),
            ("fc1", _fc(f1, dropout=0.5, flatten=True)),
            ("fc2", _fc(num_classes, relu=False)),
        ],
    )


@register_model("cnn3")
def cnn3(in_channels: int, image_size: int, num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
    """pFedClub App. B CNN3: five Conv5 blocks (pools after 1, 2, 4) and FC1 (dropout) .. FC4."""
    (c1, c2, c3, c4, c5), (f1, f2, f3) = _cnn_widths("cnn3", widths)
    return make_spec(
        "cnn3",
        (in_channels, image_size, image_size),
        num_classes,
        [
            ("cov1", [_conv(c1, 5), RELU, POOL]),
            ("cov2", [_conv(c2, 5), RELU, POOL]),
            ("cov3", [_conv(c3, 5), RELU]),
            ("cov4", [_conv(c4, 5), RELU, POOL]),
            ("cov5", [_conv(c5, 5), RELU]),
            ("fc1", _fc(f1, dropout=0.5, flatten=True)),
            ("fc2", _fc(f2)),
            ("fc3", _fc(f3)),
            ("fc4", _fc(num_classes, relu=False)),
        ],
    )


@register_model("cnn4")
def cnn4(in_channels: int, image_size: int, num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
    """pFedClub App. B CNN4: six conv blocks (BN in 1, 3, 5; pools in 2, 4, 6) and FC1 .. FC4."""
    (c1, c2, c3, c4, c5, c6), (f1, f2, f3) = _cnn_widths("cnn4", widths)
    return make_spec(
        "cnn4",
        (in_channels, image_size, image_size),
        num_classes,
        [
            ("cov1", [_conv(c1, 5), BN, RELU]),
            ("cov2", [_conv(c2, 3), RELU, POOL]),
            ("cov3", [_conv(c3, 3), BN, RELU]),
            ("cov4", [_conv(c4, 5), RELU, POOL, L("dropout", {"p": 0.05})]),
            ("cov5", [_conv(c5, 3), BN, RELU]),
            ("cov6", [_conv(c6, 3), RELU, POOL]),
            ("fc1", _fc(f1, dropout=0.1, flatten=True)),
            ("fc2", _fc(f2)),
            ("fc3", _fc(f3)),
            ("fc4", _fc(num_classes, relu=False)),
        ],
    )


def _stem(out: int, act: str) -> list[L]:
    return [_conv(out, 3, bias=False), BN, L(act)]


# Per width preset: stem channels and the depthwise-separable units (out channels, stride).
V1_WIDTHS: dict[str, tuple[int, tuple[tuple[int, int], ...]]] = {
    "cpu": (16, ((32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (256, 1))),
    "paper": (32, ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)) + ((512, 1),) * 5 + ((1024, 1),) * 2),
}


@register_model("mobilenet_v1")
def mobilenet_v1(in_channels: int, image_size: int, num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
    """MobileNetV1 (Howard et al. 2017), stride-1 stem, depthwise-separable units: width 0.5 and 8 units (cpu)
    or width 1.0 and the standard 13 (paper)."""
    stem, units = V1_WIDTHS[check_widths(widths)]
    blocks = [("stem", _stem(stem, "relu"))]
    blocks += [
        (f"dws{i + 1}", [L("depthwise_separable", {"out_channels": c, "stride": s})]) for i, (c, s) in enumerate(units)
    ]
    blocks += [("classifier", [L("adaptive_avgpool"), FLAT, L("linear", {"out_features": num_classes})])]
    return make_spec("mobilenet_v1", (in_channels, image_size, image_size), num_classes, blocks)


def _make_divisible(v: float, divisor: int = 8) -> int:
    """Round channels as torchvision's MobileNets do (never below 90 % of v)."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


# Per width preset: stem channels, the (expansion t, channels c, repeats n, first stride s) table, head channels.
V2_WIDTHS: dict[str, tuple[int, tuple[tuple[int, int, int, int], ...], int]] = {
    "cpu": (
        16,
        ((1, 8, 1, 1), (6, 12, 2, 1), (6, 16, 2, 2), (6, 32, 2, 2), (6, 48, 1, 1), (6, 80, 1, 2), (6, 160, 1, 1)),
        640,
    ),
    "paper": (
        32,
        ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)),
        1280,
    ),
}


@register_model("mobilenet_v2")
def mobilenet_v2(in_channels: int, image_size: int, num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
    """MobileNetV2 (Sandler et al. 2018), inverted residuals with ReLU6: width 0.5 and 10 units (cpu) or width
    1.0 and the standard 17 (paper)."""
    stem, cfg, head = V2_WIDTHS[check_widths(widths)]
    blocks, cin = [("stem", _stem(stem, "relu6"))], stem
    for t, c, n, s in cfg:
        for r in range(n):
            args = {"out_channels": c, "hidden_channels": cin * t, "stride": s if r == 0 else 1}
            blocks.append((f"ir{len(blocks)}", [L("inverted_residual", args)]))
            cin = c
    blocks += [
        ("head", [_conv(head, 1, bias=False), BN, L("relu6"), L("adaptive_avgpool"), FLAT]),
        ("classifier", [L("dropout", {"p": 0.2}), L("linear", {"out_features": num_classes})]),
    ]
    return make_spec("mobilenet_v2", (in_channels, image_size, image_size), num_classes, blocks)


@register_model("mobilenet_v3")
def mobilenet_v3(in_channels: int, image_size: int, num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
    """MobileNetV3-Small (Howard et al. 2019), width 1.0 at both presets; stem and first unit at stride 1."""
    check_widths(widths)
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


# FedGH's five CNNs (Yi et al. 2023; the authors' Models/CNNs.py, n_kernels 16), which DC-PFL uses: conv 5x5
# (unpadded) channels and the FC1 width; FC2 gives the 500-d representation, FC3 is the shared 500 -> C head.
FEDGH_CNNS: dict[str, tuple[int, int, int]] = {
    "fedgh_cnn1": (16, 32, 2000),
    "fedgh_cnn2": (16, 16, 2000),
    "fedgh_cnn3": (16, 32, 1000),
    "fedgh_cnn4": (16, 32, 800),
    "fedgh_cnn5": (16, 32, 500),
}
FEDGH_REPRESENTATION = 500


def _fedgh_cnn(name: str) -> Factory:
    c1, c2, f1 = FEDGH_CNNS[name]

    def factory(in_channels: int, image_size: int, num_classes: int, widths: str = C.DEFAULT_WIDTHS) -> ModelSpec:
        check_widths(widths)  # the same at both presets: the authors' widths are already CPU-sized
        return make_spec(
            name,
            (in_channels, image_size, image_size),
            num_classes,
            [
                ("conv1", [_conv(c1, 5, padding=0), RELU, POOL]),
                ("conv2", [_conv(c2, 5, padding=0), RELU, POOL]),
                ("fc1", _fc(f1, flatten=True)),
                ("fc2", _fc(FEDGH_REPRESENTATION)),
                ("fc3", _fc(num_classes, relu=False)),
            ],
        )

    factory.__doc__ = f"FedGH {name[6:]}: conv {c1}, conv {c2} (5x5, unpadded, ReLU, pool), FC {f1}, FC 500, head."
    return factory


for _name in FEDGH_CNNS:
    register_model(_name)(_fedgh_cnn(_name))

# pFedClub §4.1: how many of N=50 clients get each model (Zoo I, II, III).
ZOOS: dict[str, dict[str, int]] = {
    "I": {"cnn1": 8, "cnn2": 7, "cnn3": 7, "cnn4": 7, "mobilenet_v1": 7, "mobilenet_v2": 7, "mobilenet_v3": 7},
    "II": {"mobilenet_v1": 16, "mobilenet_v2": 17, "mobilenet_v3": 17},
    "III": {"cnn1": 12, "cnn2": 12, "cnn3": 12, "cnn4": 14},
}


def assign_models(zoo: str, num_clients: int, seed: int) -> list[str]:
    """Model name for each client 0..N-1: a zoo preset's proportions (scaled from N=50 by largest
    remainder) randomly placed by `seed`; one model name for a homogeneous fleet; or comma-separated model
    names given to clients in turn (client i gets name i mod k, like the run's `profiles`); zoo "fedgh" is
    FedGH's five CNNs in turn (client i gets fedgh_cnn{i mod 5 + 1}, as the authors' code).

    Raises ZooError for an unknown zoo or model name or a non-positive N.
    """
    if num_clients < 1:
        raise ZooError(f"number of clients must be positive, got {num_clients}")
    names = list(FEDGH_CNNS) if zoo == C.FEDGH_ZOO else zoo.split(",")
    if all(is_model(n) for n in names):
        return [names[i % len(names)] for i in range(num_clients)]
    if zoo not in ZOOS:
        raise ZooError(
            f"unknown zoo {zoo!r}; use one of {', '.join([*ZOOS, C.FEDGH_ZOO])}, a model name, or comma-separated "
            f"model names ({', '.join(MODELS)}, an MLP such as mlp8, or a FedMN pool such as fedmn_2x2x2_cnn1)"
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


# MLPs of any depth, named mlp<depth> (FedMN §IV-D's FedAvg baselines: 8-, 9- and 10-layer MLPs of 256 hidden units):
# flatten, depth - 1 hidden layers Linear(256) → ReLU, and a linear classifier; the same at both width presets (the
# paper's 256 hidden units are already CPU-sized). mlp1 is a linear classifier on the pixels.
MLP_NAME = re.compile(r"mlp([1-9]\d{0,2})")
MLP_HIDDEN = 256


def mlp(input_shape: tuple[int, int, int], depth: int, num_classes: int) -> ModelSpec:
    """`mlp<depth>`: blocks fc1..fc<depth-1> (Linear(256) → ReLU, the first flattening the image) and the classifier
    fc<depth>: depth linear layers in all."""
    blocks = [(f"fc{i + 1}", _fc(MLP_HIDDEN, flatten=i == 0)) for i in range(depth - 1)]
    blocks.append((f"fc{depth}", _fc(num_classes, relu=False, flatten=depth == 1)))
    return make_spec(f"mlp{depth}", input_shape, num_classes, blocks)


FAMILIES.add("mlp", Family(MLP_NAME, lambda match, shape, classes, widths: mlp(shape, int(match[1]), classes)))
