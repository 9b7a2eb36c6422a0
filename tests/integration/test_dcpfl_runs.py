"""DC-PFL and FedGH end to end on mnist-5k with FedGH's five CNNs (a 500-d representation, one shared head), 3
clients of 2 classes each: the head trains from class statistics, the clock charges DC-PFL's ~10 MB covariance
upload, the run over MQTT with client processes gives the in-process accuracies, each personalized model exports
to ONNX, a crashed run resumes bit-identically, a client lying about its statistics is refused with its reason
while the others train on, and a fleet of different heads is refused before the first round."""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest
import torch

from device_profiles import get_profile, transfer_seconds
from device_profiles.constants import DIRECTION_DOWN, DIRECTION_UP
from edge_client.agent import ClientAgent
from fedge.checkpoint import load_tree, tree_digest
from fedge.wire.messages import Result, Task
from launch.cli import main as cli_main
from launch.client import client_agents, run_clients
from launch.runs import load_partitioned
from launch.simulation import run_simulation
from methods.dcpfl.class_stats import COUNTS, COVARIANCES, MEANS
from server.runlog import CHECKPOINT_FILE
from server.strategy import StrategyError

from helpers.federation import (
    Crash,
    Federation,
    crash_at,
    exports_score_their_accuracy,
    fedge_run_processes,
    make_config,
    read_rows,
    rows_without_wall_clock,
    run_inproc,
)

pytestmark = pytest.mark.timeout(600)
CLASSES, D = 10, 500  # mnist's classes; the representation of every fedgh_cnn (zoo "fedgh")
FLOAT = 4


def fleet(out, strategy="dcpfl", **kw):
    """3 clients with fedgh_cnn1..3 (one 500-d linear head), 2 classes each, 2 rounds."""
    settings = {"strategy": strategy, "zoo": "fedgh", "partition": "noniid", "classes_per_client": 2}
    return make_config(out, **(settings | kw))


def train_labels(cfg) -> dict[str, np.ndarray]:
    """Each client's training labels, as the run's partition gives them."""
    ds, partition = load_partitioned(cfg)
    return {str(s.client_id): ds.y[s.train] for s in partition.clients}


@pytest.fixture(scope="module")
def dcpfl_run(tmp_path_factory):
    """One in-process DC-PFL run (the reference of the MQTT run), and its folder."""
    out = tmp_path_factory.mktemp("dcpfl") / "run"
    return run_inproc(fleet(out)), out


def test_dcpfl_and_fedgh_train_one_head_and_the_clock_charges_their_uploads(dcpfl_run, tmp_path):
    dcpfl, dc_out = dcpfl_run
    fedgh = run_inproc(fleet(tmp_path / "fedgh", "fedgh"))
    labels = train_labels(fleet(tmp_path / "x"))
    classes = {cid: len(np.unique(y)) for cid, y in labels.items()}
    assert all(1 <= n <= 2 for n in classes.values())

    rows = {name: read_rows(out) for name, out in (("dcpfl", dc_out), ("fedgh", tmp_path / "fedgh"))}
    for name, summary in (("dcpfl", dcpfl), ("fedgh", fedgh)):
        assert summary["representation_size"] == D and summary["head"]["args"]["out_features"] == CLASSES
        assert summary["rejected_replies"] == {} and summary["rejected_messages"] == {}
        assert summary["never_trained"] == [] and summary["discarded_aggregates"] == []
        assert summary["models"] == {"0": "fedgh_cnn1", "1": "fedgh_cnn2", "2": "fedgh_cnn3"}
        assert sorted((r["round"], r["client"]) for r in rows[name]) == [(r, c) for r in (0, 1) for c in "012"]
        for r in rows[name]:
            assert r["trained"] and 0 <= r["accuracy"] <= 1, r
            assert r["classes_uploaded"] == classes[r["client"]] and r["num_examples"] == len(labels[r["client"]])
            # the clock charges the bytes each way at the client's profile
            profile = get_profile(r["profile"])
            charged = transfer_seconds(r["bytes_down"], profile, DIRECTION_DOWN)
            charged += transfer_seconds(r["bytes_up"], profile, DIRECTION_UP)
            assert r["sim_transfer_seconds"] == pytest.approx(charged, rel=1e-9)
        assert set(summary["final_accuracy"]["per_client"]) == {"0", "1", "2"}
    assert dcpfl["classes_with_statistics"] == len(np.unique(np.concatenate(list(labels.values()))))

    statistics = FLOAT * (CLASSES * D + CLASSES * D * D + CLASSES)  # means, covariances, counts
    prototypes = FLOAT * (CLASSES * D + CLASSES)
    for dc, gh in zip(rows["dcpfl"], rows["fedgh"], strict=True):
        assert (dc["round"], dc["client"]) == (gh["round"], gh["client"])
        assert dc["bytes_up"] >= statistics > 100 * gh["bytes_up"]
        assert prototypes <= gh["bytes_up"] < prototypes + 64 * 1024
        assert dc["sim_transfer_seconds"] > gh["sim_transfer_seconds"]
        # DC-PFL sends the global class means from round 1 on (L_kd then acts); FedGH never does
        assert gh["aux_loss"] == 0 and (dc["aux_loss"] > 0) == (dc["round"] > 0)
        assert (dc["bytes_down"] > gh["bytes_down"]) == (dc["round"] > 0)
        # training (3 x forward x samples x 1 epoch) plus the statistics pass: a forward and, for DC-PFL, z zᵀ
        n, macs = dc["num_examples"], dc["macs"]
        assert dc["train_macs"] == 3 * macs * n + (macs + D * D) * n and gh["train_macs"] == 3 * macs * n + macs * n
    assert dcpfl["sim_seconds_total"] > fedgh["sim_seconds_total"]


def test_over_mqtt_with_client_processes_it_matches_the_inproc_run(dcpfl_run, tmp_path):
    """`fedge run` on the embedded broker, clients as 2 processes: every ~10 MB statistics reply crosses the
    chunked wire, nothing is refused, and the accuracies are the in-process run's."""
    inproc, inproc_out = dcpfl_run
    cfg = fleet(tmp_path / "mqtt", transport="mqtt", round_deadline_s=120.0, register_timeout_s=120.0, run_id="dc")
    done = fedge_run_processes(cfg, tmp_path / "mqtt.json", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "mqtt" / "summary.json").read_text())
    assert not summary["rejected_messages"] and not summary["rejected_replies"] and not summary["never_trained"]
    rows = read_rows(tmp_path / "mqtt")
    assert len(rows) == 6 and all(r["trained"] and r["bytes_up"] > 10_000_000 for r in rows)
    assert summary["final_accuracy"]["per_client"] == inproc["final_accuracy"]["per_client"]
    assert summary["classes_with_statistics"] == inproc["classes_with_statistics"]
    a, b = (load_tree(out / CHECKPOINT_FILE)["strategy_state"] for out in (tmp_path / "mqtt", inproc_out))
    # the same head and statistics; to float rounding only, as the client processes may use other torch thread
    # counts than this one (reductions in another order)
    assert torch.equal(a["counts"], b["counts"])
    for x, y in [(a[k], b[k]) for k in ("means", "covariances")] + [
        (a["head"].state[k], b["head"].state[k]) for k in a["head"].state
    ]:
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-5)


def test_each_personalized_model_exports_to_onnx_and_scores_its_final_accuracy(dcpfl_run, tmp_path):
    """`fedge export --what student` takes the client's newest snapshot (its own extractor and head), checks
    ONNX parity, and the exported model scores on the client's test shard what the run reported for it."""
    summary, out = dcpfl_run
    assert exports_score_their_accuracy(out, summary, "student", "mnist-5k", tmp_path) == 3


def test_a_crashed_run_resumes_bit_identically(tmp_path, monkeypatch):
    def config(out):
        return fleet(out, rounds=3, transport="inproc")

    straight = run_simulation(config(tmp_path / "straight"), progress=False)
    crash_at(monkeypatch, rnd=2, nth=2)  # after round 1 sent global means: the resumed run must send the same
    with pytest.raises(Crash):
        run_simulation(config(tmp_path / "crashed"), progress=False)
    monkeypatch.undo()
    resumed = run_simulation(config(tmp_path / "crashed"), progress=False, resume=True)

    assert resumed["final_accuracy"] == straight["final_accuracy"]
    assert resumed["classes_with_statistics"] == straight["classes_with_statistics"]
    a, b = (load_tree(tmp_path / run / CHECKPOINT_FILE) for run in ("straight", "crashed"))
    assert tree_digest(a["strategy_state"]) == tree_digest(b["strategy_state"])
    assert rows_without_wall_clock(tmp_path / "crashed") == rows_without_wall_clock(tmp_path / "straight")


# ---------------------------------------------------------------------------------------------- a lying client


def asymmetric(t, n):
    cov = t[COVARIANCES].clone()
    c = int(torch.nonzero(t[COUNTS] > 1)[0])
    cov[c, 0, 1] += cov[c].abs().max() + 1.0
    return t | {COVARIANCES: cov}


def not_psd(t, n):
    cov = t[COVARIANCES].clone()
    c = int(torch.nonzero(t[COUNTS] > 1)[0])
    cov[c] = -cov[c] - torch.eye(cov.shape[1])  # symmetric, every eigenvalue <= -1
    return t | {COVARIANCES: cov}


def too_many(t, n):
    counts = t[COUNTS].clone()
    counts[int(torch.nonzero(counts)[0])] += n  # the counts now sum beyond the client's data
    return t | {COUNTS: counts}


def wrapping(t, n):
    counts = t[COUNTS].clone()
    counts[:3] = torch.tensor([2**63 - 1, 2**63 - 1, 3])  # an int64 sum that wraps around to 1
    return t | {COUNTS: counts}


def huge(t, n):
    means = t[MEANS].clone()
    means[int(torch.nonzero(t[COUNTS])[0]), 0] = 1e9
    return t | {MEANS: means}


def nan(t, n):
    means = t[MEANS].clone()
    means[int(torch.nonzero(t[COUNTS])[0]), 0] = float("nan")
    return t | {MEANS: means}


LIES = {
    "statistics_asymmetric": asymmetric,
    "statistics_not_psd": not_psd,
    "statistics_counts": too_many,
    "statistics_counts-wrapping": wrapping,
    "statistics_magnitude": huge,
    "tensors": nan,  # non-finite named tensors are refused before the strategy sees them
}


def lying(monkeypatch, liar: str, lie) -> None:
    """Client `liar` trains honestly, then edits the statistics of its every dc_train reply with `lie`."""
    handle = ClientAgent.handle

    def edited(agent: ClientAgent, task: Task) -> Result:
        res = handle(agent, task)
        if agent.client_id != liar or task.type != "dc_train":
            return res
        return dataclasses.replace(res, tensors=lie(dict(res.tensors), len(agent.data.y_train)))

    monkeypatch.setattr(ClientAgent, "handle", edited)


def assert_refused_and_others_trained(summary, out, code: str, labels, rounds: int) -> None:
    """Client 1 was refused with `code` every round; 0 and 2 trained every round; the pooled statistics are
    theirs alone."""
    assert summary["rejected_replies"] == {code: rounds} and summary["never_trained"] == ["1"]
    trained = sorted((r["round"], r["client"]) for r in read_rows(out) if r["trained"])
    assert trained == [(r, c) for r in range(rounds) for c in "02"]
    # a personalized run's final evaluation is of the clients that took part, so not the liar
    assert set(summary["final_accuracy"]["per_client"]) == {"0", "2"}
    honest = np.concatenate([labels["0"], labels["2"]])
    counts = load_tree(out / CHECKPOINT_FILE)["strategy_state"]["counts"]
    assert counts.tolist() == np.bincount(honest, minlength=CLASSES).tolist()


@pytest.mark.parametrize("lie", list(LIES))
def test_a_client_lying_about_its_statistics_is_refused_and_the_round_goes_on(tmp_path, monkeypatch, lie):
    """In process (cnn1, a 128-d head): each lie is refused by the coordinator with its own reason."""
    cfg = fleet(tmp_path / "run", zoo="cnn1")
    lying(monkeypatch, "1", LIES[lie])
    summary = run_inproc(cfg)
    assert_refused_and_others_trained(summary, tmp_path / "run", lie.split("-")[0], train_labels(cfg), 2)


@pytest.mark.timeout(240)
def test_over_mosquitto_a_client_with_a_non_psd_covariance_is_refused(tmp_path, monkeypatch):
    """Over Mosquitto: the server in a thread, honest clients 0 and 2 as a `fedge client` process, client 1 a
    real agent in this process whose replies carry a non-PSD covariance (d = 500, ~10 MB on the wire)."""
    cfg = fleet(tmp_path / "run", round_deadline_s=120.0, register_timeout_s=120.0)
    lying(monkeypatch, "1", not_psd)
    with Federation(tmp_path / "fed", cfg) as fed:
        honest = fed.start_clients(["0", "2"])
        server = fed.start_server(monkeypatch)
        agents = client_agents(cfg, ["1"])
        codes: list[int] = []
        liar = threading.Thread(target=lambda: codes.append(run_clients(agents, fed.credentials, cfg)), daemon=True)
        liar.start()
        server.join(180)
        assert server.error is None, server.error
        assert honest.wait(30) == 0, honest.log()
        liar.join(30)
    assert codes == [0]
    assert_refused_and_others_trained(server.summary, tmp_path / "run", "statistics_not_psd", train_labels(cfg), 2)


def measured_attack(t, n):
    """Issue 28's attack, within MAX_FEATURE_MAGNITUDE: every held class's mean at 9e5, its covariance 9e11·I."""
    held = t[COUNTS] > 0
    means, covs = t[MEANS].clone(), t[COVARIANCES].clone()
    means[held] = 9e5
    covs[held] = 9e11 * torch.eye(covs.shape[1])
    return t | {MEANS: means, COVARIANCES: covs}


def three_times(t, n):
    """Statistics of features 3x the client's own: within the round's bounds."""
    return t | {MEANS: 3 * t[MEANS], COVARIANCES: 9 * t[COVARIANCES]}


def test_one_liar_of_four_is_refused_against_the_round_or_moves_no_honest_accuracy(tmp_path, monkeypatch):
    """4 clients (cnn1), 3 rounds, the same seed: the honest run refuses nothing; the measured attack (which took
    the honest clients from 0.97 to 0.17 before the round's bounds) is refused as `statistics_scale` every round
    and the honest clients score as in the honest run; a lie within the bounds moves them by 2 points at most."""

    def run(name):
        cfg = fleet(tmp_path / name, zoo="cnn1", clients=4, rounds=3, local_epochs=2, max_samples_per_client=200)
        return run_inproc(cfg)

    honest = run("honest")
    assert honest["rejected_replies"] == {}
    lying(monkeypatch, "1", measured_attack)
    attacked = run("attacked")
    assert attacked["rejected_replies"] == {"statistics_scale": 3} and attacked["never_trained"] == ["1"]
    want = {cid: acc for cid, acc in honest["final_accuracy"]["per_client"].items() if cid != "1"}
    assert attacked["final_accuracy"]["per_client"] == want
    monkeypatch.undo()
    lying(monkeypatch, "1", three_times)
    within = run("within")
    got = within["final_accuracy"]["per_client"]
    assert all(abs(got[cid] - acc) <= 0.02 for cid, acc in want.items()), (got, want)


# ---------------------------------------------------------------------------------------------- setup


def test_a_fleet_with_different_heads_is_refused_before_the_first_round(tmp_path, capsys):
    """cnn1 (128-d) and fedgh_cnn1 (500-d) cannot share a head: the error names both groups of clients, and
    no round ran."""
    cfg = make_config(tmp_path / "run", strategy="dcpfl", zoo="cnn1,fedgh_cnn1")
    with pytest.raises(StrategyError, match="heads differ") as refused:
        run_inproc(cfg)
    message = str(refused.value)
    assert "clients ['0', '2'] have a 128-d representation" in message
    assert "clients ['1'] have a 500-d representation" in message
    assert read_rows(tmp_path / "run") == []

    config = tmp_path / "fedgh.json"  # `fedge run` ends with the error in one line and exits 2
    config.write_text(dataclasses.replace(cfg, strategy="fedgh", transport="inproc", out=str(tmp_path / "c")).to_json())
    assert cli_main(["run", "--config", str(config), "--no-progress"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("fedge: error: fedgh shares one classifier head, but this fleet's heads differ")
    assert "clients ['0', '2'] have a 128-d" in last and "clients ['1'] have a 500-d" in last
    assert read_rows(tmp_path / "c") == []
