"""reliability-notes §10 test 9: SIGKILL the server during round k+1, after round k's checkpoint; the
restarted `fedge server --resume` continues at round k+1 and ends in the same state as a run that was
never interrupted (deterministic CPU training, same seed)."""

import json
import signal

import pytest

from fedge.checkpoint import CheckpointError, load_tree, save_tree, tree_digest

from helpers.federation import Federation, make_config, run_inproc, wait_until

pytestmark = pytest.mark.timeout(420)


def next_round(out) -> int:
    """The round the run folder's checkpoint would resume at (0 while there is none)."""
    try:
        return int(load_tree(out / "checkpoint.safetensors")["next_round"])
    except (CheckpointError, OSError):
        return 0


def test_server_killed_mid_run_resumes_to_the_uninterrupted_result(tmp_path):
    settings = dict(
        strategy="pfedclub",
        zoo="I",
        dataset="digits",
        rounds=3,
        max_samples_per_client=None,
        round_deadline_s=60.0,
        seed=11,
        server_threads=1,  # as the reference in this process: the same bits as over MQTT (test_transports_agree.py)
    )
    reference = run_inproc(make_config(tmp_path / "reference", **settings))
    cfg = make_config(tmp_path / "run", **settings)
    out = tmp_path / "run"
    with Federation(tmp_path / "fed", cfg) as fed:
        clients = fed.start_clients([str(i) for i in range(cfg.clients)])
        first = fed.start_server_process("--out", str(out))
        wait_until(lambda: next_round(out) >= 1 or not first.alive(), 300, "the checkpoint of round 0")
        assert first.alive(), first.log()
        first.signal(signal.SIGKILL)  # in round 1: the clients are training or the server is aggregating
        first.wait()
        assert next_round(out) in (1, 2) and "resuming" not in first.log()
        second = fed.start_server_process("--resume", str(out))
        assert second.wait(300) == 0, second.log()
        assert "resuming pfedclub at round" in second.log()
        assert clients.wait(60) == 0, clients.log()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] == reference["final_accuracy"]
    resumed, uninterrupted = (load_tree(p / "checkpoint.safetensors") for p in (out, tmp_path / "reference"))
    assert tree_digest(resumed["strategy_state"]) == tree_digest(uninterrupted["strategy_state"])
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(rounds)) == [0, 1, 2] and rounds == sorted(rounds)  # no round lost or written twice


@pytest.mark.parametrize(
    "checkpoint, error",
    [
        (b"\x00garbage" * 100, "cannot be read"),
        ({"strategy": "local", "clients": ["0", "1", "2"], "seed": 0, "active": 3}, "written with strategy='local'"),
    ],
)
def test_a_bad_checkpoint_is_reported_before_waiting_for_the_fleet(tmp_path, checkpoint, error):
    cfg = make_config(tmp_path / "run", register_timeout_s=600.0)  # no client ever comes: only the check can end it
    out = tmp_path / "run"
    out.mkdir()
    if isinstance(checkpoint, bytes):
        (out / "checkpoint.safetensors").write_bytes(checkpoint)
    else:
        save_tree(out / "checkpoint.safetensors", checkpoint)
    with Federation(tmp_path / "fed", cfg) as fed:
        server = fed.start_server_process("--resume", str(out))
        assert server.wait(120) == 2, server.log()
    assert error in server.log() and "waiting up to" not in server.log()
