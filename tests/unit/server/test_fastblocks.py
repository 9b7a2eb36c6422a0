"""Folded, channels-last runners of frozen blocks: the same outputs and stitch gradients, the original untouched."""

import numpy as np
import pytest
import torch
from torch import nn

from fedge.model.spec import SpecModel, build
from fedge.model.weights import load_module
from fedge.model.zoo import MODELS, create
from fedge.wire.messages import Weights
from methods.reassembly.assemble import assemble
from methods.reassembly.blocks import split_blocks
from methods.reassembly.fastblocks import FastBlocks, fast_blocks, fold_batchnorm

pytestmark = pytest.mark.timeout(120)
SHAPES = [(1, 28, 28), (3, 32, 32)]
RTOL, ATOL = 1e-4, 1e-5
BN = (nn.BatchNorm1d, nn.BatchNorm2d)


def random_model(name: str, shape: tuple[int, int, int], seed: int) -> Weights:
    """Zoo model `name` with random weights and non-trivial BN statistics and affine parameters."""
    spec = create(name, shape, 10)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = build(spec)
        for m in module.modules():
            if isinstance(m, BN):
                m.running_mean.uniform_(-1.0, 1.0)
                m.running_var.uniform_(0.1, 3.0)
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.5, 0.5)
    return Weights(spec, {k: v.clone() for k, v in module.state_dict().items()})


def frozen_module(weights: Weights, trainable: tuple[int, ...]) -> SpecModel:
    """What fine-tuning trains: the loaded candidate, frozen and in eval mode outside `trainable`."""
    module = load_module(weights.spec, weights.state).eval()
    for i, block in enumerate(module.blocks):
        block.requires_grad_(i in trainable)
        block.train(i in trainable)
    return module


def candidate(name: str, shape: tuple[int, int, int], cut: int) -> tuple[Weights, tuple[int, ...]]:
    """Blocks 0..cut-1 of one client's `name` and the rest of another's: stitches at the seam (and nowhere else)."""
    a, b = (random_model(name, shape, seed) for seed in (1, 2))
    pool_a = split_blocks("a", Weights(a.spec.with_origin("a"), a.state))
    pool_b = split_blocks("b", Weights(b.spec.with_origin("b"), b.state))
    return assemble("cand", pool_a[:cut] + pool_b[cut:], shape, 10, np.random.default_rng(0))


def bn_count(module: nn.Module, blocks: tuple[int, ...]) -> int:
    return sum(isinstance(m, BN) for i in blocks for m in module.blocks[i].modules())


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_state(before: dict[str, torch.Tensor], module: nn.Module) -> None:
    after = module.state_dict()
    assert set(after) == set(before)
    for k, v in before.items():
        assert torch.equal(after[k], v) and after[k].stride() == v.stride(), k


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(MODELS))
def test_a_fully_frozen_zoo_model_gives_the_same_logits_with_every_batchnorm_folded(name, shape):
    weights = random_model(name, shape, seed=0)
    module = frozen_module(weights, ())
    before = snapshot(module)
    runner = fast_blocks(module, ())
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = module(x), runner(x)
        by_block = x
        for i in range(len(runner.blocks)):
            by_block = runner.run_block(i, by_block)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(by_block, want, rtol=RTOL, atol=ATOL)
    assert bn_count(runner, runner.frozen) == 0  # every zoo BatchNorm directly follows a conv
    convs = [m for m in runner.modules() if isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1)]
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    assert not any(p.requires_grad for p in runner.parameters())
    assert_same_state(before, module)


@pytest.mark.parametrize("name", ["cnn4", "mobilenet_v2"])
def test_the_zoo_models_with_batchnorm_have_it_folded_out_of_their_frozen_blocks(name):
    module = frozen_module(random_model(name, SHAPES[0], seed=0), ())
    everything = tuple(range(len(module.blocks)))
    assert bn_count(module, everything) > 0
    runner = fast_blocks(module, ())
    assert bn_count(runner, everything) == 0
    assert bn_count(module, everything) > 0  # the original keeps its BatchNorms


@pytest.mark.parametrize(
    "name, shape, cut",
    [
        ("cnn4", (1, 28, 28), 3),
        ("cnn4", (3, 32, 32), 1),
        ("mobilenet_v1", (3, 32, 32), 4),
        ("mobilenet_v2", (1, 28, 28), 1),
        ("mobilenet_v2", (3, 32, 32), 6),
        ("mobilenet_v3", (3, 32, 32), 5),
    ],
)
def test_stitch_gradients_through_folded_frozen_blocks_equal_the_originals(name, shape, cut):
    weights, stitches = candidate(name, shape, cut)
    assert stitches == (cut,)
    module = frozen_module(weights, stitches)
    before = snapshot(module)
    runner = fast_blocks(module, stitches)
    assert runner.blocks[cut] is module.blocks[cut]  # the stitch is shared, not copied
    assert bn_count(runner, runner.frozen) == 0
    x = torch.randn(6, *shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (module, runner):
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        h = xg
        for i in range(len(model.blocks)):
            h = model.run_block(i, h)
        (h * torch.linspace(-1.0, 1.0, 10)).sum().backward()
        stitch = {n: p.grad.clone() for n, p in module.blocks[cut].named_parameters()}
        grads.append((h.detach(), xg.grad, stitch))
    (want, want_dx, want_dw), (got, got_dx, got_dw) = grads
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_dx, want_dx, rtol=RTOL, atol=ATOL)
    assert got_dx.is_contiguous()  # channels-last stays inside the frozen blocks, gradients included
    assert want_dw.keys() == got_dw.keys() and want_dw
    for k in want_dw:
        torch.testing.assert_close(got_dw[k], want_dw[k], rtol=RTOL, atol=ATOL)
    assert_same_state(before, module)


def test_an_optimizer_step_through_the_runner_trains_the_originals_stitch():
    weights, stitches = candidate("cnn4", (1, 28, 28), 2)
    module = frozen_module(weights, stitches)
    runner = fast_blocks(module, stitches)
    trained = [p for p in runner.parameters() if p.requires_grad]
    assert {id(p) for p in trained} == {id(p) for p in module.blocks[2].parameters()}
    frozen_before = {k: v for k, v in snapshot(module).items() if not k.startswith("blocks.2.")}
    stitch_before = snapshot(module.blocks[2])
    opt = torch.optim.SGD(trained, lr=0.1)
    runner(torch.randn(4, 1, 28, 28)).square().sum().backward()
    opt.step()
    assert any(not torch.equal(v, stitch_before[k]) for k, v in module.blocks[2].state_dict().items())
    assert all(torch.equal(module.state_dict()[k], v) for k, v in frozen_before.items())


def test_frozen_blocks_stay_in_eval_mode_and_the_runner_refuses_to_export():
    weights, stitches = candidate("mobilenet_v2", (1, 28, 28), 3)
    runner = fast_blocks(frozen_module(weights, stitches), stitches)
    runner.train()
    assert [b.training for b in runner.blocks] == [i in stitches for i in range(len(runner.blocks))]
    assert all(not m.training for i in runner.frozen for m in runner.blocks[i].modules())
    with pytest.raises(TypeError, match="original module"):
        runner.state_dict()
    assert isinstance(runner, FastBlocks)


def test_trainable_indices_outside_the_model_are_refused():
    module = frozen_module(random_model("cnn1", (1, 28, 28), 0), ())
    with pytest.raises(ValueError, match="4 blocks"):
        fast_blocks(module, (4,))


def test_linear_batchnorm1d_pairs_fold_and_batchnorms_without_running_stats_or_a_layer_before_stay():
    torch.manual_seed(0)
    block = nn.Sequential(
        nn.BatchNorm2d(3),  # nothing before it to fold into
        nn.Conv2d(3, 4, 3, padding=1, groups=1, bias=False),
        nn.BatchNorm2d(4, track_running_stats=False),  # batch statistics in eval mode: not foldable
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
    )
    for m in block.modules():
        if isinstance(m, BN):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
            if m.running_mean is not None:
                m.running_mean.uniform_(-1.0, 1.0)
                m.running_var.uniform_(0.1, 3.0)
    block.eval()
    before = snapshot(block)
    folded = fold_batchnorm(block, channels_last=True)
    assert [type(m) for m in folded] == [nn.BatchNorm2d, nn.Conv2d, nn.BatchNorm2d, nn.Flatten, nn.Linear, nn.ReLU]
    x = torch.randn(7, 3, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), block(x), rtol=RTOL, atol=ATOL)
    assert_same_state(before, block)
