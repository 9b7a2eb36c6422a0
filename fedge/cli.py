"""The `fedge` command line: zoo, profiles, data, run. Like the simulation launcher, it may import everything."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from device_profiles import ProfileError
from export import ExportError
from fedge import constants as C
from fedge.broker import BrokerError
from fedge.checkpoint import CheckpointError
from fedge.config import ConfigError
from fedge.data import DatasetError
from fedge.layers import SpecError
from fedge.partition import SCHEMES, PartitionError
from fedge.topics import TopicError
from fedge.weights import WeightsError
from fedge.zoo import ZooError
from server.fleet import FleetError
from server.strategy import StrategyError

# Errors whose message tells the user what to do; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (BrokerError, CheckpointError, ConfigError, DatasetError, ExportError,
                                            FleetError, PartitionError, ProfileError, SpecError, StrategyError, TopicError,
                                            WeightsError, ZooError, OSError)


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
    from export.executorch import check_trainable
    from fedge.zoo import MODELS, ZOOS, create

    rows = []
    for name in MODELS:
        spec = create(name, args.input, args.classes)
        try:
            check_trainable(spec)
            executorch = "yes"
        except ExportError as e:
            executorch = "no (BatchNorm)" if "BatchNorm" in str(e) else "no"
        rows.append({"name": name, "blocks": len(spec.blocks), "params": spec.params, "macs": spec.macs,
                     "executorch_training": executorch, "block_names": [b.name for b in spec.blocks]})
    _emit(args, rows, ["name", "blocks", "params", "macs", "executorch_training"])
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


def run_config(args: argparse.Namespace, flags: Sequence[str] = RUN_FLAGS) -> Any:
    """The RunConfig of a command: defaults, then --config, then the named flags, then --set."""
    from fedge.config import load_config, parse_overrides

    overrides = {k: getattr(args, k) for k in flags if getattr(args, k, None) is not None}
    return load_config(args.config, overrides | parse_overrides(args.set or []))


def broker_settings(args: argparse.Namespace, username: str | None) -> Any:
    """A Broker from --broker, --username/--password-file and the TLS flags."""
    from fedge.deploy import password_for
    from fedge.mqtt import parse_broker

    password = password_for(args.password_file, username) if args.password_file and username else None
    return parse_broker(args.broker, username, password, args.cafile, args.certfile, args.keyfile)


def print_summary(summary: dict[str, Any]) -> None:
    final, phi, teacher = summary["final_accuracy"], summary.get("phi", {}), summary.get("teacher_params", {})
    rows = [{"client": cid, "model": summary["models"][cid], "runtime": summary["runtimes"][cid],
             "accuracy": f"{acc:.4f}", "mean teacher params": f"{teacher[cid]:,.0f}" if cid in teacher else "-",
             "phi": f"{phi[cid]:+.3f}" if cid in phi else "-"} for cid, acc in final["per_client"].items()]
    print(_table(rows, ["client", "model", "runtime", "accuracy"] + (["mean teacher params", "phi"] if phi else [])))
    mean = "n/a (no client was evaluated)" if final["mean"] is None else f"{final['mean']:.4f}"
    rejected = summary.get("rejected_messages") or {}
    if rejected:
        print(f"\nrejected messages: {', '.join(f'{k} {v}' for k, v in sorted(rejected.items()))}")
    print(f"\nmean final accuracy {mean} over {len(rows)} clients; run folder: {summary['out']}")


def cmd_run(args: argparse.Namespace) -> None:
    import dataclasses

    from fedge.deploy import run_federation
    from fedge.simulation import default_out, run_simulation

    cfg = run_config(args, RUN_FLAGS + ("transport",))
    cfg = dataclasses.replace(cfg, out=cfg.out or str(default_out(cfg)))
    print("fedge run with config:\n" + cfg.to_json(), file=sys.stderr)
    if cfg.transport == "inproc":
        summary = run_simulation(cfg, progress=args.progress)
    else:
        print(f"embedded MQTT broker, {cfg.clients} clients in separate processes (logs in {cfg.out}/clients-*.log)",
              file=sys.stderr)
        summary = run_federation(cfg, progress=args.progress, processes=args.processes)
    print_summary(summary)


def cmd_server(args: argparse.Namespace) -> None:
    import dataclasses

    from fedge.deploy import serve
    from fedge.simulation import default_out

    if args.resume and not args.config:  # the interrupted run's own settings
        args.config = str(Path(args.resume) / "config.json")
    cfg = run_config(args)
    if args.resume:
        cfg = dataclasses.replace(cfg, out=args.resume)
    cfg = dataclasses.replace(cfg, out=cfg.out or str(default_out(cfg)))
    print_summary(serve(cfg, broker_settings(args, args.username), args.progress, resume=bool(args.resume)))


def cmd_client(args: argparse.Namespace) -> int:
    from fedge.deploy import client_agents, run_clients, set_threads

    cfg = run_config(args, ("dataset", "data"))
    set_threads(args.threads)
    ids = [i.strip() for i in args.id.split(",") if i.strip()]
    agents = client_agents(cfg, ids, args.model, args.profile, args.state_dir)
    return run_clients(agents, lambda cid: broker_settings(args, args.username or cid), cfg)


def cmd_broker(args: argparse.Namespace) -> None:
    from fedge.broker import TlsFiles, generate_users, read_users, serve_forever, write_mosquitto_config
    from fedge.deploy import write_secrets

    if args.write_mosquitto_config is None:
        serve_forever(args.port, args.users)
        return
    out = Path(args.write_mosquitto_config)
    if args.users:
        users = read_users(args.users)
    else:
        users = generate_users([c.strip() for c in (args.clients or "").split(",") if c.strip()])
        out.mkdir(parents=True, exist_ok=True)
        write_secrets(out / "users", users)
    if bool(args.certfile) != bool(args.keyfile):
        raise ConfigError("TLS needs both --certfile and --keyfile")
    tls = TlsFiles(Path(args.certfile), Path(args.keyfile), Path(args.cafile) if args.cafile else None,
                   args.require_certificate) if args.certfile else None
    conf = write_mosquitto_config(out, users, port=args.port, host=args.host, tls=tls, run_as=args.run_as)
    print(f"wrote {conf} for {len(users) - 1} clients; start it with: mosquitto -c {conf}")
    if not args.users:
        print(f"generated passwords are in {out / 'users'} (username:password, mode 600); give each device its line")


def cmd_predict(args: argparse.Namespace) -> None:
    """Accuracy of an ONNX model through onnxruntime on a dataset, or on one client's test shard of a run."""
    import numpy as np

    from export.onnx import predict_onnx
    from fedge.data import load_dataset

    ds = load_dataset(args.dataset, args.data)
    idx, where = np.arange(len(ds)), "all samples"
    if args.client is not None:
        from fedge.partition import make_partition
        from fedge.simulation import partition_config  # the run's split; no training code runs

        if not args.config:
            raise ConfigError("--client needs --config: the run's config.json (it defines the partition)")
        cfg = run_config(args, ())
        if cfg.dataset != ds.name:
            raise ConfigError(f"the run in {args.config} used dataset {cfg.dataset!r}, not {ds.name!r}")
        shards = {str(s.client_id): s for s in make_partition(ds.y, ds.num_classes, partition_config(cfg)).clients}
        if args.client not in shards:
            raise ConfigError(f"the run has no client {args.client!r}; its clients are 0..{len(shards) - 1}")
        idx, where = shards[args.client].test, f"client {args.client}'s test shard"
    if args.limit is not None:
        idx = idx[:max(args.limit, 0)]
    x, y = ds.tensors(idx)
    logits = predict_onnx(args.model, x)
    if logits.shape[1:] != (ds.num_classes,):
        raise ExportError(f"{args.model} gives {logits.shape[1:]} outputs per sample, {ds.name} has "
                          f"{ds.num_classes} classes")
    correct = int((logits.argmax(1) == y.numpy()).sum())
    acc = correct / len(y) if len(y) else float("nan")
    print(f"accuracy {acc:.4f} ({correct}/{len(y)}) on {where} of {ds.name}, onnxruntime, {args.model}")


def cmd_export(args: argparse.Namespace) -> None:
    """Export a run's final teacher or a client's newest student to a deployable format."""
    from export.run_models import load_final_model, model_metadata, parity_sample
    from fedge.data import load_dataset

    exporters = {"onnx": _export_onnx, "pte": _export_pte, "pte-train": _export_pte_train}
    if args.format not in exporters:
        raise ExportError(f"unsupported format {args.format!r}; supported: {', '.join(exporters)}")
    if args.batch is not None and args.batch < 1:
        raise ExportError(f"--batch must be positive, got {args.batch}")
    if args.format == "pte-train" and args.what != "student":
        raise ExportError("pte-train is a student's on-device training program; use --what student")
    weights, rnd = load_final_model(args.run_dir, args.client, args.what)
    cfg = json.loads((Path(args.run_dir) / "config.json").read_text())
    ds = load_dataset(cfg["dataset"], cfg.get("data"))
    if args.batch is None:
        args.batch = cfg.get("batch_size", C.DEFAULT_BATCH_SIZE) if args.format == "pte-train" else 1
    suffix = {"onnx": ".onnx", "pte": ".pte", "pte-train": "-train.pte"}[args.format]
    out = Path(args.out) / f"client{args.client}-{args.what}{suffix}"
    exporters[args.format](weights, out, parity_sample(ds), model_metadata(ds, args.client, args.what, rnd),
                           args, cfg)


def _export_onnx(weights: Any, out: Path, sample: Any, metadata: dict[str, str], args: Any, cfg: dict) -> None:
    from export.onnx import export_onnx

    r = export_onnx(weights.spec, weights.state, out, sample, metadata)
    print(f"wrote {r.path} (opset {r.opset}, {r.exporter} exporter; onnxruntime vs PyTorch on {r.samples} real "
          f"inputs: max abs logit difference {r.max_abs_diff:.2g}, argmax identical)")


def _manifest(out: Path, weights: Any, metadata: dict[str, str], fields: dict[str, Any]) -> Path:
    """<out>.json beside an ExecuTorch file: what an app needs to feed it (see docs/android.md)."""
    from fedge.weights import atomic_write

    meta = {k: json.loads(v) if k in ("class_names", "mean", "std") else v for k, v in metadata.items()}
    doc = {"model": weights.spec.name, **meta, "params": weights.spec.params, "macs": weights.spec.macs, **fields}
    path = out.with_suffix(".json")
    atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode())
    return path


def _batch_of(sample: Any, b: int) -> Any:
    """`b` real inputs for a program's fixed batch: the first b of `sample`, or its first one repeated."""
    return sample[:b] if len(sample) >= b else sample[:1].expand(b, *sample.shape[1:])


def _export_pte(weights: Any, out: Path, sample: Any, metadata: dict[str, str], args: Any, cfg: dict) -> None:
    """An XNNPACK inference program for batches of --batch, checked against eager on real inputs."""
    from export.executorch import export_pte

    spec, b = weights.spec, args.batch
    r = export_pte(spec, weights.state, out, _batch_of(sample, b))
    manifest = _manifest(out, weights, metadata, {
        "program": out.name, "method": "forward",
        "inputs": [{"name": "input", "dtype": "float32", "shape": [b, *spec.input_shape]}],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": [b, spec.num_classes]}],
        "xnnpack_delegate_calls": r.delegated_calls, "portable_ops": list(r.non_delegated_ops)})
    print(f"wrote {out} and {manifest.name} (batch {b}; ExecuTorch vs PyTorch max abs logit difference "
          f"{r.max_abs_diff:.2g}; {r.delegated_calls} XNNPACK delegate call(s), portable ops: "
          f"{', '.join(r.non_delegated_ops) or 'none'})")


def _export_pte_train(weights: Any, out: Path, sample: Any, metadata: dict[str, str], args: Any, cfg: dict) -> None:
    """The student's training program (.pte) and weights (.ptd), gated by gradient parity on real inputs."""
    import torch

    from export.executorch import TRAIN_INPUTS, TRAIN_OUTPUTS, export_training, gradient_parity

    spec, b = weights.spec, args.batch
    program = export_training(spec, weights.state, b)
    x = _batch_of(sample, b)
    y = torch.arange(b) % spec.num_classes
    teacher = 3 * torch.randn(b, spec.num_classes, generator=torch.Generator().manual_seed(0))
    lam, temperature = cfg.get("kd_lambda", C.KD_LAMBDA), C.KD_TEMPERATURE
    report = gradient_parity(spec, weights.state, x, y, teacher, lam, temperature, program)
    if not report.passed:
        raise ExportError(f"{spec.name!r}: the training program fails gradient parity on real inputs (worst relative "
                          f"gradient error {report.worst:.2g}); it is not written")
    pte, ptd = program.write(out)
    shapes = [[b, *spec.input_shape], [b], [b, spec.num_classes], [], []]
    dtypes = ["float32", "int64", "float32", "float32", "float32"]
    manifest = _manifest(out, weights, metadata, {
        "program": pte.name, "weights": ptd.name, "method": "forward", "batch_size": b,
        "inputs": [{"name": n, "dtype": d, "shape": sh} for n, d, sh in zip(TRAIN_INPUTS, dtypes, shapes)],
        "outputs": [{"name": n, "dtype": "float32", "shape": [b, spec.num_classes] if n == "logits" else []}
                    for n in TRAIN_OUTPUTS],
        "parameters": {f"student.{k}": list(v.shape) for k, v in weights.state.items()},
        "kd_lambda": lam, "temperature": temperature, "optimizer": "SGD",
        "sgd_lr": cfg.get("sgd_lr", C.SGD_LR), "sgd_momentum": cfg.get("sgd_momentum", C.SGD_MOMENTUM),
        "gradient_parity": {"loss_pte": report.loss_pte, "loss_eager": report.loss_eager,
                            "worst_relative_gradient_error": report.worst}})
    print(f"wrote {pte}, {ptd.name} and {manifest.name} (batch {b}; one step matches PyTorch: loss "
          f"{report.loss_pte:.6g} vs {report.loss_eager:.6g}, worst relative gradient error {report.worst:.2g})")


def add_export_parsers(sub: Any) -> None:
    """`fedge export` and `fedge predict`: deployable files of a run's models, and checking them."""
    p = sub.add_parser("export", help="export a client's final teacher or student of a run (ONNX, ExecuTorch)",
                       description="Export a client's final teacher or newest student: onnx (dynamic batch), pte "
                       "(ExecuTorch XNNPACK inference program) or pte-train (the student's ExecuTorch training "
                       "program, .pte + weights .ptd). Each file is loaded back and checked against PyTorch; a "
                       ".json manifest beside a .pte gives its inputs and outputs (docs/android.md).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (a `fedge run` --out)")
    p.add_argument("--client", required=True, help="client id")
    p.add_argument("--what", default="teacher", help="teacher (the server's final teacher) or student "
                   "(the client's newest model snapshot); default teacher")
    p.add_argument("--format", default="onnx", help="onnx, pte or pte-train (default onnx)")
    p.add_argument("--batch", type=int, help="fixed batch size of a pte program (default 1) or pte-train program "
                   "(default: the run's batch_size); ONNX files take any batch")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("predict", help="accuracy of an ONNX model through onnxruntime on a dataset")
    p.add_argument("model", metavar="MODEL.onnx", help="an ONNX file written by fedge")
    p.add_argument("--dataset", required=True, help="dataset name")
    p.add_argument("--data", help="path to the dataset files")
    p.add_argument("--client", help="only this client's test shard (needs --config)")
    p.add_argument("--config", help="the run's config.json (defines the client shards)")
    p.add_argument("--limit", type=int, help="use at most N samples")
    p.set_defaults(func=cmd_predict, set=None)


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
    add_deploy_parsers(sub)
    add_export_parsers(sub)
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
    p.add_argument("--zoo", help="I, II, III, one model name (a homogeneous fleet), or model names "
                   "separated by commas, given to clients in turn (e.g. cnn4,cnn2 with profiles rpi-4,android-mid-range)")
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
    p.add_argument("--transport", choices=["mqtt", "inproc"],
                   help="mqtt (default): embedded broker, clients as OS processes; inproc: one process, no broker")
    p.add_argument("--processes", type=int, help="client processes for --transport mqtt (default: min(cores, 4))")
    p.set_defaults(func=cmd_run)


def _connection_flags(p: argparse.ArgumentParser, username_help: str) -> None:
    p.add_argument("--broker", required=True, help="mqtt://host:1883 or mqtts://host:8883 (TLS)")
    p.add_argument("--username", help=username_help)
    p.add_argument("--password-file", help="file with the password, or username:password lines (never on the "
                   "command line, so it stays out of process lists and logs)")
    p.add_argument("--cafile", help="CA certificate to verify the broker (TLS)")
    p.add_argument("--certfile", help="client certificate (TLS)")
    p.add_argument("--keyfile", help="client key (TLS)")
    p.add_argument("--config", help="the run's TOML or JSON config (the server and all clients use the same)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")


def add_deploy_parsers(sub: Any) -> None:
    """`fedge server`, `fedge client` and `fedge broker`: the pieces of a deployed federation."""
    p = sub.add_parser("server", help="run the federation's server against an MQTT broker",
                       description="Wait for the fleet to register, run the rounds, write the run folder; "
                       "checkpoints after every round (continue with --resume RUN_DIR).")
    _connection_flags(p, "MQTT username (default: server)")
    p.add_argument("--out", help="run folder (default runs/<time>-<strategy>-<dataset>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")
    p.set_defaults(func=cmd_server, username="server")

    p = sub.add_parser("client", help="run edge clients (what a device runs) against an MQTT broker",
                       description="Register with the server, execute its tasks, upload results; reconnects "
                       "by itself and keeps its model per round in --state-dir.")
    _connection_flags(p, "MQTT username (default: the client id)")
    p.add_argument("--id", required=True, help="client id = shard number of the run's partition; several "
                   "comma-separated ids run as virtual clients, each with its own connection")
    p.add_argument("--profile", help="device profile (default: the one the run assigns to this id)")
    p.add_argument("--model", help="zoo model (default: the one the run's zoo assigns to this id)")
    p.add_argument("--dataset", help="dataset name (default: the run config's)")
    p.add_argument("--data", help="path to the dataset files")
    p.add_argument("--state-dir", help="where the client keeps its model between rounds and restarts")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.set_defaults(func=cmd_client)

    p = sub.add_parser("broker", help="run the embedded MQTT broker, or write a Mosquitto configuration",
                       description="Without --write-mosquitto-config: serve the embedded broker until Ctrl-C. "
                       "With it: write mosquitto.conf, a hashed password file and per-client ACLs to DIR.")
    p.add_argument("--port", type=int, default=1883, help="listening port (default 1883)")
    p.add_argument("--host", default="127.0.0.1", help="listening address (default 127.0.0.1)")
    p.add_argument("--users", help="username:password lines (one per client, plus `server`)")
    p.add_argument("--write-mosquitto-config", metavar="DIR", help="write a Mosquitto config instead of serving")
    p.add_argument("--clients", help="comma-separated client ids to generate passwords for (without --users)")
    p.add_argument("--cafile", help="TLS: CA certificate (also checks client certificates)")
    p.add_argument("--certfile", help="TLS: broker certificate")
    p.add_argument("--keyfile", help="TLS: broker key")
    p.add_argument("--require-certificate", action="store_true", help="TLS: demand client certificates")
    p.add_argument("--run-as", help="the user Mosquitto started as root switches to (default: `mosquitto`, as "
                   "Mosquitto does); written as root, passwd, acl and the conf then belong to it, mode 600")
    p.set_defaults(func=cmd_broker)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user errors print one line `fedge: error: ...` and return 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int | None] = args.func
    try:
        return func(args) or 0
    except USER_ERRORS as e:
        print(f"fedge: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
