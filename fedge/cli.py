"""The `fedge` command line: zoo, profiles, data, run. Like the simulation launcher, it may import everything."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Callable, Sequence

from device_profiles import ProfileError
from fedge import constants as C
from fedge.config import ConfigError
from fedge.data import DatasetError
from fedge.layers import SpecError
from fedge.partition import SCHEMES, PartitionError
from fedge.weights import WeightsError
from fedge.zoo import ZooError
from server.strategy import StrategyError

# Errors whose message tells the user what to do; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, DatasetError, PartitionError, ProfileError, SpecError,
                                            StrategyError, WeightsError, ZooError, OSError)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Plain aligned text table; numbers get thousands separators."""
    cells = [[_cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) if v[:1].isdigit() else v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _emit(args: argparse.Namespace, rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    print(json.dumps(rows, indent=2) if args.json else _table(rows, columns))


def _shape(text: str) -> tuple[int, int, int]:
    try:
        c, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CxHxW such as 1x28x28, got {text!r}") from None
    if min(c, h, w) < 1:
        raise argparse.ArgumentTypeError(f"every dimension must be positive, got {text!r}")
    return c, h, w


def cmd_zoo(args: argparse.Namespace) -> None:
    from fedge.zoo import MODELS, ZOOS, create

    rows = []
    for name in MODELS:
        spec = create(name, args.input, args.classes)
        rows.append({"name": name, "blocks": len(spec.blocks), "params": spec.params, "macs": spec.macs,
                     "block_names": [b.name for b in spec.blocks]})
    _emit(args, rows, ["name", "blocks", "params", "macs"])
    if not args.json:
        print("\nzoo presets (models: clients out of 50, pFedClub §4.1):")
        for zoo, weights in ZOOS.items():
            print(f"  {zoo:4s} " + ", ".join(f"{m}: {n}" for m, n in weights.items()))


def cmd_profiles(args: argparse.Namespace) -> None:
    from dataclasses import asdict

    from device_profiles import list_profiles, validate_profile_file

    if args.validate:
        for path in args.validate:
            validate_profile_file(path)
            print(f"{path}: ok")
        return
    rows = [asdict(p) for p in list_profiles()]
    _emit(args, rows, ["name", "runtime", "max_params", "max_macs", "train_macs_per_s", "memory_bytes"])


def cmd_data(args: argparse.Namespace) -> None:
    from fedge.data import list_datasets, load_dataset
    from fedge.partition import PartitionConfig, describe, make_partition

    if args.dataset is None:
        _emit(args, [{"name": n} for n in list_datasets()], ["name"])
        return
    ds = load_dataset(args.dataset, args.data)
    part = make_partition(ds.y, ds.num_classes, PartitionConfig(
        scheme=args.partition, num_clients=args.clients, classes_per_client=args.classes_per_client,
        alpha=args.alpha, seed=args.seed))
    rows = describe(part, ds.y)
    if args.json:
        print(json.dumps({"dataset": ds.name, "samples": len(ds.y), "input_shape": list(ds.input_shape),
                          "classes": list(ds.classes), "public": len(part.public), "clients": rows}, indent=2))
        return
    print(f"{ds.name}: {len(ds.y):,} samples, input {'x'.join(map(str, ds.input_shape))}, "
          f"{ds.num_classes} classes; public set {len(part.public):,}")
    print(_table([r | {"classes": " ".join(f"{k}:{v}" for k, v in r["classes"].items())} for r in rows],
                 ["client", "n_train", "n_test", "classes"]))


RUN_FLAGS = ("strategy", "dataset", "data", "zoo", "clients", "active", "rounds", "local_epochs", "batch_size",
             "lr", "seed", "partition", "out", "eta", "clusters", "public", "ablation")


def cmd_run(args: argparse.Namespace) -> None:
    from fedge.config import load_config, parse_overrides
    from fedge.simulation import run_simulation

    overrides = {k: getattr(args, k) for k in RUN_FLAGS if getattr(args, k) is not None}
    cfg = load_config(args.config, overrides | parse_overrides(args.set or []))
    print("fedge run with config:\n" + json.dumps(cfg.to_dict(), indent=2), file=sys.stderr)
    summary = run_simulation(cfg, progress=args.progress)
    final, phi, teacher = summary["final_accuracy"], summary.get("phi", {}), summary.get("teacher_params", {})
    rows = [{"client": cid, "model": summary["models"][cid], "accuracy": f"{acc:.4f}",
             "teacher params": f"{teacher[cid]:,.0f}" if cid in teacher else "-",
             "phi": f"{phi[cid]:+.3f}" if cid in phi else "-"} for cid, acc in final["per_client"].items()]
    print(_table(rows, ["client", "model", "accuracy"] + (["teacher params", "phi"] if phi else [])))
    mean = "n/a (no client was evaluated)" if final["mean"] is None else f"{final['mean']:.4f}"
    print(f"\nmean final accuracy {mean} over {len(rows)} clients; run folder: {summary['out']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedge", description="Personalized federated learning for "
                                     "heterogeneous edge fleets (pFedClub, pFedHR, ...).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("zoo", help="list the model zoo with parameters and MACs")
    p.add_argument("--input", type=_shape, default=(1, 28, 28), help="input shape CxHxW (default 1x28x28)")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_zoo)

    p = sub.add_parser("profiles", help="list device profiles, or validate profile files")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--validate", nargs="+", metavar="FILE", help="validate these profile TOML files")
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("data", help="list datasets, or show how one is partitioned across clients")
    p.add_argument("--dataset", help="dataset name (omit to list them)")
    p.add_argument("--data", help="path to the dataset files (.npz or official layout)")
    p.add_argument("--partition", default=C.DEFAULT_PARTITION, choices=SCHEMES)
    p.add_argument("--clients", type=int, default=C.DEFAULT_CLIENTS)
    p.add_argument("--classes-per-client", type=int, default=C.CLASSES_PER_CLIENT)
    p.add_argument("--alpha", type=float, default=C.DIRICHLET_ALPHA)
    p.add_argument("--seed", type=int, default=C.DEFAULT_SEED)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_data)
    add_run_parser(sub)
    return parser


def add_run_parser(sub: Any) -> None:
    """`fedge run`: every option is a key of RunConfig (and --set reaches the rest)."""
    p = sub.add_parser("run", help="run a whole federation (server + simulated edge clients)",
                       description="Run a federation. With no options: the embedded default "
                       f"({C.DEFAULT_DATASET}, zoo {C.DEFAULT_ZOO}, {C.DEFAULT_CLIENTS} clients).")
    p.add_argument("--config", help="TOML file of run settings (keys as in --set)")
    p.add_argument("--strategy", help=f"pfedclub, pfedclub+, pfedhr, fedavg or local (default {C.DEFAULT_STRATEGY})")
    p.add_argument("--dataset", help=f"dataset name (default {C.DEFAULT_DATASET})")
    p.add_argument("--data", help="path to dataset files, e.g. ../shared/data/mnist.npz")
    p.add_argument("--zoo", help="I, II, III, or one model name for a homogeneous fleet")
    p.add_argument("--clients", type=int, help="number of clients N")
    p.add_argument("--active", type=int, help="clients per round M")
    p.add_argument("--rounds", type=int, help="communication rounds T")
    p.add_argument("--local-epochs", type=int, help="local epochs per round E")
    p.add_argument("--batch-size", type=int, help="local batch size")
    p.add_argument("--lr", type=float, help="client learning rate (Adam)")
    p.add_argument("--seed", type=int, help="run seed")
    p.add_argument("--partition", choices=SCHEMES, help="how data is split")
    p.add_argument("--eta", type=float, help="pFedClub+ size bound: teacher params <= (1+eta)·own (default 0.1)")
    p.add_argument("--clusters", type=int, help="pFedClub/pFedHR functional groups K (default 4)")
    p.add_argument("--public", choices=["labeled", "unlabeled"], help="server public data: CE or NT-Xent stitching")
    p.add_argument("--ablation", choices=list(C.ABLATIONS), help="pFedClub ablation (paper Table 3)")
    p.add_argument("--out", help="run folder (default runs/<time>-<strategy>-<dataset>)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key (repeatable)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    p.set_defaults(func=cmd_run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user errors print one line `fedge: error: ...` and return 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except USER_ERRORS as e:
        print(f"fedge: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
