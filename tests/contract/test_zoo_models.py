"""Every registered zoo model, at both input sizes and both width presets: builds, counts, round-trips, runs block
by block."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fedge import constants as C
from fedge.model.spec import ModelSpec, build
from fedge.model.weights import from_bytes, load_model, save_model, to_bytes
from fedge.model.zoo import MODELS, create

pytestmark = pytest.mark.timeout(120)
SHAPES = [(1, 28, 28), (3, 32, 32)]
CASES = [(name, shape, widths) for name in MODELS for shape in SHAPES for widths in C.WIDTHS]


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}")
def model(request):
    name, shape, widths = request.param
    torch.manual_seed(0)
    spec = create(name, shape, 10, widths)
    return spec, build(spec).eval()


def test_pfedclubs_seven_models_and_fedghs_five_are_registered():
    pfedclub = ["cnn1", "cnn2", "cnn3", "cnn4", "mobilenet_v1", "mobilenet_v2", "mobilenet_v3"]
    assert list(MODELS) == pfedclub + [f"fedgh_cnn{i}" for i in range(1, 6)]


def test_output_shape(model):
    spec, module = model
    assert module(torch.randn(3, *spec.input_shape)).shape == (3, 10)


def test_param_count_matches_the_built_module(model):
    spec, module = model
    assert spec.params == sum(p.numel() for p in module.parameters())


def test_macs_match_torch_flop_counter_within_one_percent(model):
    spec, module = model
    with FlopCounterMode(display=False) as counter:
        module(torch.randn(2, *spec.input_shape))
    measured_macs_per_sample = counter.get_total_flops() / 2 / 2  # 2 FLOPs per MAC, batch of 2
    assert abs(spec.macs - measured_macs_per_sample) <= 0.01 * measured_macs_per_sample


def test_block_by_block_equals_whole(model):
    spec, module = model
    x = torch.randn(4, *spec.input_shape)
    h = x
    for i, block in enumerate(spec.blocks):
        assert tuple(h.shape[1:]) == block.in_shape
        h = module.run_block(i, h)
        assert tuple(h.shape[1:]) == block.out_shape
    assert torch.equal(h, module(x))


def test_spec_json_round_trip(model):
    spec, _ = model
    again = ModelSpec.from_json(spec.to_json())
    assert again == spec and again.to_json() == spec.to_json()


def test_save_load_gives_bit_identical_outputs(model, tmp_path):
    spec, module = model
    # move BN statistics away from their init so buffers matter
    module.train()
    module(torch.randn(8, *spec.input_shape))
    module.eval()
    save_model(tmp_path / "m.safetensors", spec, module.state_dict())
    spec2, state = load_model(tmp_path / "m.safetensors")
    module2 = build(spec2).eval()
    module2.load_state_dict(state)
    x = torch.randn(5, *spec.input_shape)
    assert torch.equal(module(x), module2(x))
    assert from_bytes(to_bytes(spec, module.state_dict()))[0] == spec


def test_every_block_records_its_origin(model):
    spec, _ = model
    tagged = spec.with_origin("7")
    assert [(b.origin.model, b.origin.client, b.origin.block) for b in tagged.blocks] == [
        (spec.name, "7", i) for i in range(len(spec.blocks))
    ]
