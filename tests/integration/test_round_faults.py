"""Rounds under faults, with real clients in one process: quorum and retry (reliability notes §10 test 7),
a transport that fails, and an upload with an outlying norm (test 21)."""

import dataclasses
import json

import pytest
import torch

from edge_client.agent import ClientAgent
from fedge.brokers.transport import InProcTransport
from fedge.config import RunConfig, config_from
from fedge.data.datasets import load_dataset
from fedge.data.partition import make_partition
from fedge.model.zoo import assign_models
from fedge.wire.messages import Result, Task, Weights
from launch.client import make_agent
from launch.runs import partition_config
from launch.simulation import run_simulation
from server.coordinator import Coordinator, LoopConfig, RoundFailed
from server.runlog import CHECKPOINT_FILE, RunLog
from server.strategy import StrategyConfig, StrategyError, create_strategy

pytestmark = pytest.mark.timeout(300)
STRATEGY = StrategyConfig(local_epochs=1, batch_size=16, lr=1e-3, seed=0)


def config(tmp_path, **kw) -> RunConfig:
    base = dict(
        strategy="fedavg",
        dataset="digits",
        zoo="cnn1",
        clients=4,
        active=4,
        rounds=1,
        local_epochs=1,
        batch_size=16,
        out=str(tmp_path / "run"),
        seed=3,
    )
    return config_from(base | kw)


def fleet(cfg: RunConfig) -> list[ClientAgent]:
    ds = load_dataset(cfg.dataset)
    part = make_partition(ds.y, ds.num_classes, partition_config(cfg))
    models = assign_models(cfg.zoo, cfg.clients, cfg.seed)
    return [make_agent(cfg, ds, s, models[i], "rpi-4") for i, s in enumerate(part.clients)]


def dead_in_training(agent: ClientAgent):
    """A real client whose training fails (a device bug); it still evaluates."""

    def handle(task: Task) -> Result:
        if task.type != "evaluate":
            raise RuntimeError("device fell over")
        return agent.handle(task)

    return handle


def inflating(agent: ClientAgent):
    """A real client that uploads its trained weights times 1e6."""

    def handle(task: Task) -> Result:
        res = agent.handle(task)
        if "local" not in res.models:
            return res
        w = res.models["local"]
        big = {k: v * 1e6 if v.is_floating_point() else v for k, v in w.state.items()}
        return dataclasses.replace(res, models={"local": Weights(w.spec, big)})

    return handle


def federation(tmp_path, name, handlers, loop, strategy="fedavg"):
    agents = fleet(config(tmp_path))
    handlers = {a.client_id: a.handle for a in agents} | {cid: wrap(agents[int(cid)]) for cid, wrap in handlers.items()}
    strategy = create_strategy(strategy, STRATEGY)
    coord = Coordinator(
        strategy, InProcTransport(handlers), {a.client_id: a.info() for a in agents}, loop, RunLog(tmp_path / name, {})
    )
    return coord, strategy


def global_state(strategy):
    return strategy.global_model.state


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_round_with_quorum_aggregates_the_replies_that_came(tmp_path):
    coord, _ = federation(
        tmp_path,
        "r",
        {"1": dead_in_training, "2": dead_in_training},
        LoopConfig(1, 4, 0, 1, progress=False, min_replies=2),
    )
    summary = coord.run()
    assert summary["never_trained"] == ["1", "2"] and summary["failed_rounds"] == []


def test_a_round_without_quorum_is_retried_then_the_run_stops(tmp_path, caplog):
    coord, strategy = federation(
        tmp_path,
        "r",
        {"1": dead_in_training, "2": dead_in_training},
        LoopConfig(2, 4, 0, 1, progress=False, min_replies=3, round_retries=2),
    )
    strategy.setup(coord.clients)
    initial = global_state(strategy)
    with pytest.raises(RoundFailed, match="round 0 failed 3 times") as failure:
        coord.run()
    assert same(global_state(strategy), initial)  # nothing was aggregated
    assert failure.value.summary["failed_rounds"] == [{"round": 0, "try": t, "replies": 2} for t in (1, 2, 3)]
    assert failure.value.summary["stopped_at_round"] == 0
    assert caplog.text.count("nothing aggregated") == 3
    assert not (tmp_path / "r" / CHECKPOINT_FILE).exists() and coord.runlog.rows() == []


def test_a_quorum_that_cannot_be_met_is_refused_up_front(tmp_path):
    with pytest.raises(StrategyError, match="min_replies=5"):
        federation(tmp_path, "r", {}, LoopConfig(1, 4, 0, 1, progress=False, min_replies=5))


def test_the_simulation_wires_the_quorum_and_writes_the_summary_when_it_stops(tmp_path, monkeypatch):
    handle = ClientAgent.handle
    monkeypatch.setattr(
        ClientAgent, "handle", lambda a, t: handle(a, t) if a.client_id == "0" else dead_in_training(a)(t)
    )
    with pytest.raises(RoundFailed):
        run_simulation(config(tmp_path, min_replies=2, round_retries=1), progress=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_at_round"] == 0 and len(summary["failed_rounds"]) == 2


def test_a_retried_round_is_bit_identical_to_a_clean_one(tmp_path, monkeypatch):
    cfg = dict(strategy="local", rounds=2, min_replies=4)
    clean = run_simulation(config(tmp_path, out=str(tmp_path / "clean"), **cfg), progress=False)
    handle, failed = ClientAgent.handle, []

    def flaky(agent, task):  # client 2 misses round 1 once; the others trained, and must train the same again
        if agent.client_id == "2" and task.round == 1 and task.type == "train" and not failed:
            failed.append(task.round)
            raise ConnectionError("lost the upload")
        return handle(agent, task)

    monkeypatch.setattr(ClientAgent, "handle", flaky)
    retried = run_simulation(config(tmp_path, out=str(tmp_path / "retried"), **cfg), progress=False)
    assert retried["failed_rounds"] == [{"round": 1, "try": 1, "replies": 3}]
    assert retried["final_accuracy"] == clean["final_accuracy"]
    train_losses = [
        [r.get("train_loss") for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())]
        for run in ("clean", "retried")
    ]
    assert train_losses[0] == train_losses[1]


class Hiccup:
    """A transport whose first exchange fails, as a broker restart would make it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def exchange(self, tasks, limits):
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("broker went away")
        return self.inner.exchange(tasks, limits)


def test_a_transport_failure_fails_the_try_not_the_run(tmp_path, caplog):
    coord, _ = federation(tmp_path, "r", {}, LoopConfig(1, 4, 0, 1, progress=False))
    coord.transport = Hiccup(coord.transport)
    summary = coord.run()
    assert "broker went away" in caplog.text
    assert summary["failed_rounds"] == [{"round": 0, "try": 1, "replies": 0}] and summary["never_trained"] == []


def test_an_upload_with_an_outlying_norm_is_rejected(tmp_path, caplog):
    loop = LoopConfig(1, 4, 0, 1, progress=False)
    inflated, with_outlier = federation(tmp_path, "a", {"1": inflating}, loop)
    summary = inflated.run()
    assert summary["rejected_replies"] == {"norm_bound": 1} and summary["never_trained"] == ["1"]
    assert "rejected reply from client 1: model 'local' has norm" in caplog.text
    without, reference = federation(tmp_path, "b", {"1": dead_in_training}, loop)
    without.run()
    assert same(global_state(with_outlier), global_state(reference))  # as if client 1 had not replied
