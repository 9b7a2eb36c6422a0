"""The FedTrans strategy (Algorithm 1) on synthetic replies: when the chain grows, that a grown model computes its
parent's function, that no client is ever sent a model beyond its capacity, utilities and evaluation picks, and a
resumed strategy that continues bit-identically."""

from __future__ import annotations

import json
import random

import pytest
import torch

from device_profiles import get_profile, training_memory_bytes
from fedge.checkpoint import load_tree, save_tree, tree_digest
from fedge.messages import ClientInfo, Result, Weights
from fedge.spec import build
from fedge.zoo import create
from server.fedtrans import FedTrans, weight_cells
from server.strategy import StrategyConfig, StrategyError, create_strategy

CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)
FAST = {"gamma": 2, "delta": 1, "beta": 100.0}  # grows as soon as the newest model has 3 rounds of losses
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


def test_liars_activeness_is_ignored_and_bad_losses_do_not_poison_utilities():
    s = make(["rpi-4", "rpi-4", "rpi-4"])
    tasks = s.plan(0, ["0", "1", "2"])
    res = replies(tasks, 0)
    bad = res["2"]
    res["2"] = Result(bad.client_id, 0, bad.type, 20, {"train_loss": 1.0}, bad.models, records={"activeness": {"x": 1}})
    s.aggregate(0, res)
    assert s.activeness[-1] == s.round_activeness({k: res[k] for k in ("0", "1")})
    assert all(all(abs(u) < 10 for u in us) for us in s.utilities.values())


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
