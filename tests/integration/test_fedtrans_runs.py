"""FedTrans end to end on mnist-5k: the chain grows during a run, clients are sent models of their capacities,
final models are exported to ONNX, a crashed run resumes bit-identically, and over MQTT the models of different
sizes travel both ways and give the in-process run's accuracies."""

import json

import pytest

from fedge import constants as C
from fedge.checkpoint import load_tree, tree_digest
from fedge.model.weights import load_model
from launch.cli import main as cli_main
from launch.simulation import run_simulation
from server.runlog import CHECKPOINT_FILE

from helpers.federation import (
    Crash,
    crash_at,
    fedge_run_processes,
    make_config,
    read_rows,
    rows_without_wall_clock,
    run_inproc,
)

pytestmark = pytest.mark.timeout(600)
GROW_FAST = {"gamma": 1, "delta": 1, "beta": 10.0}  # a transformation whenever the newest model has 2 rounds


def fleet(out, **kw):
    """Clients 0 and 2 on rpi-zero-2w (9.2 M MACs, 0.8 M params), client 1 on rpi-4, all registering cnn1."""
    settings = {"strategy": "fedtrans", "zoo": "cnn1", "profiles": "rpi-zero-2w,rpi-4", "clients": 3, "rounds": 4}
    return make_config(out, **(settings | GROW_FAST | kw))


def test_the_chain_grows_and_each_client_gets_models_within_its_capacity(tmp_path):
    out = tmp_path / "run"
    summary = run_inproc(fleet(out))
    chain = summary["chain"]
    assert len(chain) >= 2 and chain[1]["macs"] > chain[0]["macs"] and summary["transforms"]
    rows = read_rows(out)
    for r in rows:
        if r["trained"]:
            assert r["assigned_macs"] <= r["capacity"]
            assert r["assigned_params"] <= (800_000 if r["profile"] == "rpi-zero-2w" else 12_000_000)
    assert set(summary["final_accuracy"]["per_client"]) == {"0", "1", "2"}
    for cid, name in summary["eval_models"].items():
        folder = out / C.FINAL_MODELS_DIR / cid
        spec, _ = load_model(folder / "model.safetensors")
        assert spec.name == name and (folder / "model.onnx").stat().st_size > 0
    argv = ["export", str(out), "--client", "1", "--what", "model", "--format", "onnx", "--out", str(tmp_path / "x")]
    assert cli_main(argv) == 0  # `fedge export` re-exports the model FedTrans chose, parity-checked
    assert (tmp_path / "x" / "client1-model.onnx").exists()


def test_a_crashed_run_resumes_bit_identically(tmp_path, monkeypatch):
    def config(out):
        return fleet(out, rounds=5, transport="inproc")

    straight = run_simulation(config(tmp_path / "straight"), progress=False)
    crash_at(monkeypatch, rnd=3, nth=2)
    with pytest.raises(Crash):
        run_simulation(config(tmp_path / "crashed"), progress=False)
    monkeypatch.undo()
    resumed = run_simulation(config(tmp_path / "crashed"), progress=False, resume=True)

    assert len(straight["chain"]) >= 2
    assert resumed["final_accuracy"] == straight["final_accuracy"] and resumed["chain"] == straight["chain"]
    a, b = (load_tree(tmp_path / run / CHECKPOINT_FILE) for run in ("straight", "crashed"))
    assert tree_digest(a["strategy_state"]) == tree_digest(b["strategy_state"])
    assert rows_without_wall_clock(tmp_path / "crashed") == rows_without_wall_clock(tmp_path / "straight")


def test_over_mqtt_with_client_processes_it_matches_the_inproc_run(tmp_path):
    cfg = fleet(tmp_path / "mqtt", transport="mqtt", round_deadline_s=120.0, register_timeout_s=120.0, run_id="ft")
    done = fedge_run_processes(cfg, tmp_path / "mqtt.json", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "mqtt" / "summary.json").read_text())
    assert not summary["rejected_messages"] and not summary["rejected_replies"]
    assert len(summary["chain"]) >= 2
    sizes = {r["assigned_params"] for r in read_rows(tmp_path / "mqtt") if r["trained"]}
    assert len(sizes) >= 2  # models of different sizes went over the wire
    inproc = run_inproc(fleet(tmp_path / "inproc"))
    assert summary["final_accuracy"]["per_client"] == inproc["final_accuracy"]["per_client"]
    assert summary["chain"] == inproc["chain"]
