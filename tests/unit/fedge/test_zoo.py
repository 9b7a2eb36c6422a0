"""fedge.model.zoo's width presets: `cpu` is the zoo as it was, `paper` the authors' CNN widths and standard
MobileNets."""

import hashlib
import math

import pytest

from device_profiles import fits, get_profile, list_profiles
from fedge import constants as C
from fedge.model.zoo import FEDGH_CNNS, MODELS, ZooError, assign_models, create, is_model

pytestmark = pytest.mark.timeout(60)
SHAPES = [(1, 28, 28), (3, 32, 32)]


def sha(spec) -> str:
    return hashlib.sha256(spec.to_json().encode()).hexdigest()[:16]


# The zoo before width presets existed (commit 42b6e2f), 10 classes: params, MACs, SHA-256 of the spec's JSON.
CPU_SNAPSHOT = {
    ("cnn1", (1, 28, 28)): (215_370, 3_024_384, "2ae667bbd612a92c"),
    ("cnn1", (3, 32, 32)): (277_610, 4_769_024, "b5cbd1073bf797c7"),
    ("cnn2", (1, 28, 28)): (467_338, 5_733_888, "1d69009387c17db6"),
    ("cnn2", (3, 32, 32)): (591_018, 8_307_968, "4885bd307911b57c"),
    ("cnn3", (1, 28, 28)): (708_874, 12_528_512, "a21f9f9cd0da64f1"),
    ("cnn3", (3, 32, 32)): (939_050, 18_178_688, "0eb2b98e3ef22ef0"),
    ("cnn4", (1, 28, 28)): (689_898, 42_710_144, "df816312d5642364"),
    ("cnn4", (3, 32, 32)): (920_874, 57_549_440, "896985e47087faee"),
    ("mobilenet_v1", (1, 28, 28)): (210_570, 6_005_824, "440137a9d455af2a"),
    ("mobilenet_v1", (3, 32, 32)): (210_858, 7_307_776, "1ebf4ca77bee55bb"),
    ("mobilenet_v2", (1, 28, 28)): (323_466, 11_744_512, "b56f20b176b03bf0"),
    ("mobilenet_v2", (3, 32, 32)): (323_754, 14_420_224, "1d269b6b3c3be3c9"),
    ("mobilenet_v3", (1, 28, 28)): (1_527_818, 14_701_896, "9d8441643f2c6d90"),
    ("mobilenet_v3", (3, 32, 32)): (1_528_106, 17_507_328, "f807de0cfc23e41d"),
}


@pytest.mark.parametrize("name, shape", list(CPU_SNAPSHOT), ids=lambda v: v if isinstance(v, str) else None)
def test_cpu_preset_is_the_zoo_as_it_was_and_the_default(name, shape):
    spec = create(name, shape, 10, "cpu")
    assert (spec.params, spec.macs, sha(spec)) == CPU_SNAPSHOT[name, shape]
    assert create(name, shape, 10) == spec and C.DEFAULT_WIDTHS == "cpu"


def layer_widths(spec) -> tuple[list[int], list[int]]:
    """Conv output channels and linear output features, in order, read from the spec's layers."""
    layers = [layer for block in spec.blocks for layer in block.layers]
    convs = [ly.args["out_channels"] for ly in layers if ly.type == "conv2d"]
    return convs, [ly.args["out_features"] for ly in layers if ly.type == "linear"]


# original-code-notes §1.1 (24club tools.py): conv channels and FC widths; CNN2 is the authors' CNN2_1, and CNN4's
# four FCs are their CNN4_1's (4096→1024→512→256→C) since the paper's CNN4 has FC1..FC4.
AUTHORS = {
    "cnn1": ([10, 64], [50]),
    "cnn2": ([10, 64, 128], [50]),
    "cnn3": ([6, 16, 32, 64, 128], [1024, 128, 64]),
    "cnn4": ([32, 64, 128, 128, 256, 256], [1024, 512, 256]),
}


@pytest.mark.parametrize("name", list(AUTHORS))
@pytest.mark.parametrize("shape", SHAPES)
def test_paper_cnns_have_the_authors_channel_counts(name, shape):
    convs, linears = layer_widths(create(name, shape, 10, "paper"))
    assert (convs, linears) == (AUTHORS[name][0], AUTHORS[name][1] + [10])


def standard(published: int, features: int, stem: int, in_channels: int) -> int:
    """A published 1000-class, 3-channel parameter count with a 10-class classifier (features → 10, with bias) and
    a stem (3×3 conv to `stem` channels) on `in_channels` channels instead."""
    return published - (features * 1000 + 1000) + (features * 10 + 10) - 9 * stem * (3 - in_channels)


# Trainable parameters at 1000 classes, 3 channels: MobileNetV1 1.0 (Keras `MobileNet`, conv + BN affine) 4,231,976;
# torchvision mobilenet_v2 3,504,872 and mobilenet_v3_small 2,542,856. Input size changes no parameter.
PUBLISHED = {
    "mobilenet_v1": (4_231_976, 1024, 32),
    "mobilenet_v2": (3_504_872, 1280, 32),
    "mobilenet_v3": (2_542_856, 1024, 16),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
@pytest.mark.parametrize("shape", SHAPES)
def test_paper_mobilenets_have_the_standard_parameter_counts(name, shape):
    assert create(name, shape, 10, "paper").params == standard(*PUBLISHED[name], shape[0])


def test_standard_counts_are_the_ones_the_zoo_docstring_quotes():
    assert standard(*PUBLISHED["mobilenet_v1"], 3) == 3_217_226
    assert standard(*PUBLISHED["mobilenet_v2"], 3) == 2_236_682
    assert standard(*PUBLISHED["mobilenet_v3"], 3) == 1_528_106


@pytest.mark.parametrize("shape", SHAPES)
def test_paper_mobilenets_keep_three_stride_two_stages(shape):
    # the last feature map is 4x4 at 28 and 32 px (28→14→7→4, 32→16→8→4), as for the cpu preset
    last = {"mobilenet_v1": "classifier", "mobilenet_v2": "head", "mobilenet_v3": "head"}
    for name, block in last.items():
        for widths in C.WIDTHS:
            spec = create(name, shape, 10, widths)
            assert next(b for b in spec.blocks if b.name == block).in_shape[1:] == (4, 4), (name, widths)
    assert len(create("mobilenet_v1", shape, 10, "paper").blocks) == 1 + 13 + 1  # stem, 13 units, classifier
    assert len(create("mobilenet_v2", shape, 10, "paper").blocks) == 1 + 17 + 2  # stem, 17 units, head, classifier


@pytest.mark.parametrize("shape", SHAPES)
def test_paper_mobilenets_dwarf_paper_cnn1_and_cnn2(shape):
    # pFedClub Fig. 3b (ϕ < 0 for MobileNet clients) needs teachers smaller than the MobileNet client
    params = {name: create(name, shape, 10, "paper").params for name in MODELS}
    assert min(params["mobilenet_v1"], params["mobilenet_v2"]) > 3 * max(params["cnn1"], params["cnn2"])
    assert params["mobilenet_v3"] > 2 * max(params["cnn1"], params["cnn2"])
    assert create("mobilenet_v3", shape, 10, "paper") == create("mobilenet_v3", shape, 10, "cpu")


@pytest.mark.parametrize("widths", ["", "Paper", "gpu"])
def test_unknown_widths_is_a_zoo_error_listing_the_presets(widths):
    with pytest.raises(ZooError, match=f"unknown widths {widths!r}; use one of cpu, paper"):
        create("cnn1", (1, 28, 28), 10, widths)
    with pytest.raises(ZooError, match="use one of cpu, paper"):
        MODELS.get("mobilenet_v3")(1, 28, 10, widths)


# Which bundled profiles refuse which paper-width models (the same at 1x28x28 and 3x32x32); the default fleet
# (rpi-4, rpi-5, jetson-orin-nano) takes them all.
PFEDCLUB_MODELS = [name for name in MODELS if name not in FEDGH_CNNS]
PAPER_REJECTED = {
    "android-flagship": {"cnn4"},
    "android-mid-range": {"cnn4"},
    "android-low-end": set(PFEDCLUB_MODELS) - {"cnn1"},
    "rpi-zero-2w": set(PFEDCLUB_MODELS) - {"cnn1"},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_paper_widths_against_the_bundled_profiles(shape):
    specs = {name: create(name, shape, 10, "paper") for name in PFEDCLUB_MODELS}
    rejected = {p.name: {n for n, s in specs.items() if not fits(s, p).ok} for p in list_profiles()}
    assert {name: names for name, names in rejected.items() if names} == PAPER_REJECTED
    assert all(not rejected[name] for name in C.DEFAULT_FLEET_PROFILES)


def test_fedgh_cnns_are_the_authors_and_fit_the_default_fleet():
    """FedGH's CNN_1..5 at 3x32x32: 800 flattened features (16 x 5 x 5 for CNN_2's 16-channel conv2: 400) into FC1
    of 2000/2000/1000/800/500, a 500-d representation, a 500 -> 10 head; 1 M+ parameters, so the 1 M-parameter
    phone and the Pi Zero take only CNN_5 (670 k)."""
    params = {}
    for name, fc1 in zip(FEDGH_CNNS, (2000, 2000, 1000, 800, 500)):
        spec = create(name, (3, 32, 32), 10)
        flat = 400 if name == "fedgh_cnn2" else 800
        assert [b.out_shape for b in spec.blocks][2:] == [(fc1,), (500,), (10,)]
        assert spec.blocks[2].in_shape == ((16 if name == "fedgh_cnn2" else 32), 5, 5) and flat == math.prod(
            spec.blocks[2].in_shape
        )
        params[name] = spec.params
        assert all(fits(spec, get_profile(p)).ok for p in C.DEFAULT_FLEET_PROFILES)
    assert params["fedgh_cnn1"] == 3 * 16 * 25 + 16 + 16 * 32 * 25 + 32 + 800 * 2000 + 2000 + 2000 * 500 + 500 + 5010
    assert assign_models("fedgh", 7, seed=0) == [f"fedgh_cnn{i % 5 + 1}" for i in range(7)]


@pytest.mark.parametrize("depth", [1, 2, 8, 9, 10])
@pytest.mark.parametrize("shape", SHAPES)
def test_mlps_have_depth_linear_layers_of_256_hidden_units_at_both_presets(depth, shape):
    """mlp<depth> (FedMN §IV-D's FedAvg baselines): flatten, depth - 1 × Linear(256) → ReLU, Linear(classes)."""
    spec = create(f"mlp{depth}", shape, 10, "paper")
    assert spec == create(f"mlp{depth}", shape, 10, "cpu") and is_model(f"mlp{depth}")
    assert layer_widths(spec) == ([], [256] * (depth - 1) + [10])
    assert [b.name for b in spec.blocks] == [f"fc{i + 1}" for i in range(depth)]
    pixels = math.prod(shape)
    hidden = 0 if depth == 1 else (pixels * 256 + 256) + (depth - 2) * (256 * 256 + 256)
    assert spec.params == hidden + (256 if depth > 1 else pixels) * 10 + 10
    assert assign_models(f"mlp{depth}", 3, seed=0) == [f"mlp{depth}"] * 3


def test_mlp_parameter_counts_at_cifar10():
    # 3x32x32, 10 classes: 3072·256 + 256, then 65,792 per further hidden layer, then 2,570
    params = {d: create(f"mlp{d}", (3, 32, 32), 10).params for d in (8, 9, 10)}
    assert params == {8: 1_184_010, 9: 1_249_802, 10: 1_315_594}


@pytest.mark.parametrize("name", ["mlp0", "mlp01", "mlp", "mlp-1", "mlp8x"])
def test_malformed_mlp_names_are_not_models(name):
    assert not is_model(name)
    with pytest.raises(ZooError):
        create(name, (3, 32, 32), 10)
