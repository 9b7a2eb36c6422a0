"""Width-scaled submodels (HeteroFL model rates) and HeteroFL's Scaler layers."""

import pytest
import torch

from fedge.model.layers import LayerSpec as L
from fedge.model.layers import Residual, Scaler, SpecError
from fedge.model.spec import build, make_spec, tensor_shapes
from fedge.model.zoo import MODELS, create
from methods.heterofl.widths import scale_width, scaled, with_scalers
from server.slices import crop

pytestmark = pytest.mark.timeout(120)
RATES = (1, 0.5, 0.25, 0.125, 0.0625)


def widths(spec, kind, key):
    return [ly.args[key] for b in spec.blocks for ly in b.layers if ly.type == kind]


def test_scaled_rounds_up_and_keeps_at_least_one():
    assert [scaled(30, r) for r in (1, 0.5, 0.1, 0.01)] == [30, 15, 3, 1]  # 0.1 · 30 is 3, not 4
    assert scaled(10, 0.0625) == 1 and scaled(17, 0.5) == 9


def test_cnn1_at_half_width_by_hand():
    spec = create("cnn1", (1, 28, 28), 10)  # convs 16, 32; fc 128; 10 classes
    half = scale_width(spec, 0.5)
    assert half.name == "cnn1@0.5"
    assert widths(half, "conv2d", "out_channels") == [8, 16]
    assert widths(half, "linear", "out_features") == [64, 10]  # the logits keep num_classes
    assert half.blocks[2].in_shape == (16, 7, 7)  # input widths follow
    assert scale_width(spec, 1) is spec


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("input_shape", [(1, 28, 28), (3, 32, 32)])
@pytest.mark.parametrize("preset", ["cpu", "paper"])
def test_every_zoo_model_at_every_rate_is_a_top_left_slice_that_loads(name, input_shape, preset):
    spec = create(name, input_shape, 10, preset)
    torch.manual_seed(0)
    full = build(spec).state_dict()
    x = torch.randn(2, *input_shape)
    for rate in RATES:
        sub = scale_width(spec, rate)
        shapes = tensor_shapes(sub)
        assert shapes.keys() == full.keys()
        model = build(sub)
        model.load_state_dict({k: crop(v, shapes[k][0]) for k, v in full.items()})  # strict: every name, shape
        assert model.eval()(x).shape == (2, 10)
        # params and MACs shrink about as rate² (the input and logits layers, whose one side is fixed, as rate: FedGH's
        # CNNs spend a quarter of their MACs in the first conv, which halves at rate 1/2, hence up to 0.34)
        for full_count, sub_count in ((spec.params, sub.params), (spec.macs, sub.macs)):
            assert rate**2 * 0.99 <= sub_count / full_count <= (0.34 if rate == 0.5 else rate)
            assert rate < 1 or sub_count == full_count


def test_depthwise_convs_keep_one_group_per_channel():
    spec = create("mobilenet_v1", (3, 32, 32), 10)
    quarter = scale_width(spec, 0.25)
    for module in build(quarter).modules():
        if isinstance(module, torch.nn.Conv2d) and module.groups > 1:
            assert module.groups == module.in_channels == module.out_channels


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3"])
def test_inverted_residuals_keep_their_expansions_and_residual_adds(name):
    def structure(spec):
        residuals = [m.residual for m in build(spec).modules() if isinstance(m, Residual)]
        expansions = [len(m.body) for m in build(spec).modules() if isinstance(m, Residual)]
        return residuals, expansions

    spec = create(name, (3, 32, 32), 10)
    for rate in RATES:  # e.g. v2's 16→8 unit at 1/16 would be 1→1 and gain a residual add without the tie rule
        assert structure(scale_width(spec, rate)) == structure(spec)


def test_bad_rates_and_unscalable_layers_are_refused():
    spec = create("cnn1", (1, 8, 8), 10)
    for rate in (0, -0.5, 1.5, True):
        with pytest.raises(SpecError, match=r"rate must be in \(0, 1\]"):
            scale_width(spec, rate)
    stitched = make_spec(
        "s",
        (1, 4, 4),
        3,
        [("a", [L("stitch", {"out_shape": [2, 4, 4]})]), ("b", [L("flatten"), L("linear", {"out_features": 3})])],
    )
    with pytest.raises(SpecError, match="'stitch'"):
        scale_width(stitched, 0.5)
    grouped = make_spec(
        "g",
        (4, 4, 4),
        3,
        [
            (
                "a",
                [
                    L("conv2d", {"out_channels": 4, "kernel_size": 1, "groups": 2}),
                    L("flatten"),
                    L("linear", {"out_features": 3}),
                ],
            )
        ],
    )
    with pytest.raises(SpecError, match="groups=2"):
        scale_width(grouped, 0.5)


def test_scalers_follow_hidden_layers_without_batchnorm_and_rename_nothing():
    cnn1 = scale_width(create("cnn1", (1, 28, 28), 10), 0.5)
    scaled_cnn1 = with_scalers(cnn1, 0.5)
    kinds = [[ly.type for ly in b.layers] for b in scaled_cnn1.blocks]
    assert kinds == [
        ["conv2d", "scaler", "relu", "maxpool"],
        ["conv2d", "scaler", "relu", "maxpool"],
        ["flatten", "linear", "scaler", "relu", "dropout"],
        ["linear"],  # the logits: no Scaler
    ]
    assert tensor_shapes(scaled_cnn1) == tensor_shapes(cnn1)
    cnn4 = with_scalers(scale_width(create("cnn4", (1, 28, 28), 10), 0.25), 0.25)
    assert [ly.type for ly in cnn4.blocks[0].layers] == ["conv2d", "bn2d", "relu"]  # BN follows: none
    assert [ly.type for ly in cnn4.blocks[1].layers][:2] == ["conv2d", "scaler"]
    full = create("cnn4", (1, 28, 28), 10)
    assert with_scalers(full, 1) is full
    with pytest.raises(SpecError):
        with_scalers(full, 0)


def test_the_scaler_divides_by_the_rate_in_training_and_in_evaluation():
    """A submodel is one function: evaluated (and exported) as it was trained. Dividing in training only left a
    half-width cnn3 at chance on its own test data while its training loss fell (bench/fedtrans.py, MNIST IID)."""
    scaler = Scaler(0.25)
    x = torch.tensor([1.0, -2.0])
    assert torch.equal(scaler.train()(x), torch.tensor([4.0, -8.0]))
    assert torch.equal(scaler.eval()(x), torch.tensor([4.0, -8.0]))
    spec = make_spec("s", (2,), 2, [("a", [L("scaler", {"rate": 0.5}), L("linear", {"out_features": 2})])])
    assert spec.params == 6 and spec.macs == 4  # the scaler adds neither
    with pytest.raises(SpecError, match="scaler rate"):
        make_spec("s", (2,), 2, [("a", [L("scaler", {"rate": 2}), L("linear", {"out_features": 2})])])
