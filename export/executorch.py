"""ExecuTorch export: XNNPACK inference programs and SGD training programs, each loaded back and checked.

Inference: torch.export → to_edge_transform_and_lower(XnnpackPartitioner) → to_executorch → atomic
write → load through `executorch.runtime` → compare with eager. Training (experimental ExecuTorch API):
the student is wrapped so forward(x, y, teacher_logits, λ, T) returns (CE + λ·KL, CE, KL, logits), layers the
portable training kernels get wrong or lack are rewritten into exact equivalents, then
_export_forward_backward → to_edge → to_executorch with the weights in a separate .ptd. A training program
is trusted only after a gradient-parity check against eager PyTorch (`gradient_parity`,
`gated_training_program`); `TrainingSession` keeps one loaded and steps it (the executorch client runtime).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from export import PARITY_ATOL, ExportError, require
from fedge import constants as C
from fedge.messages import Weights
from fedge.spec import ModelSpec, SpecModel, build
from fedge.files import atomic_write
from fedge.weights import State, WeightsError, load_module

log = logging.getLogger(__name__)

# Gradient-parity limits: every gradient entry within GRAD_ATOL + GRAD_RTOL·|eager| (and the loss likewise).
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6
GATE_SEED, GATE_KD_LAMBDA, GATE_TEMPERATURE = 0, 0.2, 2.0  # the gradient-parity gate's inputs
_STUDENT = "student"  # attribute of the training wrapper; stripped from the program's parameter names
_BAD_TRAINING_OPS = {  # aten ops whose portable backward is wrong or missing (platform-facts "ExecuTorch")
    "max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
    "batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_batch_norm",
}


@dataclass(frozen=True)
class PteReport:
    """An inference .pte that was written, loaded back and compared with eager on a sample."""

    path: str
    size_bytes: int
    max_abs_diff: float
    argmax_match: bool
    delegated_calls: int
    non_delegated_ops: tuple[str, ...]


@dataclass(frozen=True)
class ParityReport:
    """One training step through a .pte against eager: losses and per-parameter max relative gradient error.

    A parameter's relative error is max|g_pte − g_eager| / max|g_eager| (normwise, so near-zero entries
    do not blow it up); `passed` applies the element-wise |Δ| ≤ atol + rtol·|g_eager| test to every entry.
    """

    loss_eager: float
    loss_pte: float
    max_rel_err: dict[str, float]
    passed: bool

    @property
    def worst(self) -> float:
        return max(self.max_rel_err.values(), default=0.0)


def _eager(spec: ModelSpec, state: State) -> SpecModel:
    try:
        return load_module(spec, state)
    except WeightsError as e:
        raise ExportError(f"cannot export {spec.name!r}: {e}") from None


def _check_input(spec: ModelSpec, x: torch.Tensor) -> None:
    if x.dim() != 4 or tuple(x.shape[1:]) != tuple(spec.input_shape) or x.dtype != torch.float32:
        raise ExportError(f"{spec.name!r} takes float32 batches of shape (N, {', '.join(map(str, spec.input_shape))}), "
                          f"got {x.dtype} {list(x.shape)}")


# --- inference ---------------------------------------------------------------------------------

def dense(x: torch.Tensor) -> torch.Tensor:
    """`x` with the canonical strides of its shape. The ExecuTorch runtime reads a tensor's dim order from its
    strides, and a size-1 channel with stride 1 (e.g. torch's view of an (N, 8, 8) array as (N, 1, 8, 8))
    reads as a permuted layout: XNNPACK then fails (0x10) and the portable convolution refuses it (0x12)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    out.copy_(x)
    return out


def _lower_inference(model: nn.Module, sample: torch.Tensor) -> tuple[bytes, int, tuple[str, ...]]:
    """(program bytes, XNNPACK delegate calls, ops left to portable kernels); delegation read before to_executorch."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(torch.export.export(model, (sample,)), partitioner=[XnnpackPartitioner()])
    calls, rest = _delegation(edge)
    return edge.to_executorch().buffer, calls, rest


def _op_name(target: object) -> str:
    name = getattr(target, "__name__", None) or str(target)
    return name.split("::")[-1]


def _delegation(edge) -> tuple[int, tuple[str, ...]]:
    """(number of XNNPACK delegate calls, sorted names of ops left to the portable kernels)."""
    calls, rest = 0, set()
    for node in edge.exported_program().graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node.target)
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

    _check_input(spec, sample)
    sample = dense(sample)  # traced strides become the program's dim order
    model = _eager(spec, state).eval()
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
        raise ExportError(f"{path}: ExecuTorch output differs from eager for {spec.name!r} "
                          f"(max |Δ| {diff:.3g}, argmax {'equal' if same else 'differs'})")
    log.info("exported %s to %s (%d bytes, max |Δ| %.2g, %d delegate calls, portable ops %s)",
             spec.name, path, len(data), diff, calls, list(rest))
    return PteReport(str(path), len(data), diff, same, calls, rest)


def predict_pte(path: str | os.PathLike[str], x: torch.Tensor) -> torch.Tensor:
    """Logits of the inference program at `path` on `x`, in batches of the program's fixed size (the last one
    padded with zeros, its padding dropped). An unreadable program or inputs of the wrong shape raise ExportError."""
    require("executorch")
    from executorch.runtime import Runtime

    try:
        method = Runtime.get().load_program(Path(path)).load_method("forward")
        shape = tuple(method.metadata.input_tensor_meta(0).sizes())
    except Exception as e:
        raise ExportError(f"{path}: not a loadable ExecuTorch inference program: {type(e).__name__}: {e}") from e
    if tuple(x.shape[1:]) != shape[1:]:
        raise ExportError(f"{path} takes inputs of shape {list(shape[1:])}, got {list(x.shape[1:])}")
    batch, out = shape[0], []
    for xb in x.split(batch):
        n = len(xb)
        if n < batch:
            xb = torch.cat([xb, xb.new_zeros(batch - n, *shape[1:])])
        out.append(method.execute([dense(xb)])[0][:n])
    return torch.cat(out)


def teacher_logits_pte(teacher: Weights, x: torch.Tensor, batch_size: int = C.EXECUTORCH_TEACHER_BATCH) -> torch.Tensor:
    """A teacher's logits on x through its XNNPACK inference program (exported for batches of `batch_size`, checked
    against eager on the first batch of x, then run over all of x): what an executorch client distills from.
    ValueError when the teacher cannot be exported or run."""
    batch = min(batch_size, len(x))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "teacher.pte"
        try:
            export_pte(teacher.spec, teacher.state, path, x[:batch])
            return predict_pte(path, x)
        except ExportError as e:
            raise ValueError(f"teacher {teacher.spec.name!r} cannot run under ExecuTorch: {e}") from e


# --- training: loss, rewrites, export ----------------------------------------------------------

# The training program's positional inputs and user outputs (the runtime appends gradients and parameters).
TRAIN_INPUTS = ("input", "labels", "teacher_logits", "kd_lambda", "temperature")
TRAIN_OUTPUTS = ("loss", "ce", "kl", "logits")


def kd_terms(logits: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor, kd_lambda: float | torch.Tensor,
             temperature: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE + λ·KL, CE, KL) with KL = T²·KL(softmax(z_s/T) ‖ softmax(z_t/T)) (pFedClub Eq. (5)): the formula of
    edge_client.training, restated because export/ may not import edge_client. λ and T may be 0-dim tensors
    (the training program takes them as inputs, so one program serves every round); λ = 0 gives plain CE."""
    ce = F.cross_entropy(logits, y)
    log_q = F.log_softmax(logits / temperature, dim=1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=1)
    kl = F.kl_div(log_p, log_q, reduction="batchmean", log_target=True) * temperature ** 2
    return ce + kd_lambda * kl, ce, kl


def kd_loss(logits: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor,
            kd_lambda: float, temperature: float) -> torch.Tensor:
    """CE + λ·KL of pFedClub Eq. (5) (see kd_terms)."""
    return kd_terms(logits, y, teacher_logits, kd_lambda, temperature)[0]


class BlockPool(nn.Module):
    """Non-overlapping k×k pooling as crop + reshape + amax/mean: gradients the portable kernels get right.

    Equals MaxPool2d(k, k) / AvgPool2d(k, k) (floor mode, no padding); with `out` set it is
    AdaptiveAvgPool2d(out) for inputs whose sides `out` divides (an export-time ExportError otherwise).
    """

    def __init__(self, mode: str, kernel: int | None = None, out: int | None = None, name: str = "") -> None:
        super().__init__()
        self.mode, self.kernel, self.out, self.name = mode, kernel, out, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        if self.out is not None:
            if h % self.out or w % self.out:
                raise ExportError(f"layer {self.name}: adaptive average pool to {self.out} of a {h}x{w} map "
                                  "has unequal windows; no exact training form")
            kh, kw = h // self.out, w // self.out
        else:
            kh = kw = self.kernel
        if h % kh or w % kw:
            x = x[:, :, : h // kh * kh, : w // kw * kw]
        x = x.reshape(n, c, h // kh, kh, w // kw, kw)
        return x.amax(dim=(3, 5)) if self.mode == "max" else x.mean(dim=(3, 5))


def _layer_name(spec: ModelSpec, path: str, module: nn.Module) -> str:
    parts = path.split(".")
    where = ""
    if len(parts) >= 2 and parts[0] == "blocks" and parts[1].isdigit() and int(parts[1]) < len(spec.blocks):
        where = f" in block {spec.blocks[int(parts[1])].name!r}"
    return f"{path} ({type(module).__name__}){where}"


def _pool_rewrite(module: nn.Module, name: str) -> nn.Module | None:
    """The exact training form of a pooling module, None when it is not a pool, ExportError when none exists."""
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        k, s, p = module.kernel_size, module.stride, module.padding
        dil = getattr(module, "dilation", 1)
        if isinstance(k, int) and s in (k, (k, k)) and p in (0, (0, 0)) and dil in (1, (1, 1)) and not module.ceil_mode:
            return BlockPool("max" if isinstance(module, nn.MaxPool2d) else "mean", kernel=k, name=name)
        raise ExportError(f"layer {name}: only square pools with stride = kernel, no padding/dilation/ceil "
                          "have an exact training form under ExecuTorch")
    if isinstance(module, nn.AdaptiveAvgPool2d):
        out = module.output_size
        out = out[0] if isinstance(out, tuple) and out[0] == out[1] else out
        if isinstance(out, int):
            return BlockPool("mean", out=out, name=name)
        raise ExportError(f"layer {name}: adaptive pool to {module.output_size} has no exact training form")
    return None


def trainable_form(spec: ModelSpec, model: SpecModel) -> nn.Module:
    """A copy of `model` with every layer the ExecuTorch portable training kernels get wrong rewritten.

    MaxPool2d / AvgPool2d (stride = kernel) and AdaptiveAvgPool2d → BlockPool; Dropout → Identity (the
    runtime's dropout draws from a generator we cannot seed: without it the program that passes the
    gradient-parity gate is exactly the one that trains). BatchNorm or a pool without an exact form raises
    ExportError naming the layer.
    BatchNorm: training-mode BN does not export; an explicit batch-statistics rewrite (mean/var/rsqrt) does
    export, and is exact in a small net, but failed gradient parity on cnn4 under executorch 1.4.1 (up to
    ~4 % relative error in the layers before cov5's BN; cnn4 without BN passes), so it is refused.
    """
    model = copy.deepcopy(model)
    for path, module in list(model.named_modules()):
        name = _layer_name(spec, path, module)
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ExportError(f"{spec.name!r} cannot be trained under ExecuTorch: layer {name} is BatchNorm, and "
                              "training-mode BatchNorm does not export (portable kernels are inference-only); "
                              "use a BN-free model or train it in eager PyTorch")
        new = _pool_rewrite(module, name)
        if new is None and isinstance(module, nn.Dropout):
            new = nn.Identity()
        if new is not None:
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def check_trainable(spec: ModelSpec) -> None:
    """ExportError naming the layer when `spec` has a layer without an exact ExecuTorch training form (BatchNorm,
    an overlapping pool); cheap (no export), so a server can check every registering executorch client."""
    trainable_form(spec, build(spec))


class KDTrainer(nn.Module):
    """forward(x, y, teacher_logits, λ, T) → (CE + λ·KL, CE, KL, logits), loss first as ExecuTorch training needs."""

    def __init__(self, student: nn.Module) -> None:
        super().__init__()
        self.student = student

    def forward(self, x: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor, kd_lambda: torch.Tensor,
                temperature: torch.Tensor):
        logits = self.student(x)
        loss, ce, kl = kd_terms(logits, y, teacher_logits, kd_lambda, temperature)
        return loss, ce.detach(), kl.detach(), logits.detach()


def _refuse_bad_ops(spec: ModelSpec, ep: torch.export.ExportedProgram) -> None:
    """Functional ops the rewrite cannot reach (e.g. F.adaptive_avg_pool2d inside squeeze-excite)."""
    for node in ep.graph.nodes:
        if node.op == "call_function" and _op_name(node.target).split(".")[0] in _BAD_TRAINING_OPS:
            stack = node.meta.get("nn_module_stack") or {}
            where = list(stack.values())[-1][0] if stack else "?"
            raise ExportError(f"{spec.name!r} cannot be trained under ExecuTorch: {_op_name(node.target)} at "
                              f"{where} has no correct portable backward kernel and no exact rewrite")


def _check_kd(kd_lambda: float, temperature: float) -> None:
    if not (math.isfinite(kd_lambda) and kd_lambda >= 0):
        raise ExportError(f"kd_lambda must be finite and >= 0, got {kd_lambda}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ExportError(f"temperature must be finite and > 0, got {temperature}")


@dataclass(frozen=True)
class TrainingProgram:
    """A joint forward-backward program (.pte) and its trainable weights kept apart from it (.ptd).

    Inputs TRAIN_INPUTS: float32 (B, C, H, W), int64 (B,), float32 (B, classes), float32 λ and T (0-dim);
    user outputs TRAIN_OUTPUTS. `batch_size` B is fixed at export. The program holds no weights: a new
    round's weights replace the .ptd (or are copied into the loaded parameters), the program stays.
    """

    program: bytes
    weights: bytes
    batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int

    def write(self, path: str | os.PathLike[str]) -> tuple[Path, Path]:
        """Write the program to `path` and the weights next to it as .ptd (atomically); returns both paths."""
        pte = Path(path)
        ptd = pte.with_suffix(".ptd")
        atomic_write(pte, self.program)
        atomic_write(ptd, self.weights)
        return pte, ptd


def export_training(spec: ModelSpec, state: State, batch_size: int = 32) -> TrainingProgram:
    """An ExecuTorch training program (forward + backward, fixed `batch_size`) of CE + λ·KL for `spec`, in the
    trainable form (pools rewritten, no dropout).

    The .pte holds the program and the .ptd the weights (`state`), via ExecuTorch's external mutable
    weights. Raises ExportError for BatchNorm, a pool without an exact rewrite, a bad batch size, weights that do not
    match, or a failing export.
    """
    require("executorch")
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge
    from torch.export.experimental import _export_forward_backward

    if batch_size < 1:
        raise ExportError(f"batch size must be positive, got {batch_size}")
    student = trainable_form(spec, _eager(spec, state)).train()
    inputs = (torch.zeros(batch_size, *spec.input_shape), torch.zeros(batch_size, dtype=torch.long),
              torch.zeros(batch_size, spec.num_classes), torch.tensor(0.0), torch.tensor(1.0))
    try:
        ep = torch.export.export(KDTrainer(student), inputs, strict=False)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"torch.export of the {spec.name!r} training wrapper failed: {type(e).__name__}: {e}") from e
    _refuse_bad_ops(spec, ep)
    try:
        joint = _export_forward_backward(ep)
        prog = to_edge(joint, compile_config=EdgeCompileConfig(_check_ir_validity=False)).to_executorch(
            config=ExecutorchBackendConfig(external_mutable_weights=True))
        with tempfile.TemporaryDirectory() as tmp:  # the public API writes the .ptd files to a folder
            prog.write_tensor_data_to_file(tmp)
            data = [f.read_bytes() for f in sorted(Path(tmp).glob("*.ptd"))]
    except Exception as e:
        raise ExportError(f"ExecuTorch training export of {spec.name!r} failed: {type(e).__name__}: {e}") from e
    if len(data) != 1:
        raise ExportError(f"ExecuTorch training export of {spec.name!r} gave {len(data)} weight files, expected 1")
    return TrainingProgram(prog.buffer, data[0], batch_size, tuple(spec.input_shape), spec.num_classes)


# --- training: runtime and parity --------------------------------------------------------------

def _strip(name: str) -> str:
    return name[len(_STUDENT) + 1:] if name.startswith(_STUDENT + ".") else name


class TrainingSession:
    """A training program loaded once and stepped many times (what `TrainingModule` is in an Android app).

    Parameter names are the student's state names (the program's `student.` prefix stripped).
    executorch 1.4.1 hands out parameter handles only after one forward_backward, so loading runs the
    program once on zeros (no optimizer step).
    """

    def __init__(self, program: TrainingProgram) -> None:
        require("executorch")
        from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
        from executorch.extension.training import TrainingModule

        self.program = program  # the runtime reads these buffers for the module's lifetime: keep them referenced
        try:
            self.module = TrainingModule(_load_for_executorch_from_buffer(program.program, program.weights))
            b = program.batch_size
            self.module.forward_backward("forward", (torch.zeros(b, *program.input_shape), torch.zeros(b, dtype=torch.long),
                                                     torch.zeros(b, program.num_classes), torch.tensor(0.0),
                                                     torch.tensor(1.0)))
        except Exception as e:  # the runtime raises RuntimeError with an error code
            raise ExportError(f"the training program does not load or run: {type(e).__name__}: {e}") from e
        self.live = self.module.named_parameters()
        self.names = {_strip(k): k for k in self.live}

    def load(self, params: State) -> None:
        """Copy `params` (exactly the program's trainable parameters, same shapes) into the live program."""
        if set(self.names) != set(params):
            raise ExportError(f"parameters do not match the program: missing {sorted(set(self.names) - set(params))[:5]}, "
                              f"unexpected {sorted(set(params) - set(self.names))[:5]}")
        for name, full in self.names.items():
            if tuple(self.live[full].shape) != tuple(params[name].shape):
                raise ExportError(f"parameter {name!r} has shape {list(params[name].shape)}, "
                                  f"the program has {list(self.live[full].shape)}")
            self.live[full].copy_(params[name])

    def params(self) -> State:
        """A copy of the live parameters."""
        return {name: self.live[full].clone() for name, full in self.names.items()}

    def optimizer(self, lr: float, momentum: float = 0.0):
        """ExecuTorch's SGD over the live parameters (a new one starts with empty momentum buffers)."""
        from executorch.extension.training import get_sgd_optimizer

        return get_sgd_optimizer(self.live, lr, momentum, 0.0, 0.0, False)

    def step(self, x: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor, kd_lambda: float,
             temperature: float, optimizer=None) -> tuple[float, float, float]:
        """One forward-backward (and an optimizer step if given) on a batch of exactly the exported size;
        returns (loss, CE, KL)."""
        _check_kd(kd_lambda, temperature)
        if len(x) != self.program.batch_size:
            raise ExportError(f"the training program takes batches of {self.program.batch_size}, got {len(x)}")
        out = self.module.forward_backward("forward", (dense(x), dense(y.to(torch.long)), dense(teacher_logits),
                                                       torch.tensor(float(kd_lambda)), torch.tensor(float(temperature))))
        if optimizer is not None:
            optimizer.step(self.module.named_gradients())
        return float(out[0]), float(out[1]), float(out[2])

    def gradients(self) -> State:
        """The gradients of the last step, by parameter name."""
        return {_strip(k): v.clone() for k, v in self.module.named_gradients().items()}


def train_step_pte(program: TrainingProgram, params: State, x: torch.Tensor, y: torch.Tensor,
                   teacher_logits: torch.Tensor, lr: float, kd_lambda: float = 0.2,
                   temperature: float = 1.0) -> tuple[float, State, State]:
    """One SGD step (no momentum) through a fresh TrainingSession at `params`: (loss, new params, gradients)."""
    session = TrainingSession(program)
    session.load(params)
    loss, _, _ = session.step(x, y, teacher_logits, kd_lambda, temperature, session.optimizer(lr))
    return loss, session.params(), session.gradients()


def gradient_parity(spec: ModelSpec, state: State, x: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor,
                    kd_lambda: float = 0.2, temperature: float = 1.0,
                    program: TrainingProgram | None = None) -> ParityReport:
    """Loss and every parameter's gradient of one step through a .pte against eager PyTorch.

    Dropout is off on both sides (the program is exported without it). Raises ExportError when the model
    cannot be exported for training; a mismatch is reported (`passed` False), not raised.
    """
    _check_input(spec, x)
    if program is None:
        program = export_training(spec, state, batch_size=len(x))
    model = _eager(spec, state).eval()  # eval: dropout off; BN-free models have no other mode difference
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss_pte, _, grads = train_step_pte(program, params, x, y, teacher_logits, 0.0, kd_lambda, temperature)
    loss = kd_loss(model(x), y, teacher_logits, kd_lambda, temperature)
    loss.backward()
    rel, passed = {}, math.isclose(loss_pte, float(loss.detach()), rel_tol=GRAD_RTOL, abs_tol=GRAD_ATOL)
    for name, p in model.named_parameters():
        ref, got = p.grad, grads[name]
        rel[name] = float((got - ref).abs().max() / ref.abs().max().clamp_min(GRAD_ATOL))
        passed = passed and bool(torch.allclose(got, ref, rtol=GRAD_RTOL, atol=GRAD_ATOL))
    return ParityReport(float(loss.detach()), loss_pte, rel, passed)


@functools.lru_cache(maxsize=32)
def _gated(spec_json: str, batch_size: int) -> TrainingProgram:
    spec = ModelSpec.from_json(spec_json)
    gen = torch.Generator().manual_seed(GATE_SEED)
    torch.manual_seed(GATE_SEED)
    state = {k: v.detach().clone() for k, v in build(spec).state_dict().items()}
    x = torch.randn(batch_size, *spec.input_shape, generator=gen)
    y = torch.randint(0, spec.num_classes, (batch_size,), generator=gen)
    t = 3 * torch.randn(batch_size, spec.num_classes, generator=gen)
    program = export_training(spec, state, batch_size)
    report = gradient_parity(spec, state, x, y, t, GATE_KD_LAMBDA, GATE_TEMPERATURE, program)
    if not report.passed:
        name = max(report.max_rel_err, key=report.max_rel_err.get)
        raise ExportError(f"{spec.name!r} fails the ExecuTorch gradient-parity gate: loss {report.loss_pte:.6g} vs "
                          f"eager {report.loss_eager:.6g}, worst parameter {name} (relative gradient error "
                          f"{report.max_rel_err[name]:.2g}); it cannot train under the executorch runtime")
    log.info("%s passes the ExecuTorch gradient-parity gate (batch %d, worst relative gradient error %.2g)",
             spec.name, batch_size, report.worst)
    return program


def gated_training_program(spec: ModelSpec, batch_size: int) -> TrainingProgram:
    """The training program of `spec`'s architecture after the gradient-parity gate (one step at seeded random
    weights and inputs matches eager); ExportError says why a model may not train under `executorch`.
    Cached per architecture and batch size (block origins do not matter)."""
    return _gated(spec.with_origin(None).to_json(), batch_size)
