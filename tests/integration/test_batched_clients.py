"""The simulation's batched clients (launch/batched.py) in whole runs: FedAvg's and pFedClub's clients (the latter
distilling from their teachers) train together in groups and end where the serial run ends, within float tolerance;
every other task (evaluation) and a group of one are the serial run's, bit for bit."""

import dataclasses

import pytest
import torch

from edge_client.training import predict
from fedge.brokers.transport import InProcTransport
from fedge.config import config_from
from fedge.model import zoo
from fedge.model.spec import build
from launch import batched
from launch.batched import BatchedClients
from launch.client import client_agents
from launch.runs import load_partitioned
from launch.server import make_strategy
from launch.simulation import run_simulation

from helpers.federation import final_snapshots, read_rows

pytestmark = pytest.mark.timeout(300)


def config(out, strategy, zoo="cnn1", **kw):
    small = {"finetune_epochs": 1, "finetune_min_steps": 0, "max_candidates": 2} if strategy == "pfedclub" else {}
    # two rounds of 3 of the 5 clients: some client trains twice (and a pFedClub one distils the second time)
    base = dict(strategy=strategy, dataset="digits", zoo=zoo, clients=5, active=3, rounds=2, local_epochs=1, seed=1)
    return config_from(base | small | kw | {"batch_size": 32, "out": str(out)})


@pytest.mark.parametrize("strategy", ["fedavg", "pfedclub"])
def test_batched_clients_train_as_the_serial_run(tmp_path, strategy):
    serial = run_simulation(config(tmp_path / "serial", strategy), progress=False)
    batched = run_simulation(config(tmp_path / "batched", strategy, engine="batched", workers=2), progress=False)

    report = batched["transport"]
    assert (report["engine"], report["client_device"], report["tasks_batched"]) == ("batched", "cpu", 6)
    assert report["largest_group"] == 3  # every round's three clients trained as one computation
    trained = [(a, b) for a, b in zip(read_rows(tmp_path / "serial"), read_rows(tmp_path / "batched")) if a["trained"]]
    assert len(trained) == 6
    seen = set()  # a pFedClub client distils from its second participation on
    for a, b in trained:
        assert (a["round"], a["client"], a["num_examples"]) == (b["round"], b["client"], b["num_examples"])
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert b.get("kd_loss", 0) == pytest.approx(a.get("kd_loss", 0), rel=1e-3)
        assert (b.get("kd_loss", 0) > 0) == (strategy == "pfedclub" and a["client"] in seen)
        seen.add(a["client"])
    assert len(seen) < len(trained)  # a client trained twice
    assert batched["final_accuracy"]["mean"] == pytest.approx(serial["final_accuracy"]["mean"], abs=0.02)
    # each client's final model: its logits on random images as close as one epoch's float rounding leaves them
    probe = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    snapshots = final_snapshots(tmp_path / "batched")
    for cid, state in final_snapshots(tmp_path / "serial").items():
        ref, got = (predict(module(s), probe) for s in (state, snapshots[cid]))
        assert float((ref - got).norm() / ref.norm()) < 1e-4, cid


def module(state):
    model = build(zoo.create("cnn1", (1, 8, 8), 10))
    model.load_state_dict(state)
    return model


IDS = ["0", "1", "2", "3"]


def fedavg_fleet(tmp_path):
    """Four FedAvg clients behind BatchedClients on the CPU, and their tasks of round 0."""
    cfg = config(tmp_path / "run", "fedavg", clients=4, active=4, engine="batched", workers=2)
    agents = client_agents(cfg, IDS, partitioned=load_partitioned(cfg))
    transport = BatchedClients(agents, InProcTransport({a.client_id: a.handle for a in agents}), torch.device("cpu"), 2)
    fedavg = make_strategy(cfg, *load_partitioned(cfg))
    fedavg.setup({a.client_id: a.info() for a in agents})
    return agents, transport, fedavg.plan(0, IDS)


def test_a_client_failing_before_its_training_does_not_hold_the_others(tmp_path):
    _, transport, tasks = fedavg_fleet(tmp_path)
    tasks["1"] = dataclasses.replace(tasks["1"], config=tasks["1"].config | {"epochs": -1})  # refused by its handler
    tasks["2"] = dataclasses.replace(tasks["2"], type="evaluate")  # not batchable: the serial path

    results = transport.exchange(tasks)

    assert list(results) == IDS and "epochs" in results["1"].error
    assert "accuracy" in results["2"].metrics and results["0"].error is None and results["3"].error is None
    assert (
        transport.report()["transport"] | {"groups": 1, "largest_group": 2, "tasks_batched": 2}
        == (transport.report()["transport"])
    )


def test_an_interrupted_exchange_leaves_no_thread_waiting(tmp_path, monkeypatch):
    agents, transport, tasks = fedavg_fleet(tmp_path)

    def interrupted(jobs, device):
        raise KeyboardInterrupt

    monkeypatch.setattr(batched, "fit_together", interrupted)
    with pytest.raises(KeyboardInterrupt):
        transport.exchange(tasks)
    assert all(type(a.trainer).__name__ == "TorchTrainer" for a in agents)  # every thread finished its handler
