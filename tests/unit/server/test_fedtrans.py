"""The FedTrans strategy (Algorithm 1) on synthetic replies: when the chain grows, that a grown model computes its
parent's function, that no client is ever sent a model beyond its capacity, utilities and evaluation picks, and a
resumed strategy that continues bit-identically."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from device_profiles import get_profile, training_memory_bytes
from fedge.checkpoint import load_tree, save_tree, tree_digest
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import ModelSpec, build, make_spec
from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result, Weights
from methods.fedtrans.server import FedTrans, weight_cells
from server.strategy import StrategyConfig, StrategyError, create_strategy

CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)
# Grows as soon as the newest model has 3 rounds of losses, from any number of reporters: these tests are of growth's
# mechanics on fleets of 2; the quorum that guards growth against a liar has tests of its own below.
FAST = {"gamma": 2, "delta": 1, "beta": 100.0, "growth_quorum": 1}
TORCH_PROFILES = ["rpi-zero-2w", "rpi-4", "rpi-5", "jetson-orin-nano"]


def fleet(profiles, model="cnn1", shape=(1, 28, 28)):
    spec = create(model, shape, 10)
    return {str(i): ClientInfo(str(i), spec.with_origin(str(i)), p, 20, 5) for i, p in enumerate(profiles)}


def make(profiles, **options) -> FedTrans:
    s = create_strategy("fedtrans", CONFIG, None, FAST | options)
    s.setup(fleet(profiles))
    return s


def replies(tasks, rnd, loss=1.0, hot=None):
    """Each client returns the model it was sent, nudged, with a loss and activeness (`hot`: the one cell whose
    activeness is high)."""
    out = {}
    for cid, task in tasks.items():
        sent = task.models["model"]
        g = torch.Generator().manual_seed(rnd * 100 + int(cid))
        state = {
            k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in sorted(sent.state.items())  # sorted: a checkpoint gives the state back in name order
        }
        names = weight_cells(sent.spec)
        act = {n: (1.0 if n == hot else 0.1) for n in names}
        out[cid] = Result(
            cid,
            rnd,
            task.type,
            20,
            {"train_loss": loss + 0.1 * int(cid)},
            {"model": Weights(sent.spec, state)},
            records={"activeness": act},
        )
    return out


def within(spec, capacity, profile_name):
    """The oracle for 'a client can train this model': MACs within its capacity, params and training memory within
    its device profile (independent of server.capacity.compatible)."""
    p = get_profile(profile_name)
    return (
        spec.macs <= capacity and spec.params <= p.max_params and training_memory_bytes(spec.params) <= p.memory_bytes
    )


def run_rounds(strategy, rounds, start=0, hot=None, sent=None):
    for rnd in range(start, start + rounds):
        tasks = strategy.plan(rnd, sorted(strategy.clients))
        if sent is not None:
            sent.append({cid: t.models["model"].spec for cid, t in tasks.items()})
        strategy.aggregate(rnd, replies(tasks, rnd, loss=2.0 - 0.01 * rnd, hot=hot))


def test_no_transformation_before_gamma_plus_delta_rounds_of_the_newest_model():
    s = make(["rpi-zero-2w", "rpi-4"], gamma=3, delta=2)
    run_rounds(s, 4)
    assert len(s.models) == 1 and s.doc is None
    run_rounds(s, 1, start=4)  # the 5th loss: DoC exists (slope 0.01 <= β) → M1
    assert len(s.models) == 2 and s.doc == pytest.approx(0.01)
    run_rounds(s, 4, start=5)  # M1 starts a new loss curve: 4 rounds are not enough
    assert len(s.models) == 2


def test_a_high_doc_never_transforms():
    s = make(["rpi-zero-2w", "rpi-4"], beta=0.001)
    run_rounds(s, 8)  # the loss falls by 0.01 a round > β
    assert len(s.models) == 1


def test_the_grown_model_computes_its_parents_function_and_transforms_the_most_active_cell():
    s = make(["rpi-zero-2w", "rpi-4"])
    hot = "blocks.1.0.weight"  # cnn1's second conv
    run_rounds(s, 3, hot=hot)
    assert len(s.models) == 2
    parent, child = s.models
    assert s.transforms[0]["ops"] == [{"cell": "blocks.1.0", "op": "widen"}]
    assert child.spec.macs > parent.spec.macs
    # what HeteroFL is given in FedTrans's comparison (App. A.1): the largest model the chain grew
    assert ModelSpec.from_dict(s.summary()["largest_model"]) == child.spec
    x = torch.randn(16, 1, 28, 28)
    a, b = build(parent.spec), build(child.spec)
    a.load_state_dict(parent.state), b.load_state_dict(child.state)
    a.eval(), b.eval()
    assert torch.allclose(a(x), b(x), atol=1e-5)
    assert s.similarity[0][1] == s.similarity[1][0] and 0 < s.similarity[0][1] < 1
    assert all(u[1] == u[0] for u in s.utilities.values())  # Alg. 1 line 18: M* starts with its parent's utility


def test_a_cell_widened_last_time_is_deepened_next():
    s = make(["rpi-4", "rpi-4"])
    run_rounds(s, 3, hot="blocks.1.0.weight")
    s.utilities = {cid: [0.0, 50.0] for cid in s.utilities}  # both clients train M1, so its loss curve fills
    run_rounds(s, 3, start=3, hot="blocks.1.0.weight")
    assert [t["ops"] for t in s.transforms] == [
        [{"cell": "blocks.1.0", "op": "widen"}],
        [{"cell": "blocks.1.0", "op": "deepen"}],
    ]


@pytest.mark.parametrize("seed", range(6))
def test_no_client_is_ever_sent_a_model_beyond_its_capacity_on_random_fleets(seed, tmp_path):
    rnd = random.Random(seed)
    profiles = [rnd.choice(TORCH_PROFILES) for _ in range(rnd.randint(2, 6))]
    options = {}
    if seed % 2:  # capacities from a file: between cnn1's MACs and ~8x that
        spec = create("cnn1", (1, 28, 28), 10)
        caps = {str(i): rnd.randint(spec.macs, 8 * spec.macs) for i in range(len(profiles))}
        (tmp_path / "caps.json").write_text(json.dumps(caps))
        options["capacity_file"] = str(tmp_path / "caps.json")
    s = make(profiles, **options)
    sent = []
    for block in range(5):
        hot = rnd.choice(sorted(weight_cells(s.models[-1].spec)))
        run_rounds(s, 3, start=3 * block, hot=hot, sent=sent)
    largest = max(s.capacity.values())
    assert all(m.spec.macs <= largest for m in s.models)
    for round_specs in sent:
        for cid, spec in round_specs.items():
            assert within(spec, s.capacity[cid], s.clients[cid].profile)
    for cid in s.clients:
        assert within(s.final_models()[cid]["model"].spec, s.capacity[cid], s.clients[cid].profile)


def test_the_chain_stops_at_the_fleets_largest_capacity(tmp_path):
    spec = create("cnn1", (1, 28, 28), 10)
    (tmp_path / "caps.json").write_text(json.dumps({"0": spec.macs, "1": spec.macs + 1}))
    s = make(["rpi-4", "rpi-4"], capacity_file=str(tmp_path / "caps.json"))
    run_rounds(s, 6)
    assert len(s.models) == 1 and "largest capacity" in s.growth_stopped


def test_an_initial_model_beyond_a_client_is_refused(tmp_path):
    (tmp_path / "caps.json").write_text(json.dumps({"0": 10, "1": 10**9}))
    with pytest.raises(StrategyError, match=r"beyond clients \['0'\]"):
        make(["rpi-4", "rpi-4"], capacity_file=str(tmp_path / "caps.json"))


def test_executorch_clients_are_refused():
    with pytest.raises(StrategyError, match="torch runtime"):
        make(["rpi-4", "android-flagship"])


def test_evaluation_uses_the_compatible_model_of_highest_utility():
    s = make(["rpi-zero-2w", "rpi-4"])
    run_rounds(s, 3)
    assert len(s.models) == 2
    s.utilities["1"] = [0.0, 1.0]
    s.utilities["0"] = [0.0, 5.0]
    fits0 = 1 in s.compatible("0")
    tasks = s.evaluation(3, ["0", "1"])
    assert tasks["1"].models["global"].spec == s.models[1].spec
    assert tasks["0"].models["global"].spec == s.models[1 if fits0 else 0].spec


def test_liars_cannot_crash_the_server_pick_the_cell_or_move_the_doc():
    """Two clients report losses of 1e308 (finite: the coordinator lets them through), one none, one an absurd
    activeness for a cell: the server keeps running, the reports are left out and counted, DoC follows the honest
    median and the honest clients' hot cell is the one transformed."""
    s = make(["rpi-4"] * 6, gamma=1, delta=1, beta=0.05)
    for rnd in range(2):
        tasks = s.plan(rnd, sorted(s.clients))
        res = replies(tasks, rnd, loss=2.0 - 0.1 * rnd, hot="blocks.1.0.weight")
        for cid in ("0", "1"):
            res[cid] = dataclasses.replace(res[cid], metrics={"train_loss": 1e308})
        res["2"] = dataclasses.replace(res["2"], metrics={})
        act = dict(res["3"].records["activeness"]) | {"blocks.0.0.weight": 1.7e308}
        res["3"] = dataclasses.replace(res["3"], records={"activeness": act})
        s.aggregate(rnd, res)
    assert s.summary()["ignored_reports"] == {"train_loss": 6, "activeness": 2}
    assert all(math.isfinite(u) and abs(u) < 5 for us in s.utilities.values() for u in us)
    # the honest losses 2.3-2.5, then 2.2-2.4 (clients 3-5): medians 2.4 and 2.3, DoC 0.1 > β, no growth
    assert s.losses == pytest.approx([2.4, 2.3]) and s.doc == pytest.approx(0.1) and len(s.models) == 1


def test_alpha_one_selects_exactly_the_most_active_cell():
    s = make(["rpi-4", "rpi-4"], alpha=1.0)
    run_rounds(s, 3, hot="blocks.1.0.weight")
    assert s.transforms[0]["ops"] == [{"cell": "blocks.1.0", "op": "widen"}]


def test_a_larger_model_nobody_trained_keeps_its_own_weights_in_eq5():
    """Only M0 trains: M1's overlap becomes (w1 + η^t·sim·w0) / (1 + η^t·sim), the rest of M1 stays as it was."""
    s = make(["rpi-4", "rpi-4"], eta=0.5)
    run_rounds(s, 3, hot="blocks.1.0.weight")
    assert len(s.models) == 2
    before = {k: v.clone() for k, v in s.models[1].state.items()}
    s.utilities = {cid: [50.0, 0.0] for cid in s.utilities}
    tasks = s.plan(4, ["0", "1"])
    assert all(t.models["model"].spec == s.models[0].spec for t in tasks.values())
    res = replies(tasks, 4)
    s.aggregate(4, res)
    w0 = sum(r.models["model"].state["blocks.1.0.weight"] for r in res.values()) / 2
    a = 0.5 ** (4 - s.created[1]) * s.similarity[0][1]
    got = s.models[1].state["blocks.1.0.weight"]
    c = w0.shape[0]
    assert torch.allclose(got[:c], (before["blocks.1.0.weight"][:c] + a * w0) / (1 + a), atol=1e-6)
    assert torch.equal(got[c:], before["blocks.1.0.weight"][c:])


def test_eq5_finds_a_smaller_models_tensors_under_a_deepened_models_shifted_names():
    """A block conv-relu-conv: deepening the first conv inserts two layers before the second, whose tensors move
    from index 2 to 4; Eq. (5) must carry M0's second conv there, and nothing into the inserted layer."""
    conv = {"kernel_size": 3, "padding": 1}
    spec = make_spec(
        "net",
        (1, 8, 8),
        10,
        [
            ("a", [L("conv2d", conv | {"out_channels": 4}), L("relu"), L("conv2d", conv | {"out_channels": 4})]),
            ("b", [L("relu"), L("flatten"), L("linear", {"out_features": 10})]),
        ],
    )
    s = create_strategy("fedtrans", CONFIG, None, FAST)
    s.setup({str(i): ClientInfo(str(i), spec.with_origin(str(i)), "rpi-4", 20, 5) for i in range(2)})
    s.ops[0] = {"blocks.0.0": "widen"}  # widened last time: deepened now
    run_rounds(s, 3, hot="blocks.0.0.weight")
    assert s.transforms[0]["ops"] == [{"cell": "blocks.0.0", "op": "deepen"}]
    assert s.lineages[1]["blocks.0.4.weight"] == "blocks.0.2.weight" and s.lineages[1]["blocks.0.2.weight"] is None
    w0 = {k: torch.full_like(v, 7.0) for k, v in s.models[0].state.items()}
    carried = s.carried(w0, 0, 1)
    assert torch.equal(carried["blocks.0.4.weight"], torch.full((4, 4, 3, 3), 7.0))
    assert "blocks.0.2.weight" not in carried and "blocks.0.2.bias" not in carried


def test_max_models_bounds_the_chain():
    s = make(["rpi-4", "rpi-4"], max_models=2)
    run_rounds(s, 9)
    assert len(s.models) == 2 and "max_models=2" in s.growth_stopped


def test_random_layer_selection_ignores_activeness_and_large_to_small_changes_the_small_model():
    picks = set()
    for seed in range(5):
        s = create_strategy(
            "fedtrans", dataclasses.replace(CONFIG, seed=seed), None, FAST | {"layer_selection": "random"}
        )
        s.setup(fleet(["rpi-4", "rpi-4"]))
        run_rounds(s, 3, hot="blocks.2.1.weight")
        picks.add(s.transforms[0]["ops"][0]["cell"])
    assert len(picks) > 1  # the gradient pick would be blocks.2.1 every time
    runs = {name: make(["rpi-4", "rpi-4"], large_to_small=flag) for name, flag in (("default", False), ("l2s", True))}
    for s in runs.values():
        run_rounds(s, 3)
        s.utilities = {cid: [0.0, 50.0] for cid in s.utilities}  # everyone trains M1; only l2s shares it into M0
        run_rounds(s, 1, start=3)
    assert tree_digest(runs["l2s"].models[0].state) != tree_digest(runs["default"].models[0].state)


def test_a_state_snapshot_is_not_changed_by_the_next_aggregate():
    s = make(["rpi-zero-2w", "rpi-4"])
    run_rounds(s, 2)
    snapshot = s.state()
    digest = tree_digest(snapshot)
    run_rounds(s, 3, start=2)
    assert len(s.models) == 2 and tree_digest(snapshot) == digest


def test_a_resumed_strategy_continues_bit_identically(tmp_path):
    a = make(["rpi-zero-2w", "rpi-4", "rpi-5"])
    run_rounds(a, 4, hot="blocks.0.0.weight")
    save_tree(tmp_path / "s.safetensors", a.state())
    b = make(["rpi-zero-2w", "rpi-4", "rpi-5"])
    b.load_state(load_tree(tmp_path / "s.safetensors"))
    assert tree_digest(b.state()) == tree_digest(a.state()) and b.summary() == a.summary()
    run_rounds(a, 5, start=4, hot="blocks.2.0.weight")
    run_rounds(b, 5, start=4, hot="blocks.2.0.weight")
    assert len(a.models) >= 3
    assert tree_digest(b.state()) == tree_digest(a.state())


def test_without_soft_aggregation_each_model_averages_only_its_own_clients():
    s = make(["rpi-4", "rpi-4"], soft_aggregation=False)
    run_rounds(s, 3)
    assert len(s.models) == 2
    s.assigned = {"0": 0, "1": 1}
    tasks = {"0": s.plan(3, ["0"])["0"], "1": s.plan(3, ["1"])["1"]}
    s.assigned = {"0": 0, "1": 1}
    before = s.models[1].state
    sent = {"0": s.models[0], "1": s.models[1]}
    tasks = {cid: type(t)(t.type, 3, t.config, {"model": sent[cid]}) for cid, t in tasks.items()}
    res = replies(tasks, 3)
    s.aggregate(3, res)
    got = s.models[1].state
    assert all(torch.allclose(got[k].double(), res["1"].models["model"].state[k].double()) for k in before)


# ---------------------------------------------------------------------------------------------- growth quorum

LIAR_LOSSES = {"rising": lambda rnd: 1.0 + rnd, "falling": lambda rnd: 10.0 - rnd}


def two_reporter_growth(lie, quorum, beta, rounds=7):
    """Four clients, two training each round ({0, 1}, then {1, 2}, ...), honest losses 2 - 0.02·round (+0.002 per
    client id) and cell blocks.1.0 the active one; liar 1 reports `lie`'s losses and calls blocks.0.0 the active
    cell. The strategy and its transformations."""
    s = make(["rpi-4"] * 4, growth_quorum=quorum, beta=beta)
    for rnd in range(rounds):
        tasks = s.plan(rnd, ["0", "1"] if rnd % 2 == 0 else ["1", "2"])
        res = replies(tasks, rnd, hot="blocks.1.0.weight")
        for cid in res:
            res[cid] = dataclasses.replace(res[cid], metrics={"train_loss": 2.0 - 0.02 * rnd + 0.002 * int(cid)})
        if lie is not None:
            act = {n: (1.0 if n == "blocks.0.0.weight" else 0.0) for n in res["1"].records["activeness"]}
            res["1"] = dataclasses.replace(res["1"], metrics={"train_loss": lie(rnd)}, records={"activeness": act})
        s.aggregate(rnd, res)
    return s, [(t["round"], t["model"], t["ops"]) for t in s.transforms]


def test_with_two_reporters_a_round_one_liar_can_neither_force_nor_stall_nor_steer_growth():
    """A point of DoC needs 3 distinct clients, pooled over two rounds (points at rounds 1, 3, 5; honest DoC
    about 0.04, a liar moves the median only between the two honest reports of a point, 0.016 apart): β = 0.005,
    no growth, and a liar's rising losses force none; β = 0.1, growth at round 5 on the honest hot cell, and a
    liar's falling losses stall nothing. With a quorum of 1 (the median of each round's two reports) the same
    liar forces growth at round 2 or stalls it."""
    for beta, lie in ((0.005, "rising"), (0.1, "falling")):
        honest, grown = two_reporter_growth(None, 3, beta)
        assert grown == ([] if beta < 0.01 else [(5, "cnn1-t1", [{"cell": "blocks.1.0", "op": "widen"}])])
        for name in ("rising", "falling"):
            assert two_reporter_growth(LIAR_LOSSES[name], 3, beta)[1] == grown, (beta, name)
        if not grown:  # 2 reports a round, 14 in all; client 1's earlier one is superseded at each of 3 points
            assert honest.summary()["quorum_reports"] == {
                f"{kind}_{what}": n
                for kind in ("train_loss", "activeness")
                for what, n in (("pooled", 14), ("set_aside", 3))
            }
        _, paper = two_reporter_growth(None, 1, beta)
        _, lied = two_reporter_growth(LIAR_LOSSES[lie], 1, beta)
        assert [r for r, *_ in paper][:1] == ([] if beta < 0.01 else [2])
        assert [r for r, *_ in lied][:1] == ([2] if beta < 0.01 else [])


def test_a_newest_model_that_fewer_clients_than_the_quorum_train_never_grows():
    """Two clients in all: their reports wait in the pool forever, counted, and the chain stays at M0."""
    s = make(["rpi-4", "rpi-4"], growth_quorum=3)
    run_rounds(s, 6)
    assert len(s.models) == 1 and s.losses == [] and s.doc is None
    assert s.summary()["quorum_reports"] == {
        "train_loss_pooled": 12,
        "train_loss_set_aside": 10,
        "activeness_pooled": 12,
        "activeness_set_aside": 10,
    }
    assert set(s.pending["train_loss"]) == {"0", "1"}
