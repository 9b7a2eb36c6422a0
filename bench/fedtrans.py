"""FedTrans against HeteroFL, FedAvg on the smallest model and local training, with FedTrans's ablations: the columns
of the FedTrans paper's Table 2 (mean and IQR of client accuracy, total training MACs, network MB, simulated wall
time; each also as a ratio to FedTrans), on one fleet of Pi Zero 2 W and Pi 4 profiles with five capacity tiers 31.5x
apart, IID and non-IID, over seeds.

    python bench/fedtrans.py                               # MNIST + CIFAR-10, IID + non-IID, 3 seeds
    python bench/fedtrans.py --datasets mnist --seeds 0 --rounds 6   # a quick look

Every run is an in-process `fedge run` (its folder under --out is reused when finished, so an interrupted benchmark
resumes; --chunk-minutes stops after whole rounds, to be continued by the same command). Direction checks (the
paper's claims; accuracy on per-seed paired differences, training MACs beside it as a ratio): FedTrans above HeteroFL
(Table 2); sharing large->small models does not help (Table 1, `+l2s` should not beat FedTrans); random layer
selection and no soft aggregation each cost accuracy (Table 3 / §5.3); FedTrans above local training (if not,
differences between methods mean little). Use OMP_NUM_THREADS=1 on a small machine.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from bench.paired import verdict  # noqa: E402
from bench.runs import add_chunk_flag, chunk_deadline, guarded, not_finished, run_one  # noqa: E402
from fedge.config import RunConfig  # noqa: E402
from server.plots import plot_time_to_accuracy  # noqa: E402

# FedTrans's parameters scaled to runs of tens of rounds: γ = 10, δ = 20 (the paper's and the authors') need 30
# rounds of one model before its first transformation. β is the DoC (loss drop per round) that counts as converging.
FEDTRANS_SCALED = {"gamma": 3, "delta": 2, "beta": 0.02}
# The fleet: client i has profile PROFILES[i % 5] and registers FLEET's model i % 5 (each must fit its device). Its
# capacities (FedTrans's T_c and HeteroFL's, option capacity_file) are CAPACITY_TIERS[i % 5]: 9.2 M to 290 M MACs,
# 31.5x apart (the paper's ">29x", §3: the smallest client runs the initial model, the largest the maximum), doubling
# from tier to tier as a FedTrans widen doubles a cell, so grown models reach 80 % of the fleet (with two tiers,
# 9.2 M and 290 M, the first widen of cnn1 on CIFAR-10, 9.27 M MACs, missed half of it). Every tier is at most its
# profile's max_macs, so the simulated clock stays that of the device.
PROFILES = ("rpi-zero-2w", "rpi-4", "rpi-4", "rpi-4", "rpi-4")
CAPACITY_TIERS = (9_200_000, 18_400_000, 36_800_000, 73_600_000, 290_000_000)
FLEET = "cnn1,cnn3,cnn3,cnn3,cnn3"  # FedTrans starts from the cheapest registered model (cnn1)
# HeteroFL's global model is the largest model FedTrans grew in the run of the same data and seed (FedTrans App. A.1),
# given as a spec file (option model_file); "HeteroFL (cnn2)" is a fixed cnn2 that every device trains whole.
HETEROFL = "HeteroFL"
METHODS: dict[str, tuple[str, str, dict[str, Any]]] = {  # label -> (strategy, zoo, options)
    "FedTrans": ("fedtrans", FLEET, FEDTRANS_SCALED),
    HETEROFL: ("heterofl", FLEET, {}),
    "HeteroFL (cnn2)": ("heterofl", "cnn1,cnn2", {}),  # a global model that trains as fast as cnn1
    "FedAvg (cnn1)": ("fedavg", "cnn1", {}),
    "local (cnn1)": ("local", "cnn1", {}),
    "FedTrans +l2s": ("fedtrans", FLEET, FEDTRANS_SCALED | {"large_to_small": True}),
    "FedTrans -l (random cells)": ("fedtrans", FLEET, FEDTRANS_SCALED | {"layer_selection": "random"}),
    "FedTrans -s (no soft agg.)": ("fedtrans", FLEET, FEDTRANS_SCALED | {"soft_aggregation": False}),
}
FILES = ("capacity_file", "model_file")  # options that name files: not in a run folder's name
DATA = {"mnist": "mnist.npz", "cifar10": "cifar10.npz"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=list(DATA), choices=list(DATA))
    p.add_argument("--partitions", nargs="+", default=["iid", "noniid"], choices=["iid", "noniid"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--active", type=int, default=5)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=300, help="train + test samples per client")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    p.add_argument("--out", default="runs/bench-fedtrans")
    p.add_argument("--json", help="also write the table as JSON here")
    add_chunk_flag(p)
    return p.parse_args(argv)


def capacity_file(args: argparse.Namespace) -> str:
    """<out>/capacities.json: client i's capacity CAPACITY_TIERS[i % 5], for the fleet's --clients."""
    path = Path(args.out) / "capacities.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(i): CAPACITY_TIERS[i % len(CAPACITY_TIERS)] for i in range(args.clients)}))
    return str(path)


def largest_file(args: argparse.Namespace, dataset: str, partition: str, seed: int, spec: dict[str, Any]) -> Path:
    """HeteroFL's global model for this data and seed, the FedTrans run's largest grown model, written to a file
    named by its content: a HeteroFL run of another model is then a run of another config, never reused."""
    text = json.dumps(spec, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(args.out) / f"{dataset}-{partition}" / f"fedtrans-largest-seed{seed}-{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run_config(
    args: argparse.Namespace, dataset: str, partition: str, method: str, seed: int, model_file: Path | None = None
) -> RunConfig:
    """The run of one method and seed; HeteroFL's global model from `model_file` (largest_file)."""
    strategy, zoo, options = METHODS[method]
    if strategy in ("fedtrans", "heterofl"):
        options = options | {"capacity_file": capacity_file(args)}
    if model_file is not None:
        options = options | {"model_file": str(model_file)}
    slug = method.split(" ")[0].lower() + ("" if zoo in (FLEET, "cnn1") else "-" + zoo.replace(",", "+"))
    slug += "".join(f"-{k}={v}" for k, v in sorted(options.items()) if k not in FEDTRANS_SCALED and k not in FILES)
    return RunConfig(
        strategy=strategy,
        dataset=dataset,
        data=str(Path(args.data_dir) / DATA[dataset]),
        zoo=zoo,
        clients=args.clients,
        active=args.active,
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        partition=partition,
        seed=seed,
        max_samples_per_client=args.samples,
        profiles=PROFILES,
        transport="inproc",
        export_onnx=False,
        options=options,
        out=str(Path(args.out) / f"{dataset}-{partition}" / f"{slug}-seed{seed}"),
    )


def run_method(
    args: argparse.Namespace, dataset: str, partition: str, method: str, seed: int, stop_at: float | None
) -> tuple[dict[str, Any] | None, Path]:
    """One method's run folder and its summary (bench/runs.run_one; None while it waits for the next chunk).
    HeteroFL first needs the FedTrans run of the same data and seed: the largest model that run grew is its global
    model."""
    grown = None
    if method == HETEROFL:
        base = run_config(args, dataset, partition, "FedTrans", seed)
        fedtrans = run_one(base, stop_at)
        if fedtrans is None:  # HeteroFL waits for the FedTrans run it depends on
            return None, Path(base.out or ".")
        grown = largest_file(args, dataset, partition, seed, fedtrans["largest_model"])
    cfg = run_config(args, dataset, partition, method, seed, grown)
    return run_one(cfg, stop_at), Path(cfg.out or ".")


def read_rows(folder: Path) -> list[dict[str, Any]]:
    """A run folder's metrics.jsonl rows."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def numbers(summary: dict[str, Any], folder: Path) -> dict[str, float]:
    """One run's Table 2 numbers: mean and IQR of the final per-client accuracy (%), training TMACs (the paper's
    are PMACs), network MB, sim hours;
    and the server's step per round (plan + aggregate + evaluation planning, s) over a client's local training (s)."""
    train = [r["train_seconds"] for r in read_rows(folder) if "train_seconds" in r]
    server = statistics.fmean(summary["server_seconds"])
    accs = [100 * a for a in summary["final_accuracy"]["per_client"].values()]
    q1, q3 = np.percentile(accs, [25, 75]) if accs else (float("nan"), float("nan"))
    return {
        "acc": statistics.fmean(accs) if accs else float("nan"),
        "iqr": float(q3 - q1),
        "tmacs": summary["train_macs_total"] / 1e12,
        "net_mb": summary["network_bytes_total"] / 1e6,
        "sim_h": summary["sim_seconds_total"] / 3600,
        "server_s": server,
        "server_share": server / statistics.fmean(train) if train else float("nan"),
    }


def cell(values: Sequence[float], digits: int = 2) -> str:
    """mean ± std of `values`, to `digits` decimals."""
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(rows: dict[str, list[dict[str, float]]]) -> list[str]:
    """Markdown rows: each column as mean ± std over seeds, and the cost columns as a ratio to FedTrans's mean."""
    base = (
        {k: statistics.fmean(r[k] for r in rows["FedTrans"]) for k in ("tmacs", "net_mb", "sim_h")}
        if "FedTrans" in rows
        else {}
    )
    lines = [
        "| method | accuracy % | IQR % | training TMACs | × FedTrans | network MB | × FedTrans | sim. time h "
        "| × FedTrans | server s/round | server ÷ one client's training |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, runs in rows.items():
        cells = [method]
        for key, digits in (
            ("acc", 2),
            ("iqr", 2),
            ("tmacs", 3),
            ("net_mb", 1),
            ("sim_h", 4),
            ("server_s", 3),
            ("server_share", 3),
        ):
            m, s = mean_std([r[key] for r in runs])
            cells.append(f"{m:.{digits}f} ± {s:.{digits}f}")
            if key in base:
                cells.append(f"{m / base[key]:.2f}" if base[key] > 0 else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def checks(rows: dict[str, list[dict[str, float]]]) -> list[str]:
    """The paper's directions on this block, accuracy on the per-seed paired differences (bench/paired.py: a
    direction only where every seed agrees), training cost on the means (it varies little over seeds)."""

    def acc(method: str) -> list[float]:
        return [r["acc"] for r in rows[method]]

    def tmacs(method: str) -> float:
        return statistics.fmean(r["tmacs"] for r in rows[method])

    def cost(a: str, b: str) -> str:
        return f"; training cost {tmacs(a):.3g} vs {tmacs(b):.3g} TMACs ({tmacs(a) / tmacs(b):.2f}x)"

    out = []
    for heterofl in ("HeteroFL", "HeteroFL (cnn2)"):
        if {"FedTrans", heterofl} <= set(rows):
            out.append(verdict("FedTrans", acc("FedTrans"), heterofl, acc(heterofl)) + cost("FedTrans", heterofl))
    if {"FedTrans", "FedTrans +l2s"} <= set(rows):
        out.append(
            verdict("FedTrans", acc("FedTrans"), "+l2s", acc("FedTrans +l2s"))
            + " (Table 1: sharing large->small does not help)"
        )
    for ablation in ("FedTrans -l (random cells)", "FedTrans -s (no soft agg.)"):
        if {"FedTrans", ablation} <= set(rows):
            out.append(verdict("FedTrans", acc("FedTrans"), ablation, acc(ablation)) + cost("FedTrans", ablation))
    if {"FedTrans", "local (cnn1)"} <= set(rows):
        out.append(
            verdict("FedTrans", acc("FedTrans"), "local (cnn1)", acc("local (cnn1)"))
            + " (federation beats training alone at this scale; if not, differences between methods mean little)"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    report = [
        f"# bench/fedtrans.py — {datetime.date.today()}",
        f"command: python bench/fedtrans.py {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"hardware: {hardware()}",
        f"scale: N={args.clients} clients ({', '.join(PROFILES)} in turn, capacities "
        f"{', '.join(f'{c / 1e6:g} M' for c in CAPACITY_TIERS)} MACs in turn), M={args.active} per round, "
        f"T={args.rounds} rounds, E={args.local_epochs}, <= {args.samples} samples per client; seeds {args.seeds}; "
        f"FedTrans {FEDTRANS_SCALED}; HeteroFL's global model: the largest model FedTrans grew in the run of the same "
        f"data and seed (App. A.1; cnn2 in 'HeteroFL (cnn2)')",
    ]
    blocks: dict[str, dict[str, list[dict[str, float]]]] = {}
    total = len(args.datasets) * len(args.partitions) * len(args.methods) * len(args.seeds)
    done, waiting, stop_at = 0, 0, chunk_deadline(args.chunk_minutes)
    for dataset in args.datasets:
        for partition in args.partitions:
            rows: dict[str, list[dict[str, float]]] = {}
            first: dict[str, Path] = {}  # method → its first seed's run folder, for the block's plot
            for method in args.methods:
                for seed in args.seeds:
                    began = time.perf_counter()
                    summary, folder = run_method(args, dataset, partition, method, seed, stop_at)
                    done += 1
                    if summary is None:
                        waiting += 1
                        shown = "paused or left for the next chunk"
                    else:
                        result = numbers(summary, folder)
                        first.setdefault(method, folder)
                        rows.setdefault(method, []).append(result)
                        shown = f"acc {result['acc']:.2f}%"
                    print(
                        f"[{done}/{total}] {dataset} {partition} {method} seed {seed}: {shown} "
                        f"({time.perf_counter() - began:.0f} s, {time.perf_counter() - started:.0f} s elapsed)",
                        file=sys.stderr,
                        flush=True,
                    )
            if waiting:
                continue
            blocks[f"{dataset} {partition}"] = rows
            plot = Path(args.out) / f"{dataset}-{partition}" / "time_to_accuracy.png"
            plot_time_to_accuracy(
                {m: read_rows(folder) for m, folder in first.items()},
                plot,
                f"{dataset} {partition}: seed {args.seeds[0]} of each method",
            )
            report += ["", f"## {dataset}, {partition}", "", *table(rows), "", *checks(rows), "", f"plot: {plot}"]
    if waiting:
        return not_finished(waiting, total)
    report += ["", f"wall time {time.perf_counter() - started:.0f} s"]
    print("\n".join(report))
    if args.json:
        Path(args.json).write_text(json.dumps(blocks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
