"""FedMN against FedAvg, FedProx, FedAvg+, pFedMe, Per-FedAvg and local training: the FedMN paper's Table II on
CIFAR-10 (FedEM's clustered split: the classes in 3 groups, each group split over the clients by Dir(0.4); every
client active every round) and its Fig. 2 (accuracy after 20 rounds against the parameters transmitted: FedMN pools
[1×b×c] of 8, 9 and 10 blocks, the paper's [1×4×3], [1×3×4], [1×2×5], [1×5×2] and every such split at 9 and 10, on a
fully connected encoder, each against FedAvg on an MLP of as many layers, 256 hidden units), with how the clients'
routings evolve, scaled down for a CPU, over seeds.

    python bench/fedmn.py --jobs 2                                    # both views, 3 seeds
    python bench/fedmn.py --views table2 --seeds 0 --rounds 5         # a quick look

Every run is an in-process `fedge run` (a finished run folder under --out is reused, so an interrupted benchmark
resumes; --chunk-minutes stops after whole rounds, to be continued by the same command); the numbers are also
written to <out>/results.json. Accuracy is each client's personalized model on its own test split (FedMN: the global
pool on the client's most likely routing; FedAvg, FedProx: the global model; FedAvg+: the global model tuned on the
client's data; pFedMe: its personalized θ; local: its own), mean ± std over seeds of the mean over clients.
Parameters transmitted: FedMN's rows count what each client downloaded and uploaded (its route's blocks and the
routing hypernetwork, which is exchanged every round), FedAvg's the whole model down and up per trained client; the
bytes on the wire are measured for both.

Directions checked (the paper's claims; accuracy on the per-seed paired differences): Table II FedMN above FedAvg,
FedProx, FedAvg+, pFedMe and Per-FedAvg, the personalized three above FedAvg, FedAvg > local; Fig. 2 each FedMN pool
transmits fewer parameters than FedAvg's MLP of as many blocks and is more accurate, and the 10-layer MLP trails the
8-layer one under FedAvg. Differences between methods mean something only where federation beats training alone
(FedAvg > local): if it does not at the default scale, raise --samples, --clients, --rounds. Routing evolution: per
round, how many distinct routings the clients hold and how many clients changed theirs since the previous round. Use
OMP_NUM_THREADS=1 on a small machine and --jobs to run settings side by side."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from bench.fedtrans import cell, read_rows  # noqa: E402
from bench.paired import verdict as paired_verdict  # noqa: E402
from bench.runs import add_chunk_flag, chunk_deadline, guarded, not_finished, run_all, run_one  # noqa: E402
from fedge.config import RunConfig  # noqa: E402
from fedge.model.spec import tensor_shapes  # noqa: E402
from fedge.model.zoo import MODELS, create, is_model  # noqa: E402
from methods.fedmn.modular import ROUTER, block_of, elements  # noqa: E402
from server.strategy import parse_options  # noqa: E402

DATASET, INPUT, CLASSES = "cifar10", (3, 32, 32), 10
# Table II: label -> strategy; the model is the encoder's zoo model, FedMN's the [2×2×2] pool on that encoder.
TABLE2: dict[str, str] = {
    "local": "local",
    "FedAvg": "fedavg",
    "FedProx": "fedprox",
    "FedAvg+": "fedavg+",
    "pFedMe": "pfedme",
    "Per-FedAvg": "perfedavg",  # not in FedMN's table (pFedClub's and pFedHR's Table 2 have it): no paper number
    "FedMN": "fedmn",
}
# CIFAR-10, %; FedMN reuses FedEM's numbers for its baselines (its §IV-C)
PAPER_TABLE2 = {"local": 70.2, "FedAvg": 78.2, "FedProx": 78.0, "FedAvg+": 82.3, "pFedMe": 81.7, "FedMN": 83.4}
TABLE2_POOL = "2x2x2"
# Fig. 2: label -> (strategy, zoo model, blocks), all at the `paper` width preset (the fc pools' hidden width 256,
# §IV-D). The paper lists its 8-block pools, [1×b×c] with b + c = 7 and b, c ≥ 2, and says only "different
# architectures" for 9 and 10 blocks: here every [1×b×c] with b, c ≥ 2 at each size, beside FedAvg's MLP of as
# many layers ("the same parameter scale").
FIG2_BLOCKS = (8, 9, 10)
FIG2: dict[str, tuple[str, str, int]] = {
    **{
        f"FedMN [1×{b}×{n - 1 - b}]": ("fedmn", f"fedmn_1x{b}x{n - 1 - b}_fc", n)
        for n in FIG2_BLOCKS
        for b in sorted(range(2, n - 2), key=lambda b: (b != 4, b != 3, b))  # the paper's order at 8: 4, 3, 2, 5
    },
    **{f"FedAvg {n}-layer MLP": ("fedavg", f"mlp{n}", n) for n in FIG2_BLOCKS},
}
FIG2_WIDTHS = "paper"
VIEWS = ("table2", "fig2")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--views", nargs="+", default=list(VIEWS), choices=VIEWS)
    p.add_argument("--methods", nargs="+", default=list(TABLE2), choices=list(TABLE2), help="Table II's methods")
    p.add_argument(
        "--archs",
        nargs="+",
        default=list(FIG2),
        choices=list(FIG2),
        metavar="ARCH",
        help=f"Fig. 2's architectures (default all {len(FIG2)}: 15 FedMN pools of 8-10 blocks and 3 FedAvg MLPs)",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--clients", type=int, default=20, help="N, all active every round (paper: 80)")
    p.add_argument("--rounds", type=int, default=30, help="Table II's rounds (paper: 150)")
    p.add_argument("--fig2-rounds", type=int, default=20, help="Fig. 2's rounds (paper: 20)")
    p.add_argument("--samples", type=int, default=750, help="max train + test samples per client (paper: ~750)")
    p.add_argument("--local-epochs", type=int, default=1, help="(paper: 1)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--alpha", type=float, default=0.4, help="Dirichlet of the clustered split (FedEM: 0.4)")
    p.add_argument("--label-clusters", type=int, default=3, help="class groups of the clustered split (FedEM: 3)")
    p.add_argument("--encoder", default="cnn1", help="Table II's zoo model (FedMN's encoders: its extractor)")
    p.add_argument("--widths", default="cpu", choices=["cpu", "paper"], help="Table II's zoo width preset")
    p.add_argument(
        "--warmup-rounds",
        type=int,
        default=3,
        help="Table II FedMN's first rounds as FedAvg of the whole pool (§IV-B pretrains the encoders with FedAvg); "
        "Fig. 2 has none",
    )
    p.add_argument(
        "--fedmn",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="FedMN options for every FedMN run (e.g. router_lr=0.5; `fedge strategies` lists them)",
    )
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10.npz"))
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (processes)")
    add_chunk_flag(p)
    p.add_argument("--out", default="runs/bench-fedmn", help="run folders and results.json")
    args = p.parse_args(argv)
    if args.encoder not in MODELS or not is_model(f"fedmn_{TABLE2_POOL}_{args.encoder}"):
        p.error(f"--encoder must be a zoo model, one of {', '.join(MODELS)}")
    if any("=" not in item for item in args.fedmn):
        p.error("--fedmn takes KEY=VALUE items")
    return args


def run_config(args: argparse.Namespace, view: str, label: str, seed: int) -> RunConfig:
    """The run of one method (Table II) or architecture (Fig. 2) and seed."""
    options: dict[str, Any] = {}
    if view == "table2":
        strategy, widths, rounds = TABLE2[label], args.widths, args.rounds
        zoo = f"fedmn_{TABLE2_POOL}_{args.encoder}" if strategy == "fedmn" else args.encoder
        if strategy == "fedmn" and args.warmup_rounds:
            options["warmup_rounds"] = args.warmup_rounds
    else:
        (strategy, zoo, _), widths, rounds = FIG2[label], FIG2_WIDTHS, args.fig2_rounds
    if strategy == "fedmn":
        options |= dict(item.split("=", 1) for item in args.fedmn)
    slug = f"{zoo}-{strategy}" + "".join(f"-{k}={v}" for k, v in sorted(options.items())) + f"-seed{seed}"
    return RunConfig(
        strategy=strategy,
        dataset=DATASET,
        data=args.data,
        zoo=zoo,
        widths=widths,
        clients=args.clients,
        active=args.clients,
        rounds=rounds,
        local_epochs=args.local_epochs,
        batch_size=args.batch_size,
        partition="clustered",
        alpha=args.alpha,
        label_clusters=args.label_clusters,
        seed=seed,
        max_samples_per_client=args.samples,
        transport="inproc",
        export_onnx=False,
        options=options,
        out=str(Path(args.out) / view / slug),
    )


def router_params(cfg: RunConfig) -> int:
    """The routing hypernetwork's parameter count of a FedMN run's pool (exchanged with every client every round)."""
    shapes = tensor_shapes(create(cfg.zoo, INPUT, CLASSES, cfg.widths))
    return elements(shapes, [n for n in shapes if block_of(n) == ROUTER])


def routing_evolution(rows: Sequence[dict[str, Any]]) -> list[dict[str, int]]:
    """Per round (of rows that carry a `routing`): the clients with a routing, how many distinct routings they hold,
    how many of them had one before (`compared`) and how many of those changed it since their previous one."""
    by_round: dict[int, dict[str, str]] = {}
    for r in rows:
        if "routing" in r:
            by_round.setdefault(r["round"], {})[str(r["client"])] = r["routing"]
    out, last = [], {}
    for rnd in sorted(by_round):
        now = by_round[rnd]
        compared = [c for c in now if c in last]
        out.append(
            {
                "round": rnd,
                "clients": len(now),
                "distinct": len(set(now.values())),
                "compared": len(compared),
                "changed": sum(now[c] != last[c] for c in compared),
            }
        )
        last |= now
    return out


def measure(cfg: RunConfig) -> dict[str, Any]:
    """One run's numbers: final mean client accuracy (%), the parameters transmitted (all rounds, all clients; the
    router's share for FedMN), the bytes on the wire (MB), mean client training seconds per round, and for FedMN the
    routing evolution and the distinct routes the summary counts."""
    summary = run_one(cfg)
    assert summary is not None  # run_all measures finished runs only
    rows = read_rows(Path(cfg.out or "."))
    trained = [r for r in rows if r.get("trained")]
    out: dict[str, Any] = {
        "acc": 100 * summary["final_accuracy"]["mean"],
        "params": trained[0]["params"] if trained else 0,
        "wire_mb": sum(r.get("bytes_down", 0) + r.get("bytes_up", 0) for r in trained) / 1e6,
        "train_s": statistics.fmean(r["train_seconds"] for r in trained) if trained else float("nan"),
        "router_sent": 0,
    }
    if cfg.strategy == "fedmn":
        sent = [r for r in rows if "params_down" in r]
        out["sent"] = sum(r["params_down"] + r["params_up"] for r in sent)
        out["router_sent"] = 2 * router_params(cfg) * len(sent)
        out["routing"] = routing_evolution(rows)
        out["distinct_routes"] = summary.get("distinct_routes")
    elif cfg.strategy == "local":
        out["sent"] = 0
    else:  # the whole model down and up, per trained client
        out["sent"] = sum(2 * r["params"] for r in trained)
    return out


def mean(runs: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def verdict(ok: bool, text: str) -> str:
    return f"- {'HOLDS' if ok else 'does NOT hold'}: {text}"


def table2(results: dict[str, list[dict[str, Any]]], rounds: int, clients: int) -> list[str]:
    """Markdown: per method, accuracy (mean ± std over seeds) beside the paper's, the parameters transmitted per
    client per round (M), MB on the wire per client per round, and client training seconds per round."""
    per = rounds * clients
    lines = [
        "| method | accuracy % | paper % | params sent / client / round (M) | wire MB / client / round | train s |",
        "|---|---|---|---|---|---|",
    ]
    for method, runs in results.items():
        paper = PAPER_TABLE2.get(method)
        lines.append(
            f"| {method} | {cell([r['acc'] for r in runs])} | {'-' if paper is None else f'{paper:.1f}'} "
            f"| {mean(runs, 'sent') / per / 1e6:.3f} | {mean(runs, 'wire_mb') / per:.2f} "
            f"| {mean(runs, 'train_s'):.2f} |"
        )
    return lines


def checks2(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Table II's directions on the per-seed paired differences (bench/paired.py): FedMN above every other method,
    FedAvg > local, and the personalized baselines FedAvg+ and pFedMe above FedAvg (the paper's CIFAR-10 row)."""
    acc = {m: [r["acc"] for r in runs] for m, runs in results.items()}
    out = []
    for other in ("FedAvg", "FedProx", "FedAvg+", "pFedMe", "Per-FedAvg"):
        if {"FedMN", other} <= set(acc):
            out.append(paired_verdict("FedMN", acc["FedMN"], other, acc[other]))
    for personalized in ("FedAvg+", "pFedMe", "Per-FedAvg"):
        if {personalized, "FedAvg"} <= set(acc):
            out.append(paired_verdict(personalized, acc[personalized], "FedAvg", acc["FedAvg"]))
    if {"FedAvg", "local"} <= set(acc):
        out.append(
            paired_verdict("FedAvg", acc["FedAvg"], "local", acc["local"])
            + " (federation beats training alone at this scale; if not, differences between methods mean little "
            "here: raise --samples, --clients, --rounds)"
        )
    if {"FedMN", "local"} <= set(acc):
        out.append(paired_verdict("FedMN", acc["FedMN"], "local", acc["local"]))
    return out


def fig2(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown: per architecture, its parameters, the parameters transmitted in all rounds (M; FedMN's without the
    router beside), MB on the wire, and the final accuracy (mean ± std over seeds)."""
    lines = [
        "| architecture | model params (M) | params transmitted (M) | of which router (M) | wire MB | accuracy % |",
        "|---|---|---|---|---|---|",
    ]
    for arch, runs in results.items():
        router = mean(runs, "router_sent")
        lines.append(
            f"| {arch} | {mean(runs, 'params') / 1e6:.3f} | {cell([r['sent'] / 1e6 for r in runs], 1)} "
            f"| {router / 1e6:.1f} | {mean(runs, 'wire_mb'):.0f} | {cell([r['acc'] for r in runs])} |"
        )
    return lines


def checks_fig2(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Fig. 2's directions, each FedMN pool against FedAvg's MLP of as many blocks: it transmits fewer parameters
    (with and without its router; on the means, which barely vary over seeds) and is more accurate (per-seed paired
    differences, bench/paired.py); FedAvg's 10-layer MLP trails its 8-layer one (paired)."""
    mlp = {FIG2[a][2]: a for a in results if FIG2[a][0] == "fedavg"}
    out = []
    for arch, runs in results.items():
        strategy, _, blocks = FIG2[arch]
        if strategy != "fedmn" or blocks not in mlp:
            continue
        other = results[mlp[blocks]]
        sent = mean(other, "sent") / 1e6
        mine, own = mean(runs, "sent") / 1e6, (mean(runs, "sent") - mean(runs, "router_sent")) / 1e6
        out.append(verdict(mine < sent, f"{arch} transmits {mine:.1f} M < {mlp[blocks]} {sent:.1f} M"))
        out.append(verdict(own < sent, f"{arch} without its router {own:.1f} M < {mlp[blocks]} {sent:.1f} M"))
        out.append(paired_verdict(arch, [r["acc"] for r in runs], mlp[blocks], [r["acc"] for r in other]))
    if {8, 10} <= set(mlp):
        shallow, deep = (results[mlp[n]] for n in (8, 10))
        out.append(
            paired_verdict(mlp[8], [r["acc"] for r in shallow], mlp[10], [r["acc"] for r in deep])
            + " (deeper converges slower)"
        )
    return out


def mean_evolution(runs: Sequence[dict[str, Any]]) -> dict[int, tuple[float, float | None]]:
    """Round -> (distinct routings, clients that changed theirs; None where no client had one before), each the
    mean over seeds."""
    rounds: dict[int, list[dict[str, int]]] = {}
    for run in runs:
        for r in run["routing"]:
            rounds.setdefault(r["round"], []).append(r)
    return {
        rnd: (
            statistics.fmean(r["distinct"] for r in rs),
            statistics.fmean(r["changed"] for r in rs) if any(r["compared"] for r in rs) else None,
        )
        for rnd, rs in sorted(rounds.items())
    }


def routing_table(evolutions: dict[str, dict[int, tuple[float, float | None]]]) -> list[str]:
    """Markdown: a row per round, a column per FedMN setting, cells 'distinct / changed' (means over seeds)."""
    labels = list(evolutions)
    rounds = sorted({rnd for ev in evolutions.values() for rnd in ev})
    lines = ["| round | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for rnd in rounds:
        cells = []
        for label in labels:
            value = evolutions[label].get(rnd)
            if value is None:
                cells.append("-")
            else:
                distinct, changed = value
                cells.append(f"{distinct:.1f} / {'-' if changed is None else f'{changed:.1f}'}")
        lines.append(f"| {rnd} | " + " | ".join(cells) + " |")
    return lines


def fedmn_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every FedMN option of the runs (the strategy's defaults, then --fedmn's), as `fedge strategies` names them."""
    return vars(parse_options("fedmn", dict(item.split("=", 1) for item in args.fedmn)))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    command = " ".join(sys.argv[1:] if argv is None else argv)
    report = [
        f"# bench/fedmn.py — {datetime.date.today()}",
        f"command: python bench/fedmn.py {command}",
        f"hardware: {hardware()}",
        f"scale: CIFAR-10, clustered split ({args.label_clusters} class groups, Dir({args.alpha})), "
        f"N={args.clients} clients all active, <= {args.samples} samples per client (train + test), "
        f"E={args.local_epochs} local epoch(s) (Adam, lr 1e-3), batch {args.batch_size}; Table II: "
        f"T={args.rounds} rounds, {args.encoder} ({args.widths} widths), FedMN [2×2×2] with "
        f"{args.warmup_rounds} warm-up round(s); Fig. 2: T={args.fig2_rounds} rounds, paper widths (256 hidden); "
        f"FedMN options {fedmn_options(args)}; seeds {args.seeds}",
    ]
    jobs: list[tuple[str, str, RunConfig]] = []  # (view, label, config)
    if "table2" in args.views:
        jobs += [("table2", m, run_config(args, "table2", m, s)) for m in args.methods for s in args.seeds]
    if "fig2" in args.views:
        jobs += [("fig2", a, run_config(args, "fig2", a, s)) for a in args.archs for s in args.seeds]
    numbers = run_all(args.jobs, [cfg for _, _, cfg in jobs], measure, chunk_deadline(args.chunk_minutes))
    if not_finished(sum(n is None for n in numbers), len(numbers)):
        return 3
    per_view: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for (view, label, _), result in zip(jobs, numbers):
        per_view.setdefault(view, {}).setdefault(label, []).append(result)
    if "table2" in per_view:
        rows = per_view["table2"]
        report += [
            "",
            f"## Table II (CIFAR-10, accuracy after {args.rounds} rounds; the paper's after 150 with 80 clients)",
            "",
            *table2(rows, args.rounds, args.clients),
            "",
            *checks2(rows),
        ]
    if "fig2" in per_view:
        rows = per_view["fig2"]
        report += [
            "",
            f"## Fig. 2 (accuracy after {args.fig2_rounds} rounds against parameters transmitted, all clients)",
            "",
            *fig2(rows),
            "",
            *checks_fig2(rows),
        ]
    evolutions = {
        (f"Table II {label}" if view == "table2" else label): mean_evolution(runs)
        for view, rows in per_view.items()
        for label, runs in rows.items()
        if runs and "routing" in runs[0]
    }
    if evolutions:
        distinct = {
            (f"Table II {label}" if view == "table2" else label): mean(runs, "distinct_routes")
            for view, rows in per_view.items()
            for label, runs in rows.items()
            if runs and "routing" in runs[0]
        }
        report += [
            "",
            "## Routing evolution (distinct routings across clients / clients whose routing changed since the "
            "previous round; means over seeds)",
            "",
            *routing_table(evolutions),
            "",
            "final distinct routes: " + ", ".join(f"{label} {n:.1f}" for label, n in distinct.items()),
        ]
    wall = time.perf_counter() - started
    report += ["", f"wall time {wall:.0f} s"]
    print("\n".join(report))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {
        "date": str(datetime.date.today()),
        "command": f"python bench/fedmn.py {command}",
        "hardware": hardware(),
        "scale": {k: v for k, v in vars(args).items() if k not in ("views", "methods", "archs", "jobs", "out")},
        "paper": {"table2": PAPER_TABLE2},
        "results": per_view,
        "checks": {
            "table2": checks2(per_view["table2"]) if "table2" in per_view else [],
            "fig2": checks_fig2(per_view["fig2"]) if "fig2" in per_view else [],
        },
        "wall_seconds": wall,
    }
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
