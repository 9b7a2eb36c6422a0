"""Where the pFedClub server step spends its time, against one client's local training time.

    python bench/server_step.py [--dataset mnist-5k] [--active 5] [--local-epochs 10] [--device cpu]

Zoo I, MNIST-size data: `--active` clients train briefly (so their features mean something), upload,
and the server runs one pFedClub aggregation. Prints seconds per stage (features/CKA, grouping,
candidate generation, stitch fine-tuning, matching), and each as a ratio to the mean wall time of one
client's local training (`--local-epochs` epochs, the paper's 10 by default), all from this one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from edge_client.training import TrainConfig, train  # noqa: E402
from fedge.config import config_from  # noqa: E402
from fedge.constants import DEFAULT_WIDTHS, WIDTHS  # noqa: E402
from fedge.data import load_dataset  # noqa: E402
from fedge.messages import Result  # noqa: E402
from fedge.partition import make_partition  # noqa: E402
from fedge.zoo import assign_models  # noqa: E402
from launch.client import make_agent  # noqa: E402
from launch.runs import partition_config  # noqa: E402
from launch.server import strategy_config  # noqa: E402
from server.reassembly import STAGES  # noqa: E402
from server.strategy import PublicData, create_strategy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--data", default=None)
    p.add_argument("--active", type=int, default=5)
    p.add_argument("--clients", type=int, default=7)
    p.add_argument("--local-epochs", type=int, default=10)
    p.add_argument("--strategy", default="pfedclub")
    p.add_argument("--device", default="cpu")
    p.add_argument("--widths", choices=WIDTHS, default=DEFAULT_WIDTHS, help="zoo width preset (fedge/zoo.py)")
    args = p.parse_args()
    cfg = config_from(
        dict(
            strategy=args.strategy,
            dataset=args.dataset,
            data=args.data,
            zoo="I",
            widths=args.widths,
            clients=args.clients,
            active=args.active,
            device=args.device,
            profiles=("jetson-orin-nano",),
        )
    )
    ds = load_dataset(cfg.dataset, cfg.data)
    part = make_partition(ds.y, ds.num_classes, partition_config(cfg))
    models = assign_models("I", cfg.clients, cfg.seed)
    agents = [make_agent(cfg, ds, part.clients[i], models[i], "jetson-orin-nano") for i in range(args.active)]
    print(f"hardware: {hardware()}; device {args.device}")
    print(f"{args.dataset}: public set {len(part.public)}, client models {[a.spec.name for a in agents]}")

    train_seconds, results = [], {}
    for a in agents:
        start = time.perf_counter()
        train(a.model, a.data.x_train, a.data.y_train, TrainConfig(args.local_epochs, cfg.batch_size, cfg.lr, 0))
        train_seconds.append(time.perf_counter() - start)
        results[a.client_id] = Result(a.client_id, 0, "kd_train", len(a.data.y_train), {}, {"local": a.weights()})
    client = statistics.fmean(train_seconds)

    x_public, y_public = ds.tensors(part.public)
    strategy = create_strategy(args.strategy, strategy_config(cfg), PublicData(x_public, y_public))
    strategy.setup({a.client_id: a.info() for a in agents})
    strategy.plan(0, list(results))
    start = time.perf_counter()
    strategy.aggregate(0, results)
    total = time.perf_counter() - start

    print(
        f"\none client's local training ({args.local_epochs} epochs, mean of {len(agents)}): {client:.2f} s "
        f"(per model: {', '.join(f'{a.spec.name} {s:.1f}' for a, s in zip(agents, train_seconds))})"
    )
    print(f"{'stage':12s} {'seconds':>9s} {'/ client training':>18s}")
    for stage in STAGES:
        print(f"{stage:12s} {strategy.times[stage]:9.2f} {strategy.times[stage] / client:17.2f}x")
    print(f"{'total':12s} {total:9.2f} {total / client:17.2f}x")
    candidates = [strategy.record(0, cid).get("candidates", 0) for cid in results]
    print(f"candidates per client: {candidates}")


if __name__ == "__main__":
    main()
