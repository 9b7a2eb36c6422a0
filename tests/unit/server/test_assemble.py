"""Candidate assembly: a stitch at every seam and where shapes differ, sizes from specs, the pFedClub+ η bound."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from device_profiles import get_profile
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import Origin, build, make_block, make_spec
from fedge.model.zoo import create
from fedge.wire.messages import Weights
from methods.reassembly.assemble import assemble, candidate_spec, size_problems, stitched_blocks, stitched_params
from methods.reassembly.blocks import split_blocks

pytestmark = pytest.mark.timeout(120)
SHAPE = (1, 28, 28)


@pytest.fixture(scope="module")
def pools(zoo_uploads):
    """Client "<model>" uploads a seeded random-weight zoo model; its blocks, by model name."""
    return {name: split_blocks(name, Weights(w.spec.with_origin(name), w.state)) for name, w in zoo_uploads.items()}


def filter_by_size(candidates, client_spec, eta, profile=None):
    """(kept, [(rejected, reasons)]) of `size_problems` over many candidates, in order."""
    problems = [(c, size_problems(c, client_spec, eta, profile)) for c in candidates]
    return [c for c, p in problems if not p], [(c, "; ".join(p)) for c, p in problems if p]


def forward(weights, n=3):
    model = build(weights.spec)
    model.load_state_dict(weights.state)
    with torch.no_grad():
        return model.eval()(torch.randn(n, *weights.spec.input_shape, generator=torch.Generator().manual_seed(0)))


def test_a_clients_own_blocks_give_its_own_model_without_stitches(pools):
    blocks = pools["cnn4"]
    weights, stitches = assemble("own", blocks, SHAPE, 10, np.random.default_rng(0))
    assert stitches == ()
    assert weights.spec.blocks == create("cnn4", SHAPE, 10).with_origin("cnn4").blocks
    for b in blocks:
        for key, tensor in b.state.items():
            copy = weights.state[f"blocks.{b.index}.{key}"]
            assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()


def test_stitches_go_exactly_where_shapes_differ(pools):
    c1, c4 = pools["cnn1"], pools["cnn4"]
    # cnn1.cov1 → (16,14,14) | cnn4.cov3 takes (32,14,14) → (64,14,14) → cnn4.cov4 → (64,7,7)
    # | cnn1.fc1 takes (32,7,7) → (128,) → cnn1.fc2 → (10,)
    weights, stitches = assemble("mix", [c1[0], c4[2], c4[3], c1[2], c1[3]], SHAPE, 10, np.random.default_rng(0))
    assert stitches == (1, 4)
    assert [b.name for b in weights.spec.blocks] == ["cov1", "stitch0", "cov3", "cov4", "stitch1", "fc1", "fc2"]
    assert weights.spec.blocks[1].in_shape == (16, 14, 14) and weights.spec.blocks[1].out_shape == (32, 14, 14)
    assert weights.spec.blocks[4].in_shape == (64, 7, 7) and weights.spec.blocks[4].out_shape == (32, 7, 7)
    assert [b.origin.client for b in weights.spec.blocks] == ["cnn1", None, "cnn4", "cnn4", None, "cnn1", "cnn1"]
    # 1×1 conv stitches: 16·32 + 32 = 544 and 64·32 + 32 = 2080 parameters
    assert weights.spec.blocks[1].params == 544 and weights.spec.blocks[4].params == 2080
    assert weights.spec.params == sum(b.spec.params for b in [c1[0], c4[2], c4[3], c1[2], c1[3]]) + 544 + 2080
    assert forward(weights).shape == (3, 10)


def test_every_seam_between_blocks_of_different_models_gets_a_stitch_even_when_shapes_match(pools):
    c2, c3 = pools["cnn2"], pools["cnn3"]
    # cnn2.cov1 → (16,14,14) = cnn3.cov2's input; cnn3.cov2 → cnn3.cov3 consecutive; cnn3.cov3 (64,7,7) → cnn2.cov3
    # wants (32,7,7): a stitch by shape. The first seam matches in shape and still gets an identity stitch.
    blocks = [c2[0], c3[1], c3[2], c2[2], c2[3], c2[4]]
    assert c2[0].spec.out_shape == c3[1].spec.in_shape
    weights, stitches = assemble("seams", blocks, SHAPE, 10, np.random.default_rng(0))
    assert [b.name for b in weights.spec.blocks] == ["cov1", "stitch0", "cov2", "cov3", "stitch1", "cov3", "fc1", "fc2"]
    assert stitches == (1, 4)
    identity = weights.state["blocks.1.0.proj.weight"]
    assert torch.equal(identity[:, :, 0, 0], torch.eye(16)) and not weights.state["blocks.1.0.proj.bias"].any()
    # ReLU(I·x + 0) on a ReLU block's output: the stitched pair computes exactly what the two blocks do alone
    model = build(weights.spec).eval()
    model.load_state_dict(weights.state)
    x = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model.run_block(1, model.run_block(0, x)), model.run_block(0, x))


def test_a_models_own_blocks_out_of_order_or_skipped_are_seams_too(pools):
    c3 = pools["cnn3"]
    # cnn3.cov3 (64,7,7) → cnn3.cov4 is consecutive: none; skipping cov4 to cov5 needs (64,4,4) vs (64,7,7): a
    # stitch by shape; starting at block 1 (not the model's first) stitches the input.
    _, none = assemble("own", c3, SHAPE, 10, np.random.default_rng(0))
    assert none == ()
    weights, stitches = assemble("skip", [c3[0], c3[2]] + c3[3:], SHAPE, 10, np.random.default_rng(0))
    assert stitches == (1,) and weights.spec.blocks[1].in_shape == (16, 14, 14)
    _, late = assemble("late", c3[1:], SHAPE, 10, np.random.default_rng(0))
    assert late == (0,)


def test_stitches_at_the_input_and_before_the_classes(pools):
    c4 = pools["cnn4"]
    weights, stitches = assemble("ends", [c4[2], c4[7]], SHAPE, 10, np.random.default_rng(0))
    # input (1,28,28) → cov3's (32,14,14); cov3's (64,14,14) → fc2's (256,); fc2's (128,) → (10,)
    assert stitches == (0, 2, 4)
    shapes = [(b.in_shape, b.out_shape) for i, b in enumerate(weights.spec.blocks) if i in stitches]
    assert shapes == [((1, 28, 28), (32, 14, 14)), ((64, 14, 14), (256,)), ((128,), (10,))]
    assert weights.spec.blocks[0].params == 1 * 32 + 32
    assert weights.spec.blocks[4].params == 128 * 10 + 10
    assert forward(weights).shape == (3, 10)


def test_stitch_weights_are_fresh_small_and_seeded(pools):
    blocks = [pools["cnn1"][0], pools["cnn4"][2]] + pools["cnn4"][3:]
    a, stitches = assemble("x", blocks, SHAPE, 10, np.random.default_rng(7))
    b, _ = assemble("x", blocks, SHAPE, 10, np.random.default_rng(7))
    c, _ = assemble("x", blocks, SHAPE, 10, np.random.default_rng(8))
    keys = [k for k in a.state if k.startswith(f"blocks.{stitches[0]}.")]
    assert sorted(keys) == ["blocks.1.0.proj.bias", "blocks.1.0.proj.weight"]
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert not torch.equal(a.state[keys[1]], c.state[keys[1]])
    bound = 1 / 16**0.5  # U(±1/√fan_in), fan_in = 16 input channels of the 1×1 conv
    assert a.state[keys[1]].abs().max() <= bound and a.state[keys[1]].dtype == torch.float32


def test_training_the_candidate_leaves_the_pool_alone(pools):
    block = pools["cnn1"][3]
    before = {k: v.clone() for k, v in block.state.items()}
    weights, _ = assemble("x", pools["cnn1"], SHAPE, 10, np.random.default_rng(0))
    for tensor in weights.state.values():
        tensor.add_(1)
    assert all(torch.equal(block.state[k], before[k]) for k in before)


@pytest.mark.parametrize("seed", range(10))
def test_stitched_params_equals_the_assembled_models_params(pools, seed):
    rng = np.random.default_rng(seed)
    every = [b for blocks in pools.values() for b in blocks]
    blocks = [every[i] for i in rng.choice(len(every), size=int(rng.integers(1, 6)), replace=False)]
    weights, stitches = assemble("x", blocks, SHAPE, 10, rng)
    assert stitched_params(blocks, SHAPE, 10) == weights.spec.params
    assert sum(p.numel() for p in build(weights.spec).parameters()) == weights.spec.params
    assert len(weights.spec.blocks) == len(blocks) + len(stitches)


def tiny(name, widths):
    """Flatten + linear layers on a (1,3,3) input; block i is one linear layer."""
    blocks = [("b0", [L("flatten"), L("linear", {"out_features": widths[0]})])]
    blocks += [(f"b{i}", [L("linear", {"out_features": w})]) for i, w in enumerate(widths[1:], 1)]
    return make_spec(name, (1, 3, 3), widths[-1], blocks)


def test_a_candidate_exactly_at_the_bound_is_kept():
    client = tiny("client", [10])  # 9·10 + 10 = 100 parameters
    other = tiny("other", [5, 10]).blocks  # 9·5 + 5 = 50 and 5·10 + 10 = 60: 110 = 1.1·100
    assert client.params == 100 and stitched_params(other, (1, 3, 3), 10) == 110
    kept, rejected = filter_by_size([other], client, eta=0.1)
    assert kept == [other] and rejected == []
    kept, rejected = filter_by_size([other], client, eta=0.09)
    assert kept == [] and rejected[0][0] == other and "110 > (1+η)|w|" in rejected[0][1]
    assert filter_by_size([other], client, eta=None) == ([other], [])


def test_the_device_profile_is_enforced_too(pools):
    client = create("cnn1", SHAPE, 10)
    small, big = pools["cnn1"], pools["mobilenet_v3"]  # 215,370 / 1,527,818 params; 3.0M / 14.7M MACs
    profile = get_profile("rpi-zero-2w")  # max_params 800,000, max_macs 9,200,000
    kept, rejected = filter_by_size([small, big], client, eta=100.0, profile=profile)
    assert kept == [small] and [c for c, _ in rejected] == [big]
    assert "does not fit profile 'rpi-zero-2w': params 1,527,818 > max_params 800,000" in rejected[0][1]
    assert "macs 14,701,896 > max_macs 9,200,000" in rejected[0][1]
    assert "(1+η)|w|" not in rejected[0][1]  # 1.5M is within (1+100)·215k


@pytest.mark.parametrize("seed", range(25))
def test_no_kept_candidate_breaks_the_eta_bound(pools, seed):
    rng = np.random.default_rng(seed)
    names = sorted(pools)
    client_name = names[int(rng.integers(len(names)))]
    client = create(client_name, SHAPE, 10)
    every = [b for blocks in pools.values() for b in blocks]
    candidates = [
        [every[i] for i in sorted(rng.choice(len(every), size=int(rng.integers(1, 7)), replace=False))]
        for _ in range(30)
    ]
    candidates.append(pools[client_name])  # its own model: exactly |w|, kept for any η >= 0
    eta = float(rng.choice([0.0, 0.1, 0.5, 2.0, -0.5]))
    kept, rejected = filter_by_size(candidates, client, eta)
    assert len(kept) + len(rejected) == len(candidates)
    bound = (1 + Fraction(repr(eta))) * client.params
    assert all(stitched_params(c, SHAPE, 10) <= bound for c in kept)
    assert all(stitched_params(c, SHAPE, 10) > bound for c, _ in rejected)
    assert (pools[client_name] in kept) == (eta >= 0)


def test_bad_input_is_refused(pools):
    with pytest.raises(ValueError, match="no blocks"):
        assemble("empty", [], SHAPE, 10, np.random.default_rng(0))
    with pytest.raises(ValueError, match="eta"):
        filter_by_size([pools["cnn1"]], create("cnn1", SHAPE, 10), eta=-1.0)


def test_a_prefix_is_sized_without_the_stitch_to_the_classes(pools):
    prefix = [pools["cnn1"][0], pools["cnn4"][2]]
    chain, stitches = stitched_blocks(prefix, SHAPE, None)
    full, _ = candidate_spec("c", prefix, SHAPE, 10)
    assert stitches == (1,) and chain == list(full.blocks[:-1])  # the candidate's last block maps to the classes
    assert sum(b.params for b in chain) + full.blocks[-1].params == full.params


def test_the_stitch_that_makes_the_logits_does_not_clip_them():
    hidden = make_block("fc", [L("linear", {"out_features": 6}), L("relu")], (12,), Origin("m", "0", 0))
    spec, stitches = candidate_spec("c", [hidden], (12,), 3)
    assert stitches == (1,) and spec.blocks[1].layers[0].args == {"out_shape": [3], "relu": False}
    torch.manual_seed(0)
    logits = build(spec)(torch.randn(64, 12))
    assert bool((logits < 0).any())
