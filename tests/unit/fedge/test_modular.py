"""FedMN's modular network (methods/fedmn/modular.py): the units of a layer are distinct, Eq. (11) on hand-built masks
(the
no-input case included), which blocks a route reaches and uses, the forced path is the most likely chain, forward
runs exactly the route (straight-through gates included), and what a route exchanges."""

import dataclasses
import itertools
import math

import pytest
import torch

from device_profiles import fits, get_profile
from fedge.model.spec import build, tensor_shapes
from fedge.model.zoo import create
from methods.fedmn.modular import (
    ROUTER,
    Layout,
    best_path,
    block_of,
    downloaded,
    eq11,
    has_path,
    layout_of,
    net_of,
    reachable,
    router_has_batchnorm,
    router_macs,
    uploaded,
    used_blocks,
    with_path,
)

pytestmark = pytest.mark.timeout(60)
SPEC = create("fedmn_2x2x2_fc", (1, 4, 4), 10)
LAYOUT = Layout((2, 2, 2))


def route(*paths: int, layout: Layout = LAYOUT) -> list[bool]:
    on = [False] * layout.paths
    for p in paths:
        on[p] = True
    return on


def chain(layout: Layout, blocks: list[int]) -> list[int]:
    """The paths of the chain through block blocks[l] of every layer, then to the output."""
    paths = [layout.path(layer, blocks[layer - 1], blocks[layer - 2]) for layer in range(2, layout.layers + 1)]
    return [*paths, layout.output_path(blocks[-1])]


def test_the_layout_counts_the_papers_paths():
    assert LAYOUT.paths == 2 * 2 + 2 * 2 + 2  # E = Σ n_l n_{l+1} + n_L (§II-A)
    assert Layout((3, 3, 3)).paths == 21 and Layout((1, 4, 3)).paths == 4 + 12 + 3
    every = [LAYOUT.path(layer, j, k) for layer in (2, 3) for j in range(2) for k in range(2)]
    assert every + [LAYOUT.output_path(j) for j in range(2)] == list(range(LAYOUT.paths))
    with pytest.raises(ValueError, match="at least two"):
        Layout((2,))


def test_the_units_of_one_layer_have_distinct_storage_and_initial_values():
    net = net_of(build(SPEC))
    for units in [list(net.encoders), *[list(layer) for layer in net.layers]]:
        for a, b in itertools.combinations(units, 2):
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                assert p.data_ptr() != q.data_ptr(), name
                assert not torch.equal(p, q), name
    # and every tensor of the state is its own (no module shared by reference, original-code-notes §3.1)
    state = build(SPEC).state_dict()
    assert len({t.data_ptr() for t in state.values()}) == len(state)


def test_eq11_on_hand_built_masks():
    a, b, c = (torch.full((3, 4), v) for v in (1.0, 2.0, 6.0))
    assert torch.equal(eq11([a, b, c], torch.tensor([1.0, 0.0, 1.0])), torch.full((3, 4), 3.5))
    assert torch.equal(eq11([a, b, c], torch.tensor([1.0, 1.0, 1.0])), torch.full((3, 4), 3.0))
    assert torch.equal(eq11([a, b, c], torch.tensor([0.0, 1.0, 0.0])), b)
    assert torch.equal(eq11([a, b, c], torch.tensor([True, False, True])), torch.full((3, 4), 3.5))
    assert torch.equal(eq11([a, b, c], torch.zeros(3)), torch.zeros(3, 4))  # no input: 0, not NaN


def test_eq11_straight_through_gates_give_the_hard_value_and_the_soft_gradient():
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    soft = torch.tensor([0.7, 0.4], requires_grad=True)
    gates = torch.tensor([1.0, 0.0]) + (soft - soft.detach())
    out = eq11([a, b], gates)
    assert torch.equal(out, a)  # exactly the hard route's mean
    out.sum().backward()
    # ∂/∂C_k of Σ C ũ / Σ C at C = (1, 0): (ũ_k − u) / Σ C, summed over the batch and features
    assert torch.allclose(soft.grad, torch.stack([(a - a).sum(), (b - a).sum()]))
    assert soft.grad[1] != 0  # the path that is off learns whether it should be on


def test_reachable_and_used_blocks_of_hand_built_routes():
    # encoder 0 → block 2.1 → block 3.0 → output; encoder 1 → block 2.0, which feeds nothing
    r = route(LAYOUT.path(2, 1, 0), LAYOUT.path(3, 0, 1), LAYOUT.output_path(0), LAYOUT.path(2, 0, 1))
    assert reachable(LAYOUT, r) == {(1, 0), (1, 1), (2, 1), (2, 0), (3, 0)}
    assert used_blocks(LAYOUT, r) == {(1, 0), (2, 1), (3, 0)}
    assert has_path(LAYOUT, r)
    # block 3.1 is fed only by block 2.0, which nothing feeds in this route: unreachable, so unused
    r = route(LAYOUT.path(3, 1, 0), LAYOUT.output_path(1), LAYOUT.path(2, 1, 1))
    assert (3, 1) not in reachable(LAYOUT, r) and used_blocks(LAYOUT, r) == set()
    assert not has_path(LAYOUT, r) and not has_path(LAYOUT, route())
    assert used_blocks(LAYOUT, [True] * LAYOUT.paths) == set(LAYOUT.blocks())


def test_the_forced_path_is_the_most_likely_chain():
    layout = Layout((2, 3, 2))
    logits = torch.randn(layout.paths, generator=torch.Generator().manual_seed(3))
    logp = torch.nn.functional.logsigmoid(logits.double())
    chains = [chain(layout, list(c)) for c in itertools.product(range(2), range(3), range(2))]
    best = max(chains, key=lambda c: float(logp[c].sum()))
    assert sorted(best_path(layout, logits)) == sorted(best)
    forced = with_path(layout, torch.zeros(layout.paths, dtype=torch.bool), logits)
    assert sorted(torch.nonzero(forced).flatten().tolist()) == sorted(best)
    connected = torch.tensor(route(*chain(layout, [1, 2, 0]), layout=layout))
    assert torch.equal(with_path(layout, connected, logits), connected)  # a route with a path stays as it is


def test_eval_forward_runs_exactly_the_route():
    torch.manual_seed(0)
    model = build(SPEC).eval()
    net = net_of(model)
    r = route(*chain(LAYOUT, [1, 0, 1]))
    net.set_routing(torch.tensor(r))
    x = torch.randn(5, 1, 4, 4)
    manual = net.layers[1][1](net.layers[0][0](net.encoders[1](x)))
    assert torch.allclose(model(x), manual)
    before = model(x)
    with torch.no_grad():
        for unused in (net.encoders[0], net.layers[0][1], net.layers[1][0]):
            for p in unused.parameters():
                p.add_(1.0)
    assert torch.equal(model(x), before)  # blocks off the route do not count
    with torch.no_grad():
        net.layers[0][0][0].bias.add_(1.0)
    assert not torch.equal(model(x), before)


def test_two_paths_into_a_block_average_its_predecessors():
    torch.manual_seed(0)
    model = build(SPEC).eval()
    net = net_of(model)
    r = route(LAYOUT.path(2, 0, 0), LAYOUT.path(2, 0, 1), LAYOUT.path(3, 0, 0), LAYOUT.path(3, 1, 0))
    r[LAYOUT.output_path(0)] = r[LAYOUT.output_path(1)] = True
    net.set_routing(torch.tensor(r))
    x = torch.randn(3, 1, 4, 4)
    u = net.layers[0][0]((net.encoders[0](x) + net.encoders[1](x)) / 2)
    assert torch.allclose(model(x), (net.layers[1][0](u) + net.layers[1][1](u)) / 2, atol=1e-6)


def test_the_routing_survives_a_state_dict_round_trip():
    model = build(SPEC)
    r = torch.tensor(route(*chain(LAYOUT, [0, 1, 1])))
    net_of(model).set_routing(r)
    other = build(SPEC)
    other.load_state_dict(model.state_dict())
    assert net_of(other).route == tuple(r.tolist())


def test_training_with_straight_through_gates_runs_the_hard_route_and_trains_only_its_blocks():
    torch.manual_seed(0)
    model = build(SPEC).train()
    net = net_of(model)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # compare forward values without dropout's draws
    r = route(*chain(LAYOUT, [0, 1, 0]))
    soft = torch.full((LAYOUT.paths,), 0.5, requires_grad=True)
    net.gates = (tuple(r), torch.tensor(r, dtype=torch.float) + (soft - soft.detach()))
    x = torch.randn(4, 1, 4, 4)
    out = model(x)
    net.gates = (tuple(r), torch.tensor(r, dtype=torch.float))
    assert torch.equal(out, model(x))  # forward is exactly the hard route
    out.sum().backward()
    used = used_blocks(LAYOUT, r)
    for name, p in model.named_parameters():
        part = block_of(name)
        if part in used:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name  # an inactive block gets no input and no gradient; the router is not run
    # off paths between blocks that run get a gradient: encoder 1 → block 2.1 is off but feeds a used block
    assert soft.grad[LAYOUT.path(2, 1, 1)] != 0 and soft.grad[LAYOUT.path(3, 1, 1)] == 0


def test_a_route_downloads_what_it_reaches_and_uploads_what_it_used():
    names = list(tensor_shapes(SPEC))
    r = route(*chain(LAYOUT, [1, 1, 0]))
    down, up = downloaded(names, LAYOUT, r), uploaded(names, LAYOUT, r)
    # every encoder is reached (its input is x); encoder 0 feeds nothing on this route, so it is not uploaded
    assert {block_of(n) for n in down} == {ROUTER, (1, 0), (1, 1), (2, 1), (3, 0)}
    assert {block_of(n) for n in up} == {ROUTER, (1, 1), (2, 1), (3, 0)}
    assert not any(n.endswith("routing") for n in down)
    everything = {n for n in names if block_of(n) is not None}
    assert (
        set(downloaded(names, LAYOUT, [True] * LAYOUT.paths)) == set(uploaded(names, LAYOUT, [True] * 10)) == everything
    )
    assert not router_has_batchnorm(SPEC) and router_has_batchnorm(create("fedmn_1x2x2_mobilenet_v2", (3, 8, 8), 10))


def test_the_spec_counts_the_whole_pool_and_the_router_apart():
    spec = create("fedmn_3x3x3_cnn1", (3, 16, 16), 10)
    model = build(spec)
    assert spec.params == sum(p.numel() for p in model.parameters())
    net = net_of(model)
    encoder = create("cnn1", (3, 16, 16), 10)
    assert layout_of(spec).paths == 21
    enc_macs = sum(b.macs for b in encoder.blocks[:-1])
    assert spec.macs == 3 * enc_macs + 3 * 128 * 128 + 3 * 128 * 10
    assert router_macs(spec) == enc_macs + 128 * 128 + 10 * 64 + (128 + 64) * 21
    assert sum(p.numel() for p in net.router.parameters()) == spec.params - sum(
        p.numel() for n, p in model.named_parameters() if ".router." not in n
    )
    assert math.prod(net.routing.shape) == 21 and net.routing.dtype == torch.bool


def test_a_device_must_hold_the_whole_pool_and_its_router():
    """A client holds every block and the router, so its profile is checked against all of them (a route uses
    fewer): one parameter or MAC fewer than the pool's is refused."""
    spec = create("fedmn_2x2x2_cnn1", (3, 32, 32), 10)
    profile = dataclasses.replace(get_profile("jetson-orin-nano"), max_params=spec.params, max_macs=spec.macs)
    assert fits(spec, profile).ok
    for limit in ("max_params", "max_macs"):
        tight = dataclasses.replace(profile, **{limit: getattr(profile, limit) - 1})
        assert not fits(spec, tight).ok
