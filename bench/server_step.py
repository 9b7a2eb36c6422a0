"""pFedClub's and pFedHR's server step on the same uploads, side by side, against one client's local training
and against the hardware's floor.

    python bench/server_step.py [--dataset mnist-5k] [--active 5] [--local-epochs 10] [--device cpu] [--threads 1]
                                [--strategies pfedclub pfedclub@1 pfedclub@4 pfedhr] [--set pfedclub:exclude_self=true]

Zoo I, MNIST-size data: `--active` clients train briefly (so their features mean something) and upload; then
each strategy runs one aggregation on those same uploads. Prints seconds per stage (features/CKA, grouping,
candidate generation, stitch fine-tuning, matching) for each strategy, the ratio of each strategy's total to
the first one's and to pFedHR's (`NAME@K` is NAME with max_candidates=K: the pFedClub / pFedHR ratio at each
cap), candidates generated and kept per client with seconds per kept candidate, and each total as a ratio to the
mean wall time of one client's local training (`--local-epochs` epochs, the paper's 10 by default), all from this
one run. With a cap on pFedClub's candidates it also prints what every candidate (Alg. 1 line 20) would cost at
the measured seconds each. The floor (bench/floor.py): the FLOPs each trained candidate's fine-tuning and
matching must do (pFedHR's client copies included), at this machine's measured dense rate on `--threads`
threads; `NAME per candidate / floor: R.RRx` says how far each strategy is from it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from bench.floor import (  # noqa: E402
    block_rates,
    finetune_block_flops,
    floor_lines,
    machine_rate,
    matching_block_flops,
)
from edge_client.training import TrainConfig, train  # noqa: E402
from fedge.config import config_from  # noqa: E402
from fedge.constants import DEFAULT_SEED, DEFAULT_WIDTHS, WIDTHS  # noqa: E402
from fedge.data.datasets import load_dataset  # noqa: E402
from fedge.data.partition import make_partition, stratified_sample  # noqa: E402
from fedge.model.spec import ModelSpec  # noqa: E402
from fedge.model.zoo import assign_models  # noqa: E402
from fedge.wire.messages import Result  # noqa: E402
from launch.client import make_agent  # noqa: E402
from launch.runs import partition_config  # noqa: E402
from launch.server import strategy_config  # noqa: E402
from methods.pfedhr.candidates import block_operations, depth_order, pfedhr_candidates  # noqa: E402
from methods.reassembly.assemble import assemble, assemble_modules, candidate_spec  # noqa: E402
from methods.reassembly.features import block_features  # noqa: E402
from methods.reassembly.finetune import (  # noqa: E402
    best_match,
    finetune_candidates,
    module_logits,
    public_logits,
    train_stitch_modules,
)
from methods.reassembly.strategy import STAGES, ReassemblyStrategy  # noqa: E402
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


def samples_seen(strategy: ReassemblyStrategy, n: int) -> int:
    """Samples one fine-tuning goes through over n public samples: whole passes, then the batches of the last."""
    batch, steps = strategy.finetune_config("bench").schedule(n)
    per_pass = -(-n // batch)
    return steps // per_pass * n + min(steps % per_pass * batch, n)


def trained_flops(
    strategy: ReassemblyStrategy, results: dict[str, Result], n: int
) -> list[tuple[ModelSpec, list[float]]]:
    """Every model the strategy's step fine-tuned, found again from the same uploads and seeds, with the FLOPs of
    each of its blocks (floor.finetune_block_flops + matching_block_flops): pFedClub's kept candidates per client
    (stitches only); pFedHR's shared candidates (every parameter, or the stitches) and its fine-tuned client copies
    (every parameter)."""
    uploads = {cid: r.models["local"] for cid, r in results.items()}
    pool, _ = strategy.pool(0, uploads)
    seen = samples_seen(strategy, n)

    def flops(spec, trainable):
        tune, match = finetune_block_flops(spec, trainable, seen, 1, n), matching_block_flops(spec, trainable, n)
        return spec, [a + b for a, b in zip(tune, match)]

    def whole(spec):
        return tuple(range(len(spec.blocks)))

    if strategy.name.startswith("pfedclub"):
        out = []
        for cid, own in pool.uploads.items():
            for keys in strategy.search(0, cid, pool).candidates:
                spec, stitches = candidate_spec(
                    "c", [pool.blocks[k] for k in keys], own.spec.input_shape, own.spec.num_classes
                )
                out.append(flops(spec, stitches))
        return out
    any_spec = next(iter(pool.uploads.values())).spec
    found = pfedhr_candidates(depth_order(pool.groups), block_operations(pool.blocks.values()), strategy.options.scan)
    out = []
    for keys in found.candidates:
        spec, stitches = candidate_spec("c", [pool.blocks[k] for k in keys], any_spec.input_shape, any_spec.num_classes)
        out.append(flops(spec, whole(spec) if strategy.options.pfedhr_finetune == "all" else stitches))
    return out + [flops(w.spec, whole(w.spec)) for w in pool.uploads.values()]


def own_rate_seconds(
    models: list[tuple[ModelSpec, list[float]]],
    uploads: list[ModelSpec],
    batch: int,
    threads: int,
    dense: float,
    fold: bool,
) -> float:
    """The seconds `models`' FLOPs take with each block at its own measured rate (floor.block_rates: forward +
    backward to its input at the fine-tuning batch, this machine, `threads` threads; `fold`: as pFedClub's
    candidates run them) instead of the dense one: the floor for the kernels torch has here, where depthwise
    convolutions and BatchNorm are memory-bound. A block is known by its origin (model, index); stitches, which
    no upload holds, count at the dense rate."""
    rates = {}
    for spec in {u.name: u for u in uploads}.values():
        for r in block_rates(spec, batch, threads, fold=fold):
            origin = spec.blocks[r.index].origin
            rates[(origin.model, origin.block)] = r.rate or dense
    return sum(
        f / rates.get((b.origin.model, b.origin.block), dense) for spec, fs in models for b, f in zip(spec.blocks, fs)
    )


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
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the floor is measured on as many)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="pFedClub's server threads over clients (1: the floor's one thread; pFedHR's step is serial)",
    )
    p.add_argument(
        "--compare-paths",
        type=int,
        default=0,
        metavar="K",
        help="also time K candidates per client through the plain weights path, the server's module path and "
        "that path in lockstep",
    )
    p.add_argument("--widths", choices=WIDTHS, default=DEFAULT_WIDTHS, help="zoo width preset (fedge/model/zoo.py)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
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
    print(f"hardware: {hardware()}; device {args.device}, {args.threads} torch thread(s)")
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
    totals, times, rows, strategies = {}, {}, {}, {}
    for name in args.strategies:
        cap = name.partition("@")[2]
        chosen = options[names[name]] | ({"max_candidates": cap} if cap else {})
        strategy = create_strategy(names[name], strategy_config(cfg), PublicData(x_public, y_public), chosen)
        strategy.setup({a.client_id: a.info() for a in agents})
        strategy.workers = args.workers
        strategy.plan(0, list(results))
        start = time.perf_counter()
        strategy.aggregate(0, results)
        totals[name] = time.perf_counter() - start
        times[name] = dict(strategy.times)
        rows[name] = {cid: strategy.record(0, cid) for cid in results}
        strategies[name] = strategy
        print(f"{name} options: {strategy.options}")

    rate = machine_rate(args.threads) if args.device == "cpu" else float("nan")
    first = args.strategies[0]
    print(f"\n{'stage':12s}" + "".join(f"{n:>12s}" for n in args.strategies))
    for stage in STAGES:
        print(f"{stage:12s}" + "".join(f"{times[n][stage]:12.2f}" for n in args.strategies))
    print(f"{'total (s)':12s}" + "".join(f"{totals[n]:12.2f}" for n in args.strategies))
    print(f"{'/ ' + first:12s}" + "".join(f"{totals[n] / totals[first]:12.2f}" for n in args.strategies))
    print(f"{'/ client':12s}" + "".join(f"{totals[n] / client:12.2f}" for n in args.strategies))
    hr = next((n for n in args.strategies if names[n] == "pfedhr"), None)
    if hr is not None:
        print(f"{'/ ' + hr:12s}" + "".join(f"{totals[n] / totals[hr]:12.2f}" for n in args.strategies))
    per_candidate, flops, own_rate = {}, {}, {}
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
        counted = trained_flops(strategies[name], results, len(x_public))
        total = sum(sum(fs) for _, fs in counted)
        flops[name] = total / trained if trained else float("nan")
        per_candidate[name] = (each, flops[name] / rate)
        if args.device == "cpu" and trained:
            batch = strategies[name].finetune_config("bench").schedule(len(x_public))[0]
            fold = getattr(strategies[name].options, "fold_frozen", False)  # pFedHR trains whole models, unfolded
            specs = [a.spec for a in agents]
            own_rate[name] = own_rate_seconds(counted, specs, batch, args.threads, rate, fold) / trained
        steps = sorted({r.get("finetune_steps") for r in rows[name].values()} - {None})
        print(f"  fine-tuning steps {steps}, {len(counted)} models fine-tuned, {total / 1e9:.1f} GFLOP in all")
        if per_client and sum(generated) > trained:
            print(
                f"  every candidate (Alg. 1 line 20, {sum(generated):,}) at {each:.3f} s each would take "
                f"{each * sum(generated):,.0f} s (an estimate from this run's seconds per candidate)"
            )
        for key in ("teacher_is_self", "teacher_fallback"):
            count = sum(bool(r.get(key)) for r in rows[name].values())
            if count:
                print(f"  {key}: {count} of {len(rows[name])} clients")
    print()
    if args.device == "cpu":
        floors = {n: v for n, v in per_candidate.items() if v[1] > 0}
        print("\n".join(floor_lines(floors, flops, rate, args.threads, own_rate)))
    else:  # machine_rate measures the CPU: a floor for another device needs that device's rate
        print(f"no floor printed: it is measured on the CPU, and this run used {args.device}")
    club = next((n for n in args.strategies if names[n].startswith("pfedclub")), None)
    if args.compare_paths and club is not None:
        compare_paths(strategies[club], results, x_public, y_public, args.compare_paths)


def compare_paths(strategy: ReassemblyStrategy, results: dict[str, Result], x, y, count: int) -> None:
    """The same candidates (up to `count` per client, from the strategy's own search) through the plain path
    (assemble → finetune_candidates → public_logits: weights built per candidate, BatchNorm as uploaded), the
    server's (assemble_modules over the pool's frozen, folded, channels-last blocks → train_stitch_modules →
    module_logits) and the server's in lockstep (a frozen block several candidates hold runs once on their
    inputs concatenated): seconds of each, and the largest difference of their Eq. (4) scores from the server's
    path, with how many clients' choice agrees."""
    pool, _ = strategy.pool(0, {cid: r.models["local"] for cid, r in results.items()})
    cfg = strategy.finetune_config("finetune", 0, "paths")
    paths = ("plain weights", "frozen folded modules", "the same in lockstep")
    seconds, gap, same, n = dict.fromkeys(paths, 0.0), dict.fromkeys(paths, 0.0), dict.fromkeys(paths, 0), 0

    def modules(blocks, io, lockstep: bool) -> list[float]:
        rng = np.random.default_rng(0)
        built = [assemble_modules(f"c{i}", b, *io, rng, pool.frozen) for i, b in enumerate(blocks)]
        train_stitch_modules([m for m, _ in built], [t for _, t in built], x, y, replace(cfg, lockstep=lockstep))
        starts = [t[0] if t else len(m.blocks) for m, t in built]
        return best_match(own_logits, module_logits([m for m, _ in built], starts, x, lockstep))[1]

    for cid, own in pool.uploads.items():
        keys = strategy.search(0, cid, pool).candidates[:count]
        blocks = [[pool.blocks[k] for k in ks] for ks in keys]
        io = (own.spec.input_shape, own.spec.num_classes)
        own_logits = public_logits([own], x)[0]
        scores = {}
        for path in paths:
            start = time.perf_counter()
            if path == paths[0]:
                rng = np.random.default_rng(0)
                tuned = finetune_candidates([assemble(f"c{i}", b, *io, rng) for i, b in enumerate(blocks)], x, y, cfg)
                scores[path] = best_match(own_logits, public_logits([t.weights for t in tuned], x))[1]
            else:
                scores[path] = modules(blocks, io, lockstep=path == paths[2])
            seconds[path] += time.perf_counter() - start
        base = scores[paths[1]]
        for path, got in scores.items():
            gap[path] = max([gap[path]] + [abs(a - b) for a, b in zip(base, got)])
            same[path] += max(range(len(got)), key=got.__getitem__) == max(range(len(base)), key=base.__getitem__)
        n += len(keys)
    print(f"\nthe same {n} candidates through three paths (vs the server's default, {paths[1]}):")
    for path in paths:
        print(
            f"  {path:24s} {seconds[path]:8.2f} s ({seconds[paths[1]] / seconds[path]:.2f}x of the server's speed); "
            f"largest Eq. (4) score difference {gap[path]:.1e}; the same candidate chosen for {same[path]} of "
            f"{len(results)} clients"
        )


if __name__ == "__main__":
    main()
