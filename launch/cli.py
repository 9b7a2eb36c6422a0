"""The `fedge` command line: one parser, one function per command; each imports what its command needs when it runs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from device_profiles import ProfileError
from fedge import constants as C
from fedge.config import ConfigError
from fedge.data.partition import SCHEMES
from fedge.errors import UserError
from fedge.extras import missing_extra
from launch.export_commands import add_export_parsers
from launch.new_method import add_new_method_parser

# Errors whose message tells the user what to do; anything else is a bug and keeps its traceback. Each command
# imports what it needs when it runs, so `fedge client` loads neither the server nor the embedded broker.
USER_ERRORS: tuple[type[Exception], ...] = (UserError, ProfileError, OSError)


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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def cmd_zoo(args: argparse.Namespace) -> None:
    from export import ExportError
    from export.training_program import check_trainable
    from fedge.model.zoo import FEDGH_CNNS, MODELS, ZOOS, create
    from methods.dcpfl.heads import HeadError, representation_size

    rows = []
    for name in MODELS:
        spec = create(name, args.input, args.classes, args.widths)
        try:
            check_trainable(spec)
            executorch = "yes"
        except ExportError:
            executorch = "no"
        try:
            representation: int | None = representation_size(spec)
        except HeadError:
            representation = None
        rows.append(
            {
                "name": name,
                "blocks": len(spec.blocks),
                "params": spec.params,
                "macs": spec.macs,
                "executorch_training": executorch,
                "representation": representation,
                "block_names": [b.name for b in spec.blocks],
            }
        )
    _emit(args, rows, ["name", "blocks", "params", "macs", "executorch_training", "representation"])
    if not args.json:
        print("\nzoo presets (models: clients out of 50, pFedClub §4.1):")
        for zoo, weights in ZOOS.items():
            print(f"  {zoo:4s} " + ", ".join(f"{m}: {n}" for m, n in weights.items()))
        print(f"  {C.FEDGH_ZOO} client i gets model i mod 5 of {', '.join(FEDGH_CNNS)} (FedGH, DC-PFL)")
        print(
            "\nmodel families: fedmn_<units>_<encoder> is a FedMN pool (e.g. fedmn_2x2x2_cnn1: 2 encoders, 2 MLP "
            "blocks, 2 output blocks;\n  the encoder is a model above without its last block, or fc); mlp<depth> an "
            "MLP of 256 hidden units (e.g. mlp8)"
        )


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
    from fedge.data.datasets import list_datasets, load_dataset
    from fedge.data.partition import PartitionConfig, describe, make_partition

    if args.dataset is None:
        _emit(args, [{"name": n} for n in list_datasets()], ["name"])
        return
    ds = load_dataset(args.dataset, args.data)
    part = make_partition(
        ds.y,
        ds.num_classes,
        PartitionConfig(
            scheme=args.partition,
            num_clients=args.clients,
            classes_per_client=args.classes_per_client,
            alpha=args.alpha,
            label_clusters=args.label_clusters,
            seed=args.seed,
        ),
    )
    rows = describe(part, ds.y)
    if args.json:
        print(
            json.dumps(
                {
                    "dataset": ds.name,
                    "samples": len(ds.y),
                    "input_shape": list(ds.input_shape),
                    "classes": list(ds.classes),
                    "public": len(part.public),
                    "clients": rows,
                },
                indent=2,
            )
        )
        return
    print(
        f"{ds.name}: {len(ds.y):,} samples, input {'x'.join(map(str, ds.input_shape))}, "
        f"{ds.num_classes} classes; public set {len(part.public):,}"
    )
    print(
        _table(
            [r | {"classes": " ".join(f"{k}:{v}" for k, v in r["classes"].items())} for r in rows],
            ["client", "n_train", "n_test", "classes"],
        )
    )


RUN_FLAGS = (
    "strategy",
    "dataset",
    "data",
    "zoo",
    "widths",
    "clients",
    "active",
    "rounds",
    "local_epochs",
    "batch_size",
    "lr",
    "seed",
    "partition",
    "aggregator",
    "out",
    "public_data",
)


def run_config(args: argparse.Namespace, flags: Sequence[str] = RUN_FLAGS) -> Any:
    """The RunConfig of a command: defaults, then the strategy's paper fleet (fedge.config.paper_fleets) for each of
    its keys nothing below sets, then --config, then the named flags, then --set. What the paper fleet chose is
    printed, with why."""
    from fedge.config import load_config_chosen, paper_fleets, parse_overrides

    overrides = {k: getattr(args, k) for k in flags if getattr(args, k, None) is not None}
    cfg, chosen = load_config_chosen(args.config, overrides | parse_overrides(args.set or []))
    if chosen:
        keys = ", ".join(f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in chosen.items())
        print(
            f"{cfg.strategy} runs on its paper's fleet: {keys}. {paper_fleets()[cfg.strategy].why}. "
            "A flag, --set or the config file sets any of these keys instead.",
            file=sys.stderr,
        )
    return cfg


def strategies_text() -> str:
    """Every registered strategy with its options (name, type, default, help), from the registry."""
    from server.strategy import STRATEGIES

    lines = ["strategies and their options (set with --set NAME=VALUE or a TOML [options] table):"]
    for name in STRATEGIES:
        cls = STRATEGIES.get(name)
        lines.append(f"  {name}: {' '.join((cls.__doc__ or '').split(chr(10) * 2)[0].split())}")
        described = cls.options_type.describe()
        lines += [f"      {o} ({kind}, default {default!r}): {text}" for o, kind, default, text in described]
        if not described:
            lines.append("      (no options)")
    return "\n".join(lines)


def cmd_strategies(args: argparse.Namespace) -> None:
    """`fedge strategies`: what `fedge run --strategy` accepts, with each strategy's options."""
    from server.strategy import STRATEGIES

    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": name,
                        "options": [
                            {"name": o, "type": kind, "default": default, "help": text}
                            for o, kind, default, text in STRATEGIES.get(name).options_type.describe()
                        ],
                    }
                    for name in STRATEGIES
                ],
                indent=2,
            )
        )
        return
    print(strategies_text())


def broker_settings(args: argparse.Namespace, username: str | None) -> Any:
    """A Broker from --broker, --username/--password-file and the TLS flags."""
    from fedge.brokers.mqtt import parse_broker
    from launch.client import password_for

    password = password_for(args.password_file, username) if args.password_file and username else None
    return parse_broker(args.broker, username, password, args.cafile, args.certfile, args.keyfile)


def print_summary(summary: dict[str, Any]) -> None:
    """The end table: a row for every client of the run, what became of it (summary.json's client_status), its final
    accuracy where it was evaluated; then the mean, saying over how many of how many clients."""
    from fedge.wire.messages import client_order

    final, phi, teacher = summary["final_accuracy"], summary.get("phi", {}), summary.get("teacher_params", {})
    evaluated = summary.get("eval_models", {})  # a strategy that evaluates clients on models it chose (FedTrans)
    status = summary.get("client_status", {})
    accuracy = final["per_client"]
    clients = sorted(set(summary["models"]) | set(accuracy), key=client_order)
    rows = [
        {
            "client": cid,
            "model": summary["models"].get(cid, "-"),
            "evaluated on": evaluated.get(cid, "-"),
            "runtime": summary["runtimes"].get(cid, "-"),
            "status": status[cid]["status"] if cid in status else "-",
            "accuracy": f"{accuracy[cid]:.4f}" if cid in accuracy else "-",
            "mean teacher params": f"{teacher[cid]:,.0f}" if cid in teacher else "-",
            "phi": f"{phi[cid]:+.3f}" if cid in phi else "-",
        }
        for cid in clients
    ]
    columns = ["client", "model"] + (["evaluated on"] if evaluated else []) + ["runtime", "status", "accuracy"]
    print(_table(rows, columns + (["mean teacher params", "phi"] if phi else [])))
    others = [f"client {cid} {s['status']}: {s['reason']}" for cid, s in status.items() if s["status"] != "trained"]
    if others:
        print("\n" + "\n".join(others))
    mean = "n/a (no client was evaluated)" if final["mean"] is None else f"{final['mean']:.4f}"
    for what, key in (("refused replies", "rejected_replies"), ("rejected messages", "rejected_messages")):
        counts = summary.get(key) or {}
        if counts:
            print(f"\n{what}: {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}")
    print(f"\nmean final accuracy {mean} over {len(accuracy)} of {len(clients)} clients; run folder: {summary['out']}")


def cmd_run(args: argparse.Namespace) -> None:
    import dataclasses

    from launch.federation import run_federation
    from launch.runs import default_out
    from launch.server import resolve_options
    from launch.simulation import run_simulation
    from launch.workers import available_cores

    if args.client_device not in (None, "cpu") and args.engine is None:
        args.engine = "batched"  # a GPU trains the simulation's clients batched
    cfg = resolve_options(
        run_config(args, RUN_FLAGS + ("transport", "workers", "engine", "ray_address", "client_device"))
    )
    # the server at one torch thread unless told otherwise, over either transport: the same arithmetic, the same models;
    # the in-process simulation's clients on a worker process per core (bit for bit the same models as one by one)
    workers = cfg.workers or (0 if cfg.engine == "ray" else available_cores())  # ray: one per CPU of the cluster
    cfg = dataclasses.replace(
        cfg, out=cfg.out or str(default_out(cfg)), server_threads=cfg.server_threads or 1, workers=workers
    )
    print(
        f"fedge run: {cfg.strategy} on {cfg.dataset} ({cfg.partition}), zoo {cfg.zoo}, {cfg.clients} clients "
        f"({cfg.active} per round) on {', '.join(cfg.profiles)}, {cfg.rounds} rounds of {cfg.local_epochs} local "
        f"epochs, seed {cfg.seed}, {cfg.transport}; every setting in {cfg.out}/config.json",
        file=sys.stderr,
    )
    if cfg.transport == "inproc":
        summary = run_simulation(cfg, progress=args.progress)
    else:
        print(
            f"embedded MQTT broker, {cfg.clients} clients in separate processes (logs in {cfg.out}/clients-*.log)",
            file=sys.stderr,
        )
        summary = run_federation(cfg, progress=args.progress, processes=args.processes)
    print_summary(summary)


def cmd_server(args: argparse.Namespace) -> None:
    import dataclasses

    from launch.runs import default_out
    from launch.server import serve

    if args.resume and not args.config:  # the interrupted run's own settings
        args.config = str(Path(args.resume) / "config.json")
    cfg = run_config(args)
    if args.resume:
        cfg = dataclasses.replace(cfg, out=args.resume)
    cfg = dataclasses.replace(cfg, out=cfg.out or str(default_out(cfg)))
    print_summary(serve(cfg, broker_settings(args, args.username), args.progress, resume=bool(args.resume)))


def cmd_client(args: argparse.Namespace) -> int:
    import torch

    from fedge.torch_build import check_client_build
    from launch.client import client_agents, run_clients, set_threads

    set_threads(args.threads)
    check_client_build(torch.get_num_threads())
    cfg = run_config(args, ("dataset", "data", "data_dir"))
    ids = [i.strip() for i in args.id.split(",") if i.strip()]
    agents = client_agents(cfg, ids, args.model, args.profile, args.state_dir)
    return run_clients(agents, lambda cid: broker_settings(args, args.username or cid), cfg)


def cmd_doctor(args: argparse.Namespace) -> int:
    from device_profiles import get_profile
    from launch.doctor import report, text

    profile = get_profile(args.profile) if args.profile else None
    r = report(profile, args.input, args.classes, args.batch_size, args.widths)
    print(json.dumps(r, indent=2) if args.json else text(r))
    return 1 if r["problems"] else 0


def cmd_broker(args: argparse.Namespace) -> None:
    from fedge.brokers.access import TlsFiles, generate_users, read_users
    from fedge.brokers.embedded_broker import serve_forever
    from launch.federation import write_secrets

    written = args.write_mosquitto_config or args.write_rabbitmq_config
    if written is None:
        serve_forever(args.port, args.users)
        return
    out = Path(written)
    if args.users:
        users, users_file = read_users(args.users), Path(args.users)
    else:
        users, users_file = (
            generate_users([c.strip() for c in (args.clients or "").split(",") if c.strip()]),
            out / "users",
        )
        out.mkdir(parents=True, exist_ok=True)
        write_secrets(users_file, users)
    if bool(args.certfile) != bool(args.keyfile):
        raise ConfigError("TLS needs both --certfile and --keyfile")
    tls = (
        TlsFiles(
            Path(args.certfile),
            Path(args.keyfile),
            Path(args.cafile) if args.cafile else None,
            args.require_certificate,
        )
        if args.certfile
        else None
    )
    if args.write_rabbitmq_config:
        from fedge.brokers.rabbitmq import write_rabbitmq_config

        conf = write_rabbitmq_config(out, users, users_file, args.port, args.host, tls, run_as=args.run_as)
        print(
            f"wrote {conf}, enabled_plugins, definitions.json and users.sh for {len(users) - 1} clients.\n"
            f"A new node, or each node of a new cluster, loads the users at boot: start it with "
            f"RABBITMQ_CONFIG_FILE={conf} RABBITMQ_ENABLED_PLUGINS_FILE={out.resolve() / 'enabled_plugins'} "
            f"rabbitmq-server\nA running cluster: sh {out.resolve() / 'users.sh'} on any node "
            f"(docs/deployment.md: joining nodes into a cluster)"
        )
    else:
        from fedge.brokers.mosquitto import write_mosquitto_config

        conf = write_mosquitto_config(out, users, port=args.port, host=args.host, tls=tls, run_as=args.run_as)
        print(f"wrote {conf} for {len(users) - 1} clients; start it with: mosquitto -c {conf}")
    if not args.users:
        print(f"generated passwords are in {users_file} (username:password, mode 600); give each device its line")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help may end with text made when help is asked for (`footer`), so that listing the
    strategies imports the server only then, never for `fedge client`."""

    footer: Callable[[], str] | None = None

    def format_help(self) -> str:
        text = super().format_help()
        return text if self.footer is None else f"{text}\n{self.footer()}\n"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fedge",
        description="Personalized federated learning for heterogeneous edge fleets (pFedClub, pFedHR, ...).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("zoo", help="list the model zoo with parameters and MACs")
    p.add_argument("--input", type=_shape, default=(1, 28, 28), help="input shape CxHxW (default 1x28x28)")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    p.add_argument(
        "--widths", choices=C.WIDTHS, default=C.DEFAULT_WIDTHS, help=f"width preset (default {C.DEFAULT_WIDTHS})"
    )
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
    p.add_argument("--alpha", type=float, default=C.DIRICHLET_ALPHA, help="Dirichlet α (dirichlet, clustered)")
    p.add_argument(
        "--label-clusters", type=int, default=C.LABEL_CLUSTERS, help="class groups of the clustered partition"
    )
    p.add_argument("--seed", type=int, default=C.DEFAULT_SEED)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser(
        "doctor",
        help="check this machine before it joins a fleet: torch build, memory, which zoo models it can train",
        description="Measure in a fresh interpreter what `import torch` and a few training steps cost here, and "
        "list per zoo model whether the device profile admits it and whether it fits the memory available now. "
        "Exit status 1 when a problem is found (e.g. a CUDA build of torch without a GPU), with its fix.",
    )
    p.add_argument("--profile", help="device profile to check the zoo against (e.g. rpi-4; `fedge profiles`)")
    p.add_argument("--input", type=_shape, default=(1, 28, 28), help="the run's input shape CxHxW (default 1x28x28)")
    p.add_argument("--classes", type=_positive, default=10, help="the run's number of classes (default 10)")
    p.add_argument("--batch-size", type=_positive, default=C.DEFAULT_BATCH_SIZE, help="the run's batch size")
    p.add_argument(
        "--widths", choices=C.WIDTHS, default=C.DEFAULT_WIDTHS, help=f"width preset (default {C.DEFAULT_WIDTHS})"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("strategies", help="list the strategies and their options")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_strategies)
    add_run_parser(sub)
    add_deploy_parsers(sub)
    add_export_parsers(sub)
    add_new_method_parser(sub)
    return parser


def add_run_parser(sub: Any) -> None:
    """`fedge run`: every flag is a run-level key of RunConfig; --set reaches the rest and the strategy's options,
    which the help lists from the strategy registry."""
    from fedge.config import run_keys

    p = sub.add_parser(
        "run",
        help="run a whole federation (server + simulated edge clients)",
        description="Run a federation. With no options: the embedded default "
        f"({C.DEFAULT_DATASET}, zoo {C.DEFAULT_ZOO}, {C.DEFAULT_CLIENTS} clients). Run-level keys "
        f"for --set or a TOML file: {', '.join(run_keys())}.",
    )
    p.footer = strategies_text
    p.add_argument(
        "--config", help="TOML file of run settings (keys as in --set; strategy options also in an [options] table)"
    )
    p.add_argument("--strategy", help=f"a strategy listed below (default {C.DEFAULT_STRATEGY})")
    p.add_argument("--dataset", help=f"dataset name (default {C.DEFAULT_DATASET})")
    p.add_argument("--data", help="path to dataset files, e.g. ../shared/data/mnist.npz")
    p.add_argument(
        "--zoo",
        help="I, II, III, fedgh (FedGH's five CNNs in turn), one model name (a homogeneous fleet), or model names "
        "separated by commas, given to clients in turn (e.g. cnn4,cnn2 with profiles rpi-4,android-mid-range)",
    )
    p.add_argument(
        "--widths",
        choices=C.WIDTHS,
        help=f"zoo width preset (default {C.DEFAULT_WIDTHS}): cpu shrinks the models for CPU runs; paper has the "
        "authors' CNN1-CNN4 channel counts and standard-width MobileNets",
    )
    p.add_argument("--clients", type=int, help="number of clients N")
    p.add_argument("--active", type=int, help="clients per round M")
    p.add_argument("--rounds", type=int, help="communication rounds T")
    p.add_argument("--local-epochs", type=int, help="local epochs per round E")
    p.add_argument("--batch-size", type=int, help="local batch size")
    p.add_argument("--lr", type=float, help="client learning rate (Adam)")
    p.add_argument("--seed", type=int, help="run seed")
    p.add_argument("--partition", choices=SCHEMES, help="how data is split")
    p.add_argument(
        "--aggregator",
        choices=C.AGGREGATORS,
        help=f"how strategies that average uploads aggregate them (default {C.DEFAULT_AGGREGATOR}: the strategy's "
        "own weighted mean); median, trimmed_mean (--set trim_fraction=), krum, multi_krum (--set byzantine=) "
        "resist lying clients at a cost in accuracy (docs/security.md)",
    )
    p.add_argument("--out", help="run folder (default runs/<time>-<strategy>-<dataset>)")
    p.add_argument("--public-data", metavar="PATH", help=PUBLIC_DATA_HELP)
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="set a run-level key or an option of the strategy (repeatable)",
    )
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    p.add_argument(
        "--transport",
        choices=["mqtt", "inproc"],
        help="mqtt (default): embedded broker, clients as OS processes; inproc: one process, no broker",
    )
    p.add_argument("--processes", type=int, help="client processes for --transport mqtt (default: min(cores, 4))")
    p.add_argument(
        "--workers",
        type=int,
        help="client worker processes for --transport inproc, one torch thread each (default: the machine's cores; "
        "1: every client in the server's process, one after another; with --engine ray: one per CPU of the cluster); "
        "the same models bit for bit whatever the count",
    )
    p.add_argument(
        "--engine",
        choices=["processes", "ray", "batched"],
        help="where --transport inproc runs its clients: worker processes of this machine (default), actors of a "
        "Ray cluster (the ray extra; the run folder and data on storage every node sees), or batched: in one "
        "process, the models of one architecture trained together (on --client-device; --workers torch threads; "
        "within float tolerance of the others, which agree bit for bit)",
    )
    p.add_argument(
        "--client-device",
        help="cpu (default), cuda or cuda:N: where --transport inproc --engine batched trains the clients (cuda "
        "implies --engine batched)",
    )
    p.add_argument(
        "--ray-address", help="the Ray cluster for --engine ray, e.g. ray://head:10001 (default: a local one)"
    )
    p.set_defaults(func=cmd_run)


PUBLIC_DATA_HELP = (
    "the server's public set from your own folder or .npz instead of 8%% of the dataset: class folders or "
    "x_train, y_train (labelled), or loose images or x (unlabelled) (config key public_data)"
)


def _connection_flags(p: argparse.ArgumentParser, username_help: str) -> None:
    p.add_argument(
        "--broker",
        required=True,
        help="mqtt://host:1883 or mqtts://host:8883 (TLS); for a broker cluster, every node's address, "
        "comma-separated (mqtt://n1:1883,mqtt://n2:1883): a lost connection moves to the next node",
    )
    p.add_argument("--username", help=username_help)
    p.add_argument(
        "--password-file",
        help="file with the password, or username:password lines (never on the "
        "command line, so it stays out of process lists and logs)",
    )
    p.add_argument("--cafile", help="CA certificate to verify the broker (TLS)")
    p.add_argument("--certfile", help="client certificate (TLS)")
    p.add_argument("--keyfile", help="client key (TLS)")
    p.add_argument("--config", help="the run's TOML or JSON config (the server and all clients use the same)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")


def add_deploy_parsers(sub: Any) -> None:
    """`fedge server`, `fedge client` and `fedge broker`: the pieces of a deployed federation."""
    p = sub.add_parser(
        "server",
        help="run the federation's server against an MQTT broker",
        description="Wait for the fleet to register, run the rounds, write the run folder; "
        "checkpoints after every round (continue with --resume RUN_DIR).",
    )
    _connection_flags(p, "MQTT username (default: server)")
    p.add_argument("--out", help="run folder (default runs/<time>-<strategy>-<dataset>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    p.add_argument("--public-data", metavar="PATH", help=PUBLIC_DATA_HELP)
    p.set_defaults(func=cmd_server, username="server")

    p = sub.add_parser(
        "client",
        help="run edge clients (what a device runs) against an MQTT broker",
        description="Register with the server, execute its tasks, upload results; reconnects "
        "by itself and keeps its model per round in --state-dir.",
    )
    _connection_flags(p, "MQTT username (default: the client id)")
    p.add_argument(
        "--id",
        required=True,
        help="client id = shard number of the run's partition; several "
        "comma-separated ids run as virtual clients, each with its own connection",
    )
    p.add_argument("--profile", help="device profile (default: the one the run assigns to this id)")
    p.add_argument("--model", help="zoo model (default: the one the run's zoo assigns to this id)")
    p.add_argument("--dataset", help="dataset name (default: the run config's)")
    p.add_argument("--data", help="path to the dataset files")
    p.add_argument(
        "--data-dir",
        metavar="PATH",
        help="this device's own data instead of a shard: a folder of class folders of PNG/JPEG images, or an .npz "
        "with x_train, y_train (optionally x_test, y_test); read into the run's input shape, classes and "
        "normalisation ({id} is replaced by the client id; config key data_dir)",
    )
    p.add_argument("--state-dir", help="where the client keeps its model between rounds and restarts")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.set_defaults(func=cmd_client)

    p = sub.add_parser(
        "broker",
        help="run the embedded MQTT broker, or write a Mosquitto or RabbitMQ configuration",
        description="Without --write-*-config: serve the embedded broker until Ctrl-C. With "
        "--write-mosquitto-config: write mosquitto.conf, a hashed password file and per-client ACLs to DIR. With "
        "--write-rabbitmq-config: write rabbitmq.conf, enabled_plugins, definitions.json (hashed passwords, "
        "permissions equal to the ACL, loaded at boot) and users.sh (the same for a running cluster) to DIR. "
        "See docs/deployment.md.",
    )
    p.add_argument("--port", type=int, default=1883, help="listening port (default 1883)")
    p.add_argument("--host", default="127.0.0.1", help="listening address (default 127.0.0.1)")
    p.add_argument("--users", help="username:password lines (one per client, plus `server`)")
    written = p.add_mutually_exclusive_group()
    written.add_argument("--write-mosquitto-config", metavar="DIR", help="write a Mosquitto config instead of serving")
    written.add_argument(
        "--write-rabbitmq-config", metavar="DIR", help="write a RabbitMQ (MQTT plugin) config instead of serving"
    )
    p.add_argument("--clients", help="comma-separated client ids to generate passwords for (without --users)")
    p.add_argument("--cafile", help="TLS: CA certificate (also checks client certificates)")
    p.add_argument("--certfile", help="TLS: broker certificate")
    p.add_argument("--keyfile", help="TLS: broker key")
    p.add_argument("--require-certificate", action="store_true", help="TLS: demand client certificates")
    p.add_argument(
        "--run-as",
        help="the user the broker started as root switches to (default: `mosquitto` or `rabbitmq`, as their "
        "Debian packages do); written as root, the files then belong to it, mode 600",
    )
    p.set_defaults(func=cmd_broker)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user errors print one line `fedge: error: ...` and return 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    func: Callable[[argparse.Namespace], int | None] = args.func
    try:
        return func(args) or 0
    except USER_ERRORS as e:
        print(f"fedge: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional extra this command needs is not installed: say which
        missing = missing_extra(e.name or "", f"fedge {args.command}")
        if missing is None:
            raise
        print(f"fedge: error: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
