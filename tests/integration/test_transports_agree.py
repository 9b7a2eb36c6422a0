"""The in-process simulation, its clients on worker processes, and a run over MQTT train the same models bit for bit,
for every registered strategy: each client's final snapshot, the server's strategy state and every round's numbers
are equal (issue 30: they were not, because the in-process run trained its clients at torch's default thread count
and `fedge run`'s client processes at one)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edge_client.agent import INITIAL_ROUND
from fedge.checkpoint import load_tree
from fedge.config import paper_fleets
from launch.simulation import one_thread, run_simulation
from server.runlog import CHECKPOINT_FILE
from server.strategy import STRATEGIES

from helpers.federation import (
    checkpoint_without_wall_clock,
    final_snapshots,
    make_config,
    outcome,
    over_embedded_broker,
    rows_without_wall_clock,
    run_inproc,
    same_tree,
)

pytestmark = pytest.mark.timeout(300)
# the zoo of the strategy's paper fleet (FedAvg and its relatives: cnn1; DC-PFL, FedGH: FedGH's CNNs; FedMN: its pool),
# but one model for the multi-width methods; Zoo I for the others
ZOOS = {"heterofl": "cnn1", "fedtrans": "cnn1"}


def zoo(strategy: str) -> str:
    fleet = paper_fleets().get(strategy)
    return ZOOS.get(strategy) or (fleet.values.get("zoo", "I") if fleet is not None else "I")


@pytest.fixture
def threads_restored():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def fleet(out: Path, strategy: str, **overrides):
    """3 clients, 2 rounds, the server at one torch thread; Zoo I's CNNs (three architectures, so the reassembly
    methods stitch) unless the strategy needs one model or one head."""
    values = {"zoo": zoo(strategy), "server_threads": 1, "round_deadline_s": 120.0} | overrides
    return make_config(out, strategy=strategy, **values)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_on_workers_and_over_mqtt_each_client_ends_with_the_in_process_runs_model(strategy, tmp_path, threads_restored):
    run_simulation(fleet(tmp_path / "inproc", strategy), progress=False)
    # 3 clients on 2 workers: when the one with a single client is done first, it takes the other's second client
    # (which then moves; test_workers.py makes a move certain)
    summary = run_simulation(fleet(tmp_path / "workers", strategy, workers=2), progress=False)
    assert summary["transport"]["workers"] == 2 and summary["transport"]["workers_replaced"] == 0
    assert rows_without_wall_clock(tmp_path / "workers") == rows_without_wall_clock(tmp_path / "inproc")
    assert same_tree(
        checkpoint_without_wall_clock(tmp_path / "workers"), checkpoint_without_wall_clock(tmp_path / "inproc")
    )
    workers = final_snapshots(tmp_path / "workers")
    torch.set_num_threads(1)  # the clients in threads of this process train as `fedge run`'s client processes do
    _, agents = over_embedded_broker(fleet(tmp_path / "mqtt", strategy))
    inproc = final_snapshots(tmp_path / "inproc")
    mqtt = {a.client_id: a.snapshots[max(a.snapshots)] for a in agents if max(a.snapshots) != INITIAL_ROUND}
    assert inproc.keys() == mqtt.keys() == workers.keys()
    for cid in inproc:
        assert same_tree(inproc[cid], mqtt[cid]), f"client {cid}'s final model differs over MQTT"
        assert same_tree(inproc[cid], workers[cid]), f"client {cid}'s final model differs on workers"
    states = [load_tree(tmp_path / run / CHECKPOINT_FILE)["strategy_state"] for run in ("inproc", "mqtt")]
    assert inproc or states[0]  # a model was compared: the clients' own, or the server's
    checkpoints = [checkpoint_without_wall_clock(tmp_path / run) for run in ("inproc", "mqtt")]
    assert same_tree(*checkpoints)  # the strategy's state, upload norms, update bounds, counters
    assert outcome(tmp_path / "inproc") == outcome(tmp_path / "mqtt")


def test_a_client_task_runs_at_one_torch_thread_whatever_the_process_uses(threads_restored):
    seen = []
    torch.set_num_threads(2)
    one_thread(lambda task: seen.append(torch.get_num_threads()))(None)
    assert seen == [1] and torch.get_num_threads() == 2


def test_fedge_run_inproc_trains_as_the_one_thread_reference(tmp_path):
    # The command line at torch's default thread count (every core) trains the clients and runs the server at one
    # thread, so it equals the reference that runs over MQTT reproduce (test_deploy_mqtt.py).
    cfg = fleet(tmp_path / "cli", "pfedclub", server_threads=0, transport="inproc")
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "launch.cli", "run", "--config", str(tmp_path / "cfg.json"), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    run_inproc(fleet(tmp_path / "reference", "pfedclub", server_threads=0))
    cli, reference = final_snapshots(tmp_path / "cli"), final_snapshots(tmp_path / "reference")
    assert cli.keys() == reference.keys() == {"0", "1", "2"}
    assert all(same_tree(cli[cid], reference[cid]) for cid in cli)
