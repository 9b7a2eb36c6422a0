"""The fedmn strategy (methods/fedmn/server.py): the warm-up and a client without a route train every path, later rounds
send exactly the route's blocks, aggregation is FedAvg when every block is used and leaves an unused block as it was,
an upload is refused for an inactive block, a wrong shape or another route, the temperature anneals, and the clock
charges the router's passes."""

import math

import pytest
import torch

from device_profiles import get_profile
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result
from fedge.wire.payloads import payload_rejection
from methods.fedmn.modular import (
    NEXT_ROUTE,
    ROUTE,
    ROUTER,
    ROUTING,
    block_of,
    downloaded,
    layout_of,
    router_macs,
    uploaded,
)
from server.aggregation import weighted_average
from server.coordinator import Coordinator, LoopConfig
from server.runlog import RunLog
from server.strategy import StrategyConfig, StrategyError, create_strategy

pytestmark = pytest.mark.timeout(60)
SPEC = create("fedmn_2x2x2_fc", (1, 4, 4), 10)
LAYOUT = layout_of(SPEC)
CONFIG = StrategyConfig(local_epochs=1, batch_size=4, lr=1e-2, seed=0)
ALL = torch.ones(LAYOUT.paths, dtype=torch.bool)


def fleet(n=3, spec=SPEC):
    return {str(i): ClientInfo(str(i), spec.with_origin(str(i)), "rpi-4", 10 * (i + 1), 5) for i in range(n)}


def strategy(**options):
    s = create_strategy("fedmn", CONFIG, None, options)
    s.setup(fleet())
    return s


def chain(encoder, middle, out):
    r = torch.zeros(LAYOUT.paths, dtype=torch.bool)
    r[[LAYOUT.path(2, middle, encoder), LAYOUT.path(3, out, middle), LAYOUT.output_path(out)]] = True
    return r


def reply(task, cid, seed, next_route=None, n=None):
    """The client's reply to `task`: the tensors of its route's used blocks and the router, moved by seeded noise of
    1/10 their scale, the task's route, and a next and most likely route."""
    gen = torch.Generator().manual_seed(seed)
    used = uploaded(list(task.tensors), LAYOUT, task.tensors[ROUTE].tolist())
    tensors = {
        k: (v + 0.1 * v.abs().mean() * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone())
        for k, v in task.tensors.items()
        if k in used
    }
    nxt = chain(0, 0, 0) if next_route is None else next_route
    tensors |= {ROUTE: task.tensors[ROUTE].clone(), NEXT_ROUTE: nxt, ROUTING: nxt.clone()}
    return Result(cid, task.round, task.type, n or 10 * (int(cid) + 1), {"train_loss": 1.0}, tensors=tensors)


def test_warmup_and_unknown_clients_train_every_path_and_later_rounds_send_exactly_the_route():
    s = strategy(warmup_rounds=1)
    names = list(s.global_model.state)
    tasks = s.plan(0, ["0", "1", "2"])
    for task in tasks.values():
        assert torch.equal(task.tensors[ROUTE], ALL) and task.config["learn_routing"] is False
        assert set(task.tensors) - {ROUTE} == set(downloaded(names, LAYOUT, ALL.tolist()))
    routes = {"0": chain(0, 0, 0), "1": chain(1, 1, 1)}
    s.aggregate(0, {cid: reply(tasks[cid], cid, 1, routes[cid]) for cid in ("0", "1")})
    again = s.plan(1, ["0", "1", "2"])
    assert again["0"].tensors.keys() == s.plan(1, ["0", "1", "2"])["0"].tensors.keys()  # planning twice: same
    for cid, route in routes.items():
        task = again[cid]
        assert torch.equal(task.tensors[ROUTE], route) and task.config["learn_routing"] is True
        assert set(task.tensors) - {ROUTE} == set(downloaded(names, LAYOUT, route.tolist()))
        # the route reaches both encoders (the input feeds every one) and the blocks of its chain
        reached = {"router", (1, 0), (1, 1), (2, int(cid)), (3, int(cid))}
        assert {block_of(n) for n in task.tensors if n != ROUTE} == reached
        expected = s.expects(task, s.clients[cid]).tensors
        assert set(expected) - {ROUTE, NEXT_ROUTE, ROUTING} == set(uploaded(names, LAYOUT, route.tolist()))
    # client 2 sent nothing in round 0: the server knows no route of it, so it trains every path
    assert torch.equal(again["2"].tensors[ROUTE], ALL) and again["2"].config["learn_routing"] is False
    assert s.plan(0, ["0"])["0"].config["learn_routing"] is False  # a warm-up round ignores known routes


def test_aggregation_is_fedavg_when_every_block_is_used():
    s = strategy()
    tasks = s.plan(0, ["0", "1", "2"])
    replies = {cid: reply(task, cid, int(cid)) for cid, task in tasks.items()}
    before = s.global_model.state
    s.aggregate(0, replies)
    uploaded = [{k: v for k, v in replies[c].tensors.items() if k not in (ROUTE, NEXT_ROUTE, ROUTING)} for c in "012"]
    fedavg = weighted_average(uploaded, [10, 20, 30])
    for name, value in s.global_model.state.items():
        if name in fedavg:
            assert torch.allclose(value, fedavg[name], atol=1e-6), name
        else:
            assert torch.equal(value, before[name]), name  # the private buffers are never exchanged


def test_a_block_nobody_used_keeps_its_value_and_a_shared_one_averages_over_its_users():
    s = strategy(max_client_share=1.0)  # plain example weights
    s.routes = {"0": chain(0, 0, 0), "1": chain(0, 0, 1), "2": chain(1, 0, 1)}
    before = {k: v.clone() for k, v in s.global_model.state.items()}
    tasks = s.plan(1, ["0", "1", "2"])
    replies = {cid: reply(task, cid, 10 + int(cid)) for cid, task in tasks.items()}
    s.aggregate(1, replies)
    after = s.global_model.state
    users = {(1, 0): "01", (1, 1): "2", (2, 0): "012", (2, 1): "", (3, 0): "0", (3, 1): "12", "router": "012"}
    for name, value in after.items():
        part = block_of(name)
        if part is None:
            continue
        who = users[part]
        if not who:
            assert torch.equal(value, before[name]), name  # block 2.1: nobody used it
            continue
        weights = [10 * (int(c) + 1) for c in who]  # the shares are normalised over the users only
        expected = sum(w * replies[c].tensors[name] for c, w in zip(who, weights)) / sum(weights)
        assert torch.allclose(value, expected, atol=1e-6), name
    assert torch.equal(s.routes["0"], chain(0, 0, 0))  # the replies' next routes are kept


def test_the_share_cap_holds_on_every_block_among_its_users():
    s = strategy()  # max_client_share 0.5
    s.routes = {"0": chain(0, 0, 0), "1": chain(0, 0, 0), "2": chain(1, 1, 1)}
    tasks = s.plan(1, ["0", "1", "2"])
    replies = {cid: reply(task, cid, 20 + int(cid), n=10**6 if cid == "0" else 10) for cid, task in tasks.items()}
    s.aggregate(1, replies)
    name = next(n for n in s.global_model.state if block_of(n) == (2, 0))  # used by the liar 0 and client 1
    expected = (replies["0"].tensors[name] + replies["1"].tensors[name]) / 2  # two users: equal shares
    assert torch.allclose(s.global_model.state[name], expected, atol=1e-6)
    assert s.shares["0"] == pytest.approx(0.5)  # the router's three users: the liar at the cap


def check(s, task, result):
    """The coordinator's two checks of a reply: what the task declared, then the strategy's own."""
    client = s.clients[result.client_id]
    return payload_rejection(result, s.expects(task, client), client, get_profile("rpi-4")) or s.reply_rejection(
        task, client, result
    )


def test_an_upload_with_an_inactive_block_a_wrong_shape_or_another_route_is_refused():
    s = strategy()
    s.routes = {"0": chain(0, 1, 0)}
    task = s.plan(1, ["0"])["0"]
    good = reply(task, "0", 3)
    assert check(s, task, good) is None
    state = build(SPEC).state_dict()
    inactive = next(n for n in state if block_of(n) == (1, 1))
    extra = Result("0", 1, task.type, 10, {}, tensors=good.tensors | {inactive: state[inactive]})
    assert check(s, task, extra)[0] == "payload"
    name = next(n for n in good.tensors if block_of(n) == (2, 1))
    assert check(s, task, Result("0", 1, task.type, 10, {}, tensors=good.tensors | {name: torch.zeros(2, 2)}))[0] == (
        "tensors"
    )
    other = Result("0", 1, task.type, 10, {}, tensors=good.tensors | {ROUTE: chain(0, 0, 0)})
    assert check(s, task, other)[0] == "route"
    dead = Result(
        "0", 1, task.type, 10, {}, tensors=good.tensors | {NEXT_ROUTE: torch.zeros(LAYOUT.paths, dtype=torch.bool)}
    )
    assert check(s, task, dead)[0] == "route"
    huge = good.tensors | {name: task.tensors[name] * 11}  # finite and of its shape, but 11 x what it was sent
    assert check(s, task, Result("0", 1, task.type, 10, {}, tensors=huge))[0] == "norm_bound"
    missing = {k: v for k, v in good.tensors.items() if k != name}
    assert check(s, task, Result("0", 1, task.type, 10, {}, tensors=missing))[0] == "payload"


def test_the_temperature_anneals_from_its_start_to_its_floor_after_the_warmup():
    s = strategy(warmup_rounds=2, temperature=1.0, min_temperature=0.1, temperature_decay=0.5)
    assert s.temperature(0) == s.temperature(2) == 1.0
    assert s.temperature(3) == pytest.approx(math.exp(-0.5))
    assert s.temperature(50) == 0.1
    s.routes = {"0": chain(0, 0, 0)}
    assert s.plan(3, ["0"])["0"].config["route_temperature"] == pytest.approx(math.exp(-0.5))


def test_the_clock_charges_the_routers_passes_over_the_data():
    s = strategy(warmup_rounds=1)
    client = s.clients["0"]
    assert s.other_macs(s.plan(0, ["0"])["0"], client) == router_macs(SPEC)  # the warm-up's decision pass
    s.routes = {"0": chain(0, 0, 0)}
    assert s.other_macs(s.plan(1, ["0"])["0"], client) == 5 * router_macs(SPEC)


def test_evaluation_sends_the_global_blocks_of_each_clients_most_likely_route():
    s = strategy()
    s.routings = {"1": chain(1, 0, 1)}
    tasks = s.evaluation(0, ["0", "1"])
    assert torch.equal(tasks["0"].tensors[ROUTING], ALL)
    assert {block_of(n) for n in tasks["1"].tensors if n != ROUTING} == {(1, 1), (2, 0), (3, 1)}
    final = s.final_models()["1"]["model"]
    assert torch.equal(next(v for k, v in final.state.items() if k.endswith(".routing")), chain(1, 0, 1))


def test_a_fleet_without_one_modular_network_is_refused():
    s = create_strategy("fedmn", CONFIG)
    with pytest.raises(StrategyError, match="one modular network"):
        s.setup(fleet(spec=create("cnn1", (1, 4, 4), 10)))
    mixed = fleet() | {"9": ClientInfo("9", create("fedmn_3x3x3_fc", (1, 4, 4), 10), "rpi-4", 10, 5)}
    with pytest.raises(StrategyError, match="one modular network"):
        s.setup(mixed)


def test_a_heavy_tailed_router_step_is_clipped_not_refused_and_an_outlying_block_update_is_refused(tmp_path):
    """Honest router steps vary across clients beyond 10 x the round's median (bench/robust.py): the router is left
    out of the whole-update outlier check (FedMN.outlier_exempt) and clipped instead; blocks are not left out."""
    s = strategy()
    s.routes = {cid: ALL.clone() for cid in "012"}
    tasks = s.plan(1, ["0", "1", "2"])
    coordinator = Coordinator(s, None, fleet(), LoopConfig(2, 3, 0, 1, progress=False), RunLog(tmp_path, {}))
    router = set(s.outlier_exempt())
    assert router and router == {n for n in s.parts[ROUTER]}

    def moved(cid, scale, names):
        res = reply(tasks[cid], cid, int(cid), next_route=ALL)
        sent = tasks[cid].tensors
        big = {n: sent[n] + scale * (t - sent[n]) for n, t in res.tensors.items() if n in names}
        return Result(cid, 1, res.type, res.num_examples, res.metrics, tensors=res.tensors | big)

    blocks = {n for n in tasks["0"].tensors if block_of(n) not in (None, ROUTER)}
    honest = {cid: reply(tasks[cid], cid, int(cid), next_route=ALL) for cid in "12"}
    routed = {"0": moved("0", 30.0, router)} | honest  # 30 x the others' step, within the 10 x norm bound
    kept = coordinator.accepted(routed, tasks)
    assert set(kept) == {"0", "1", "2"} and coordinator.bounds.clipped["0"] >= len(router)
    outlier = {"0": moved("0", 12.0, blocks)} | honest  # 12 x the median update: an outlier, within the norm bound
    assert set(coordinator.accepted(outlier, tasks)) == {"1", "2"} and coordinator.rejected == {"update_outlier": 1}
