"""Side-by-side comparison of local, pFedHR, pFedClub and pFedClub+ on one partition and seeds.

    python bench/compare.py --data-dir ../shared/data [--datasets mnist cifar10] [--zoos III I] [--seeds 0 1]
        [--widths paper]

Prints the hardware, one row per (dataset, zoo, strategy): final mean accuracy ± std over seeds, mean
teacher parameters, mean ϕ (pFedClub Eq. 6) overall and per model type, server seconds per round; then
the ratios pFedClub / pFedHR of server time and teacher size. Every run's folder is kept under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedge.config import config_from  # noqa: E402
from fedge.constants import DEFAULT_WIDTHS, WIDTHS  # noqa: E402
from launch.simulation import run_simulation  # noqa: E402

STRATEGIES = ("local", "pfedhr", "pfedclub", "pfedclub+")


def hardware() -> str:
    cpu = platform.processor() or "cpu"
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} logical cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"python {platform.python_version()}"
    )


def mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f}±{std:.3f}"


def run_one(args: argparse.Namespace, dataset: str, zoo: str, strategy: str, seed: int) -> dict:
    out = Path(args.out) / f"{dataset}-zoo{zoo}-{args.widths}-{strategy}-s{seed}"
    cfg = config_from(
        dict(
            strategy=strategy,
            dataset=dataset,
            data=str(Path(args.data_dir) / f"{dataset}.npz"),
            zoo=zoo,
            widths=args.widths,
            clients=args.clients,
            active=args.active,
            rounds=args.rounds,
            local_epochs=args.local_epochs,
            seed=seed,
            partition="noniid",
            max_samples_per_client=args.samples_per_client,
            max_public_samples=args.public_samples,
            eta=args.eta,
            out=str(out),
        )
    )
    start = time.perf_counter()
    summary = run_simulation(cfg, progress=False)
    print(
        f"  {dataset} zoo {zoo} {strategy:9s} seed {seed}: acc {summary['final_accuracy']['mean']:.3f} "
        f"in {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return summary


def row(summaries: list[dict]) -> dict:
    """Aggregate one (dataset, zoo, strategy) cell over seeds."""
    phi_by_model: dict[str, list[float]] = defaultdict(list)
    teacher, phis, server = [], [], []
    for s in summaries:
        server.append(statistics.fmean(s["server_seconds"]))
        for cid, phi in s.get("phi", {}).items():
            phi_by_model[s["models"][cid]].append(phi)
            phis.append(phi)
        teacher += list(s.get("teacher_params", {}).values())
    return {
        "acc": mean_std([s["final_accuracy"]["mean"] for s in summaries]),
        "teacher": statistics.fmean(teacher) if teacher else None,
        "phi": statistics.fmean(phis) if phis else None,
        "phi_by_model": {m: round(statistics.fmean(v), 3) for m, v in sorted(phi_by_model.items())},
        "server_s": statistics.fmean(server),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data", help="folder with mnist.npz and cifar10.npz")
    p.add_argument("--datasets", nargs="+", default=["mnist", "cifar10"])
    p.add_argument("--zoos", nargs="+", default=["III", "I"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--samples-per-client", type=int, default=300)
    p.add_argument("--public-samples", type=int, default=500)
    p.add_argument("--eta", type=float, default=0.1)
    p.add_argument("--out", default="runs/bench-compare")
    p.add_argument("--widths", choices=WIDTHS, default=DEFAULT_WIDTHS, help="zoo width preset (fedge/model/zoo.py)")
    args = p.parse_args()
    print(f"hardware: {hardware()}")
    print(
        f"setting: non-IID 2 classes/client, {args.clients} clients, {args.active} active, {args.rounds} rounds, "
        f"{args.local_epochs} local epochs, ≤{args.samples_per_client} samples/client, "
        f"{args.public_samples} public samples, seeds {args.seeds}, {args.widths} widths",
        flush=True,
    )
    cells = {}
    for dataset in args.datasets:
        for zoo in args.zoos:
            for strategy in args.strategies:
                cells[(dataset, zoo, strategy)] = row([run_one(args, dataset, zoo, strategy, s) for s in args.seeds])
    print(
        f"\n{'dataset':8s} {'zoo':4s} {'strategy':10s} {'accuracy':>12s} {'teacher params':>15s} {'mean ϕ':>8s} "
        f"{'server s/round':>15s}  ϕ per model type"
    )
    for (dataset, zoo, strategy), c in cells.items():
        teacher = f"{c['teacher']:,.0f}" if c["teacher"] is not None else "-"
        phi = f"{c['phi']:+.3f}" if c["phi"] is not None else "-"
        print(
            f"{dataset:8s} {zoo:4s} {strategy:10s} {c['acc']:>12s} {teacher:>15s} {phi:>8s} "
            f"{c['server_s']:>15.2f}  {json.dumps(c['phi_by_model'])}"
        )
    print("\nratios pFedClub / pFedHR (same dataset, zoo, seeds):")
    for dataset in args.datasets:
        for zoo in args.zoos:
            club, hr = cells.get((dataset, zoo, "pfedclub")), cells.get((dataset, zoo, "pfedhr"))
            if club and hr and hr["teacher"] and hr["server_s"]:
                print(
                    f"  {dataset} zoo {zoo}: server time {club['server_s'] / hr['server_s']:.2f}x, "
                    f"teacher size {club['teacher'] / hr['teacher']:.2f}x"
                )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "table.json").write_text(json.dumps({"/".join(k): v for k, v in cells.items()}, indent=2))


if __name__ == "__main__":
    main()
