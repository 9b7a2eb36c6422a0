"""`fedge export` and `fedge predict`: deployable files of a run's models, and checking them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from fedge import constants as C
from fedge.config import ConfigError, load_config


def cmd_predict(args: argparse.Namespace) -> None:
    """Score an ONNX model through onnxruntime on labelled data (a dataset, one client's test shard of a run, or
    the user's own images) class by class, saying what the model is, which classes its client trained on, and
    how any --limit sample was drawn."""
    from export import ExportError
    from export.onnx import predict_onnx
    from export.predict import model_info, score, table, unheld_warning, write_report
    from fedge.data.datasets import normalise
    from fedge.data.partition import stratified_sample

    if (args.dataset is None) == (args.data_dir is None):
        raise ConfigError(
            "say what to score the model on: --dataset NAME (a registered dataset; with --client and --config, "
            "a client's test shard) or --data-dir PATH (your own folder of class folders, or an .npz)"
        )
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be 0 or more, got {args.seed}")
    info = model_info(args.model)
    images, labels, pool, where, task, note = (_own_data_part if args.data_dir else _dataset_part)(args, info)
    if not len(pool):
        raise ConfigError(f"{where} holds no samples to score; score the model on a --dataset or --data-dir")
    drawn, drawn_from, scored_on = "", len(pool), where
    if args.limit is not None and args.limit < len(pool):
        drawn = (
            f"; {args.limit:,} of its {len(pool):,} samples drawn by seed {args.seed} with the class proportions "
            "kept (per-class counts below)"
        )
        scored_on = f"a {args.limit:,}-sample draw from {where}"
        pool = stratified_sample(labels, args.limit, args.seed, among=pool)
    x = normalise(images(pool), task.mean, task.std)
    logits = predict_onnx(args.model, x)
    if logits.shape[1:] != (len(task.classes),):
        raise ExportError(
            f"{args.model} gives {logits.shape[1:]} outputs per sample; the data has {len(task.classes)} classes"
        )
    scores = score(logits, labels[pool], task.classes)
    print(f"model: {info.describe()}")
    print(f"trained: {info.trained_on()}")
    print(f"data: {where}{drawn}")
    if note:
        print(f"note: {note}")
    print(f"accuracy {scores.accuracy:.4f} ({scores.correct}/{scores.total}) on {scored_on}, onnxruntime")
    print(table(scores, info.client_classes))
    warning = unheld_warning(scores, info)
    if warning:
        print(warning)
    if args.out:
        sample = {"seed": args.seed, "drawn_from": drawn_from, "limit": args.limit}
        data = {"where": where, "sample": sample if drawn else None}
        report, png = write_report(args.out, info, scores, data, warning)
        print(f"wrote {report} and {png}")


# images(idx) in [0, 1], labels, pool indices, where, task, a note on what the score means (or None)
Part = tuple[Callable[[Any], Any], Any, Any, str, Any, str | None]


def _dataset_part(args: argparse.Namespace, info: Any) -> Part:
    """A registered dataset (all of it, or --client's test shard of the --config run), read into the model's
    task: its classes and input shape must match the model's metadata, and its normalisation is the model's."""
    import numpy as np

    from fedge.data.datasets import load_dataset
    from fedge.data.own_data import DataTask

    if args.resize:
        raise ConfigError("--resize goes with --data-dir: a dataset's images are the size they are")
    ds = load_dataset(args.dataset, args.data)
    task = DataTask.of(ds)
    if info.classes is not None and info.classes != task.classes:
        raise ConfigError(
            f"{args.model} was trained on classes {', '.join(info.classes)}; {ds.name} has "
            f"{', '.join(task.classes)}. Score it on data of its classes (--data-dir: class folders named as them)"
        )
    if info.input_shape is not None and info.input_shape != task.input_shape:
        shape = "x".join(map(str, info.input_shape))
        raise ConfigError(
            f"{args.model} takes {shape} (C x H x W) inputs, {ds.name}'s images are "
            f"{'x'.join(map(str, task.input_shape))}; score it on data of that shape (--data-dir, with --resize "
            "to resize your images)"
        )
    if info.mean is not None and info.std is not None:
        task = DataTask(task.input_shape, task.classes, info.mean, info.std)  # normalised as the model was trained
    pool, where = np.arange(len(ds)), f"all samples of {ds.name}"
    if args.client is not None:
        from fedge.data.partition import make_partition
        from launch.runs import partition_config  # the run's split; no training code runs

        if not args.config:
            raise ConfigError("--client needs --config: the run's config.json (it defines the partition)")
        cfg = load_config(args.config, {})
        if cfg.dataset != ds.name:
            raise ConfigError(f"the run in {args.config} used dataset {cfg.dataset!r}, not {ds.name!r}")
        if cfg.data_dir is not None:
            raise ConfigError(
                f"the run in {args.config} had its clients read their own data ({cfg.data_dir}), not shards of "
                f"{ds.name}; score client {args.client}'s model on its data with --data-dir"
            )
        shards = {str(s.client_id): s for s in make_partition(ds.y, ds.num_classes, partition_config(cfg)).clients}
        if args.client not in shards:
            raise ConfigError(f"the run has no client {args.client!r}; its clients are 0..{len(shards) - 1}")
        pool, where = shards[args.client].test, f"client {args.client}'s test shard of {ds.name}"
    elif args.config:
        raise ConfigError("--config goes with --client: it defines that client's test shard")
    note = None
    if args.client is not None and info.client is not None and args.client != info.client:
        note = f"this is client {info.client}'s model, scored on client {args.client}'s test shard"
    return ds.pixels, ds.y, pool, where, task, note


def _own_data_part(args: argparse.Namespace, info: Any) -> Part:
    """The user's own labelled images (fedge.data.own_data.read_labelled), read into the model's task from its
    metadata (input shape, classes, normalisation)."""
    import numpy as np

    from fedge.data.own_data import read_labelled

    if args.client is not None or args.config or args.data:
        raise ConfigError("--client, --config and --data go with --dataset, not --data-dir")
    task = info.task(resize=args.resize)
    x, y, where, test_split = read_labelled(args.data_dir, task)
    note = None
    if not test_split and info.client is not None:
        note = (
            f"if this is client {info.client}'s own data, it trained on about {1 - C.OWN_TEST_FRACTION:.0%} of it "
            f"(a device holds out {C.OWN_TEST_FRACTION:.0%} of each class); an .npz with x_test, y_test is scored "
            "on that split alone"
        )
    return (lambda idx: x[idx]), y, np.arange(len(y)), where, task, note


def cmd_export(args: argparse.Namespace) -> None:
    """Export a run's final teacher or a client's newest student to a deployable format."""
    from export import ExportError
    from export.run_models import load_final_model, model_metadata, parity_sample
    from fedge.data.datasets import load_dataset
    from launch.runs import client_classes, run_metadata

    exporters = {"onnx": _export_onnx, "pte": _export_pte, "pte-train": _export_pte_train}
    if args.format not in exporters:
        raise ExportError(f"unsupported format {args.format!r}; supported: {', '.join(exporters)}")
    if args.batch is not None and args.batch < 1:
        raise ExportError(f"--batch must be positive, got {args.batch}")
    if args.format == "pte-train" and args.what != "student":
        raise ExportError("pte-train is a student's on-device training program; use --what student")
    from server.strategy import STRATEGIES

    weights, rnd = load_final_model(args.run_dir, args.client, args.what)
    run_cfg = load_config(Path(args.run_dir) / "config.json", {})
    cfg, personalized = run_cfg.to_dict(), STRATEGIES.get(run_cfg.strategy).personalized
    ds = load_dataset(run_cfg.dataset, run_cfg.data)
    if args.batch is None:
        args.batch = cfg.get("batch_size", C.DEFAULT_BATCH_SIZE) if args.format == "pte-train" else 1
    suffix = {"onnx": ".onnx", "pte": ".pte", "pte-train": "-train.pte"}[args.format]
    out = Path(args.out) / f"client{args.client}-{args.what}{suffix}"
    classes = client_classes(run_cfg).get(args.client) if personalized else None
    metadata = model_metadata(run_metadata(run_cfg, args.run_dir, personalized), args.client, args.what, rnd, classes)
    exporters[args.format](weights, out, parity_sample(ds), metadata, args, cfg)


def _export_onnx(weights: Any, out: Path, sample: Any, metadata: dict[str, str], args: Any, cfg: dict) -> None:
    from export.onnx import export_onnx

    r = export_onnx(weights.spec, weights.state, out, sample, metadata)
    print(
        f"wrote {r.path} (opset {r.opset}, {r.exporter} exporter; onnxruntime vs PyTorch on {r.samples} real "
        f"inputs: max abs logit difference {r.max_abs_diff:.2g}, argmax identical)"
    )


def _manifest(out: Path, weights: Any, metadata: dict[str, str], fields: dict[str, Any]) -> Path:
    """<out>.json beside an ExecuTorch file: what an app needs to feed it (see docs/android.md)."""
    from export.run_models import JSON_PROPS
    from fedge.files import atomic_write

    meta = {k: json.loads(v) if k in JSON_PROPS else v for k, v in metadata.items()}
    doc = {"model": weights.spec.name, **meta, "params": weights.spec.params, "macs": weights.spec.macs, **fields}
    path = out.with_suffix(".json")
    atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode())
    return path


def _batch_of(sample: Any, b: int) -> Any:
    """`b` real inputs for a program's fixed batch: b spread over `sample` (export.pte.spread), or its first one
    repeated."""
    from export.pte import spread

    return spread(sample, b) if len(sample) >= b else sample[:1].expand(b, *sample.shape[1:])


def _export_pte(weights: Any, out: Path, sample: Any, metadata: dict[str, str], args: Any, cfg: dict) -> None:
    """An XNNPACK inference program for batches of --batch, checked against eager on real inputs."""
    from export.pte import export_pte

    spec, b = weights.spec, args.batch
    r = export_pte(spec, weights.state, out, _batch_of(sample, b))
    manifest = _manifest(
        out,
        weights,
        metadata,
        {
            "program": out.name,
            "method": "forward",
            "inputs": [{"name": "input", "dtype": "float32", "shape": [b, *spec.input_shape]}],
            "outputs": [{"name": "logits", "dtype": "float32", "shape": [b, spec.num_classes]}],
            "xnnpack_delegate_calls": r.delegated_calls,
            "portable_ops": list(r.non_delegated_ops),
        },
    )
    print(
        f"wrote {out} and {manifest.name} (batch {b}; ExecuTorch vs PyTorch max abs logit difference "
        f"{r.max_abs_diff:.2g}; {r.delegated_calls} XNNPACK delegate call(s), portable ops: "
        f"{', '.join(r.non_delegated_ops) or 'none'})"
    )


def _export_pte_train(weights: Any, out: Path, sample: Any, metadata: dict[str, str], args: Any, cfg: dict) -> None:
    """The student's training program (.pte) and weights (.ptd), gated by gradient parity on real inputs."""
    import torch

    from export import ExportError
    from export.parity import checked_parity
    from export.training_program import export_training
    from fedge.executorch_program import BN_STATS, TRAIN_INPUTS, TRAIN_OUTPUTS
    from fedge.model.spec import build

    spec, b = weights.spec, args.batch
    program = export_training(spec, weights.state, b)
    x = _batch_of(sample, b)
    y = torch.arange(b) % spec.num_classes
    teacher = 3 * torch.randn(b, spec.num_classes, generator=torch.Generator().manual_seed(0))
    options = cfg.get("options", {})
    lam, temperature = options.get("kd_lambda", C.KD_LAMBDA), C.KD_TEMPERATURE
    direction = options.get("kd_direction", C.KD_DIRECTION)
    report = checked_parity(spec, weights.state, x, y, teacher, lam, temperature, program, direction)
    if not report.passed:
        raise ExportError(
            f"{spec.name!r}: the training program fails gradient parity on real inputs (worst relative "
            f"gradient error {report.worst:.2g}); it is not written"
        )
    pte, ptd = program.write(out)
    shapes = [[b, *spec.input_shape], [b], [b, spec.num_classes], [], [], []]
    dtypes = ["float32", "int64", "float32", "float32", "float32", "float32"]
    manifest = _manifest(
        out,
        weights,
        metadata,
        {
            "program": pte.name,
            "weights": ptd.name,
            "method": "forward",
            "batch_size": b,
            "inputs": [{"name": n, "dtype": d, "shape": sh} for n, d, sh in zip(TRAIN_INPUTS, dtypes, shapes)],
            "outputs": [
                {"name": n, "dtype": "float32", "shape": [b, spec.num_classes] if n == "logits" else []}
                for n in TRAIN_OUTPUTS
            ]
            + (
                [{"name": BN_STATS, "dtype": "float32", "shape": [2 * sum(n.channels for n in program.norms)]}]
                if program.norms
                else []
            ),
            # BatchNorm: per layer, in order, the batch mean then the unbiased batch variance (`channels` each);
            # the app folds them into the running statistics: stat = (1 - momentum) * stat + momentum * batch_stat
            "batchnorm": [{"name": n.name, "channels": n.channels, "momentum": n.momentum} for n in program.norms],
            "parameters": {f"student.{k}": list(p.shape) for k, p in build(spec).named_parameters()},
            "kd_lambda": lam,
            "temperature": temperature,
            "kd_direction": direction,
            "optimizer": "SGD",
            "sgd_lr": cfg.get("sgd_lr", C.SGD_LR),
            "sgd_momentum": cfg.get("sgd_momentum", C.SGD_MOMENTUM),
            "gradient_parity": {
                "loss_pte": report.loss_pte,
                "loss_eager": report.loss_eager,
                "worst_relative_gradient_error": report.worst,
                "float64_twin_worst_relative_error": report.worst_twin,
                "running_statistics_worst_relative_error": report.worst_stat,
            },
        },
    )
    print(
        f"wrote {pte}, {ptd.name} and {manifest.name} (batch {b}; one step matches PyTorch: loss "
        f"{report.loss_pte:.6g} vs {report.loss_eager:.6g}, worst relative gradient error {report.worst:.2g})"
    )


def add_export_parsers(sub: Any) -> None:
    """`fedge export` and `fedge predict`: deployable files of a run's models, and checking them."""
    p = sub.add_parser(
        "export",
        help="export a client's final teacher or student of a run (ONNX, ExecuTorch)",
        description="Export a client's final teacher or newest student: onnx (dynamic batch), pte "
        "(ExecuTorch XNNPACK inference program) or pte-train (the student's ExecuTorch training "
        "program, .pte + weights .ptd). Each file is loaded back and checked against PyTorch; a "
        ".json manifest beside a .pte gives its inputs and outputs (docs/android.md).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (a `fedge run` --out)")
    p.add_argument("--client", required=True, help="client id")
    p.add_argument(
        "--what",
        default="teacher",
        help="teacher (pFedClub's/pFedHR's final teacher), model (the model FedTrans/HeteroFL chose for the client) "
        "or student (the client's newest model snapshot); default teacher",
    )
    p.add_argument("--format", default="onnx", help="onnx, pte or pte-train (default onnx)")
    p.add_argument(
        "--batch",
        type=int,
        help="fixed batch size of a pte program (default 1) or pte-train program "
        "(default: the run's batch_size); ONNX files take any batch",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "predict",
        help="accuracy of an ONNX model through onnxruntime, per class, on a dataset or your own data",
        description="Score an ONNX model written by fedge through onnxruntime on labelled data: a registered "
        "dataset (--dataset), one client's test shard of a run (--client, --config), or your own images "
        "(--data-dir: a folder of class folders, or an .npz, read as a device reads them, into the model's "
        "input shape, classes and normalisation from its metadata). Prints what the model is and which classes "
        "its client trained on, accuracy overall and per class, and a warning when a personalized model is "
        "scored on classes its client never held.",
    )
    p.add_argument("model", metavar="MODEL.onnx", help="an ONNX file written by fedge")
    data = p.add_argument_group("data (one of --dataset, --data-dir)")
    data.add_argument("--dataset", help="a registered dataset's name (`fedge data` lists them)")
    data.add_argument("--data", help="with --dataset: path to the dataset's files")
    data.add_argument("--client", help="with --dataset: only this client's test shard (needs --config)")
    data.add_argument("--config", help="with --client: the run's config.json (it defines the client shards)")
    data.add_argument(
        "--data-dir",
        metavar="PATH",
        help="your own labelled data: a folder of class folders of PNG/JPEG images, or an .npz (x_train, y_train "
        "and optionally x_test, y_test: then the test split alone is scored)",
    )
    data.add_argument(
        "--resize",
        action="store_true",
        help="with --data-dir: resize images of another size to the model's (bilinear, as a device's reader "
        "does); without it a size mismatch is an error",
    )
    p.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="score N samples, drawn by --seed with the class proportions of the data kept (never the first N)",
    )
    p.add_argument(
        "--seed", type=int, default=C.DEFAULT_SEED, help=f"seed of the --limit draw (default {C.DEFAULT_SEED})"
    )
    p.add_argument("--out", metavar="DIR", help="also write DIR/per_class.json and DIR/confusion.png")
    p.set_defaults(func=cmd_predict, set=None)
