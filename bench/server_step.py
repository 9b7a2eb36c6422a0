"""pFedClub's and pFedHR's server step on the same uploads, side by side, against one client's local training.

    python bench/server_step.py [--dataset mnist-5k] [--active 5] [--local-epochs 10] [--device cpu]
                                [--strategies pfedclub pfedclub@4 pfedhr] [--set pfedclub:exclude_self=true ...]

Zoo I, MNIST-size data: `--active` clients train briefly (so their features mean something) and upload; then
each strategy runs one aggregation on those same uploads. Prints seconds per stage (features/CKA, grouping,
candidate generation, stitch fine-tuning, matching) for each strategy, the ratio of each strategy's total to
the first one's (`NAME@K` is NAME with max_candidates=K), candidates generated and kept per client with
seconds per kept candidate, and each total as a ratio to the mean wall time of one client's local training
(`--local-epochs` epochs, the paper's 10 by default), all from this one run. With a cap on pFedClub's
candidates it also prints what every candidate (Alg. 1 line 20) would cost at the measured seconds each.
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
from fedge.constants import DEFAULT_SEED, DEFAULT_WIDTHS, WIDTHS  # noqa: E402
from fedge.data import load_dataset  # noqa: E402
from fedge.messages import Result  # noqa: E402
from fedge.partition import make_partition, stratified_sample  # noqa: E402
from fedge.zoo import assign_models  # noqa: E402
from launch.client import make_agent  # noqa: E402
from launch.runs import partition_config  # noqa: E402
from launch.server import strategy_config  # noqa: E402
from server.features import block_features  # noqa: E402
from server.reassembly import STAGES  # noqa: E402
from server.strategy import PublicData, create_strategy  # noqa: E402


def parse_sets(items: list[str], strategies: list[str]) -> dict[str, dict[str, str]]:
    """`strategy:key=value` (or `key=value` for every strategy) → options per strategy."""
    out: dict[str, dict[str, str]] = {name: {} for name in strategies}
    for item in items:
        target, _, pair = item.rpartition(":")
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set takes [strategy:]key=value, got {item!r}")
        for name in [target] if target else strategies:
            out[name][key] = value
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--data", default=None)
    p.add_argument("--active", type=int, default=5)
    p.add_argument("--clients", type=int, default=7)
    p.add_argument("--local-epochs", type=int, default=10)
    p.add_argument("--strategies", nargs="+", default=["pfedclub", "pfedhr"])
    p.add_argument("--set", action="append", default=[], metavar="[STRATEGY:]KEY=VALUE", help="a strategy option")
    p.add_argument("--device", default="cpu")
    p.add_argument("--widths", choices=WIDTHS, default=DEFAULT_WIDTHS, help="zoo width preset (fedge/zoo.py)")
    args = p.parse_args()
    names = {column: column.partition("@")[0] for column in args.strategies}
    options = parse_sets(args.set, sorted(set(names.values())))
    cfg = config_from(
        dict(
            strategy=names[args.strategies[0]],
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
    print(
        f"one client's local training ({args.local_epochs} epochs, mean of {len(agents)}): {client:.2f} s "
        f"(per model: {', '.join(f'{a.spec.name} {s:.1f}' for a, s in zip(agents, train_seconds))})"
    )

    x_public, y_public = ds.tensors(part.public)
    warm = x_public[stratified_sample(y_public.numpy(), 64, DEFAULT_SEED)]
    for w in results.values():  # warm up torch's kernels, so the first strategy timed does not pay for it
        block_features(w.models["local"], warm, device=args.device)
    totals, times, rows = {}, {}, {}
    for name in args.strategies:
        cap = name.partition("@")[2]
        chosen = options[names[name]] | ({"max_candidates": cap} if cap else {})
        strategy = create_strategy(names[name], strategy_config(cfg), PublicData(x_public, y_public), chosen)
        strategy.setup({a.client_id: a.info() for a in agents})
        strategy.plan(0, list(results))
        start = time.perf_counter()
        strategy.aggregate(0, results)
        totals[name] = time.perf_counter() - start
        times[name] = dict(strategy.times)
        rows[name] = {cid: strategy.record(0, cid) for cid in results}
        print(f"{name} options: {strategy.options}")

    first = args.strategies[0]
    print(f"\n{'stage':12s}" + "".join(f"{n:>12s}" for n in args.strategies))
    for stage in STAGES:
        print(f"{stage:12s}" + "".join(f"{times[n][stage]:12.2f}" for n in args.strategies))
    print(f"{'total (s)':12s}" + "".join(f"{totals[n]:12.2f}" for n in args.strategies))
    print(f"{'/ ' + first:12s}" + "".join(f"{totals[n] / totals[first]:12.2f}" for n in args.strategies))
    print(f"{'/ client':12s}" + "".join(f"{totals[n] / client:12.2f}" for n in args.strategies))
    for name in args.strategies:
        kept = [r.get("candidates", 0) for r in rows[name].values()]
        per_client = all("candidates_total" in r for r in rows[name].values())  # pFedClub: candidates per client
        key = "candidates_total" if per_client else "candidates_generated"
        generated = [r.get(key) for r in rows[name].values()]
        trained = sum(kept) if per_client else max(kept, default=0)  # pFedHR's candidates are shared
        fit = times[name]["finetune"] + times[name]["matching"] + times[name]["candidates"]
        each = fit / trained if trained else float("nan")
        print(f"\n{name}: candidates kept per client {kept}, {key} {generated}")
        print(f"  {trained} candidates built, fine-tuned and matched in {fit:.2f} s: {each:.3f} s per candidate")
        if per_client and sum(generated) > trained:
            print(
                f"  every candidate (Alg. 1 line 20, {sum(generated):,}) at {each:.3f} s each would take "
                f"{each * sum(generated):,.0f} s (an estimate from this run's seconds per candidate)"
            )
        for key in ("teacher_is_self", "teacher_fallback"):
            count = sum(bool(r.get(key)) for r in rows[name].values())
            if count:
                print(f"  {key}: {count} of {len(rows[name])} clients")


if __name__ == "__main__":
    main()
