"""bench/fedmn.py: the routing evolution of a hand-made metrics file, the Table II and Fig. 2 tables beside the paper's
numbers, the direction checks on hand-written numbers, and one tiny end-to-end run whose results.json has the
tables' structure and whose folders are reused when run again."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # bench/ is scripts, not an installed package

from bench import fedmn  # noqa: E402
from bench.fedtrans import read_rows  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_routing_evolution_counts_distinct_routings_and_changes_since_each_clients_previous_one(tmp_path):
    rows = [
        # round 0: three clients, two routings (client 2's row has none: it had not trained yet)
        {"round": 0, "client": "0", "routing": "1101"},
        {"round": 0, "client": "1", "routing": "1101"},
        {"round": 0, "client": "2", "accuracy": 0.1},
        # round 1: client 0 changes, client 1 keeps, client 2 gets its first
        {"round": 1, "client": "0", "routing": "0111"},
        {"round": 1, "client": "1", "routing": "1101"},
        {"round": 1, "client": "2", "routing": "1111"},
        # round 2: only client 2 reports (changed since round 1); client 0 reports the routing it had in round 1
        {"round": 2, "client": "0", "routing": "0111"},
        {"round": 2, "client": "2", "routing": "0111"},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert fedmn.routing_evolution(read_rows(tmp_path)) == [
        {"round": 0, "clients": 2, "distinct": 1, "compared": 0, "changed": 0},
        {"round": 1, "clients": 3, "distinct": 3, "compared": 2, "changed": 1},
        {"round": 2, "clients": 2, "distinct": 1, "compared": 2, "changed": 1},
    ]


def run(acc, sent, router=0, routing=None, params=1000, wire=4.0):
    out = {"acc": acc, "sent": sent, "router_sent": router, "params": params, "wire_mb": wire, "train_s": 0.5}
    if routing is not None:
        out |= {"routing": routing, "distinct_routes": routing[-1]["distinct"]}
    return out


def evo(*distinct_changed):
    return [
        {"round": i, "clients": 4, "distinct": d, "compared": 0 if i == 0 else 4, "changed": c}
        for i, (d, c) in enumerate(distinct_changed)
    ]


def test_table2_puts_the_papers_numbers_beside_ours_and_checks_the_directions():
    results = {
        "local": [run(70.0, 0), run(72.0, 0)],
        "FedAvg": [run(75.0, 8e6), run(75.0, 8e6)],
        "FedMN": [run(74.0, 4e6, 1e6, evo((1, 0), (2, 1))), run(76.0, 4e6, 1e6, evo((2, 0), (2, 0)))],
    }
    lines = fedmn.table2(results, rounds=10, clients=4)
    assert lines[2] == "| local | 71.00 ± 1.41 | 70.2 | 0.000 | 0.10 | 0.50 |"
    assert lines[3] == "| FedAvg | 75.00 ± 0.00 | 78.2 | 0.200 | 0.10 | 0.50 |"  # 8 M over 10 rounds x 4 clients
    assert lines[4].startswith("| FedMN | 75.00 ± 1.41 | 83.4 | 0.100 |") and len(lines) == 5
    verdicts = fedmn.checks2(results)
    assert verdicts[0] == "- within noise: FedMN > FedAvg, FedMN − FedAvg = -1.00, +1.00 per seed (mean +0.00)"
    assert verdicts[1].startswith("- HOLDS: FedAvg > local, FedAvg − local = +5.00, +3.00 per seed (mean +4.00) (fed")
    assert verdicts[2] == "- HOLDS: FedMN > local, FedMN − local = +4.00, +4.00 per seed (mean +4.00)"
    assert fedmn.mean_evolution(results["FedMN"]) == {0: (1.5, None), 1: (2.0, 0.5)}


def test_fig2_table_and_checks_compare_each_pool_with_the_mlp_of_as_many_blocks():
    results = {
        "FedMN [1×4×3]": [
            run(40.0, 10e6, 4e6, evo((2, 0)), params=1_455_281),
            run(41.0, 10e6, 4e6, evo((2, 0)), params=1_455_281),
        ],
        "FedMN [1×5×2]": [run(30.0, 13e6, 4e6, evo((1, 0))), run(36.0, 13e6, 4e6, evo((1, 0)))],
        "FedMN [1×4×5]": [run(38.0, 11e6, 4e6), run(39.0, 11e6, 4e6)],
        "FedAvg 8-layer MLP": [run(35.0, 12e6, params=1_184_010), run(35.0, 12e6, params=1_184_010)],
        "FedAvg 10-layer MLP": [run(33.0, 14e6), run(34.0, 14e6)],
    }
    lines = fedmn.fig2(results)
    assert lines[2] == "| FedMN [1×4×3] | 1.455 | 10.0 ± 0.0 | 4.0 | 4 | 40.50 ± 0.71 |"
    assert lines[5] == "| FedAvg 8-layer MLP | 1.184 | 12.0 ± 0.0 | 0.0 | 4 | 35.00 ± 0.00 |"
    assert fedmn.checks_fig2(results) == [
        "- HOLDS: FedMN [1×4×3] transmits 10.0 M < FedAvg 8-layer MLP 12.0 M",
        "- HOLDS: FedMN [1×4×3] without its router 6.0 M < FedAvg 8-layer MLP 12.0 M",
        "- HOLDS: FedMN [1×4×3] > FedAvg 8-layer MLP, FedMN [1×4×3] − FedAvg 8-layer MLP = +5.00, +6.00 per seed"
        " (mean +5.50)",
        "- does NOT hold: FedMN [1×5×2] transmits 13.0 M < FedAvg 8-layer MLP 12.0 M",
        "- HOLDS: FedMN [1×5×2] without its router 9.0 M < FedAvg 8-layer MLP 12.0 M",
        "- within noise: FedMN [1×5×2] > FedAvg 8-layer MLP, FedMN [1×5×2] − FedAvg 8-layer MLP = -5.00, +1.00 per"
        " seed (mean -2.00)",
        "- HOLDS: FedMN [1×4×5] transmits 11.0 M < FedAvg 10-layer MLP 14.0 M",  # 10 blocks: against the 10-layer MLP
        "- HOLDS: FedMN [1×4×5] without its router 7.0 M < FedAvg 10-layer MLP 14.0 M",
        "- HOLDS: FedMN [1×4×5] > FedAvg 10-layer MLP, FedMN [1×4×5] − FedAvg 10-layer MLP = +5.00, +5.00 per seed"
        " (mean +5.00)",
        "- HOLDS: FedAvg 8-layer MLP > FedAvg 10-layer MLP, FedAvg 8-layer MLP − FedAvg 10-layer MLP = +2.00, +1.00"
        " per seed (mean +1.50) (deeper converges slower)",
    ]
    table = fedmn.routing_table({a: fedmn.mean_evolution(r) for a, r in results.items() if "routing" in r[0]})
    assert table == ["| round | FedMN [1×4×3] | FedMN [1×5×2] |", "|---|---|---|", "| 0 | 2.0 / - | 1.0 / - |"]


def test_run_configs_follow_the_paper_setup():
    args = fedmn.parse_args(["--clients", "5", "--warmup-rounds", "2"])
    cfg = fedmn.run_config(args, "table2", "FedMN", 1)
    assert (cfg.strategy, cfg.zoo, cfg.partition, cfg.alpha, cfg.label_clusters) == (
        "fedmn",
        "fedmn_2x2x2_cnn1",
        "clustered",
        0.4,
        3,
    )
    assert cfg.active == cfg.clients == 5 and cfg.options == {"warmup_rounds": 2} and cfg.rounds == 30
    assert fedmn.run_config(args, "table2", "local", 1).zoo == "cnn1"
    fig = fedmn.run_config(args, "fig2", "FedAvg 9-layer MLP", 0)
    assert (fig.strategy, fig.zoo, fig.widths, fig.rounds, fig.options) == ("fedavg", "mlp9", "paper", 20, {})
    # the fc pools' hidden width is the MLPs' 256 at the paper preset
    assert fedmn.router_params(fedmn.run_config(args, "fig2", "FedMN [1×4×3]", 0)) > 0
    with pytest.raises(SystemExit):
        fedmn.parse_args(["--encoder", "resnet"])
    # --fedmn sets FedMN options of every FedMN run (Table II and Fig. 2) and none of the others'
    tuned = fedmn.parse_args(["--fedmn", "router_lr=2", "temperature_decay=0.2"])
    assert fedmn.run_config(tuned, "table2", "FedMN", 0).options == {
        "warmup_rounds": 3,
        "router_lr": "2",
        "temperature_decay": "0.2",
    }
    assert fedmn.run_config(tuned, "fig2", "FedMN [1×5×2]", 0).options["router_lr"] == "2"
    assert fedmn.run_config(tuned, "table2", "FedAvg", 0).options == {}
    assert fedmn.fedmn_options(tuned)["router_lr"] == 2.0
    with pytest.raises(SystemExit):
        fedmn.parse_args(["--fedmn", "router_lr"])


def test_a_tiny_benchmark_runs_and_reuses_its_finished_runs(tmp_path, capsys):
    data = ROOT.parent / "shared" / "data" / "cifar10.npz"
    if not data.exists():
        pytest.skip(f"needs {data}")
    argv = ["--seeds", "0", "--clients", "3", "--rounds", "2", "--fig2-rounds", "1", "--samples", "40"]
    argv += ["--warmup-rounds", "1", "--archs", "FedMN [1×4×3]", "FedAvg 8-layer MLP"]
    argv += ["--data", str(data), "--out", str(tmp_path)]
    assert fedmn.main(argv) == 0
    out = capsys.readouterr().out
    for text in (
        "## Table II",
        "| local |",
        "| FedAvg |",
        "| FedProx |",
        "| FedAvg+ |",
        "| pFedMe |",
        "| Per-FedAvg |",
    ):
        assert text in out
    assert "## Fig. 2" in out and "| FedMN [1×4×3] |" in out
    assert "| FedAvg 8-layer MLP |" in out and "## Routing evolution" in out and "| round | Table II FedMN |" in out
    summaries = sorted(tmp_path.glob("*/*/summary.json"))
    assert len(summaries) == 7 + 2
    assert not list(tmp_path.glob("*/*/clients")) and not list(tmp_path.glob("*/*/checkpoint.safetensors"))
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"date", "command", "hardware", "scale", "paper", "results", "checks", "wall_seconds"}
    assert set(results["results"]["table2"]) == {
        "local",
        "FedAvg",
        "FedProx",
        "FedAvg+",
        "pFedMe",
        "Per-FedAvg",
        "FedMN",
    }
    assert set(results["results"]["fig2"]) == {"FedMN [1×4×3]", "FedAvg 8-layer MLP"}
    table2 = results["results"]["table2"]
    assert table2["local"][0]["sent"] == 0
    assert table2["FedAvg"][0]["sent"] == 2 * 3 * 2 * table2["FedAvg"][0]["params"]  # down + up, 3 clients, 2 rounds
    evolution = table2["FedMN"][0]["routing"]
    assert [r["round"] for r in evolution] == [0, 1] and all(r["clients"] == 3 for r in evolution)
    # FedMN against 5 methods, the 3 personalized baselines against FedAvg, FedAvg and FedMN against local
    assert results["scale"]["clients"] == 3 and len(results["checks"]["table2"]) == 10
    stamps = [p.stat().st_mtime_ns for p in summaries]
    assert fedmn.main(argv) == 0
    assert [p.stat().st_mtime_ns for p in summaries] == stamps
