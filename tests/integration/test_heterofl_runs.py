"""HeteroFL end to end in one process on mnist-5k: a mixed fleet trains submodels of different widths, is
evaluated on them, leaves them as final models; a crashed run resumes bit-identically."""

import json

import pytest

from fedge import constants as C
from fedge.checkpoint import load_tree, tree_digest
from fedge.model.weights import load_model
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


def mixed(out, **kw):
    """Clients 0 and 2 on rpi-zero-2w with cnn1, client 1 on rpi-4 with cnn4 (the global model)."""
    return make_config(
        out, strategy="heterofl", zoo="cnn1,cnn4", profiles="rpi-zero-2w,rpi-4", clients=3, rounds=2, **kw
    )


def test_a_mixed_fleet_trains_submodels_of_its_capacities(tmp_path):
    summary = run_inproc(mixed(tmp_path / "run"))
    out = tmp_path / "run"
    rows = read_rows(out)
    by_client = {r["client"]: r for r in rows if r["round"] == 1}
    # cnn4 at 1/2 needs 10.8 M MACs, over the zero's 9.2 M; 1/4 fits
    assert {cid: r["rate"] for cid, r in by_client.items()} == {"0": 0.25, "1": 1.0, "2": 0.25}
    assert by_client["0"]["assigned_model"] == "cnn4@0.25" and by_client["1"]["assigned_model"] == "cnn4"
    assert by_client["0"]["assigned_macs"] <= by_client["0"]["capacity"] == 9_200_000
    assert all(r["trained"] and 0 <= r["accuracy"] <= 1 for r in rows)
    assert set(summary["final_accuracy"]["per_client"]) == {"0", "1", "2"}
    assert summary["rate"] == {"0": 0.25, "1": 1.0, "2": 0.25} and summary["global_model"] == "cnn4"
    for cid, name in (("0", "cnn4@0.25"), ("1", "cnn4")):
        folder = out / C.FINAL_MODELS_DIR / cid
        spec, _ = load_model(folder / "model.safetensors")
        assert spec.name == name and (folder / "model.onnx").stat().st_size > 0
    state = load_tree(out / CHECKPOINT_FILE)["strategy_state"]["global"]
    assert state.spec.name == "cnn4"


def test_a_crashed_run_resumes_bit_identically(tmp_path, monkeypatch):
    capacities = tmp_path / "capacity.json"
    capacities.write_text(json.dumps({"0": 10**9, "1": 3_000_000, "2": 700_000}))

    def config(out):
        return make_config(
            out, strategy="heterofl", zoo="cnn2", rounds=3, transport="inproc", capacity_file=str(capacities)
        )

    straight = run_simulation(config(tmp_path / "straight"), progress=False)
    crash_at(monkeypatch, rnd=2, nth=2)
    with pytest.raises(Crash):
        run_simulation(config(tmp_path / "crashed"), progress=False)
    monkeypatch.undo()
    resumed = run_simulation(config(tmp_path / "crashed"), progress=False, resume=True)

    assert len(set(straight["rate"].values())) == 3
    assert resumed["final_accuracy"] == straight["final_accuracy"] and resumed["rate"] == straight["rate"]
    a, b = (load_tree(tmp_path / run / CHECKPOINT_FILE) for run in ("straight", "crashed"))
    assert tree_digest(a["strategy_state"]) == tree_digest(b["strategy_state"])
    assert rows_without_wall_clock(tmp_path / "crashed") == rows_without_wall_clock(tmp_path / "straight")


def test_over_mqtt_with_client_processes_it_matches_the_inproc_run(tmp_path):
    """`fedge run` on the embedded broker, clients as 2 processes: submodels of three sizes go over the wire both
    ways (each reply sized by its own submodel), nothing is refused, and the accuracies are the in-process run's."""
    cfg = mixed(tmp_path / "mqtt", transport="mqtt", round_deadline_s=120.0, register_timeout_s=120.0, run_id="hfl")
    done = fedge_run_processes(cfg, tmp_path / "mqtt.json", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "mqtt" / "summary.json").read_text())
    assert not summary["rejected_messages"] and not summary["rejected_replies"]
    assert summary["rate"] == {"0": 0.25, "1": 1.0, "2": 0.25}
    sizes = {r["client"]: r["assigned_params"] for r in read_rows(tmp_path / "mqtt") if r["trained"]}
    assert sizes["0"] == sizes["2"] < sizes["1"]
    inproc = run_inproc(mixed(tmp_path / "inproc"))
    assert summary["final_accuracy"]["per_client"] == inproc["final_accuracy"]["per_client"]
