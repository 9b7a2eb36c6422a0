"""ONNX export of a ModelSpec + weights: export, check, stamp metadata, write, load back in onnxruntime, compare."""

from __future__ import annotations

import io
import json
import logging
import warnings
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from torch import nn

from export import PARITY_ATOL, ExportError, require
from fedge.files import atomic_write
from fedge.model.spec import ModelSpec
from fedge.model.weights import State, load_module

log = logging.getLogger(__name__)
# The dynamo exporter warns once per torchvision op ("torchvision is not installed. Skipping ...") on every
# export; fedge's models use no torchvision op, so those lines are noise in a run's progress output.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

# Export-specific limits and defaults (issue 5: parity gate of every ONNX export).
ONNX_OPSET = 18  # opset asked of both exporters (the dynamo exporter may raise it; the report says which)
ONNX_EXPORTERS = ("dynamo", "torchscript")  # tried in this order; the second only if the first raises
INPUT_NAME, OUTPUT_NAME, BATCH_DIM = "input", "logits", "batch"
ORT_PROVIDERS = ["CPUExecutionProvider"]
PREDICT_BATCH_SIZE = 512


@dataclass(frozen=True)
class OnnxReport:
    """What an export produced and how closely onnxruntime matched eager PyTorch on the sample."""

    path: Path
    exporter: str
    opset: int
    max_abs_diff: float
    argmax_agree: bool
    samples: int
    input_name: str
    output_name: str
    input_shape: tuple[int | str, ...]
    output_shape: tuple[int | str, ...]


def fedge_version() -> str:
    try:
        return importlib_metadata.version("fedge")
    except importlib_metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"


def spec_metadata(spec: ModelSpec) -> dict[str, str]:
    """The metadata props every export of `spec` carries: name, block origins, params, MACs, shapes, spec."""
    origins = [
        {"name": b.name, "model": b.origin.model, "client": b.origin.client, "block": b.origin.block}
        for b in spec.blocks
    ]
    return {
        "model": spec.name,
        "blocks": json.dumps(origins),
        "params": str(spec.params),
        "macs": str(spec.macs),
        "input_shape": "x".join(map(str, spec.input_shape)),
        "num_classes": str(spec.num_classes),
        "fedge_version": fedge_version(),
        "fedge_spec": spec.to_json(),
    }


def _to_onnx_bytes(module: nn.Module, sample: torch.Tensor, exporter: str) -> bytes:
    """Serialized ModelProto of `module` with a dynamic batch dimension; exporter errors propagate."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            batch = torch.export.Dim(BATCH_DIM, min=1)
            program = torch.onnx.export(
                module,
                (sample,),
                None,
                dynamo=True,
                opset_version=ONNX_OPSET,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_shapes=({0: batch},),
                verbose=False,
            )
            return program.model_proto.SerializeToString()
        buf = io.BytesIO()
        torch.onnx.export(
            module,
            (sample,),
            buf,
            dynamo=False,
            opset_version=ONNX_OPSET,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: BATCH_DIM}, OUTPUT_NAME: {0: BATCH_DIM}},
        )
        return buf.getvalue()


def _dims(value_info) -> tuple[int | str, ...]:  # noqa: ANN001 - onnx.ValueInfoProto
    return tuple(d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim)


def export_module(
    module: nn.Module,
    path: str | Path,
    sample: torch.Tensor,
    metadata: Mapping[str, str],
    exporters: tuple[str, ...] = ONNX_EXPORTERS,
    atol: float = PARITY_ATOL,
) -> OnnxReport:
    """Export `module` (in eval mode, on CPU) to `path` and prove the file: onnx.checker, then onnxruntime on
    `sample` (and on its first row alone, for the dynamic batch) against eager PyTorch. Every exporter failing,
    a failed check, a max abs logit difference above `atol` or any differing argmax raise ExportError (and
    leave no file at `path`)."""
    require("onnx", "onnxscript", "onnxruntime")
    import onnx

    path = Path(path)
    if sample.ndim < 2 or len(sample) < 1:
        raise ExportError(f"the parity sample must be a non-empty batch, got shape {list(sample.shape)}")
    module = module.to("cpu").eval()
    sample = sample.detach().to("cpu", torch.float32)
    errors = []
    for exporter in exporters:
        try:
            with torch.no_grad():
                data = _to_onnx_bytes(module, sample, exporter)
            break
        except Exception as e:  # noqa: BLE001 - any exporter failure means: try the next one
            errors.append(f"{exporter}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            log.warning("ONNX exporter %s failed, %s", exporter, errors[-1])
    else:
        raise ExportError(f"no ONNX exporter could export the model: {'; '.join(errors)}")
    model = onnx.load_from_string(data)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    props = {k: str(v) for k, v in metadata.items()} | {"opset": str(opset), "exporter": exporter}
    onnx.helper.set_model_props(model, {k: props[k] for k in sorted(props)})
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"onnx.checker rejects the exported model: {e}") from None
    atomic_write(path, model.SerializeToString())
    try:
        return _parity(module, path, sample, exporter, opset, atol, model)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _parity(
    module: nn.Module, path: Path, sample: torch.Tensor, exporter: str, opset: int, atol: float, model
) -> OnnxReport:  # noqa: ANN001 - onnx.ModelProto
    """Load the written file back into onnxruntime and compare it with eager PyTorch (batch N and batch 1)."""
    session = _session(path)
    got = session.run([OUTPUT_NAME], {INPUT_NAME: sample.numpy()})[0]
    got_one = session.run([OUTPUT_NAME], {INPUT_NAME: sample[:1].numpy()})[0]
    with torch.no_grad():
        want = module(sample).numpy()
    if got.shape != want.shape or got_one.shape != want[:1].shape:
        raise ExportError(
            f"{path}: onnxruntime gives shapes {got.shape} (batch {len(sample)}) and {got_one.shape} "
            f"(batch 1), eager PyTorch {want.shape}"
        )
    diff = float(max(np.abs(got - want).max(), np.abs(got_one - want[:1]).max()))
    agree = bool((got.argmax(1) == want.argmax(1)).all() and (got_one.argmax(1) == want[:1].argmax(1)).all())
    if not diff <= atol or not agree:
        disagree = int((got.argmax(1) != want.argmax(1)).sum())
        raise ExportError(
            f"{path}: onnxruntime does not reproduce eager PyTorch: max abs logit difference "
            f"{diff:.3g} (allowed {atol:g}), argmax differs on {disagree} of {len(sample)} samples"
        )
    graph = model.graph
    return OnnxReport(
        path,
        exporter,
        opset,
        diff,
        agree,
        len(sample),
        INPUT_NAME,
        OUTPUT_NAME,
        _dims(graph.input[0]),
        _dims(graph.output[0]),
    )


def export_onnx(
    spec: ModelSpec, state: State, path: str | Path, sample: torch.Tensor, metadata: Mapping[str, str]
) -> OnnxReport:
    """Export spec + weights to an ONNX file at `path` with a dynamic batch, metadata props (the spec's own:
    model, blocks with origins, params, MACs, input shape, version; plus `metadata`, e.g. client, round,
    classes) and a parity check on `sample` (real inputs). Weights that do not fit the spec raise WeightsError;
    a sample of the wrong shape or a failed check raises ExportError."""
    if tuple(sample.shape[1:]) != tuple(spec.input_shape):
        raise ExportError(
            f"the parity sample has shape {list(sample.shape[1:])} per item, model {spec.name!r} "
            f"takes {list(spec.input_shape)}"
        )
    module = load_module(spec, state, "cpu")
    return export_module(module, path, sample, spec_metadata(spec) | dict(metadata))


def _session(path: str | Path):  # noqa: ANN202 - onnxruntime.InferenceSession
    require("onnxruntime")
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), providers=ORT_PROVIDERS)
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types for unreadable files
        raise ExportError(f"onnxruntime cannot load {path}: {str(e).splitlines()[0] if str(e) else e}") from None


def onnx_metadata(path: str | Path) -> dict[str, str]:
    """The metadata props of an ONNX file; an unreadable file raises ExportError."""
    return dict(_session(path).get_modelmeta().custom_metadata_map)


def predict_onnx(path: str | Path, x: np.ndarray | torch.Tensor, batch_size: int = PREDICT_BATCH_SIZE) -> np.ndarray:
    """Logits (N, classes) of the ONNX model at `path` on inputs `x` (N, C, H, W) through onnxruntime on CPU.
    An unreadable file or inputs of the wrong per-item shape raise ExportError."""
    session = _session(path)
    x = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    x = x.astype(np.float32, copy=False)
    inp = session.get_inputs()[0]
    want = [d if isinstance(d, int) else None for d in inp.shape[1:]]
    if x.ndim != len(inp.shape) or any(w is not None and w != g for w, g in zip(want, x.shape[1:])):
        raise ExportError(f"{path} takes inputs of shape {['N', *want]}, got {list(x.shape)}")
    outs = [session.run(None, {inp.name: x[i : i + batch_size]})[0] for i in range(0, len(x), batch_size)]
    return np.concatenate(outs) if outs else np.zeros((0, 0), np.float32)
