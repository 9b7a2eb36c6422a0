"""The simulated clock in real in-process runs: every metrics row carries it, the run's counters add up to the
rounds' times and the summary's totals to the rows, time_to_accuracy.png is drawn, a client that never replied
costs the deadline, and a checkpoint from before the clock still resumes."""

import json

import pytest

from fedge.brokers.transport import InProcTransport
from fedge.checkpoint import load_tree, save_tree
from fedge.config import config_from
from fedge.data.datasets import load_dataset
from fedge.data.partition import make_partition
from fedge.model.zoo import assign_models
from launch.client import make_agent
from launch.runs import partition_config
from launch.simulation import run_simulation
from server.coordinator import Coordinator, LoopConfig
from server.runlog import CHECKPOINT_FILE, RunLog
from server.strategy import StrategyConfig, create_strategy

pytestmark = pytest.mark.timeout(300)
CLIENT_FIELDS = {"sim_compute_seconds", "sim_transfer_seconds", "sim_seconds", "bytes_down", "bytes_up", "train_macs"}
ROUND_FIELDS = {"round_sim_seconds", "cumulative_sim_seconds", "cumulative_train_macs"}


def config(tmp_path, **kw):
    base = dict(
        strategy="fedavg",
        dataset="digits",
        zoo="cnn1",
        clients=4,
        active=3,
        rounds=3,
        local_epochs=1,
        batch_size=32,
        out=str(tmp_path / "run"),
        seed=2,
    )
    return config_from(base | kw)


def read_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def by_round(rows):
    out = {}
    for r in rows:
        out.setdefault(r["round"], []).append(r)
    return dict(sorted(out.items()))


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clock")
    summary = run_simulation(config(tmp), progress=False)
    return summary, tmp / "run"


def test_every_trained_row_carries_its_clients_exchange(fedavg_run):
    _, out = fedavg_run
    rows = read_rows(out)
    trained = [r for r in rows if r["trained"]]
    assert trained and all(CLIENT_FIELDS <= set(r) for r in trained)
    assert not any(CLIENT_FIELDS & set(r) for r in rows if not r["trained"])
    assert all(ROUND_FIELDS <= set(r) for r in rows)
    for r in trained:
        assert r["train_macs"] == 3 * r["macs"] * r["num_examples"] * 1  # FedAvg: no teacher, one epoch
        assert r["bytes_down"] > 4 * r["params"] and r["bytes_up"] > 4 * r["params"]  # the model goes both ways
        assert r["sim_seconds"] == pytest.approx(r["sim_compute_seconds"] + r["sim_transfer_seconds"])
        assert r["sim_compute_seconds"] > 0 and r["sim_transfer_seconds"] > 0
    assert "sim_train_seconds" not in trained[0]


def test_the_runs_counters_add_up_the_rounds(fedavg_run):
    summary, out = fedavg_run
    rounds = by_round(read_rows(out))
    clock, macs = 0.0, 0
    for rnd, rows in rounds.items():
        (round_s,) = {r["round_sim_seconds"] for r in rows}  # one value per round, on every row
        assert round_s == max(r["sim_seconds"] for r in rows if r["trained"])  # in-process: no deadline
        clock += round_s
        macs += sum(r["train_macs"] for r in rows if r["trained"])
        assert {r["cumulative_sim_seconds"] for r in rows} == {clock}, rnd
        assert {r["cumulative_train_macs"] for r in rows} == {macs}, rnd
    cumulative = [rows[0]["cumulative_sim_seconds"] for rows in rounds.values()]
    assert cumulative == sorted(cumulative) and len(set(cumulative)) == len(cumulative)

    on_disk = json.loads((out / "summary.json").read_text())
    every = read_rows(out)
    assert on_disk["sim_seconds_total"] == summary["sim_seconds_total"] == clock
    assert on_disk["train_macs_total"] == sum(r.get("train_macs", 0) for r in every) == macs
    assert on_disk["network_bytes_total"] == sum(r.get("bytes_down", 0) + r.get("bytes_up", 0) for r in every)


def test_the_run_folder_has_time_to_accuracy(fedavg_run):
    _, out = fedavg_run
    png = out / "time_to_accuracy.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def coordinator(tmp_path, name, loop, missing=(), resume=False):
    """A FedAvg federation of 4 real clients in one process; clients in `missing` never reply."""
    cfg = config(tmp_path, clients=4, active=4)
    ds = load_dataset(cfg.dataset)
    part = make_partition(ds.y, ds.num_classes, partition_config(cfg))
    models = assign_models(cfg.zoo, cfg.clients, cfg.seed)
    agents = [make_agent(cfg, ds, s, models[i], "rpi-4") for i, s in enumerate(part.clients)]
    handlers = {a.client_id: a.handle for a in agents if a.client_id not in missing}
    strategy = create_strategy("fedavg", StrategyConfig(local_epochs=1, batch_size=32, lr=1e-3, seed=0))
    clients = {a.client_id: a.info() for a in agents}
    return Coordinator(strategy, InProcTransport(handlers), clients, loop, RunLog(tmp_path / name, {}, resume=resume))


def test_a_client_that_never_replied_costs_the_round_its_deadline(tmp_path):
    loop = LoopConfig(1, 4, 0, 1, progress=False, min_replies=2, deadline_s=900.0)
    summary = coordinator(tmp_path, "late", loop, missing={"3"}).run()
    rows = read_rows(tmp_path / "late")
    assert {r["round_sim_seconds"] for r in rows} == {900.0} and summary["sim_seconds_total"] == 900.0
    assert not next(r for r in rows if r["client"] == "3")["trained"]

    without = LoopConfig(1, 4, 0, 1, progress=False, min_replies=2)  # in-process: no deadline
    coordinator(tmp_path, "inproc", without, missing={"3"}).run()
    rows = read_rows(tmp_path / "inproc")
    assert {r["round_sim_seconds"] for r in rows} == {max(r["sim_seconds"] for r in rows if r["trained"])}


def test_a_checkpoint_from_before_the_clock_resumes_with_the_clock_at_zero(tmp_path):
    coordinator(tmp_path, "old", LoopConfig(2, 4, 0, 1, progress=False)).run()
    path = tmp_path / "old" / CHECKPOINT_FILE
    tree = load_tree(path)
    tree["next_round"] = 1
    del tree["sim_clock"]  # as written before the clock existed
    save_tree(path, tree)

    summary = coordinator(tmp_path, "old", LoopConfig(2, 4, 0, 1, progress=False), resume=True).run(resume=True)

    last = [r for r in read_rows(tmp_path / "old") if r["round"] == 1]
    assert {r["cumulative_sim_seconds"] for r in last} == {last[0]["round_sim_seconds"]}
    assert summary["sim_seconds_total"] == last[0]["round_sim_seconds"]
