"""bench/reproduce.py's plan: the scales, the presets' cells, and each (cell, seed) as a run config with its folder;
pure (nothing is run or read here)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from bench.reproduce_paper import Cell
from fedge import constants as C
from fedge.config import ConfigError, RunConfig, config_from, run_keys
from fedge.model.zoo import ZOOS
from launch.server import resolve_options
from server.strategy import STRATEGIES


@dataclass(frozen=True)
class Scale:
    """What --scale sets. `samples_per_client` caps a client's train + test samples (None: its 72/20 share of the
    whole dataset); `public_samples` caps the public set (None: 8 % of the whole dataset)."""

    name: str
    clients: int
    active: int
    rounds: int
    local_epochs: int
    samples_per_client: int | None
    public_samples: int | None

    def run_values(self) -> dict[str, int | None]:
        """The run-level keys this scale sets."""
        return {key: getattr(self, field) for key, field in SCALE_RUN_KEYS.items()}

    def overridden(self, run_set: Mapping[str, str]) -> Scale:
        """This scale as --run-set leaves it (a run-level key it sets, given again, wins), named by what changed, so
        the report's header says what the runs ran ("small with --run-set clients=5, rounds=3: N=5 ...")."""
        given = [key for key in SCALE_RUN_KEYS if key in run_set]
        if not given:
            return self
        ours = {k: v for k, v in self.run_values().items() if v is not None}
        cfg = config_from(ours | {k: run_set[k] for k in given})  # the values as the runs will read them
        values = {SCALE_RUN_KEYS[k]: getattr(cfg, k) for k in given}
        name = f"{self.name} with --run-set {', '.join(f'{k}={run_set[k]}' for k in given)}"
        return dataclasses.replace(self, name=name, **values)

    def describe(self) -> str:
        def cap(n: int | None, everything: str) -> str:
            return everything if n is None else f"≤{n:,}"

        return (
            f"{self.name}: N={self.clients} clients, M={self.active} active per round, T={self.rounds} rounds, "
            f"E={self.local_epochs} local epochs, {cap(self.samples_per_client, 'all')} samples per client "
            f"(train + test), {cap(self.public_samples, 'all 8 %')} public samples"
        )


SCALE_RUN_KEYS = {  # run-level key: Scale field
    "clients": "clients",
    "active": "active",
    "rounds": "rounds",
    "local_epochs": "local_epochs",
    "max_samples_per_client": "samples_per_client",
    "max_public_samples": "public_samples",
}
# pFedClub §4.1: N = 50, M = 5, 10 local epochs, all data split 72/20/8. T = 100 is not in the text: it is the x-axis
# of Fig. 4 and Fig. 6 (Appendix C, rounds 0-100) and the authors' code's default (original-code-notes §1.3).
FULL = Scale("full", 50, 5, 100, 10, None, None)
# Every scale but smoke keeps the paper's public set (8 % of the data): it is the server's, cheap to hold, and its
# size is how many optimiser steps a stitch gets (at ≤ 300 public samples, a handful: the candidates stay untrained).
SCALES = {
    "full": FULL,  # the paper: for a GPU
    "medium": Scale("medium", 20, 5, 10, 5, 400, None),
    "small": Scale("small", 10, 5, 5, 2, 200, None),
    "smoke": Scale("smoke", 5, 5, 2, 1, 80, 64),  # checks the pipeline; its numbers mean nothing
}
PAPER_SHARE = 1200  # ≈ a client's train + test at N = 50 (MNIST 1,288; CIFAR-10 1,104 images)
# §4.1: K = 4, λ = 0.2 (Eq. (5)), 3 server fine-tuning epochs; client Adam lr 1e-3, 2 classes per non-IID client.
PAPER_OPTIONS = {"clusters": 4, "kd_lambda": 0.2, "finetune_epochs": 3}
PAPER_RUN = {"lr": 1e-3, "classes_per_client": 2}
PAPER_ETA = 0.1  # §4.4, pFedClub+
# pFedClub's cap on CMSR candidates here (not in the paper, which keeps all): the option's default until issue 33 made
# it 4, kept so the runs in docs/results.md and their folders continue as they were made; --set max_candidates= wins
PFEDCLUB_MAX_CANDIDATES = 16
DEFAULT_SEEDS = (0, 1, 2)  # "average client accuracy with three runs" (§4.1)
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "table1": {"datasets": ("mnist", "cifar10"), "zoos": ("I", "II", "III"), "public": ("labeled", "unlabeled")},
    "table3": {"datasets": ("cifar10",), "zoos": ("III",), "public": ("unlabeled",)},
    "fig3": {"datasets": ("mnist", "cifar10"), "zoos": ("I",), "public": ("unlabeled",), "partition": ("noniid",)},
}
PARTITIONS = ("iid", "noniid")
FLAG_KEYS = {"strategy", "dataset", "data", "zoo", "partition", "seed", "out", "device", "options"}
AXIS_OPTIONS = {"public", "ablation"}  # set per cell by the presets


class ReproError(ConfigError):
    """A flag, override or run folder that bench/reproduce.py cannot use; the message says what to do."""


def parse_scale(text: str) -> Scale:
    """A named scale, or a float f in (0, 1]: N = max(5, round(50 f)), M = min(5, N), T = max(2, round(100 f)),
    E = 10, ≤ max(20, round(1200 f)) samples per client, the paper's public set (8 % of the data); 1 is full."""
    if text in SCALES:
        return SCALES[text]
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--scale takes {', '.join(SCALES)} or a number in (0, 1], got {text!r}"
        ) from None
    if not 0 < f <= 1:
        raise argparse.ArgumentTypeError(f"--scale as a number must be in (0, 1] (1 = full), got {text!r}")
    if f == 1:
        return FULL
    clients = max(5, round(50 * f))
    return Scale(
        f"x{f:g}",
        clients,
        min(5, clients),
        max(2, round(100 * f)),
        10,
        max(20, round(PAPER_SHARE * f)),
        None,
    )


@dataclass(frozen=True)
class Axes:
    """The flags' filters; None = the preset's own."""

    datasets: tuple[str, ...] | None = None
    zoos: tuple[str, ...] | None = None
    public: tuple[str, ...] | None = None
    partition: tuple[str, ...] | None = None

    def of(self, preset: str, axis: str) -> tuple[str, ...]:
        given = getattr(self, axis)
        return given if given is not None else PRESETS[preset].get(axis, PARTITIONS)


def preset_cells(preset: str, axes: Axes, local: bool = True, eta: float = PAPER_ETA) -> list[Cell]:
    """The cells (rows) of a preset, in table order; `local` adds the training-alone reference to each group."""
    if preset not in PRESETS:
        raise ReproError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")
    cells = []
    for dataset in axes.of(preset, "datasets"):
        for zoo in axes.of(preset, "zoos"):
            for partition in axes.of(preset, "partition"):
                group = Cell(preset, dataset, zoo, partition, "local", one_per_model=preset == "fig3")
                cells += [group] if local else []
                for public in axes.of(preset, "public"):
                    at = dataclasses.replace(group, public=public)
                    if preset == "table1":
                        cells += [dataclasses.replace(at, strategy=s) for s in ("pfedhr", "pfedclub")]
                    elif preset == "table3":
                        cells += [dataclasses.replace(at, strategy="pfedclub", variant=v) for v in C.ABLATIONS]
                    else:
                        cells += [dataclasses.replace(at, strategy=s) for s in ("pfedhr", "pfedclub")]
                        cells += [dataclasses.replace(at, strategy="pfedclub+", eta=eta)]
    return cells


@dataclass(frozen=True)
class Run:
    """One federation: a cell and a seed, the config_from values that define it, and its folder."""

    cell: Cell
    seed: int
    values: Mapping[str, Any]
    folder: Path

    def config(self) -> RunConfig:
        """The run's config with the strategy's options checked and completed (ConfigError if one is bad)."""
        return resolve_options(config_from(self.values))

    def command(self) -> str:
        """The equivalent `fedge run` command line: the same config, its server at the torch threads this process's
        runs use (fedge run's server takes one unless told), so the folder it writes is this run's, reused."""
        flat = {k: v for k, v in self.values.items() if k != "options"} | dict(self.values.get("options", {}))
        flat["server_threads"] = flat.get("server_threads") or torch.get_num_threads()
        words = ["fedge", "run", "--transport", "inproc", "--no-progress", "--out", str(self.folder)]
        for key, value in flat.items():
            if value is not None:
                text = str(value).lower() if isinstance(value, bool) else str(value)
                words += ["--set", f"{key}={text}"]
        return shlex.join(words)


def cell_scale(cell: Cell, scale: Scale) -> Scale:
    """Fig. 3's fleet is one client per model type of the zoo, all active; any other cell uses `scale` as is."""
    if not cell.one_per_model:
        return scale
    n = len(ZOOS[cell.zoo])
    return dataclasses.replace(scale, clients=n, active=n)


def cell_options(cell: Cell, user: Mapping[str, str]) -> dict[str, Any]:
    """The strategy options of a cell: §4.1's, the cell's public data / ablation / η, then the user's --set ones
    that this strategy has."""
    if cell.strategy == "local":
        options: dict[str, Any] = {}
    else:
        options = dict(PAPER_OPTIONS) | {"public": cell.public}
        if cell.strategy in ("pfedclub", "pfedclub+"):
            options["ablation"] = cell.variant
            options["max_candidates"] = PFEDCLUB_MAX_CANDIDATES
        if cell.eta is not None:
            options["eta"] = cell.eta
    known = {f.name for f in dataclasses.fields(STRATEGIES.get(cell.strategy).options_type)}
    return options | {k: v for k, v in user.items() if k in known}


def folder_name(cell: Cell, seed: int) -> str:
    parts = [cell.dataset, f"zoo{cell.zoo}" + ("-each" if cell.one_per_model else ""), cell.partition, cell.strategy]
    parts += [] if cell.public == "-" else [cell.public]
    parts += [] if cell.variant == "none" else [cell.variant]
    parts += [] if cell.eta is None else [f"eta{cell.eta:g}"]
    return "-".join(parts + [f"s{seed}"])


def data_path(data_dir: Path, dataset: str) -> str | None:
    """<data-dir>/<dataset>.npz when it exists; else None (an embedded dataset, or the loader says what is missing)."""
    path = data_dir / f"{dataset}.npz"
    return str(path) if path.is_file() else None


def expand(
    cells: Sequence[Cell],
    seeds: Sequence[int],
    scale: Scale,
    out: Path,
    data_dir: Path,
    device: str = "auto",
    run_set: Mapping[str, str] | None = None,
    option_set: Mapping[str, str] | None = None,
) -> list[Run]:
    """Every (cell, seed) as a Run. `run_set` holds run-level keys (over the scale's), `option_set` strategy options
    (given to the strategies that have them). A key they cannot take raises ReproError."""
    run_set, option_set = dict(run_set or {}), dict(option_set or {})
    check_overrides(cells, run_set, option_set)
    runs = []
    for cell in cells:
        s = cell_scale(cell, scale)
        base = {
            "strategy": cell.strategy,
            "dataset": cell.dataset,
            "data": data_path(data_dir, cell.dataset),
            "zoo": ",".join(ZOOS[cell.zoo]) if cell.one_per_model else cell.zoo,
            "partition": cell.partition,
            **s.run_values(),
            "device": device,
            "export_onnx": False,  # teachers' ONNX files are not part of the reproduction
        } | PAPER_RUN
        for seed in seeds:
            values = base | {"seed": seed} | run_set | {"options": cell_options(cell, option_set)}
            runs.append(Run(cell, seed, values, out / scale.name / folder_name(cell, seed)))
    return runs


def check_overrides(cells: Sequence[Cell], run_set: Mapping[str, str], option_set: Mapping[str, str]) -> None:
    """--run-set takes run-level keys other than those with a flag of their own; --set takes options that some
    strategy of the cells has, other than those a preset varies. Anything else raises ReproError."""
    flagged = sorted(set(run_set) & FLAG_KEYS)
    unknown = sorted(set(run_set) - set(run_keys()))
    if flagged:
        raise ReproError(f"--run-set {', '.join(flagged)}: use the flag of its own (--datasets, --zoos, --seeds, ...)")
    if unknown:
        raise ReproError(
            f"--run-set {', '.join(unknown)}: not a run-level key of RunConfig (known: {', '.join(run_keys())}); "
            f"a strategy option goes in --set"
        )
    axis = sorted(set(option_set) & AXIS_OPTIONS)
    if axis:
        raise ReproError(f"--set {', '.join(axis)}: the presets vary it per cell (use --public or --preset table3)")
    known = {f.name for s in {c.strategy for c in cells} for f in dataclasses.fields(STRATEGIES.get(s).options_type)}
    stray = sorted(set(option_set) - known)
    if stray:
        raise ReproError(
            f"--set {', '.join(stray)}: no strategy of these presets has that option (theirs: "
            f"{', '.join(sorted(known))}); a run-level key goes in --run-set"
        )
