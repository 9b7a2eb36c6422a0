"""ModelSpec: shape validation with clear errors, counts from arguments, layer registry, stitches."""

import json

import pytest
import torch

from fedge.model.layers import LayerSpec as L
from fedge.model.layers import SpecError
from fedge.model.spec import ModelSpec, build, make_spec, tensor_shapes

pytestmark = pytest.mark.timeout(60)


def tiny(channels: int = 4) -> ModelSpec:
    return make_spec(
        "tiny",
        (1, 8, 8),
        3,
        [
            (
                "conv",
                [
                    L("conv2d", {"out_channels": channels, "kernel_size": 3, "padding": 1}),
                    L("relu"),
                    L("maxpool", {"kernel_size": 2}),
                ],
            ),
            ("fc", [L("flatten"), L("linear", {"out_features": 3})]),
        ],
    )


def test_hand_computed_counts():
    spec = tiny()
    # conv: 4·1·3·3 + 4 = 40 params; MACs 4·8·8·1·9 = 2304. fc: 64·3 + 3 = 195 params, 192 MACs.
    assert [b.params for b in spec.blocks] == [40, 195]
    assert [b.macs for b in spec.blocks] == [2304, 192]
    assert (spec.params, spec.macs) == (235, 2496)
    assert spec.blocks[0].out_shape == (4, 4, 4)


def test_shapes_that_do_not_chain_name_the_block():
    d = tiny().to_dict()
    d["blocks"][1]["in_shape"] = [8, 4, 4]
    with pytest.raises(SpecError, match=r"block 1 \('fc'\).*\[8, 4, 4\].*\[4, 4, 4\]"):
        ModelSpec.from_dict(d)


def test_declared_output_shape_mismatch():
    d = tiny().to_dict()
    d["blocks"][0]["out_shape"] = [4, 8, 8]
    with pytest.raises(SpecError, match=r"block 0 \('conv'\): declared output shape \[4, 8, 8\]"):
        ModelSpec.from_dict(d)


def test_final_shape_must_be_the_classes():
    with pytest.raises(SpecError, match=r"final output shape \[3\] != \(5,\)"):
        make_spec("x", (1, 8, 8), 5, [("fc", [L("flatten"), L("linear", {"out_features": 3})])])


@pytest.mark.parametrize(
    "layer, message",
    [
        (L("conv2d", {"out_channels": 2, "kernel_size": 11}), "kernel 11.*does not fit a spatial size of 8"),
        (L("linear", {"out_features": 2}), "linear needs a 1-d input"),
        (L("nonsense"), "unknown layer type 'nonsense'"),
        (L("conv2d", {"kernel_size": 3}), "out_channels"),
    ],
)
def test_bad_layers_raise_spec_error_naming_the_block(layer, message):
    with pytest.raises(SpecError, match=message) as err:
        make_spec("x", (1, 8, 8), 2, [("first", [layer])])
    assert "'first'" in str(err.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        (json.dumps({"schema": 99}), "unsupported spec schema 99"),
        (json.dumps({"schema": 1, "name": "x"}), "missing or invalid field"),
    ],
)
def test_malformed_json(text, message):
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_json(text)


def test_conv_stitch_is_small_and_resizes():
    # 64×16×16 → 32×8×8: a 1×1 conv (64·32 + 32 params), then parameter-free pooling.
    spec = make_spec(
        "s",
        (64, 16, 16),
        2,
        [
            ("stitch", [L("stitch", {"out_shape": [32, 8, 8]})]),
            ("fc", [L("flatten"), L("linear", {"out_features": 2})]),
        ],
    )
    assert spec.blocks[0].params == 64 * 32 + 32
    assert spec.blocks[0].macs == 64 * 32 * 16 * 16
    module = build(spec)
    y = module.run_block(0, torch.randn(2, 64, 16, 16))
    assert y.shape == (2, 32, 8, 8) and bool((y >= 0).all())
    up = build(
        make_spec(
            "u",
            (8, 4, 4),
            2,
            [
                ("stitch", [L("stitch", {"out_shape": [8, 7, 7]})]),
                ("fc", [L("flatten"), L("linear", {"out_features": 2})]),
            ],
        )
    )
    assert up.run_block(0, torch.randn(1, 8, 4, 4)).shape == (1, 8, 7, 7)


def test_linear_stitch_from_conv_map_to_vector():
    spec = make_spec(
        "s", (4, 2, 2), 2, [("stitch", [L("stitch", {"out_shape": [6]})]), ("fc", [L("linear", {"out_features": 2})])]
    )
    assert spec.blocks[0].params == 16 * 6 + 6
    assert build(spec).run_block(0, torch.randn(3, 4, 2, 2)).shape == (3, 6)


def test_residual_is_used_only_when_shapes_allow():
    spec = make_spec(
        "ir",
        (8, 4, 4),
        2,
        [
            ("keep", [L("inverted_residual", {"out_channels": 8, "hidden_channels": 16})]),
            ("down", [L("inverted_residual", {"out_channels": 8, "hidden_channels": 16, "stride": 2})]),
            ("fc", [L("flatten"), L("linear", {"out_features": 2})]),
        ],
    )
    module = build(spec)
    assert module.blocks[0][0].residual and not module.blocks[1][0].residual
    with torch.no_grad():
        for p in module.blocks[0].parameters():
            p.zero_()
    x = torch.randn(2, 8, 4, 4)
    module.eval()
    assert torch.equal(module.run_block(0, x), x)  # a zeroed body leaves only the skip connection


def test_tensor_shapes_are_remembered_per_spec_and_returned_as_copies():
    a, b = tiny(4), tiny(6)
    first = tensor_shapes(a)
    assert first["blocks.0.0.weight"] == ((4, 1, 3, 3), torch.float32)
    first.clear()  # the caller's copy: the remembered shapes are unchanged
    assert tensor_shapes(a) == {k: (tuple(v.shape), v.dtype) for k, v in build(a, "meta").state_dict().items()}
    assert tensor_shapes(b)["blocks.0.0.weight"] == ((6, 1, 3, 3), torch.float32)  # another spec, its own shapes
