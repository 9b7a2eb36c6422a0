"""How a benchmark runs one federation into a folder it keeps: reuse a finished run, resume an interrupted or paused
one from its checkpoint, start anew otherwise; and stop after whole rounds when a chunk's time is up, so a long
reproduction (a lent GPU's few minutes, a CI job's limit) is done chunk by chunk by rerunning the same command."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from fedge import constants as C
from fedge.config import ConfigError, RunConfig
from launch.server import resolve_options
from launch.simulation import run_simulation
from server.coordinator import RunPaused
from server.runlog import CHECKPOINT_FILE

T = TypeVar("T", bound=dict)  # a run's numbers, with its accuracy under "acc"
UNFINISHED = ("paused", "left")

# may differ between a run and its continuation (other machine, path, worker count, the in-process simulation or
# MQTT: the same models bit for bit, tests/integration/test_transports_agree.py); the server's thread count, which
# can change the bits, is compared as the number the run used (server_threads_used)
IGNORED_KEYS = ("out", "device", "data", "workers", "engine", "ray_address", "transport", "server_threads")
STATES = {"new": "to run", "restart": "to run again", "resume": "to resume", "finished": "finished: reused"}


class FolderError(ConfigError):
    """A run folder that holds something other than this run; the message says what to do."""


def folder_state(folder: Path, cfg: RunConfig) -> str:
    """What a run's folder holds: "finished" (the summary of a completed run), "resume" (a checkpoint to continue
    from), "restart" (a start with no round completed) or "new". A folder holding a run of another config, or
    anything but a run, raises FolderError."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        if folder.exists() and any(folder.iterdir()):
            raise FolderError(f"{folder} holds something other than a run; use another --out, or delete the folder")
        return "new"
    saved = json.loads(config_file.read_text())
    wanted = json.loads(json.dumps(resolve_options(cfg).to_dict()))
    summary_file = folder / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    differ = [
        (k, saved.get(k), wanted.get(k))
        for k in sorted(set(saved) | set(wanted))
        if k not in IGNORED_KEYS and saved.get(k) != wanted.get(k)
    ]
    threads = (server_threads_used(saved, summary), cfg.server_threads or torch.get_num_threads())
    if threads[0] is not None and threads[0] != threads[1]:
        differ.append(("server threads", *threads))
    if differ:
        shown = "; ".join(f"{k}: {there!r} there, {now!r} now" for k, there, now in differ[:4])
        raise FolderError(f"{folder} holds a run of another config ({shown}); use another --out, or delete the folder")
    if summary and "stopped_at_round" not in summary:
        return "finished"
    return "resume" if (folder / "checkpoint.safetensors").is_file() else "restart"


def server_threads_used(config: dict[str, Any], summary: dict[str, Any]) -> int | None:
    """The torch threads a run's server used: its config's server_threads, or where that is 0 ("as they are"), the
    number its summary recorded; None where neither says (a run started "as they are" and not finished)."""
    return config.get("server_threads") or summary.get("server_threads")


# The chunks (by their stop_at) in which this process has already run a round, and those in which a run paused. Its
# first run of a chunk starts even when the chunk's time is already spent (planning, reading reused runs and a busy
# CPU can take that long), so every chunk advances; a later one is left once the time is up or a run has paused (it
# paused because its next round would not fit: another run's first round would not either). A worker process of
# run_all starts with none: each starts at most one run late.
_ADVANCED: set[float] = set()
_SPENT: set[float] = set()


def run_kept(cfg: RunConfig, stop_at: float | None = None, replace: bool = False) -> str:
    """Run cfg in its folder cfg.out, reusing a finished run and resuming an interrupted or paused one; with
    `stop_at` (a time.time()), pause after whole rounds once it is near (at least one round runs). Returns what was
    done: "reused", "resumed", "ran", or "paused" (the folder's checkpoint continues it); "left" without touching
    the folder when this process already ran a round in this chunk and the chunk is spent. A folder holding a run
    of another config raises FolderError, or with `replace` is deleted and run anew (a line on stderr says so); one
    holding anything but a run always raises it."""
    folder = Path(cfg.out or ".")
    try:
        state = folder_state(folder, cfg)
    except FolderError:
        if not (replace and (folder / "config.json").is_file()):  # never delete what is not a run
            raise
        print(f"replacing the run in {folder}: it was of another config", file=sys.stderr)
        shutil.rmtree(folder)
        state = "new"
    if state == "finished":
        return "reused"
    if stop_at is not None and stop_at in _ADVANCED and (stop_at in _SPENT or time.time() >= stop_at):
        return "left"
    if state == "restart":  # same config, no round completed: clients' snapshots would be stale, start clean
        shutil.rmtree(folder)
    if stop_at is not None:
        _ADVANCED.add(stop_at)
    try:
        cfg = dataclasses.replace(cfg, out=str(folder))
        run_simulation(cfg, progress=False, resume=state == "resume", stop_at=stop_at)
    except RunPaused:
        if stop_at is not None:  # only a run with a stop_at pauses
            _SPENT.add(stop_at)
        return "paused"
    return "resumed" if state == "resume" else "ran"


def chunk_deadline(minutes: float | None) -> float | None:
    """The time.time() a chunk of `minutes` from now ends (None: no chunks)."""
    return None if minutes is None else time.time() + 60 * minutes


def add_chunk_flag(parser: argparse.ArgumentParser) -> None:
    """--chunk-minutes, as every benchmark that keeps its runs takes it."""
    parser.add_argument(
        "--chunk-minutes",
        type=float,
        help="stop after whole rounds once this many minutes are (nearly) spent: a round starts only if the last "
        "one's time still fits, a run not started is left; rerun the same command to continue (exit status 3 "
        "until every run has finished)",
    )


def run_one(cfg: RunConfig, stop_at: float | None = None) -> dict[str, Any] | None:
    """The run's summary.json, running or resuming it unless its folder holds the finished run (run_kept; a folder
    of another config is replaced: a benchmark's folder names leave out its scale); None if it paused or was left
    for the next chunk. A finished run keeps its config, summary, metrics and plots;
    its clients' model snapshots and its checkpoint, which only an unfinished run needs, are removed (three
    snapshots a client: 3 GB for 100 clients of FedGH's CNN_1)."""
    if run_kept(cfg, stop_at, replace=True) in UNFINISHED:
        return None
    out = Path(cfg.out or ".")
    shutil.rmtree(out / C.CLIENT_STATE_DIR, ignore_errors=True)
    (out / CHECKPOINT_FILE).unlink(missing_ok=True)
    return json.loads((out / "summary.json").read_text())


def _measured(cfg: RunConfig, measure: Callable[[RunConfig], T], stop_at: float | None) -> T | None:
    return None if run_one(cfg, stop_at) is None else measure(cfg)


def run_all(
    jobs: int, configs: list[RunConfig], measure: Callable[[RunConfig], T], stop_at: float | None = None
) -> list[T | None]:
    """`measure` of every config once its run has finished (a config repeated is run once), `jobs` processes at a
    time, with a line per run on stderr; None for a run that paused or was left for the next chunk (`stop_at`).
    `measure` reads the finished run (run_one reuses it)."""
    started = time.perf_counter()
    unique = list({cfg.out: cfg for cfg in configs}.values())
    done: dict[str | None, T | None] = {}
    task = functools.partial(_measured, measure=measure, stop_at=stop_at)
    # Fresh interpreters for the workers: a fork of a process with threads (a test run's brokers) can deadlock.
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) if jobs > 1 else None
    try:
        for i, result in enumerate(pool.map(task, unique) if pool else map(task, unique)):
            done[unique[i].out] = result
            shown = "paused or left for the next chunk" if result is None else f"acc {result['acc']:.2f}%"
            print(
                f"[{i + 1}/{len(unique)}] {unique[i].out}: {shown} ({time.perf_counter() - started:.0f} s elapsed)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if pool:
            pool.shutdown()
    return [done[cfg.out] for cfg in configs]


def guarded(main: Callable[[], int]) -> int:
    """A benchmark's main, with a run folder it cannot use reported as one line (exit status 2), not a traceback."""
    try:
        return main()
    except FolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def not_finished(waiting: int, total: int) -> int:
    """Exit status 3 with a line on stderr when `waiting` of `total` runs wait for the next chunk; 0 when none do."""
    if waiting:
        print(
            f"not finished: {waiting} of {total} runs wait for the next chunk; rerun the same command to "
            "continue (finished runs are reused, paused ones resume after their last whole round)",
            file=sys.stderr,
        )
    return 3 if waiting else 0
