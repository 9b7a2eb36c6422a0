"""Every registered strategy, on a homogeneous fleet every strategy accepts: plan and aggregate contracts."""

import pytest

from edge_client.agent import TASKS
from fedge.messages import ClientInfo
from fedge.zoo import create
from server.strategy import STRATEGIES, StrategyConfig, create_strategy

pytestmark = pytest.mark.timeout(120)
CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)


def fleet(n=4):
    return {str(i): ClientInfo(str(i), create("cnn1", (1, 8, 8), 10).with_origin(str(i)), "rpi-4", 20, 5)
            for i in range(n)}


@pytest.fixture(params=list(STRATEGIES))
def strategy(request):
    s = create_strategy(request.param, CONFIG)
    s.setup(fleet())
    return s


def test_plans_exactly_the_active_clients_with_known_task_types(strategy):
    tasks = strategy.plan(0, ["1", "3"])
    assert set(tasks) == {"1", "3"}
    assert all(t.type in TASKS and t.round == 0 for t in tasks.values())
    assert all(t.type in TASKS for t in strategy.evaluation(0, ["0", "1"]).values())


def test_zero_replies_are_survived(strategy):
    strategy.plan(0, ["0"])
    strategy.aggregate(0, {})
    assert set(strategy.plan(1, ["0", "2"])) == {"0", "2"}


def test_plans_are_seed_deterministic():
    for name in STRATEGIES:
        a, b = create_strategy(name, CONFIG), create_strategy(name, CONFIG)
        a.setup(fleet())
        b.setup(fleet())
        ta, tb = a.plan(0, ["0", "1"]), b.plan(0, ["0", "1"])
        for cid in ta:
            assert ta[cid].config == tb[cid].config
            assert all(
                all((ta[cid].models[role].state[k] == tb[cid].models[role].state[k]).all()
                    for k in ta[cid].models[role].state)
                for role in ta[cid].models)
