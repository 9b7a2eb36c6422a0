"""A mixed fleet: Raspberry Pi clients train in eager PyTorch, Android clients through ExecuTorch training programs
(BN-free CNNs, and BatchNorm models: a MobileNet and CNN4), in one pFedClub run over MQTT (`fedge run`, clients as
processes), with the same results as in one process."""

import json

import pytest

from fedge.config import RunConfig, config_from

from helpers.federation import fedge_run_processes, read_rows, run_inproc

pytestmark = pytest.mark.timeout(600)
RUNTIMES = {"0": "torch", "1": "executorch", "2": "torch", "3": "executorch"}


def mixed(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        strategy="pfedclub",
        dataset="digits",
        zoo="cnn4,cnn2,cnn3,cnn1",
        profiles=("rpi-4", "android-mid-range"),
        clients=4,
        active=4,
        rounds=2,
        local_epochs=1,
        finetune_epochs=1,
        finetune_min_steps=0,
        max_candidates=2,
        batch_size=16,
        seed=3,
        out=str(tmp_path / name),
        heartbeat_s=1.0,
        round_deadline_s=300.0,
        register_timeout_s=300.0,
        run_id="mixed",
        export_onnx=False,
    )
    return config_from(base | kw)


def test_a_mixed_torch_and_executorch_fleet_completes_pfedclub_over_mqtt(tmp_path):
    # prepare
    cfg = mixed(tmp_path, "mqtt")
    done = fedge_run_processes(cfg, tmp_path / "mqtt.json", timeout=540)
    # assert: every client trained in every round on its profile's runtime, and distilled in round 1
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "mqtt" / "summary.json").read_text())
    assert not summary["rejected_messages"] and not summary["failed_rounds"]
    assert summary["runtimes"] == RUNTIMES and "runtime" in done.stdout
    # the server shares the machine with the client processes: one torch thread, in config.json and used
    recorded = json.loads((tmp_path / "mqtt" / "config.json").read_text())
    assert recorded["server_threads"] == summary["server_threads"] == 1
    got = read_rows(tmp_path / "mqtt")
    assert {(r["round"], r["client"]) for r in got if r["trained"]} == {(r, c) for r in (0, 1) for c in RUNTIMES}
    assert all(r["runtime"] == RUNTIMES[r["client"]] for r in got)
    assert all(r["kd_loss"] > 0 for r in got if r["round"] == 1)
    # the same run in one process gives the same accuracies: ExecuTorch training is deterministic too
    inproc = run_inproc(mixed(tmp_path, "inproc"))
    assert summary["final_accuracy"]["per_client"] == inproc["final_accuracy"]["per_client"]


def test_android_mobilenet_and_cnn4_train_through_executorch_in_a_mixed_fleet_over_mqtt(tmp_path):
    # prepare: BatchNorm models on the Android clients (1: mobilenet_v2, 3: cnn4), BN-free CNNs on the Pis
    cfg = mixed(tmp_path, "bn", zoo="cnn2,mobilenet_v2,cnn1,cnn4")
    done = fedge_run_processes(cfg, tmp_path / "bn.json", timeout=540)
    # assert: every client trained in every round on its profile's runtime, and distilled in round 1
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "bn" / "summary.json").read_text())
    assert not summary["rejected_messages"] and not summary["failed_rounds"]
    assert summary["runtimes"] == RUNTIMES
    got = read_rows(tmp_path / "bn")
    assert {(r["round"], r["client"]) for r in got if r["trained"]} == {(r, c) for r in (0, 1) for c in RUNTIMES}
    assert all(r["runtime"] == RUNTIMES[r["client"]] for r in got)
    assert all(r["kd_loss"] > 0 for r in got if r["round"] == 1)


def test_executorch_clients_run_the_teacher_programs_the_server_shipped(tmp_path):
    # execute: in one process (make_strategy gives pFedClub the server's teacher program exporter)
    summary = run_inproc(mixed(tmp_path, "ship"))
    # assert: in round 1 every executorch client distilled from a shipped program and said which one it ran;
    # torch clients got the weights as before
    got = [r for r in read_rows(tmp_path / "ship") if r["round"] == 1 and r["trained"]]
    android = [r for r in got if RUNTIMES[r["client"]] == "executorch"]
    assert android and all(len(r["teacher_pte_sha256"]) == 64 and r["kd_loss"] > 0 for r in android)
    assert all("teacher_pte_sha256" not in r for r in got if RUNTIMES[r["client"]] == "torch")
    assert 1 <= summary["teacher_programs_exported"] <= len(android)
