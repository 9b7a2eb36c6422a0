"""ModelSpec.activations (elements per sample kept for backward) by hand, and the footprint it gives."""

from device_profiles import training_footprint_bytes
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import make_spec
from fedge.model.zoo import MODELS, create


def test_two_layer_spec_footprint_by_hand() -> None:
    spec = make_spec("tiny", (1, 4, 4), 3, [("head", [L("flatten"), L("linear", {"out_features": 3})])])
    assert spec.params == 16 * 3 + 3
    assert spec.activations == 16 + 16 + 3  # the input, the flatten's output, the linear's output
    f = training_footprint_bytes(spec, batch_size=4)
    assert (f.weights, f.gradients, f.optimizer_state, f.activations) == (204, 204, 408, 35 * 4 * 4)


def test_a_composite_layer_counts_its_parts() -> None:
    block = [L("inverted_residual", {"hidden_channels": 8, "out_channels": 4})]
    spec = make_spec("ir", (4, 2, 2), 2, [("b", block), ("head", [L("flatten"), L("linear", {"out_features": 2})])])
    # input 16; expansion conv, bn, relu6 at 8x2x2 (3 x 32); depthwise conv, bn, relu6 (3 x 32); projection conv
    # and bn at 4x2x2 (2 x 16); the residual sum (16); flatten (16); linear (2)
    assert spec.activations == 16 + 6 * 32 + 2 * 16 + 16 + 16 + 2


def test_every_zoo_model_has_a_positive_activation_count() -> None:
    for name in MODELS:
        assert create(name, (1, 28, 28), 10, "cpu").activations > 0
