"""The run engine end to end in one process: both strategies, the run folder contract, failures."""

import dataclasses
import json

import pytest
import torch

from edge_client.agent import ClientAgent
from fedge import constants as C
from fedge.brokers.transport import InProcTransport
from fedge.checkpoint import CheckpointError, load_tree
from fedge.config import RunConfig, config_from, load_config
from fedge.data.datasets import load_dataset
from fedge.data.partition import make_partition
from fedge.model.zoo import assign_models, create
from fedge.wire.messages import Task
from launch.client import client_agents, make_agent
from launch.runs import partition_config
from launch.simulation import run_simulation
from server.coordinator import Coordinator, LoopConfig, RoundFailed, sample_clients
from server.runlog import CHECKPOINT_FILE, RunLog
from server.strategy import StrategyConfig, StrategyError, create_strategy

pytestmark = pytest.mark.timeout(300)
ROW_KEYS = {
    "round",
    "client",
    "model",
    "params",
    "macs",
    "accuracy",
    "loss",
    "train_loss",
    "train_seconds",
    "peak_rss_bytes",
}


def config(tmp_path, **kw) -> RunConfig:
    base = dict(
        strategy="local",
        dataset="digits",
        zoo="I",
        clients=7,
        active=3,
        rounds=2,
        local_epochs=1,
        batch_size=16,
        out=str(tmp_path / "run"),
        seed=3,
    )
    return config_from(base | kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference federation (strategy local, zoo I, 7 clients, 2 rounds), run once for the module:
    its summary and its run folder."""
    tmp = tmp_path_factory.mktemp("reference")
    return run_simulation(config(tmp), progress=False), tmp / "run"


def test_local_run_writes_the_contract(reference):
    summary, out = reference
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["strategy"] == "local" and on_disk["dataset"] == "digits"
    assert (on_disk["rounds"], on_disk["clients"]) == (2, 7)
    assert len(on_disk["server_seconds"]) == 2
    per_client = on_disk["final_accuracy"]["per_client"]
    assert set(per_client) == {str(i) for i in range(7)} and on_disk["never_trained"] == []
    assert on_disk["final_accuracy"]["mean"] == pytest.approx(sum(per_client.values()) / len(per_client))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Local-T: every client trains and is evaluated every round, though 3 of 7 are selected per round
    assert sorted((r["round"], r["client"]) for r in rows if r["trained"]) == [
        (rnd, str(c)) for rnd in range(2) for c in range(7)
    ]
    assert all(ROW_KEYS <= set(r) for r in rows)
    assert (out / "accuracy.png").stat().st_size > 0
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["zoo"] == "I" and recorded["transport"] == "inproc"  # where the clients ran, not the default
    assert on_disk["server_threads"] == torch.get_num_threads() >= 1  # server_threads 0: as they were
    assert summary["final_accuracy"] == on_disk["final_accuracy"]


def test_local_on_selected_clients_only_trains_those(reference, tmp_path):
    """every_round=false: a client trains only in the rounds it is selected (the weaker baseline); a client's
    model is the same as under Local-T after the same number of its own training rounds."""
    cfg = config(tmp_path, every_round=False)
    summary = run_simulation(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    picked = [sample_clients([str(i) for i in range(7)], 3, cfg.seed, rnd) for rnd in range(2)]
    assert sorted((r["round"], r["client"]) for r in rows if r["trained"]) == sorted(
        (rnd, cid) for rnd in range(2) for cid in picked[rnd]
    )
    trained = set(picked[0]) | set(picked[1])
    assert set(summary["never_trained"]) == {str(i) for i in range(7)} - trained
    assert set(summary["final_accuracy"]["per_client"]) == trained
    reference_rows = [json.loads(line) for line in (reference[1] / "metrics.jsonl").read_text().splitlines()]
    # a client selected in round 0 trained the same first round under both: same data, seed and model
    first = {r["client"]: r["train_loss"] for r in reference_rows if r["round"] == 0}
    assert all(r["train_loss"] == first[r["client"]] for r in rows if r["round"] == 0 and r["trained"])


def test_same_seed_same_numbers(reference, tmp_path):
    again = run_simulation(config(tmp_path, out=str(tmp_path / "again")), progress=False)
    assert again["final_accuracy"] == reference[0]["final_accuracy"]


def test_fedavg_learns_a_shared_model(tmp_path):
    summary = run_simulation(
        config(tmp_path, strategy="fedavg", zoo="cnn1", partition="iid", rounds=3, local_epochs=2), progress=False
    )
    per_client = summary["final_accuracy"]["per_client"]
    assert set(per_client) == {str(i) for i in range(7)}  # the global model is evaluated on everyone
    assert summary["final_accuracy"]["mean"] > 0.5  # 10 classes: chance is 0.1


def test_fedavg_refuses_a_heterogeneous_zoo(tmp_path):
    with pytest.raises(StrategyError, match="same model"):
        run_simulation(config(tmp_path, strategy="fedavg"), progress=False)


def test_paper_widths_reach_the_clients_models_and_a_resume_keeps_them(tmp_path):
    cfg = config(
        tmp_path,
        strategy="fedavg",
        zoo="cnn2",
        clients=2,
        active=2,
        rounds=1,
        widths="paper",
        max_samples_per_client=40,
    )
    run_simulation(cfg, progress=False)
    out = tmp_path / "run"
    paper = create("cnn2", (1, 8, 8), 10, "paper")
    assert [ly.args["out_channels"] for b in paper.blocks for ly in b.layers if ly.type == "conv2d"] == [10, 64, 128]
    for cid in ("0", "1"):  # each client's model after the round, as its agent saved it, and the server's aggregate
        snapshot = load_tree(max((out / C.CLIENT_STATE_DIR / cid).glob("round-*.safetensors")))
        assert snapshot["model"].spec == paper.with_origin(cid)
    assert load_tree(out / CHECKPOINT_FILE)["strategy_state"]["global"].spec.params == paper.params
    assert load_tree(out / CHECKPOINT_FILE)["widths"] == "paper"
    # `fedge client` processes read the run's config.json (launch/federation.py); `fedge server --resume` too
    recorded = load_config(out / "config.json", {})
    assert recorded.widths == "paper" and client_agents(recorded, ["1"])[0].spec == paper.with_origin("1")
    with pytest.raises(CheckpointError, match="widths='paper', this run has 'cpu'"):
        run_simulation(dataclasses.replace(cfg, widths="cpu", rounds=2), progress=False, resume=True)


def fleet(tmp_path, cfg):
    ds = load_dataset(cfg.dataset)
    part = make_partition(ds.y, ds.num_classes, partition_config(cfg))
    models = assign_models(cfg.zoo, cfg.clients, cfg.seed)
    return [make_agent(cfg, ds, s, models[i], "rpi-4") for i, s in enumerate(part.clients)]


class Crashing:
    """A real client whose training task raises (as a device bug would); evaluation still works."""

    def __init__(self, agent: ClientAgent) -> None:
        self.agent = agent

    def handle(self, task: Task):
        if task.type == "train":
            raise RuntimeError("device fell over")
        return self.agent.handle(task)


def test_a_crashing_client_does_not_stop_the_round(tmp_path, caplog):
    cfg = config(tmp_path, clients=4, active=4, rounds=1)
    agents = fleet(tmp_path, cfg)
    handlers = {a.client_id: a.handle for a in agents} | {"1": Crashing(agents[1]).handle}
    strategy = create_strategy("local", StrategyConfig(1, 16, 1e-3, 0))
    coord = Coordinator(
        strategy,
        InProcTransport(handlers),
        {a.client_id: a.info() for a in agents},
        LoopConfig(1, 4, 0, 1, progress=False),
        RunLog(tmp_path / "r", {}),
    )
    summary = coord.run()
    assert set(summary["final_accuracy"]["per_client"]) == {"0", "2", "3"}
    assert summary["never_trained"] == ["1"]
    assert "device fell over" in caplog.text


def test_a_round_with_no_replies_stops_the_run_cleanly(tmp_path):
    cfg = config(tmp_path, clients=3, active=2, rounds=2)
    agents = fleet(tmp_path, cfg)
    strategy = create_strategy("fedavg", StrategyConfig(1, 16, 1e-3, 0))
    with pytest.raises(StrategyError):  # zoo I is heterogeneous; use cnn1 agents below
        strategy.setup({a.client_id: a.info() for a in agents})
    cfg = config(tmp_path, clients=3, active=2, rounds=2, zoo="cnn1")
    agents = fleet(tmp_path, cfg)
    dead = {a.client_id: Crashing(a).handle for a in agents}
    coord = Coordinator(
        strategy,
        InProcTransport(dead),
        {a.client_id: a.info() for a in agents},
        LoopConfig(2, 2, 0, 1, progress=False, round_retries=1),
        RunLog(tmp_path / "r", {}),
    )
    with pytest.raises(RoundFailed) as failure:  # below min_replies = 1, tried twice, nothing aggregated
        coord.run()
    assert failure.value.summary["never_trained"] == ["0", "1", "2"]
    assert len(failure.value.summary["failed_rounds"]) == 2


def test_sampling_is_deterministic_and_without_replacement():
    ids = [str(i) for i in range(12)]
    a = sample_clients(ids, 4, seed=1, rnd=5)
    assert a == sample_clients(ids, 4, seed=1, rnd=5) and len(set(a)) == 4
    assert any(sample_clients(ids, 4, seed=1, rnd=r) != a for r in range(5))
