"""A `fedge client` process's resident memory per zoo model: at start-up and at peak after one local epoch.

    python bench/client_memory.py [--dataset mnist-5k] [--models cnn1 cnn2 ...] [--threads 1]

For each model, a fresh process does what `fedge client` does (launch.client.make_agent: imports, the run's
partition, the agent with its model at cpu widths on a torch profile) and runs one `train` task of one local
epoch at the run's default batch size, as the server would send it. It reports the RSS of a bare Python, after
the imports, at start-up (agent built) and the peak after the epoch (fedge.memory), next to the training
footprint estimate (device_profiles.training_footprint_bytes), and for every bundled profile whether the whole
client process (peak RSS) fits its memory_bytes, and whether the training part alone (peak - after imports)
does: memory_bytes is documented as what is left after the OS and the Python + torch runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6


def measure(model: str, dataset: str, threads: int) -> dict[str, float]:
    """Child process: RSS (bytes) at each stage of one client's start-up and first local epoch."""
    with open("/proc/self/statm", encoding="ascii") as f:  # before anything of ours (fedge imports torch)
        bare = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    sys.path.insert(0, str(ROOT))
    import torch

    from device_profiles import training_footprint_bytes
    from fedge.config import config_from
    from fedge.memory import peak_rss_bytes, rss_bytes
    from fedge.tasks import TrainTask
    from fedge.wire.messages import Task
    from launch.client import make_agent
    from launch.runs import load_partitioned

    torch.set_num_threads(threads)
    imported = rss_bytes()
    cfg = config_from({"dataset": dataset, "widths": "cpu"})
    ds, partition = load_partitioned(cfg)
    agent = make_agent(cfg, ds, partition.clients[0], model, "rpi-4")
    startup = rss_bytes()
    settings = TrainTask(epochs=1, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed, upload=True)
    agent.handle(Task("train", 0, settings.to_config()))
    return {
        "bare": bare,
        "imported": imported,
        "startup": startup,
        "peak": peak_rss_bytes(),
        "footprint": training_footprint_bytes(agent.spec, cfg.batch_size).total,
        "batch": cfg.batch_size,
        "samples": len(agent.data.y_train),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mnist-5k")
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.dataset, args.threads)))
        return
    sys.path.insert(0, str(ROOT))
    from device_profiles import list_profiles
    from fedge.model.zoo import MODELS

    rows = {}
    for model in args.models or list(MODELS):
        cmd = [sys.executable, __file__, "--child", model, "--dataset", args.dataset, "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
        rows[model] = json.loads(out.strip().splitlines()[-1])
    first = next(iter(rows.values()))
    print(f"{args.dataset}, batch {first['batch']}, {first['samples']} training samples, {args.threads} thread(s)")
    print(
        f"{'model':14} {'python':>8} {'imports':>8} {'start-up':>9} {'peak':>8} {'peak-imp':>9} {'estimate':>9}  (MB)"
    )
    for model, r in rows.items():
        print(
            f"{model:14} {r['bare'] / MB:8.1f} {r['imported'] / MB:8.1f} {r['startup'] / MB:9.1f} "
            f"{r['peak'] / MB:8.1f} {(r['peak'] - r['imported']) / MB:9.1f} {r['footprint'] / MB:9.1f}"
        )
    print("\nprofile              runtime     memory_bytes  whole process fits (peak <= memory_bytes)")
    worst = max(r["peak"] for r in rows.values())
    worst_training = max(r["peak"] - r["imported"] for r in rows.values())
    for p in list_profiles():
        whole = [m for m, r in rows.items() if r["peak"] <= p.memory_bytes]
        verdict = "all models" if len(whole) == len(rows) else (", ".join(whole) or "none")
        training = "yes" if worst_training <= p.memory_bytes else "no"
        print(
            f"{p.name:20} {p.runtime:11} {p.memory_bytes / MB:9.1f} MB  {verdict} "
            f"(worst peak {worst / MB:.1f} MB; training part alone fits: {training})"
        )


if __name__ == "__main__":
    main()
