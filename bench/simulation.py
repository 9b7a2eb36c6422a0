"""The in-process simulation's speed: serial against worker processes, beside the floor, on one machine.

    python bench/simulation.py [--data ../shared/data/mnist.npz] [--rounds 3] [--workers N] [--settings ...]
        [--engines processes,ray,batched] [--client-device cpu|cuda]

Settings (issue 30): FedAvg on cnn1, 100 clients on MNIST, 10 and 100 per round; pFedClub on Zoo I, 20 clients, 10 per
round (its server step excluded, and kept small: 2 candidates per client, 500 public samples, one fine-tuning epoch;
bench/server_step.py measures it). Each runs serially (workers=1: every client in this process, one after another),
on `--workers` processes and on as many actors of a local Ray instance (launch/workers.py), same seed; every run is
checked to give the serial run's metrics rows (the bench refuses to print a speed for a run that differs). The
batched engine (launch/batched.py: the models of one architecture trained together, at `--workers` torch threads, on
`--client-device`) agrees within float tolerance only: its rows must name the same clients, rounds and sample counts,
and `loss_gap` reports the largest relative difference of a training loss from the serial run's.

Per run: the client path's seconds (the rounds' wall time less the server's own step, `server_seconds`: training and
evaluation exchanges, metrics and checkpoint writing), rounds per minute on it, client training samples per second,
and the setup (data, agents, worker processes) apart. The floor of the worker run is the sum of every client task's
seconds (training and evaluation) as the serial run measured them, each alone at one thread, divided by the workers:
what a pool with no overhead and perfect balance would take; `ratio` is the run's client path over it (for the
batched engine too: below 1 it beats that ideal pool).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers.federation: rows without wall clock

from bench.compare import hardware  # noqa: E402
from edge_client.agent import ClientAgent  # noqa: E402
from fedge.config import RunConfig, config_from  # noqa: E402
from launch.simulation import run_simulation  # noqa: E402
from launch.workers import available_cores  # noqa: E402

from helpers.federation import read_rows, rows_without_wall_clock  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "fedavg-10": {"strategy": "fedavg", "zoo": "cnn1", "clients": 100, "active": 10},
    "fedavg-100": {"strategy": "fedavg", "zoo": "cnn1", "clients": 100, "active": 100},
    "pfedclub": {
        "strategy": "pfedclub",
        "zoo": "I",
        "clients": 20,
        "active": 10,
        "finetune_epochs": 1,  # the server step is not measured here: kept small (bench/server_step.py measures it)
        "finetune_min_steps": 0,
        "max_candidates": 2,
        "max_public_samples": 500,
    },
}


def timed_tasks(seconds: list[float]) -> Any:
    """ClientAgent.handle that appends each task's wall seconds to `seconds` (the serial run: each task alone)."""
    handle = ClientAgent.handle

    def timed(agent: ClientAgent, task: Any) -> Any:
        start = time.perf_counter()
        try:
            return handle(agent, task)
        finally:
            seconds.append(time.perf_counter() - start)

    return timed


def one_run(cfg: RunConfig) -> dict[str, float]:
    """Run `cfg`; its setup, client path and server seconds, rounds per minute and samples per second."""
    start = time.perf_counter()
    summary = run_simulation(cfg, progress=False)
    total = time.perf_counter() - start
    server = sum(summary["server_seconds"])
    path = summary["wall_seconds"] - server
    samples = sum(r["num_examples"] for r in read_rows(Path(cfg.out)) if r["trained"]) * cfg.local_epochs
    return {
        "setup_s": total - summary["wall_seconds"],
        "path_s": path,
        "server_s": server,
        "rounds_per_min": 60 * cfg.rounds / path,
        "samples_per_s": samples / path,
    }


def bench(name: str, cfg: RunConfig, workers: int, engines: list[str], device: str, out: Path) -> list[dict[str, Any]]:
    """The serial run (each task timed) and the worker runs (one per engine) of one setting, each checked equal to
    the serial one (batched: the same clients and rounds, `loss_gap` apart); their table rows."""
    task_seconds: list[float] = []
    original = ClientAgent.handle
    ClientAgent.handle = timed_tasks(task_seconds)  # this process's agents only: the serial run
    try:
        serial = one_run(dataclasses.replace(cfg, workers=1, out=str(out / f"{name}-serial")))
    finally:
        ClientAgent.handle = original
    tasks = sum(task_seconds)
    rows = [{"setting": name, "mode": "serial", **serial, "floor_s": tasks, "ratio": serial["path_s"] / tasks}]
    rows[0]["loss_gap"] = 0.0
    for engine in engines:
        run = out / f"{name}-{engine}"
        pooled = one_run(dataclasses.replace(cfg, workers=workers, engine=engine, out=str(run), client_device=device))
        if engine == "batched":
            gap = loss_gap(out / f"{name}-serial", run)
        elif rows_without_wall_clock(out / f"{name}-serial") != rows_without_wall_clock(run):
            raise SystemExit(f"{name}: the {engine} run's metrics differ from the serial run's; no speed is reported")
        else:
            gap = 0.0
        floor = tasks / workers
        mode = {"processes": f"{workers} processes", "ray": f"{workers} Ray actors (local)"}.get(
            engine, f"batched, {workers} threads, {device}"
        )
        rows.append(
            {"setting": name, "mode": mode, **pooled, "floor_s": floor, "ratio": pooled["path_s"] / floor}
            | {"loss_gap": gap}
        )
    return rows


def loss_gap(serial: Path, batched: Path) -> float:
    """The largest relative difference of a client's training loss between the serial and the batched run; exits
    when their rows differ in client, round, training or sample count (then they did not run the same federation)."""
    keys = ("round", "client", "trained", "num_examples")
    a, b = read_rows(serial), read_rows(batched)
    if [[r.get(k) for k in keys] for r in a] != [[r.get(k) for k in keys] for r in b]:
        raise SystemExit(f"{batched.name}: other clients, rounds or samples than the serial run; no speed is reported")
    return max((abs(y["train_loss"] / x["train_loss"] - 1) for x, y in zip(a, b) if x["trained"]), default=0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/mnist.npz"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--workers", type=int, default=available_cores())
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument(
        "--engines", default="processes,ray,batched", help="comma-separated: processes, ray (a local instance), batched"
    )
    p.add_argument("--client-device", default="cpu", help="where the batched engine trains: cpu, cuda, cuda:N")
    args = p.parse_args()
    print(f"hardware: {hardware()}; {args.workers} workers, {args.rounds} rounds, {args.local_epochs} local epoch(s)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.settings.split(","):
            base = {"dataset": "mnist", "data": args.data, "rounds": args.rounds, "local_epochs": args.local_epochs}
            base |= {"transport": "inproc"}
            cfg = config_from(base | {"server_threads": 1, "export_onnx": False, "seed": 0} | SETTINGS[name])
            rows += bench(name, cfg, args.workers, args.engines.split(","), args.client_device, Path(tmp))
            print(f"{name}: done", file=sys.stderr)
    columns = ["setting", "mode", "setup_s", "path_s", "server_s", "rounds_per_min", "samples_per_s"]
    columns += ["floor_s", "ratio", "loss_gap"]
    print(" | ".join(columns))
    for r in rows:
        print(
            " | ".join(
                f"{r[c]:.1e}" if c == "loss_gap" else f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])
                for c in columns
            )
        )
    for name in dict.fromkeys(r["setting"] for r in rows):
        serial, *pooled = (r for r in rows if r["setting"] == name)
        for r in pooled:
            print(f"{name}: {r['mode']} / serial client path {r['path_s'] / serial['path_s']:.2f}x")


if __name__ == "__main__":
    main()
