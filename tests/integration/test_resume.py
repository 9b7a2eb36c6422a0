"""Server crash and resume (reliability notes §10 test 9): a run killed in round 2, after the checkpoint of
round 1, resumes from the run folder and ends bit-identical to a run that was never interrupted."""

import pytest

from fedge.checkpoint import CheckpointError, load_tree, save_tree, tree_digest
from fedge.config import config_from
from launch.simulation import run_simulation
from server.coordinator import Coordinator, check_resumable, run_identity
from server.runlog import CHECKPOINT_FILE

from helpers.federation import (
    Crash,
    checkpoint_without_wall_clock,
    crash_at,
    final_snapshots,
    read_rows,
    rows_without_wall_clock,
    same_tree,
)

pytestmark = pytest.mark.timeout(600)
# The reply's bytes hold the client's wall-clock metrics (helpers.federation.WALL_CLOCK_FIELDS), so simulated
# seconds may differ by a few bytes' upload per round: 64 B at 2.5 Mbit/s is 0.2 ms.
SIM_SLACK_S = 1e-3


def config(out, strategy, **kw):
    base = dict(
        strategy=strategy,
        dataset="digits",
        zoo="cnn1" if strategy == "fedavg" else "I",
        clients=5,
        active=3,
        rounds=3,
        local_epochs=1,
        batch_size=32,
        out=str(out),
        seed=1,
    )
    small = {"finetune_epochs": 1, "finetune_min_steps": 0} if strategy.startswith("pf") else {}  # reassembly options
    small |= {"max_candidates": 2} if strategy.startswith("pfedclub") else {}
    return config_from(base | small | kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """uninterrupted(strategy, **kw): the summary and folder of the run of config(.., strategy, **kw) that is never
    interrupted, run once per module (the crashed runs of several tests are compared with the same one)."""
    runs = {}

    def run(strategy, **kw):
        key = (strategy, tuple(sorted(kw.items())))
        if key not in runs:
            out = tmp_path_factory.mktemp(f"straight-{strategy}")
            runs[key] = run_simulation(config(out, strategy, **kw), progress=False), out
        return runs[key]

    return run


def check_clock(straight, crashed, checkpoint_of_round_1, strategy):
    """The resumed run's simulated clock continues from the checkpoint's counters exactly, and matches the
    uninterrupted run's (the simulated seconds up to a reply's few bytes of wall-clock metrics)."""
    a, b = read_rows(straight), read_rows(crashed)
    first = {r["round"]: r for r in b}
    saved = checkpoint_of_round_1["sim_clock"]
    assert saved["seconds"] == first[1]["cumulative_sim_seconds"]
    assert saved["train_macs"] == first[1]["cumulative_train_macs"]
    assert first[2]["cumulative_sim_seconds"] == saved["seconds"] + first[2]["round_sim_seconds"]
    for x, y in zip(a, b):
        assert x["cumulative_train_macs"] == y["cumulative_train_macs"]
        assert x["cumulative_sim_seconds"] == pytest.approx(y["cumulative_sim_seconds"], abs=SIM_SLACK_S)
        assert x.get("bytes_up", 0) == pytest.approx(y.get("bytes_up", 0), abs=64)
    trained = [r for r in a if r["trained"]]
    plain = [r["train_macs"] == 3 * r["macs"] * r["num_examples"] for r in trained]
    # fedavg trains without a teacher; pFedClub/pFedHR clients that trained before distill from one
    assert all(plain) if strategy == "fedavg" else not all(plain)


@pytest.mark.parametrize("strategy", ["fedavg", "pfedclub", "pfedhr"])
def test_a_crashed_run_resumes_bit_identically(tmp_path, monkeypatch, strategy, uninterrupted):
    straight, straight_out = uninterrupted(strategy)
    crash_at(monkeypatch, rnd=2, nth=2)
    with pytest.raises(Crash):
        run_simulation(config(tmp_path / "crashed", strategy), progress=False)
    monkeypatch.undo()
    saved = load_tree(tmp_path / "crashed" / CHECKPOINT_FILE)
    assert saved["next_round"] == 2

    resumed = run_simulation(config(tmp_path / "crashed", strategy), progress=False, resume=True)

    for key in ("final_accuracy", "never_trained", "client_status", "rejected_replies", "phi", "teacher_params"):
        assert resumed.get(key) == straight.get(key), key
    a, b = (load_tree(out / CHECKPOINT_FILE) for out in (straight_out, tmp_path / "crashed"))
    assert a["next_round"] == b["next_round"] == 3
    assert tree_digest(a["strategy_state"]) == tree_digest(b["strategy_state"])
    assert rows_without_wall_clock(tmp_path / "crashed") == rows_without_wall_clock(straight_out)
    assert len(resumed["server_seconds"]) == 3
    check_clock(straight_out, tmp_path / "crashed", saved, strategy)
    assert a["sim_clock"]["train_macs"] == b["sim_clock"]["train_macs"] == resumed["train_macs_total"]
    assert b["sim_clock"]["seconds"] == resumed["sim_seconds_total"]
    assert resumed["sim_seconds_total"] == pytest.approx(straight["sim_seconds_total"], abs=SIM_SLACK_S)


@pytest.mark.parametrize(
    ("strategy", "mode"),
    [
        ("fedavg", {"workers": 2}),
        ("pfedclub", {"workers": 2}),
        ("fedavg", {"engine": "ray", "workers": 2}),  # actors of a local Ray instance
        ("fedavg", {"engine": "batched", "workers": 2}),  # clients trained together: compared with a batched run
        ("pfedclub", {"engine": "batched", "workers": 2}),  # Zoo I's 3 of 5: groups of one, the serial run's bits
    ],
)
def test_a_run_on_workers_crashed_in_aggregation_resumes_bit_identically(
    tmp_path, monkeypatch, strategy, mode, uninterrupted
):
    # Every client of round 2 trained (on its worker, which snapshotted it) before the server died: the resumed
    # run's new workers (or batched clients) re-run round 2 from the snapshots before it.
    together = strategy == "fedavg" and mode.get("engine") == "batched"
    straight, straight_out = uninterrupted(strategy, **(mode if together else {}))
    aggregate = Coordinator.aggregate

    def crashing(coordinator, rnd, results):
        if rnd == 2:
            raise Crash
        aggregate(coordinator, rnd, results)

    monkeypatch.setattr(Coordinator, "aggregate", crashing)
    with pytest.raises(Crash):
        run_simulation(config(tmp_path / "crashed", strategy, **mode), progress=False)
    monkeypatch.undo()
    assert load_tree(tmp_path / "crashed" / CHECKPOINT_FILE)["next_round"] == 2

    resumed = run_simulation(config(tmp_path / "crashed", strategy, **mode), progress=False, resume=True)

    assert resumed["final_accuracy"] == straight["final_accuracy"]
    assert rows_without_wall_clock(tmp_path / "crashed") == rows_without_wall_clock(straight_out)
    crashed, clean = (checkpoint_without_wall_clock(out) for out in (tmp_path / "crashed", straight_out))
    assert same_tree(crashed, clean)
    assert same_tree(final_snapshots(tmp_path / "crashed"), final_snapshots(straight_out))


def test_resume_refuses_another_configuration_and_a_missing_checkpoint(tmp_path):
    run_simulation(config(tmp_path / "run", "local", rounds=1), progress=False)
    with pytest.raises(CheckpointError, match="seed"):
        run_simulation(config(tmp_path / "run", "local", rounds=2, seed=2), progress=False, resume=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_simulation(config(tmp_path / "empty", "local"), progress=False, resume=True)


def test_a_finished_run_can_be_extended_and_its_wall_seconds_add_up(tmp_path):
    first = run_simulation(config(tmp_path / "run", "local", rounds=1), progress=False)
    checkpoint = tmp_path / "run" / CHECKPOINT_FILE
    assert 0 < load_tree(checkpoint)["wall_seconds"] <= first["wall_seconds"]
    save_tree(checkpoint, load_tree(checkpoint) | {"wall_seconds": 1000.0})  # as if the first call took 1000 s
    summary = run_simulation(config(tmp_path / "run", "local", rounds=2), progress=False, resume=True)
    assert summary["rounds"] == 2 and len(summary["server_seconds"]) == 2
    assert 1000 < summary["wall_seconds"] < 1000 + first["wall_seconds"] + 600  # the second call's time added
    assert sorted({r["round"] for r in read_rows(tmp_path / "run")}) == [0, 1]


def test_a_checkpoint_from_before_widths_were_recorded_resumes_only_at_cpu_widths(tmp_path):
    identity = run_identity("local", ["0", "1"], 0, 2)
    older = {k: v for k, v in identity.items() if k != "widths"}  # what a checkpoint held before the key existed
    assert check_resumable(older, identity, tmp_path) is older
    with pytest.raises(CheckpointError, match="widths='cpu', this run has 'paper'"):
        check_resumable(older, run_identity("local", ["0", "1"], 0, 2, "paper"), tmp_path)


def test_resume_refuses_another_strategy_option(tmp_path):
    run_simulation(config(tmp_path / "run", "local", rounds=1, every_round=False), progress=False)
    with pytest.raises(CheckpointError, match="option every_round=False, this run has True"):
        run_simulation(config(tmp_path / "run", "local", rounds=2), progress=False, resume=True)
    summary = run_simulation(
        config(tmp_path / "run", "local", rounds=2, every_round=False), progress=False, resume=True
    )
    assert summary["rounds"] == 2


def test_a_checkpoint_from_before_options_were_recorded_resumes_unchecked(tmp_path, caplog):
    identity = run_identity("local", ["0", "1"], 0, 2, options={"every_round": True})
    older = {k: v for k, v in identity.items() if k != "options"}
    assert check_resumable(older, identity, tmp_path) is older
    assert "predates recording options" in caplog.text
    with pytest.raises(CheckpointError, match="option every_round=True, this run has False"):
        check_resumable(identity, run_identity("local", ["0", "1"], 0, 2, options={"every_round": False}), tmp_path)
    # an option added to the strategy after the checkpoint was written, one removed since, NaN and a tuple
    now = run_identity("local", ["0", "1"], 0, 2, options={"every_round": True, "new": 1, "x": float("nan")})
    then = run_identity("local", ["0", "1"], 0, 2, options={"every_round": True, "old": 2, "x": float("nan")})
    assert check_resumable(then, now, tmp_path) is then
    pair = run_identity("local", ["0"], 0, 1, options={"sizes": (1, 2)})
    assert pair["options"] == {"sizes": [1, 2]} and check_resumable(pair, pair, tmp_path) is pair
