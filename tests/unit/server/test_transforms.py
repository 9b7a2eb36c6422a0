"""FedTrans §4.1 widen and deepen: function preservation on the zoo, spec counts, lineage, cell_match, errors,
symmetry breaking and determinism."""

import pytest
import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

import methods.fedtrans.transforms as T
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import build, make_spec
from fedge.model.zoo import create
from methods.fedtrans.transforms import Cell, TransformError, can_deepen, can_widen, cells, deepen, widen

pytestmark = pytest.mark.timeout(300)
CNNS = ["cnn1", "cnn2", "cnn3", "cnn4"]
SHAPES = [(1, 28, 28), (3, 32, 32)]
CASES = [(name, shape) for name in CNNS for shape in SHAPES]
TOL = 1e-5


def _parent(name, shape=(3, 32, 32)):
    """A zoo model at `shape` with weights seeded 0 (see _parent_state)."""
    torch.manual_seed(0)
    spec = create(name, shape, 10)
    return spec, _parent_state(spec)


def _parent_state(spec):
    """Seeded-by-caller weights of `spec` with random BatchNorm running statistics and affine parameters."""
    module = build(spec)
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.25, 4.0)
            m.weight.data.normal_()
            m.bias.data.normal_()
    return module.state_dict()


def _run(spec, state, x):
    module = build(spec).eval()
    module.load_state_dict(state)
    with torch.no_grad():
        return module(x)


def _max_diff(parent, child, shape):
    x = torch.randn(8, *shape, generator=torch.Generator().manual_seed(1))
    return (_run(child.spec, child.state, x) - _run(*parent, x)).abs().max().item()


@pytest.mark.parametrize("name,shape", CASES, ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_widen_preserves_the_function_of_every_widenable_cell(name, shape):
    parent = _parent(name, shape)
    widenable = [c for c in cells(parent[0]) if can_widen(parent[0], c)]
    assert widenable == cells(parent[0])  # every cell of a zoo CNN has a conv/linear consumer
    for cell in widenable:
        child = widen(*parent, cell, torch.Generator().manual_seed(7))
        assert _max_diff(parent, child, shape) <= TOL, cell.name


@pytest.mark.parametrize("name,shape", CASES, ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_deepen_preserves_the_function_of_every_deepenable_cell(name, shape):
    parent = _parent(name, shape)
    deepenable = [c for c in cells(parent[0]) if can_deepen(parent[0], c)]
    assert deepenable == cells(parent[0])  # every zoo CNN cell is followed by a ReLU in its block
    for cell in deepenable:
        child = deepen(*parent, cell)
        assert _max_diff(parent, child, shape) <= TOL, cell.name


def test_widen_copies_batchnorm_statistics():
    spec, state = _parent("cnn4")
    child = widen(spec, state, Cell(0, 0), torch.Generator().manual_seed(0))  # conv → bn2d at blocks.0.1
    for t in ("weight", "bias", "running_mean", "running_var"):
        old, new = state[f"blocks.0.1.{t}"], child.state[f"blocks.0.1.{t}"]
        assert torch.equal(new, torch.cat([old, old]))
    assert torch.equal(child.state["blocks.0.1.num_batches_tracked"], state["blocks.0.1.num_batches_tracked"])
    assert _max_diff((spec, state), child, spec.input_shape) <= TOL


def test_widen_crosses_a_flatten_duplicating_whole_channel_runs():
    spec, state = _parent("cnn1")  # blocks.1.0 conv (32 ch) → relu → pool → flatten → linear on 32·8·8
    child = widen(spec, state, Cell(1, 0), torch.Generator().manual_seed(0))
    w, new = state["blocks.2.1.weight"].reshape(128, 32, 64), child.state["blocks.2.1.weight"].reshape(128, 64, 64)
    a = new[:, :32] / w  # one share per channel, constant over its 64 columns and over the outputs
    assert torch.allclose(a, a[:1, :, :1].expand_as(a), atol=1e-5)
    assert torch.allclose(new[:, :32] + new[:, 32:], w, atol=1e-6)
    lo, hi = T.SPLIT_RANGE
    assert bool(((a[0, :, 0] >= lo - 1e-6) & (a[0, :, 0] <= hi + 1e-6)).all())


def test_chain_widen_deepen_widen_stays_exact():
    spec, state = _parent("cnn4")
    rng = torch.Generator().manual_seed(3)
    first = widen(spec, state, Cell(2, 0), rng)
    second = deepen(first.spec, first.state, Cell(2, 0))  # inserts blocks.2.3 (conv) and blocks.2.4 (relu)
    assert Cell(2, 3) in cells(second.spec)
    third = widen(second.spec, second.state, Cell(2, 3), rng)  # widen the inserted cell itself
    fourth = widen(third.spec, third.state, Cell(7, 0), rng)
    for step in (first, second, third, fourth):
        assert _max_diff((spec, state), step, spec.input_shape) <= TOL


@pytest.mark.parametrize("name", CNNS)
def test_transformed_spec_counts_params_and_macs_of_the_built_module(name):
    spec, state = _parent(name)
    c = cells(spec)
    chain = [widen(spec, state, c[0], torch.Generator().manual_seed(0))]
    chain.append(deepen(chain[-1].spec, chain[-1].state, c[-1]))
    chain.append(widen(chain[-1].spec, chain[-1].state, cells(chain[-1].spec)[-1], torch.Generator()))
    for child in chain:
        module = build(child.spec).eval()
        assert child.spec.params == sum(p.numel() for p in module.parameters())
        with FlopCounterMode(display=False) as counter:
            module(torch.randn(1, *spec.input_shape))
        assert child.spec.macs == counter.get_total_flops() // 2
    assert chain[-1].spec.params > spec.params and chain[-1].spec.macs > spec.macs


def test_widen_lineage_shapes_and_cell_match():
    spec, state = _parent("cnn1")  # cells blocks.0.0 (conv 16), blocks.1.0 (conv 32, consumer), blocks.2.1 (fc1)
    child = widen(spec, state, Cell(0, 0), torch.Generator().manual_seed(0))
    assert set(child.lineage) == set(child.state) == set(build(child.spec).state_dict())
    assert all(child.lineage[k] == k for k in child.state)
    assert child.state["blocks.0.0.weight"].shape == (32, 3, 5, 5)
    assert child.state["blocks.0.0.bias"].shape == (32,)
    assert child.state["blocks.1.0.weight"].shape == (32, 32, 5, 5)
    for k in ("blocks.2.1.weight", "blocks.2.1.bias", "blocks.3.0.weight", "blocks.3.0.bias", "blocks.1.0.bias"):
        assert torch.equal(child.state[k], state[k])
    assert child.cell_match == {
        "blocks.0.0": (16 * 3 * 25 + 16) / (32 * 3 * 25 + 32),  # = 0.5: producer, weight and bias doubled
        "blocks.1.0": (32 * 16 * 25 + 32) / (32 * 32 * 25 + 32),  # consumer: input columns doubled, bias kept
        "blocks.2.1": 1.0,
    }
    assert child.spec.name == "cnn1+wide"


def test_deepen_lineage_shifts_names_and_marks_the_inserted_cell():
    spec, state = _parent("cnn4")  # blocks.0: conv, bn2d, relu → insert conv at 3, relu at 4
    child = deepen(spec, state, Cell(0, 0))
    assert [ly.type for ly in child.spec.blocks[0].layers] == ["conv2d", "bn2d", "relu", "conv2d", "relu"]
    assert set(child.lineage) == set(child.state) == set(build(child.spec).state_dict())
    assert child.lineage["blocks.0.3.weight"] is None and child.lineage["blocks.0.3.bias"] is None
    assert [k for k, v in child.lineage.items() if v is None] == ["blocks.0.3.weight", "blocks.0.3.bias"]
    for k, src in child.lineage.items():
        if src is not None:
            assert torch.equal(child.state[k], state[src])
    assert child.cell_match["blocks.0.3"] == 0.0
    assert all(v == 1.0 for k, v in child.cell_match.items() if k != "blocks.0.3")
    assert torch.equal(child.state["blocks.0.3.bias"], torch.zeros(32))

    spec, state = _parent("cnn3")  # fc2 in block 6: linear, relu; a later layer in the same block would shift
    lin = deepen(spec, state, Cell(5, 1))  # fc1 block: flatten, linear, relu, dropout → dropout moves 3 → 5
    assert [ly.type for ly in lin.spec.blocks[5].layers] == ["flatten", "linear", "relu", "linear", "relu", "dropout"]
    assert torch.equal(lin.state["blocks.5.3.weight"], torch.eye(256))
    assert lin.lineage["blocks.6.0.weight"] == "blocks.6.0.weight"


def _conv(out, k):
    return L("conv2d", {"out_channels": out, "kernel_size": k, "padding": k // 2})


def test_deepen_shifts_weighted_layers_after_it_in_the_block():
    torch.manual_seed(0)
    body = [_conv(4, 3), L("relu6"), _conv(6, 3), L("bn2d"), L("relu"), L("flatten"), L("linear", {"out_features": 5})]
    spec = make_spec("custom", (3, 6, 6), 3, [("body", body), ("head", [L("linear", {"out_features": 3})])])
    parent = (spec, _parent_state(spec))
    child = deepen(*parent, Cell(0, 0))  # insert conv + relu6 at 2 and 3: conv 2 → 4, bn 3 → 5, linear 6 → 8
    assert [ly.type for ly in child.spec.blocks[0].layers][:4] == ["conv2d", "relu6", "conv2d", "relu6"]
    assert child.lineage["blocks.0.4.weight"] == "blocks.0.2.weight"
    assert child.lineage["blocks.0.5.running_var"] == "blocks.0.3.running_var"
    assert child.lineage["blocks.0.8.bias"] == "blocks.0.6.bias"
    assert child.lineage["blocks.1.0.weight"] == "blocks.1.0.weight"
    for k, src in child.lineage.items():
        assert (src is None) == k.startswith("blocks.0.2.")
        assert src is None or torch.equal(child.state[k], parent[1][src])
    assert child.cell_match == {"blocks.0.0": 1.0, "blocks.0.2": 0.0, "blocks.0.4": 1.0, "blocks.0.8": 1.0}
    assert _max_diff(parent, child, spec.input_shape) <= TOL
    wide = widen(*parent, Cell(0, 2), torch.Generator().manual_seed(0))  # conv → bn → relu → flatten → linear
    assert wide.state["blocks.0.6.weight"].shape == (5, 2 * 6 * 36)
    assert _max_diff(parent, wide, spec.input_shape) <= TOL


def test_even_kernel_cannot_be_deepened():
    spec = make_spec(
        "even", (3, 6, 6), 2, [("b", [_conv(4, 2), L("relu"), L("flatten"), L("linear", {"out_features": 2})])]
    )
    assert not can_deepen(spec, Cell(0, 0))
    with pytest.raises(TransformError, match="even kernel"):
        deepen(spec, build(spec).state_dict(), Cell(0, 0))


def test_cell_match_is_in_unit_interval_along_a_chain():
    spec, state = _parent("cnn2")
    t = widen(spec, state, Cell(1, 0), torch.Generator().manual_seed(0))
    t = deepen(t.spec, t.state, Cell(1, 0))
    t = widen(t.spec, t.state, Cell(1, 2), torch.Generator().manual_seed(1))  # the inserted conv, before the pool
    assert set(t.cell_match) == {c.name for c in cells(t.spec)}
    assert all(0.0 <= v <= 1.0 for v in t.cell_match.values())
    assert t.cell_match["blocks.1.2"] == pytest.approx(0.5)


def test_logits_layer_is_not_a_cell_and_transforming_it_raises():
    spec, state = _parent("cnn1")
    assert cells(spec) == [Cell(0, 0), Cell(1, 0), Cell(2, 1)]
    assert Cell(3, 0) not in cells(spec)  # fc2, the classifier
    with pytest.raises(TransformError, match="not a cell"):
        widen(spec, state, Cell(3, 0))
    with pytest.raises(TransformError, match="not a cell"):
        can_deepen(spec, Cell(3, 0))
    assert issubclass(TransformError, ValueError)


def test_a_composite_consumer_blocks_widen():
    spec = create("mobilenet_v1", (3, 32, 32), 10)  # stem conv → bn → relu → depthwise_separable
    state = build(spec).state_dict()
    assert cells(spec) == [Cell(0, 0)]
    assert not can_widen(spec, Cell(0, 0))
    with pytest.raises(TransformError, match="depthwise_separable"):
        widen(spec, state, Cell(0, 0))
    assert can_deepen(spec, Cell(0, 0))


def test_no_relu_after_a_cell_blocks_deepen():
    spec = create("mobilenet_v3", (3, 32, 32), 10)  # stem conv → bn → hardswish (can be negative)
    state = build(spec).state_dict()
    assert not can_deepen(spec, Cell(0, 0))
    with pytest.raises(TransformError, match="no relu"):
        deepen(spec, state, Cell(0, 0))
    assert can_widen(spec, Cell(12, 0))  # head conv → bn → hardswish → avgpool → flatten → linear


def test_a_model_without_plain_layers_has_no_cells():
    spec = make_spec(
        "tiny",
        (3, 8, 8),
        4,
        [("b", [L("depthwise_separable", {"out_channels": 4}), L("adaptive_avgpool"), L("flatten")])],
    )
    assert cells(spec) == []


def test_state_that_does_not_match_the_spec_raises():
    spec, state = _parent("cnn1")
    bad = dict(state)
    bad["blocks.0.0.weight"] = torch.zeros(3, 3)
    with pytest.raises(TransformError, match="state is not that of"):
        widen(spec, bad, Cell(0, 0))
    with pytest.raises(TransformError, match="state is not that of"):
        deepen(spec, {k: v for k, v in state.items() if k != "blocks.0.0.bias"}, Cell(0, 0))


def _copy_gap_after_one_sgd_step(split):
    """Per unit of widened cnn1 blocks.0.0: max |unit j − its copy j + 16| after one SGD step on random data."""
    spec, state = _parent("cnn1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(T, "SPLIT_RANGE", split)
        child = widen(spec, state, Cell(0, 0), torch.Generator().manual_seed(0))
    module = build(child.spec).eval()  # eval: no dropout noise, the gradients alone differ
    module.load_state_dict(child.state)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, *spec.input_shape, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    F.cross_entropy(module(x), y).backward()
    opt.step()
    w = module.state_dict()["blocks.0.0.weight"]
    return (w[:16] - w[16:]).flatten(1).abs().amax(1)


def test_unequal_split_breaks_symmetry_after_one_sgd_step():
    diff = _copy_gap_after_one_sgd_step(T.SPLIT_RANGE)
    assert int((diff > 1e-6).sum()) >= 12  # a unit with no gradient (dead ReLU on this batch) may stay equal
    same = _copy_gap_after_one_sgd_step((0.5, 0.5))  # the control: an equal split stays symmetric
    assert float(same.max()) < 1e-6


def test_same_seed_gives_the_same_state_and_another_seed_a_different_split():
    spec, state = _parent("cnn2")
    a = widen(spec, state, Cell(2, 0), torch.Generator().manual_seed(5))
    b = widen(spec, state, Cell(2, 0), torch.Generator().manual_seed(5))
    c = widen(spec, state, Cell(2, 0), torch.Generator().manual_seed(6))
    assert a.state.keys() == b.state.keys() and all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert not torch.equal(a.state["blocks.3.1.weight"], c.state["blocks.3.1.weight"])
    assert a.spec == b.spec == c.spec


def test_widen_does_not_alias_or_change_the_parent_state():
    spec, state = _parent("cnn1")
    before = {k: v.clone() for k, v in state.items()}
    child = widen(spec, state, Cell(1, 0), torch.Generator().manual_seed(0))
    child.state["blocks.0.0.weight"].add_(1.0)
    assert all(torch.equal(state[k], before[k]) for k in state)
