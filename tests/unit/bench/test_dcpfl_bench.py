"""bench/dcpfl.py: the table beside the paper's numbers, the direction checks on hand-written accuracies, and one tiny
end-to-end run whose Table 3 reuses Table 1's DC-PFL run and whose folders are reused when run again."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # bench/ is scripts, not an installed package

from bench import dcpfl  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_the_table_puts_the_papers_numbers_beside_ours_and_skips_methods_not_run():
    results = {"K=10, 100%": {"local": [70.0, 72.0], "DC-PFL": [80.0, 80.0]}}
    lines = dcpfl.table12(results, ["local", "FedGH", "DC-PFL"])
    assert lines[2] == "| local | 71.00 ± 1.41 | 92.57 |"
    assert lines[3] == "| DC-PFL | 80.00 ± 0.00 | 96.31 |"
    assert len(lines) == 4  # FedGH was not run: no row


def test_checks_claim_a_direction_only_where_every_seed_agrees():
    results = {
        "K=10, 100%": {
            "local": [75.0, 70.0],
            "FedGH": [74.0, 71.0],  # one seed above local, one below: within noise
            "DC-PFL": [80.0, 78.0],
            "w/o AL": [81.0, 79.0],
            "w/o GC": [79.0, 77.5],
        }
    }
    verdicts = dcpfl.checks12(results)
    assert verdicts == [
        "- K=10, 100%: HOLDS: DC-PFL > FedGH, DC-PFL − FedGH = +6.00, +7.00 per seed (mean +6.50)",
        "- K=10, 100%: within noise: FedGH > local, FedGH − local = -1.00, +1.00 per seed (mean +0.00)",
        "- K=10, 100%: HOLDS: DC-PFL > local, DC-PFL − local = +5.00, +8.00 per seed (mean +6.50)",
        "- K=10, 100%: does NOT hold: DC-PFL > w/o AL, DC-PFL − w/o AL = -1.00, -1.00 per seed (mean -1.00)",
        "- K=10, 100%: HOLDS: DC-PFL > w/o GC, DC-PFL − w/o GC = +1.00, +0.50 per seed (mean +0.75)",
    ]


def test_a_tiny_benchmark_runs_and_reuses_its_finished_runs(tmp_path, capsys):
    data = ROOT.parent / "shared" / "data" / "cifar10.npz"
    if not data.exists():
        pytest.skip(f"needs {data}")
    argv = ["--tables", "1", "3", "--settings", "K=10, 100%", "--methods", "local", "DC-PFL", "--seeds", "0"]
    argv += ["--rounds", "1", "--local-epochs", "1", "--samples", "30", "--data", str(data), "--out", str(tmp_path)]
    assert dcpfl.main(argv) == 0
    out = capsys.readouterr().out
    assert "| local |" in out and "| DC-PFL |" in out and "| 5,000 |" in out
    summaries = sorted(tmp_path.glob("*/*/summary.json"))
    assert len(summaries) == 2 + 4  # Table 3's Σ|G_c| = 1,000 is Table 1's DC-PFL run
    # a finished run keeps its numbers, not its clients' snapshots or its checkpoint
    assert not list(tmp_path.glob("*/*/clients")) and not list(tmp_path.glob("*/*/checkpoint.safetensors"))
    assert all((p.parent / "metrics.jsonl").exists() for p in summaries)
    stamps = [p.stat().st_mtime_ns for p in summaries]
    assert dcpfl.main(argv) == 0
    assert [p.stat().st_mtime_ns for p in summaries] == stamps
