"""pFedClub, pFedClub+ and pFedHR end to end in one process, on tiny data: records, bounds, kept teachers."""

import json

import pytest

from fedge.config import config_from
from launch.simulation import run_simulation

pytestmark = pytest.mark.timeout(600)


def run(tmp_path, strategy, **kw):
    base = dict(
        strategy=strategy,
        dataset="digits",
        zoo="I",
        clients=5,
        active=3,
        rounds=2,
        local_epochs=1,
        batch_size=32,
        finetune_epochs=1,
        finetune_min_steps=0,
        out=str(tmp_path / strategy),
        seed=1,
    )
    cap = {"max_candidates": 2} if strategy.startswith("pfedclub") else {}
    summary = run_simulation(config_from(base | cap | kw), progress=False)
    rows = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if r["trained"]]


def test_pfedclub_plus_never_exceeds_the_bound(tmp_path):
    summary, rows = run(tmp_path, "pfedclub+", eta=0.1)
    with_teacher = [r for r in rows if r.get("teacher_params") is not None]
    assert with_teacher, "no client got a teacher"
    for r in with_teacher:
        assert r["teacher_params"] <= 1.1 * r["params"] + 1e-9, r
        assert r["teacher_fits_profile"] is True
        assert r["phi"] == pytest.approx((r["teacher_params"] - r["params"]) / r["params"])
    assert set(summary["phi"]) == {r["client"] for r in with_teacher}
    assert all(v <= 0.1 + 1e-9 for v in summary["phi"].values())
    for key in ("teacher_params", "candidates_per_client", "final_accuracy", "server_seconds"):
        assert key in summary
    for plot in ("accuracy.png", "phi.png", "server_time.png"):
        assert (tmp_path / "pfedclub+" / plot).stat().st_size > 0


def test_pfedclub_records_origins_and_stage_times(tmp_path):
    summary, rows = run(tmp_path, "pfedclub")
    r = next(r for r in rows if r.get("teacher_params") is not None)
    assert all(f"time_{s}" in r for s in ("features", "grouping", "candidates", "finetune", "matching"))
    assert r["teacher_origins"] and all(o == "stitch" or "@" in o for o in r["teacher_origins"])
    assert r["candidates"] >= 1
    # first participation trains with CE only; a later one distills from the kept teacher
    first = {}
    for row in sorted(rows, key=lambda x: x["round"]):
        first.setdefault(row["client"], row)
    assert all(row["kd_loss"] == 0 for row in first.values())


def test_pfedhr_runs_and_records_teachers(tmp_path):
    summary, rows = run(tmp_path, "pfedhr")
    assert summary["strategy"] == "pfedhr"
    assert any(r.get("teacher_params") for r in rows)


def test_unlabeled_public_data_path(tmp_path):
    summary, rows = run(tmp_path, "pfedclub", public="unlabeled", rounds=1)
    assert json.loads((tmp_path / "pfedclub" / "config.json").read_text())["options"]["public"] == "unlabeled"
    assert any(r.get("teacher_params") for r in rows)
