"""Reproduce pFedClub (NeurIPS 2024) Table 1, Table 3 and Fig. 3 with the §4.1 setup, our numbers beside the paper's.

    python bench/reproduce.py --preset table1 [table3 fig3] [--scale smoke|small|medium|full|FLOAT]
        [--datasets mnist cifar10] [--zoos I II III] [--public labeled unlabeled] [--partition noniid iid]
        [--seeds 0 1 2] [--device auto|cpu|cuda] [--threads N] [--workers W] [--data-dir ../shared/data]
        [--out runs/reproduce]
        [--run-set KEY=VALUE ...] [--set KEY=VALUE ...] [--no-local] [--dry-run]

Presets (each axis can be narrowed or widened with the flags above; without them, the paper's):
  table1  Zoo I/II/III x labeled/unlabeled public data x IID/non-IID x MNIST/CIFAR-10: pFedHR and pFedClub (the
          paper's rows), and local (training alone) as the reference federation must beat.
  table3  Zoo III, unlabeled public data, IID/non-IID, CIFAR-10 (the paper's; add mnist as ours): pFedClub full and
          its ablations max, min, noc, nbc (`ablation` option), and local.
  fig3    Zoo I with one client per model type (7 clients, all active every round), unlabeled, non-IID, MNIST and
          CIFAR-10 (the paper's dataset, SVHN, is not here: its values are shown as "paper (SVHN)", directions only):
          pFedHR, pFedClub, pFedClub+ (η = 0.1), and local; accuracy and ϕ (Eq. (6)) per model type.

Scales (--scale; the header of the report prints what the chosen one sets):
  full    the paper: N = 50 clients, M = 5 active, T = 100 rounds, E = 10 local epochs, all data (72/20/8); for a GPU
          (each pFedClub round fine-tunes 5 x 4 candidates on the whole public set, 4,800-5,600 images).
  medium  N = 20, M = 5, T = 10, E = 5, <=400 samples per client, the paper's public set.
  small   N = 10, M = 5, T = 5, E = 2, <=200 samples per client, the paper's public set (the default).
  smoke   N = 5, M = 5, T = 2, E = 1, <=80 samples per client, <=64 public samples: checks the pipeline only.
  FLOAT   f in (0, 1]: N = max(5, round(50f)), M = min(5, N), T = max(2, round(100f)), E = 10,
          <=max(20, round(1200f)) samples per client, the paper's public set; 1 is full.
  Every scale but smoke keeps the paper's public set (8 % of the data, 4,800-5,600 images): it is the server's and
  decides how many optimiser steps a stitch gets (a few hundred public samples gave 3-15: untrained candidates).
  Fig. 3 always has one client per model type, all of them active. Seconds per run measured with --threads 1 on a
  2-core CPU shared with other work, before small and medium took the paper's public set: smoke CIFAR-10 Zoo III 5 s
  (local, pFedHR) to 18 s (pFedClub), Fig. 3 CIFAR-10 6-46 s; small MNIST Zoo III 10 s (local), 22 s (pFedHR), 99 s
  (pFedClub). pFedClub's server step dominates and grows with the public set, the active clients and the zoo's size
  (Zoo I on CIFAR-10 is the heaviest cell). Those times are from before the server's 225-step fine-tuning floor
  (finetune_min_steps), which lengthens the reassembly methods' runs: smoke digits Zoo III with unlabeled public data
  now takes 31 s (pFedHR) and about 77 s (pFedClub) on the same machine; `--set finetune_min_steps=0` gives the
  epochs alone.

Every run is an in-process simulation (launch.simulation.run_simulation) whose folder is kept under
<out>/<scale>/<dataset>-zoo<Z>[-each]-<partition>-<strategy>[-<public>][-<ablation>][-eta<η>]-s<seed>. A folder whose
run finished is read back instead of run again, and an interrupted one resumes from its checkpoint, so a long
reproduction can be stopped and continued by running the same command. `--chunk-minutes M` makes that a plan: runs
pause after whole rounds once M minutes are nearly spent (a round starts only if the last one's time still fits) and
the rest wait; each rerun adds whole rounds and runs to the folder (exit status 3 until all have finished), as a
lent GPU's few minutes allow: `--scale full --device cuda --chunk-minutes 7`. The report (setup, one Markdown table per
preset, direction checks) is printed and written to <out>/results.md and <out>/results.json; one progress line per
run goes to stderr. `--dry-run` lists every run with the equivalent `fedge run` command and runs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from bench.reproduce_paper import Cell, setup_lines  # noqa: E402
from bench.reproduce_plan import (  # noqa: E402
    DEFAULT_SEEDS,
    PAPER_ETA,
    PARTITIONS,
    PRESETS,
    SCALES,
    Axes,
    ReproError,
    Run,
    expand,
    parse_scale,
    preset_cells,
)
from bench.reproduce_report import CellStats, SeedResult, read_run, render, to_json  # noqa: E402
from bench.runs import STATES, UNFINISHED, add_chunk_flag, chunk_deadline, folder_state, run_kept  # noqa: E402
from fedge.config import ConfigError, parse_overrides  # noqa: E402
from fedge.model.zoo import ZOOS  # noqa: E402


def execute(run: Run, workers: int = 1, stop_at: float | None = None) -> tuple[SeedResult | None, str]:
    """Run (or reuse, or resume) one federation, its clients on `workers` processes, pausing after whole rounds
    near `stop_at` (bench/runs.py); its result (None unless finished) and what was done."""
    how = run_kept(dataclasses.replace(run.config(), out=str(run.folder), workers=workers), stop_at)
    return (None if how in UNFINISHED else read_run(run.folder)), how


def run_all(
    runs: Sequence[Run], workers: int = 1, stop_at: float | None = None
) -> tuple[dict[Path, SeedResult], dict[str, int], list[str]]:
    """Every distinct run folder once (presets share runs), with a progress line each on stderr; clients on
    `workers` processes; with `stop_at`, paused after whole rounds near it and the rest left for the next chunk."""
    unique = list({r.folder: r for r in runs}.values())
    results: dict[Path, SeedResult] = {}
    counts = {"ran": 0, "reused": 0, "resumed": 0, "paused": 0, "left": 0, "failed": 0}
    failures = []
    start = time.perf_counter()
    for i, run in enumerate(unique, 1):
        began = time.perf_counter()
        try:
            result, how = execute(run, workers, stop_at)
        except Exception as e:  # one failed run must not lose the others of a long reproduction
            counts["failed"] += 1
            failures.append(f"{run.cell.label} seed {run.seed} ({run.folder}): {type(e).__name__}: {e}")
            print(f"[{i}/{len(unique)}] {run.cell.label} seed {run.seed}: FAILED: {e}", file=sys.stderr, flush=True)
            continue
        counts[how] += 1
        if how == "left":
            continue
        elapsed = datetime.timedelta(seconds=round(time.perf_counter() - start))
        if result is None:
            acc = "paused: the chunk's time is up; rerun the same command to continue it"
        else:
            results[run.folder] = result
            acc = f"final {result.final:.2f}%" if result.final is not None else "final n/a"
            acc += f", last-3 {result.last3:.2f}%" if result.last3 is not None else ""
        print(
            f"[{i}/{len(unique)}] {run.cell.label} seed {run.seed}: {acc} ({how} in "
            f"{time.perf_counter() - began:.0f} s; {elapsed} elapsed) {run.folder}",
            file=sys.stderr,
            flush=True,
        )
    return results, counts, failures


def collect(runs: Sequence[Run], results: Mapping[Path, SeedResult]) -> dict[Cell, CellStats]:
    """Each cell over the seeds that finished."""
    stats: dict[Cell, CellStats] = {}
    for run in runs:
        cs = stats.setdefault(run.cell, CellStats(run.cell, [], []))
        if run.folder in results:
            cs.seeds.append(run.seed)
            cs.results.append(results[run.folder])
    return stats


# ---------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", choices=list(PRESETS), default=["table1"], help="tables to reproduce")
    p.add_argument(
        "--scale",
        type=parse_scale,
        default=SCALES["small"],
        help="full, medium, small, smoke, or a number in (0, 1]: what each sets is listed above (default small)",
    )
    p.add_argument("--datasets", nargs="+", help="dataset names (table1, fig3: mnist cifar10; table3: cifar10)")
    p.add_argument("--zoos", nargs="+", choices=list(ZOOS), help="model zoos (table1: I II III; table3: III; fig3: I)")
    p.add_argument(
        "--public", nargs="+", choices=["labeled", "unlabeled"], help="public data (table1: both; else unlabeled)"
    )
    p.add_argument("--partition", nargs="+", choices=PARTITIONS, help="data split (fig3: noniid; else both)")
    p.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="one run per seed (0 1 2)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="torch device (auto: cuda if any)")
    p.add_argument(
        "--threads",
        type=int,
        help="the server's torch CPU threads (default torch's; clients always train at one, as fedge run's client "
        "processes); 1 is much faster on a CPU others share",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes for each run's clients (default 1: in this process); the same numbers bit for bit, "
        "worth it where client training dominates (medium, full): each run's workers take 6-11 s to start",
    )
    p.add_argument("--data-dir", default="../shared/data", help="folder with <dataset>.npz (mnist.npz, cifar10.npz)")
    p.add_argument("--out", default="runs/reproduce", help="keeps every run's folder, results.md and results.json")
    p.add_argument(
        "--run-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run-level key of RunConfig for every run, e.g. batch_size=10 (repeatable)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy option, given to the strategies that have it, e.g. eta=0 (repeatable)",
    )
    p.add_argument("--local", action=argparse.BooleanOptionalAction, default=True, help="run local as the reference")
    add_chunk_flag(p)
    p.add_argument("--dry-run", action="store_true", help="list the runs and their fedge run commands; run nothing")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> list[Run]:
    """The runs the command line asks for (ReproError / ConfigError when a flag or override cannot be used)."""
    axes = Axes(*(None if v is None else tuple(v) for v in (args.datasets, args.zoos, args.public, args.partition)))
    option_set = parse_overrides(args.set)
    eta = option_set.pop("eta", None)
    try:
        bound = PAPER_ETA if eta is None else float(eta)
    except ValueError:
        raise ReproError(f"--set eta={eta}: not a number") from None
    cells = [c for preset in dict.fromkeys(args.preset) for c in preset_cells(preset, axes, args.local, bound)]
    if eta is not None and not any(c.eta is not None for c in cells):
        raise ReproError("--set eta: only pFedClub+ has it, and only --preset fig3 runs pFedClub+")
    runs = expand(
        cells, args.seeds, args.scale, Path(args.out), Path(args.data_dir), args.device,
        parse_overrides(args.run_set), option_set,
    )  # fmt: skip
    for run in runs:
        run.config()  # every option checked before anything runs
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # small models on busy cores: more threads spin more than they compute
    try:
        runs = plan(args)
        scale = args.scale.overridden(parse_overrides(args.run_set))  # what the runs run, for the header
        states = {r.folder: folder_state(r.folder, dataclasses.replace(r.config(), out=str(r.folder))) for r in runs}
        stop_at = chunk_deadline(args.chunk_minutes)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    header = [
        "# pFedClub reproduction (bench/reproduce.py)",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- hardware: {hardware()}",
        f"- command: `{shlex.join(['python', 'bench/reproduce.py', *(argv if argv is not None else sys.argv[1:])])}`",
        f"- presets: {' '.join(dict.fromkeys(args.preset))}; seeds: {' '.join(map(str, args.seeds))}",
        f"- scale {scale.describe()}"
        + ("; Fig. 3: N = M = one client per model type" if "fig3" in args.preset else ""),
    ]
    header += setup_lines(runs, args)
    if args.dry_run:
        print("\n".join(header))
        print(f"\n{len({r.folder for r in runs})} runs (dry run: nothing is run):")
        for run in {r.folder: r for r in runs}.values():
            print(f"- {run.cell.label} seed {run.seed} ({STATES[states[run.folder]]})\n  {run.command()}")
        return 0
    results, counts, failures = run_all(runs, args.workers, stop_at)
    header.insert(6, f"- runs: {sum(counts.values())} ({', '.join(f'{v} {k}' for k, v in counts.items())}); folders "
                  f"under {Path(args.out) / args.scale.name}")  # fmt: skip
    stats = collect(runs, results)
    report = render(stats, header)
    if failures:
        report += "\nFailed runs:\n\n" + "\n".join(f"- {f}" for f in failures) + "\n"
    unfinished = counts["paused"] + counts["left"]
    if unfinished:
        report += (
            f"\n**Not finished**: {unfinished} runs wait for the next chunk ({counts['paused']} paused after whole "
            f"rounds, {counts['left']} not started); the tables hold the finished seeds only. Rerun the same command "
            f"to continue.\n"
        )
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(report)
    document = {"header": header, "counts": counts, "failures": failures, "cells": to_json(stats)}
    (out / "results.json").write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    return 1 if failures else 3 if unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
