"""`fedge export` and `fedge predict`: deployable files of a run's models, and checking them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedge import constants as C
from fedge.config import ConfigError, load_config


def cmd_predict(args: argparse.Namespace) -> None:
    """Accuracy of an ONNX model through onnxruntime on a dataset, or on one client's test shard of a run."""
    import numpy as np

    from export import ExportError
    from export.onnx import predict_onnx
    from fedge.data import load_dataset

    ds = load_dataset(args.dataset, args.data)
    idx, where = np.arange(len(ds)), "all samples"
    if args.client is not None:
        from fedge.partition import make_partition
        from launch.runs import partition_config  # the run's split; no training code runs

        if not args.config:
            raise ConfigError("--client needs --config: the run's config.json (it defines the partition)")
        cfg = load_config(args.config, {})
        if cfg.dataset != ds.name:
            raise ConfigError(f"the run in {args.config} used dataset {cfg.dataset!r}, not {ds.name!r}")
        shards = {str(s.client_id): s for s in make_partition(ds.y, ds.num_classes, partition_config(cfg)).clients}
        if args.client not in shards:
            raise ConfigError(f"the run has no client {args.client!r}; its clients are 0..{len(shards) - 1}")
        idx, where = shards[args.client].test, f"client {args.client}'s test shard"
    if args.limit is not None:
        idx = idx[: max(args.limit, 0)]
    x, y = ds.tensors(idx)
    logits = predict_onnx(args.model, x)
    if logits.shape[1:] != (ds.num_classes,):
        raise ExportError(
            f"{args.model} gives {logits.shape[1:]} outputs per sample, {ds.name} has {ds.num_classes} classes"
        )
    correct = int((logits.argmax(1) == y.numpy()).sum())
    acc = correct / len(y) if len(y) else float("nan")
    print(f"accuracy {acc:.4f} ({correct}/{len(y)}) on {where} of {ds.name}, onnxruntime, {args.model}")


def cmd_export(args: argparse.Namespace) -> None:
    """Export a run's final teacher or a client's newest student to a deployable format."""
    from export import ExportError
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
    exporters[args.format](weights, out, parity_sample(ds), model_metadata(ds, args.client, args.what, rnd), args, cfg)


def _export_onnx(weights: Any, out: Path, sample: Any, metadata: dict[str, str], args: Any, cfg: dict) -> None:
    from export.onnx import export_onnx

    r = export_onnx(weights.spec, weights.state, out, sample, metadata)
    print(
        f"wrote {r.path} (opset {r.opset}, {r.exporter} exporter; onnxruntime vs PyTorch on {r.samples} real "
        f"inputs: max abs logit difference {r.max_abs_diff:.2g}, argmax identical)"
    )


def _manifest(out: Path, weights: Any, metadata: dict[str, str], fields: dict[str, Any]) -> Path:
    """<out>.json beside an ExecuTorch file: what an app needs to feed it (see docs/android.md)."""
    from fedge.files import atomic_write

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
    from fedge.spec import build

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

    p = sub.add_parser("predict", help="accuracy of an ONNX model through onnxruntime on a dataset")
    p.add_argument("model", metavar="MODEL.onnx", help="an ONNX file written by fedge")
    p.add_argument("--dataset", required=True, help="dataset name")
    p.add_argument("--data", help="path to the dataset files")
    p.add_argument("--client", help="only this client's test shard (needs --config)")
    p.add_argument("--config", help="the run's config.json (defines the client shards)")
    p.add_argument("--limit", type=int, help="use at most N samples")
    p.set_defaults(func=cmd_predict, set=None)
