"""One client of four lying *within* the old bounds (issue 28), in-process on the same seed as an all-honest run:
uploading -9.9 x what it was sent (FedAvg's global model; FedMN's blocks and router, every path on) is refused as an
update outlier every round it replies, and the honest run refuses nothing; a reversed update x 8, inside the outlier
bound, is clipped to the round's median; every averaging strategy runs with every robust aggregator."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from fedge import constants as C
from launch.simulation import run_simulation

from helpers.federation import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is scripts, not an installed package
from bench.robust import liar  # noqa: E402

pytestmark = pytest.mark.timeout(300)
LIAR, ROUNDS = "0", 3
FLEETS = {"fedavg": {"zoo": "cnn1"}, "fedmn": {"zoo": "fedmn_2x2_cnn1"}}


def run(tmp_path: Path, name: str, strategy: str, attack: str | None = None, **kw) -> dict:
    settings = {"clients": 4, "rounds": ROUNDS, "transport": "inproc", "export_onnx": False}
    cfg = make_config(tmp_path / name, strategy=strategy, **settings | FLEETS.get(strategy, {}) | kw)
    return run_simulation(cfg, progress=False, adversaries={LIAR: liar(attack)} if attack else None)


@pytest.mark.parametrize(
    "strategy, code",
    # FedMN: the liar never gets a route (its replies are refused), so it is always sent every path on, a task that
    # learns no routing, and its changed router is refused before its update is measured
    [("fedavg", "update_outlier"), ("fedmn", "route")],
)
def test_an_upload_of_minus_9_9_times_what_was_sent_is_refused_every_round(tmp_path, strategy, code):
    honest = run(tmp_path, "honest", strategy)
    attacked = run(tmp_path, "attacked", strategy, "scaled")
    assert honest["rejected_replies"] == {} and honest["discarded_aggregates"] == []
    assert attacked["rejected_replies"] == {code: ROUNDS}
    assert LIAR in attacked["never_trained"] or strategy == "fedmn"  # FedMN evaluates every client it routed
    others = [cid for cid in attacked["final_accuracy"]["per_client"] if cid != LIAR]
    assert others and all(math.isfinite(attacked["final_accuracy"]["per_client"][c]) for c in others)


def test_a_reversed_update_inside_the_outlier_bound_is_clipped_to_the_rounds_median(tmp_path):
    attacked = run(tmp_path, "attacked", "fedavg", "flipped")
    clipped = attacked["clipped_updates"]
    assert clipped.get(LIAR, 0) > 0, clipped
    assert all(n <= clipped[LIAR] for n in clipped.values())
    unclipped = run(tmp_path, "unclipped", "fedavg", "flipped", clip_factor=0.0)
    assert unclipped["clipped_updates"] == {}


@pytest.mark.parametrize("aggregator", [a for a in C.AGGREGATORS if a != "mean"])
@pytest.mark.parametrize(
    "strategy, fleet",
    [("fedavg", {}), ("heterofl", {"zoo": "cnn2,cnn1"}), ("fedtrans", {"zoo": "cnn1"}), ("fedmn", {})],
)
def test_every_averaging_strategy_runs_with_every_robust_aggregator(tmp_path, strategy, fleet, aggregator):
    summary = run(tmp_path, "run", strategy, aggregator=aggregator, rounds=1, dataset="digits", **fleet)
    accuracies = summary["final_accuracy"]["per_client"].values()
    assert summary["discarded_aggregates"] == [] and accuracies and all(0 <= a <= 1 for a in accuracies)
