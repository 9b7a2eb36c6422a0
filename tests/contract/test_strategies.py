"""Every registered strategy, on a homogeneous fleet all accept: plan/aggregate contracts, zero replies,
order independence, seed determinism, and state that survives a checkpoint and a re-planned round."""

import pytest
import torch

from edge_client.agent import TASKS
from fedge.checkpoint import load_tree, save_tree, tree_digest
from fedge.messages import ClientInfo, Result, Weights
from fedge.spec import build
from fedge.zoo import create
from server.strategy import STRATEGIES, PublicData, StrategyConfig, create_strategy

pytestmark = pytest.mark.timeout(120)
CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0, finetune_epochs=1, max_candidates=2)
PUBLIC = PublicData(torch.randn(24, 1, 8, 8, generator=torch.Generator().manual_seed(0)),
                    torch.arange(24) % 10)


def fleet(n=4):
    return {str(i): ClientInfo(str(i), create("cnn1", (1, 8, 8), 10).with_origin(str(i)), "rpi-4", 20, 5)
            for i in range(n)}


def make(name):
    s = create_strategy(name, CONFIG, PUBLIC)
    s.setup(fleet())
    return s


def uploads(rnd, cids):
    out = {}
    for cid in cids:
        torch.manual_seed(int(cid))
        spec = create("cnn1", (1, 8, 8), 10).with_origin(cid)
        out[cid] = Result(cid, rnd, "train", 20, {"train_loss": 1.0},
                          {"local": Weights(spec, build(spec).state_dict())})
    return out


def same_tasks(a, b):
    assert a.keys() == b.keys()
    for cid in a:
        assert a[cid].type == b[cid].type and a[cid].config == b[cid].config
        assert a[cid].models.keys() == b[cid].models.keys()
        for role, w in a[cid].models.items():
            other = b[cid].models[role].state
            assert w.state.keys() == other.keys() and all(torch.equal(w.state[k], other[k]) for k in w.state)


@pytest.fixture(params=list(STRATEGIES))
def name(request):
    return request.param


def test_plans_exactly_the_active_clients_with_known_task_types(name):
    strategy = make(name)
    tasks = strategy.plan(0, ["1", "3"])
    assert set(tasks) == {"1", "3"}
    assert all(t.type in TASKS and t.round == 0 for t in tasks.values())
    assert all(t.type in TASKS for t in strategy.evaluation(0, ["0", "1"]).values())


def test_zero_and_one_replies_are_survived(name):
    strategy = make(name)
    strategy.aggregate(0, {})
    strategy.aggregate(1, uploads(1, ["2"]))
    assert set(strategy.plan(2, ["0", "2"])) == {"0", "2"}


def test_aggregation_is_order_independent_and_seed_deterministic(name):
    results = uploads(0, ["0", "1", "2"])
    a, b = make(name), make(name)
    a.aggregate(0, results)
    b.aggregate(0, dict(reversed(list(results.items()))))
    same_tasks(a.plan(1, ["0", "1", "2", "3"]), b.plan(1, ["0", "1", "2", "3"]))


def saved(tree, tmp_path):
    save_tree(tmp_path / "state.safetensors", tree)
    return load_tree(tmp_path / "state.safetensors")


def test_state_survives_a_checkpoint_and_resumes_the_same(name, tmp_path):
    a = make(name)
    a.aggregate(0, uploads(0, ["0", "1", "2"]))
    b = make(name)
    b.load_state(saved(a.state(), tmp_path))
    assert tree_digest(b.state()) == tree_digest(a.state()) and b.summary() == a.summary()
    same_tasks(b.plan(1, ["0", "1", "2", "3"]), a.plan(1, ["0", "1", "2", "3"]))
    b.aggregate(1, uploads(1, ["0", "3"]))
    a.aggregate(1, uploads(1, ["0", "3"]))
    assert tree_digest(b.state()) == tree_digest(a.state())


def test_planning_a_round_again_changes_no_state(name):
    strategy = make(name)
    strategy.aggregate(0, uploads(0, ["0", "1", "2"]))
    before = tree_digest(strategy.state())
    first = strategy.plan(1, ["0", "1"])
    same_tasks(strategy.plan(1, ["0", "1"]), first)
    assert tree_digest(strategy.state()) == before
