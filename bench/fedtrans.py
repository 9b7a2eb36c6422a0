"""FedTrans against HeteroFL, FedAvg on the smallest model and local training, with FedTrans's ablations: the columns
of the FedTrans paper's Table 2 (mean and IQR of client accuracy, total training MACs, network MB, simulated wall
time; each also as a ratio to FedTrans), on one fleet whose capacities come from the bundled device profiles, IID and
non-IID, over seeds.

    python bench/fedtrans.py                               # MNIST + CIFAR-10, IID + non-IID, 3 seeds
    python bench/fedtrans.py --datasets mnist --seeds 0 --rounds 6   # a quick look

Every run is an in-process `fedge run` (its folder under --out is reused when finished, so an interrupted benchmark
resumes). Direction checks (the paper's claims): FedTrans >= HeteroFL in accuracy at lower training cost (Table 2);
sharing large->small models does not help (Table 1, `+l2s` should not beat FedTrans); random layer selection and no
soft aggregation each cost accuracy or MACs (Table 3 / §5.3). Use OMP_NUM_THREADS=1 on a small machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from fedge import constants as C  # noqa: E402
from fedge.config import RunConfig  # noqa: E402
from launch.server import resolve_options  # noqa: E402
from launch.simulation import run_simulation  # noqa: E402
from server.plots import plot_time_to_accuracy  # noqa: E402
from server.runlog import CHECKPOINT_FILE  # noqa: E402

T = TypeVar("T", bound=dict)

# FedTrans's parameters scaled to runs of tens of rounds: γ = 10, δ = 20 (the paper's and the authors') need 30
# rounds of one model before its first transformation. β is the DoC (loss drop per round) that counts as converging.
FEDTRANS_SCALED = {"gamma": 3, "delta": 2, "beta": 0.02}
PROFILES = ("rpi-zero-2w", "rpi-4")  # 9.2 M to 290 M MACs: 31x, the paper's ">29x"
# The fleet registers cnn1 on the rpi-zero-2w and cnn3 on the rpi-4 (each must fit its device): HeteroFL's global
# model is the largest registered (cnn3), FedTrans starts from the cheapest (cnn1).
FLEET = "cnn1,cnn3"
HETEROFL_MODEL = "cnn3"
METHODS: dict[str, tuple[str, str, dict[str, Any]]] = {  # label -> (strategy, zoo, options)
    "FedTrans": ("fedtrans", FLEET, FEDTRANS_SCALED),
    "HeteroFL": ("heterofl", FLEET, {}),
    "HeteroFL (cnn2)": ("heterofl", "cnn1,cnn2", {}),  # a global model that trains as fast as cnn1
    "FedAvg (cnn1)": ("fedavg", "cnn1", {}),
    "local (cnn1)": ("local", "cnn1", {}),
    "FedTrans +l2s": ("fedtrans", FLEET, FEDTRANS_SCALED | {"large_to_small": True}),
    "FedTrans -l (random cells)": ("fedtrans", FLEET, FEDTRANS_SCALED | {"layer_selection": "random"}),
    "FedTrans -s (no soft agg.)": ("fedtrans", FLEET, FEDTRANS_SCALED | {"soft_aggregation": False}),
}
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
    return p.parse_args(argv)


def run_config(args: argparse.Namespace, dataset: str, partition: str, method: str, seed: int) -> RunConfig:
    strategy, zoo, options = METHODS[method]
    slug = method.split(" ")[0].lower() + ("" if zoo in (FLEET, "cnn1") else "-" + zoo.replace(",", "+"))
    slug += "".join(f"-{k}={v}" for k, v in sorted(options.items()) if k not in FEDTRANS_SCALED)
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


def run_one(cfg: RunConfig) -> dict[str, Any]:
    """The run's summary.json, running it unless its folder holds a finished run of the same config. A finished
    run keeps its config, summary, metrics and plots; its clients' model snapshots and its checkpoint, which only
    an interrupted run needs, are removed (three snapshots a client: 3 GB for 100 clients of FedGH's CNN_1)."""
    out = Path(cfg.out or ".")
    done = out / "summary.json"
    resolved = json.loads(json.dumps(resolve_options(cfg).to_dict()))
    if done.exists() and json.loads((out / "config.json").read_text()) == resolved:
        return json.loads(done.read_text())
    if out.exists():
        shutil.rmtree(out)
    run_simulation(cfg, progress=False)
    shutil.rmtree(out / C.CLIENT_STATE_DIR, ignore_errors=True)
    (out / CHECKPOINT_FILE).unlink(missing_ok=True)
    return json.loads(done.read_text())


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


def run_all(jobs: int, configs: list[RunConfig], measure: Callable[[RunConfig], T]) -> list[T]:
    """`measure` of every config (a config repeated is run once), `jobs` processes at a time, with a line per
    finished run on stderr."""
    started = time.perf_counter()
    unique = list({cfg.out: cfg for cfg in configs}.values())
    done: dict[str | None, T] = {}
    # Fresh interpreters for the workers: a fork of a process with threads (a test run's brokers) can deadlock.
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) if jobs > 1 else None
    try:
        for i, result in enumerate(pool.map(measure, unique) if pool else map(measure, unique)):
            done[unique[i].out] = result
            print(
                f"[{i + 1}/{len(unique)}] {unique[i].out}: acc {result['acc']:.2f}% "
                f"({time.perf_counter() - started:.0f} s elapsed)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if pool:
            pool.shutdown()
    return [done[cfg.out] for cfg in configs]


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
    """The paper's directions on this block's means, each HOLDS or does NOT hold."""

    def mean(method: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rows[method])

    out = []

    def check(text: str, ok: bool) -> None:
        out.append(f"- {'HOLDS' if ok else 'does NOT hold'}: {text}")

    for heterofl in ("HeteroFL", "HeteroFL (cnn2)"):
        if {"FedTrans", heterofl} <= set(rows):
            check(
                f"FedTrans >= {heterofl} in accuracy ({mean('FedTrans', 'acc'):.2f} vs {mean(heterofl, 'acc'):.2f}) "
                f"at lower training cost ({mean('FedTrans', 'tmacs'):.3g} vs {mean(heterofl, 'tmacs'):.3g} TMACs)",
                mean("FedTrans", "acc") >= mean(heterofl, "acc")
                and mean("FedTrans", "tmacs") < mean(heterofl, "tmacs"),
            )
    if {"FedTrans", "FedTrans +l2s"} <= set(rows):
        check(
            f"sharing large->small does not help (Table 1): FedTrans {mean('FedTrans', 'acc'):.2f} >= "
            f"+l2s {mean('FedTrans +l2s', 'acc'):.2f}",
            mean("FedTrans", "acc") >= mean("FedTrans +l2s", "acc"),
        )
    for ablation in ("FedTrans -l (random cells)", "FedTrans -s (no soft agg.)"):
        if {"FedTrans", ablation} <= set(rows):
            check(
                f"{ablation} costs accuracy or MACs: accuracy {mean(ablation, 'acc'):.2f} vs "
                f"{mean('FedTrans', 'acc'):.2f}, TMACs {mean(ablation, 'tmacs'):.3g} vs "
                f"{mean('FedTrans', 'tmacs'):.3g}",
                mean(ablation, "acc") < mean("FedTrans", "acc") or mean(ablation, "tmacs") > mean("FedTrans", "tmacs"),
            )
    if {"FedTrans", "local (cnn1)"} <= set(rows):
        check(
            f"federation beats training alone at this scale: FedTrans {mean('FedTrans', 'acc'):.2f} vs local "
            f"{mean('local (cnn1)', 'acc'):.2f} (if not, differences between methods mean little here)",
            mean("FedTrans", "acc") > mean("local (cnn1)", "acc"),
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    report = [
        f"# bench/fedtrans.py — {datetime.date.today()}",
        f"command: python bench/fedtrans.py {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"hardware: {hardware()}",
        f"scale: N={args.clients} clients ({', '.join(PROFILES)} in turn), M={args.active} per round, "
        f"T={args.rounds} rounds, E={args.local_epochs}, <= {args.samples} samples per client; seeds {args.seeds}; "
        f"FedTrans {FEDTRANS_SCALED}; HeteroFL's global model {HETEROFL_MODEL} (cnn2 in 'HeteroFL (cnn2)')",
    ]
    blocks: dict[str, dict[str, list[dict[str, float]]]] = {}
    total = len(args.datasets) * len(args.partitions) * len(args.methods) * len(args.seeds)
    done = 0
    for dataset in args.datasets:
        for partition in args.partitions:
            rows: dict[str, list[dict[str, float]]] = {}
            first: dict[str, Path] = {}  # method → its first seed's run folder, for the block's plot
            for method in args.methods:
                for seed in args.seeds:
                    began = time.perf_counter()
                    cfg = run_config(args, dataset, partition, method, seed)
                    result = numbers(run_one(cfg), Path(cfg.out or "."))
                    first.setdefault(method, Path(cfg.out or "."))
                    rows.setdefault(method, []).append(result)
                    done += 1
                    print(
                        f"[{done}/{total}] {dataset} {partition} {method} seed {seed}: acc {result['acc']:.2f}% "
                        f"({time.perf_counter() - began:.0f} s, {time.perf_counter() - started:.0f} s elapsed)",
                        file=sys.stderr,
                        flush=True,
                    )
            blocks[f"{dataset} {partition}"] = rows
            plot = Path(args.out) / f"{dataset}-{partition}" / "time_to_accuracy.png"
            plot_time_to_accuracy(
                {m: read_rows(folder) for m, folder in first.items()},
                plot,
                f"{dataset} {partition}: seed {args.seeds[0]} of each method",
            )
            report += ["", f"## {dataset}, {partition}", "", *table(rows), "", *checks(rows), "", f"plot: {plot}"]
    report += ["", f"wall time {time.perf_counter() - started:.0f} s"]
    print("\n".join(report))
    if args.json:
        Path(args.json).write_text(json.dumps(blocks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
