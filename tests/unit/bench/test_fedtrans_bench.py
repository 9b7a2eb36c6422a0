"""bench/fedtrans.py: the Table 2 numbers of a run folder, the table's ratios to FedTrans, the direction checks on
hand-written numbers, and one tiny end-to-end run whose folder is reused when run again."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # bench/ is scripts, not an installed package

from bench import fedtrans  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def row(acc, tmacs, net=10.0, sim=1.0):
    return {"acc": acc, "iqr": 1.0, "tmacs": tmacs, "net_mb": net, "sim_h": sim, "server_s": 0.1, "server_share": 0.1}


def test_numbers_read_a_run_folder(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in ({"train_seconds": 2.0}, {"train_seconds": 4.0}, {"accuracy": 0.5}))
    )
    summary = {
        "final_accuracy": {"per_client": {"0": 0.5, "1": 0.7, "2": 0.9, "3": 1.0}},
        "train_macs_total": 3e12,
        "network_bytes_total": 5e6,
        "sim_seconds_total": 7200.0,
        "server_seconds": [0.3, 0.9],
    }
    n = fedtrans.numbers(summary, tmp_path)
    assert n["acc"] == pytest.approx(77.5) and n["iqr"] == pytest.approx(92.5 - 65.0)
    assert n["tmacs"] == 3.0 and n["net_mb"] == 5.0 and n["sim_h"] == 2.0
    assert n["server_s"] == pytest.approx(0.6) and n["server_share"] == pytest.approx(0.2)


def test_table_gives_ratios_to_fedtrans_and_checks_claim_a_direction_only_where_every_seed_agrees():
    rows = {
        "FedTrans": [row(80, 2.0), row(82, 2.0)],
        "HeteroFL": [row(70, 8.0), row(72, 8.0)],
        "FedTrans +l2s": [row(85, 2.0), row(83, 2.0)],
        "FedTrans -l (random cells)": [row(81, 2.0), row(81, 2.0)],
        "FedTrans -s (no soft agg.)": [row(75, 2.0), row(83, 2.0)],
        "local (cnn1)": [row(60, 1.0), row(61, 1.0)],
    }
    lines = fedtrans.table(rows)
    heterofl = next(line for line in lines if line.startswith("| HeteroFL"))
    assert "| 71.00 ± 1.41 |" in heterofl and "| 8.000 ± 0.000 | 4.00 |" in heterofl
    verdicts = fedtrans.checks(rows)
    assert verdicts[0] == (
        "- HOLDS: FedTrans > HeteroFL, FedTrans − HeteroFL = +10.00, +10.00 per seed (mean +10.00); "
        "training cost 2 vs 8 TMACs (0.25x)"
    )
    assert verdicts[1].startswith("- does NOT hold: FedTrans > +l2s")  # +l2s is better in both seeds
    assert verdicts[2].startswith("- within noise: FedTrans > FedTrans -l")  # one seed each way
    assert verdicts[3].startswith("- within noise: FedTrans > FedTrans -s")  # +5, -1: means 81 vs 79 are no direction
    assert verdicts[4].startswith("- HOLDS: FedTrans > local (cnn1)")


def test_a_tiny_benchmark_runs_and_reuses_its_finished_runs(tmp_path, capsys):
    argv = ["--datasets", "mnist", "--partitions", "iid", "--methods", "FedTrans", "local (cnn1)", "--seeds", "0"]
    argv += ["--rounds", "1", "--clients", "2", "--active", "2", "--samples", "40", "--out", str(tmp_path)]
    data = ROOT.parent / "shared" / "data" / "mnist.npz"
    if not data.exists():
        pytest.skip(f"needs {data}")
    assert fedtrans.main(argv) == 0
    first = capsys.readouterr().out
    assert "| FedTrans |" in first and "| local (cnn1) |" in first
    assert (tmp_path / "mnist-iid" / "time_to_accuracy.png").stat().st_size > 0
    stamp = (tmp_path / "mnist-iid" / "fedtrans-seed0" / "summary.json").stat().st_mtime_ns
    assert fedtrans.main(argv) == 0
    assert (tmp_path / "mnist-iid" / "fedtrans-seed0" / "summary.json").stat().st_mtime_ns == stamp


def test_heterofls_global_model_is_the_largest_model_fedtrans_grew_in_the_same_run(tmp_path, capsys, monkeypatch):
    """FedTrans App. A.1: HeteroFL is given the largest model FedTrans transformed; asking for HeteroFL alone runs
    the FedTrans run of its data and seed first. FedTrans here grows as soon as it can (β high, one reporter)."""
    data = ROOT.parent / "shared" / "data" / "mnist.npz"
    if not data.exists():
        pytest.skip(f"needs {data}")
    strategy, zoo, options = fedtrans.METHODS["FedTrans"]
    monkeypatch.setitem(fedtrans.METHODS, "FedTrans", (strategy, zoo, options | {"beta": 100.0, "growth_quorum": 1}))
    argv = ["--datasets", "mnist", "--partitions", "iid", "--methods", "HeteroFL", "--seeds", "0", "--rounds", "8"]
    argv += ["--clients", "5", "--active", "5", "--samples", "60", "--out", str(tmp_path)]
    assert fedtrans.main(argv) == 0
    runs = tmp_path / "mnist-iid"
    grown = json.loads(next(runs.glob("fedtrans-*seed0/summary.json")).read_text())
    largest = max(grown["chain"], key=lambda m: m["macs"])
    assert len(grown["chain"]) > 1 and largest["name"] != "cnn1"  # it grew
    heterofl = json.loads((runs / "heterofl-seed0" / "summary.json").read_text())
    assert heterofl["global_model"] == largest["name"] == grown["largest_model"]["name"]
    (spec_file,) = runs.glob("fedtrans-largest-seed0-*.json")
    assert json.loads(spec_file.read_text()) == grown["largest_model"]
    assert json.loads((runs / "heterofl-seed0" / "config.json").read_text())["options"]["model_file"] == str(spec_file)
    # the capacity tiers: client i has CAPACITY_TIERS[i % 5], so the grown model reaches every client but the first
    assert heterofl["capacity"] == {str(i): fedtrans.CAPACITY_TIERS[i] for i in range(5)}
    assert heterofl["rate"]["0"] < 1 and all(heterofl["rate"][str(i)] == 1 for i in range(1, 5))
