"""ExecuTorch inference programs: torch.export → to_edge_transform_and_lower(XnnpackPartitioner) → to_executorch
→ atomic write → load through `executorch.runtime` → compare with eager; running them; a teacher's logits."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from export import PARITY_ATOL, ExportError, require
from fedge import constants as C
from fedge.executorch_program import dense
from fedge.files import atomic_write
from fedge.model.spec import ModelSpec, SpecModel
from fedge.model.weights import State, WeightsError, load_module
from fedge.teacher_program import InferenceProgram, TeacherProgramError
from fedge.wire.messages import Weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PteReport:
    """An inference .pte that was written, loaded back and compared with eager on a sample."""

    path: str
    size_bytes: int
    max_abs_diff: float
    argmax_match: bool
    delegated_calls: int
    non_delegated_ops: tuple[str, ...]


def eager_module(spec: ModelSpec, state: State) -> SpecModel:
    """`spec` with `state` loaded, for export; weights that do not match the spec raise ExportError."""
    try:
        return load_module(spec, state)
    except WeightsError as e:
        raise ExportError(f"cannot export {spec.name!r}: {e}") from None


def check_input(spec: ModelSpec, x: torch.Tensor) -> None:
    """ExportError unless `x` is a float32 batch of `spec`'s input shape."""
    if x.dim() != 4 or tuple(x.shape[1:]) != tuple(spec.input_shape) or x.dtype != torch.float32:
        raise ExportError(
            f"{spec.name!r} takes float32 batches of shape (N, {', '.join(map(str, spec.input_shape))}), "
            f"got {x.dtype} {list(x.shape)}"
        )


def op_name(target: object) -> str:
    """An exported graph node's operator name without its namespace (e.g. 'max_pool2d.default')."""
    name = getattr(target, "__name__", None) or str(target)
    return name.split("::")[-1]


def _lower_inference(model: nn.Module, sample: torch.Tensor) -> tuple[bytes, int, tuple[str, ...]]:
    """(program bytes, XNNPACK delegate calls, ops left to portable kernels); delegation read before to_executorch."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner,
    )
    from executorch.exir import to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(torch.export.export(model, (sample,)), partitioner=[XnnpackPartitioner()])
    calls, rest = _delegation(edge)
    return edge.to_executorch().buffer, calls, rest


def _delegation(edge) -> tuple[int, tuple[str, ...]]:
    """(number of XNNPACK delegate calls, sorted names of ops left to the portable kernels)."""
    calls, rest = 0, set()
    for node in edge.exported_program().graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        if name == "executorch_call_delegate":
            calls += 1
        elif name not in ("getitem", "alias_copy.default"):
            rest.add(name)
    return calls, tuple(sorted(rest))


def export_pte(spec: ModelSpec, state: State, path: str | os.PathLike[str], sample: torch.Tensor) -> PteReport:
    """Export an XNNPACK inference program to `path`, load it back and compare it with eager on `sample`.

    The program has static shapes: it takes batches of exactly len(sample). Raises ExportError when the
    weights do not match the spec, the sample has the wrong shape, export fails, the written file does not
    load and run, or its output differs from eager by more than PARITY_ATOL or in any argmax.
    """
    require("executorch")
    from executorch.runtime import Runtime

    check_input(spec, sample)
    sample = dense(sample)  # traced strides become the program's dim order
    model = eager_module(spec, state).eval()
    try:
        data, calls, rest = _lower_inference(model, sample)
    except Exception as e:  # torch.export / lowering raise many types; name the stage
        raise ExportError(f"ExecuTorch inference export of {spec.name!r} failed: {type(e).__name__}: {e}") from e
    atomic_write(path, data)
    try:
        got = Runtime.get().load_program(Path(path)).load_method("forward").execute([sample])[0]
    except Exception as e:  # the runtime raises RuntimeError/ValueError with an error code (e.g. 0x14)
        raise ExportError(f"{path}: the written program does not load or run: {type(e).__name__}: {e}") from e
    with torch.no_grad():
        want = model(sample)
    diff = float((got - want).abs().max())
    same = bool(torch.equal(got.argmax(1), want.argmax(1)))
    if not (diff <= PARITY_ATOL and same):
        raise ExportError(
            f"{path}: ExecuTorch output differs from eager for {spec.name!r} "
            f"(max |Δ| {diff:.3g}, argmax {'equal' if same else 'differs'})"
        )
    log.info(
        "exported %s to %s (%d bytes, max |Δ| %.2g, %d delegate calls, portable ops %s)",
        spec.name,
        path,
        len(data),
        diff,
        calls,
        list(rest),
    )
    return PteReport(str(path), len(data), diff, same, calls, rest)


def predict_pte(path: str | os.PathLike[str], x: torch.Tensor) -> torch.Tensor:
    """Logits of the inference program at `path` on `x`, in batches of the program's fixed size (the last one
    padded with zeros, its padding dropped). An unreadable program or inputs of the wrong shape raise ExportError."""
    require("executorch")
    try:
        return InferenceProgram(Path(path).read_bytes()).logits(x)
    except (OSError, TeacherProgramError) as e:
        raise ExportError(f"{path}: {e}") from e


def spread(x: torch.Tensor, n: int) -> torch.Tensor:
    """min(n, len(x)) rows of x evenly spaced from its first to its last: where the labels are not at hand, a
    parity batch that spans an array sorted by class (its first rows would all be of one class)."""
    return x[torch.linspace(0, len(x) - 1, min(n, len(x))).round().long()] if len(x) else x


def teacher_program(teacher: Weights, sample: torch.Tensor, batch_size: int = C.EXECUTORCH_TEACHER_BATCH) -> bytes:
    """A teacher's XNNPACK inference program for batches of min(batch_size, len(sample)), loaded back and checked
    against eager on such a batch spread over `sample` (export_pte): what the server ships to executorch clients.
    ExportError when the teacher cannot be exported or the program differs from eager."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "teacher.pte"
        export_pte(teacher.spec, teacher.state, path, spread(sample, batch_size))
        return path.read_bytes()


def teacher_logits_pte(teacher: Weights, x: torch.Tensor, batch_size: int = C.EXECUTORCH_TEACHER_BATCH) -> torch.Tensor:
    """A teacher's logits on x through its XNNPACK inference program (exported for batches of `batch_size`, checked
    against eager on a batch spread over x, then run over all of x): what an executorch client distills from.
    ValueError when the teacher cannot be exported or run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "teacher.pte"
        try:
            export_pte(teacher.spec, teacher.state, path, spread(x, batch_size))
            return predict_pte(path, x)
        except ExportError as e:
            raise ValueError(f"teacher {teacher.spec.name!r} cannot run under ExecuTorch: {e}") from e
