"""ExecuTorch training programs (experimental ExecuTorch API): the student wrapped so forward(x, y, teacher_logits,
λ, T, w) returns (CE + λ·KL, CE, KL, logits[, BN batch statistics]), w picking the KL's direction; the layers the
portable training kernels get wrong or lack rewritten into exact equivalents (pools, training-mode BatchNorm),
then _export_forward_backward → to_edge → to_executorch with the weights in a separate .ptd. A program is trusted
only after the gradient-parity check (export.parity)."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from torch import nn

from export import ExportError, require
from export.pte import eager_module, op_name
from fedge.distill import kd_terms
from fedge.executorch_program import NormLayer, TrainingProgram, zero_train_inputs
from fedge.model.spec import ModelSpec, SpecModel, build
from fedge.model.weights import State

_BAD_TRAINING_OPS = {  # aten ops whose portable backward is wrong or missing (platform-facts "ExecuTorch")
    "max_pool2d",
    "max_pool2d_with_indices",
    "avg_pool2d",
    "adaptive_avg_pool2d",
    "_adaptive_avg_pool2d",
    "batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
    "native_batch_norm",
}


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
                raise ExportError(
                    f"layer {self.name}: adaptive average pool to {self.out} of a {h}x{w} map "
                    "has unequal windows; no exact training form"
                )
            kh, kw = h // self.out, w // self.out
        else:
            kh = kw = self.kernel
        if h % kh or w % kw:
            x = x[:, :, : h // kh * kh, : w // kw * kw]
        x = x.reshape(n, c, h // kh, kh, w // kw, kw)
        return x.amax(dim=(3, 5)) if self.mode == "max" else x.mean(dim=(3, 5))


class _Recorded:
    """The statistics a BatchStatNorm recorded in the current forward. A plain object, not a list on the module:
    torch.export warns about tensors left in module attributes it can walk."""

    def __init__(self) -> None:
        self.stats: list[torch.Tensor] = []


class BatchStatNorm(nn.Module):
    """Training-mode BatchNorm2d from core ops (mean, sub, mul, rsqrt): y = (x − μ_B) / √(σ²_B + ε) · γ + β with
    the batch mean and biased variance over (N, H, W), as torch's training-mode BatchNorm normalises.

    Training-mode BatchNorm does not export (`_native_batch_norm_legit_functional` is not core ATen). γ and β
    are the BatchNorm's own parameters (same names); the running statistics are not held here: each forward
    appends (μ_B, unbiased σ²_B) detached to `recorded.stats`, which the training wrapper returns as an output.
    """

    def __init__(self, bn: nn.BatchNorm2d, name: str) -> None:
        super().__init__()
        if not bn.affine or not bn.track_running_stats:
            raise ExportError(f"layer {name}: only affine BatchNorm with running statistics has a training form")
        self.weight, self.bias, self.eps, self.momentum, self.name = bn.weight, bn.bias, bn.eps, bn.momentum, name
        self.recorded = _Recorded()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0] * x.shape[2] * x.shape[3]
        if n < 2:
            raise ExportError(f"layer {self.name}: BatchNorm needs more than one value per channel, got {n}")
        mean = x.mean(dim=(0, 2, 3), keepdim=True)
        centred = x - mean
        var = (centred * centred).mean(dim=(0, 2, 3), keepdim=True)
        self.recorded.stats.append(torch.cat([mean.flatten(), var.flatten() * (n / (n - 1))]).detach())
        # γ[:, None, None], not γ.reshape(1, -1, 1, 1): a view of a parameter fails ExecuTorch's emitter (its
        # external-weight constant tag) under external_mutable_weights
        return centred * torch.rsqrt(var + self.eps) * self.weight[:, None, None] + self.bias[:, None, None]


def norm_layers(model: nn.Module) -> tuple[NormLayer, ...]:
    """The BatchNorm layers of a trainable form, in module order (the order of the program's BN statistics)."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, BatchStatNorm)]
    return tuple(NormLayer(p, int(m.weight.numel()), m.momentum) for p, m in found)


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
        raise ExportError(
            f"layer {name}: only square pools with stride = kernel, no padding/dilation/ceil "
            "have an exact training form under ExecuTorch"
        )
    if isinstance(module, nn.AdaptiveAvgPool2d):
        out = module.output_size
        out = out[0] if isinstance(out, tuple) and out[0] == out[1] else out
        if isinstance(out, int):
            return BlockPool("mean", out=out, name=name)
        raise ExportError(f"layer {name}: adaptive pool to {module.output_size} has no exact training form")
    return None


def trainable_form(spec: ModelSpec, model: SpecModel) -> nn.Module:
    """A copy of `model` with every layer the ExecuTorch portable training kernels get wrong or lack rewritten.

    MaxPool2d / AvgPool2d (stride = kernel) and AdaptiveAvgPool2d → BlockPool; BatchNorm2d → BatchStatNorm
    (batch statistics from core ops; the running statistics are updated by the runtime from the program's
    BN_STATS output); Dropout → Identity (the runtime's dropout draws from a generator we cannot seed: without it
    the program that passes the gradient-parity gate is exactly the one that trains). A pool without an exact
    form, or a BatchNorm that is not 2-d, affine and tracking, raises ExportError naming the layer.
    """
    model = copy.deepcopy(model)
    for path, module in list(model.named_modules()):
        name = _layer_name(spec, path, module)
        new = _pool_rewrite(module, name)
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if not isinstance(module, nn.BatchNorm2d):
                raise ExportError(f"layer {name}: only BatchNorm2d has an ExecuTorch training form")
            new = BatchStatNorm(module, name)
        if new is None and isinstance(module, nn.Dropout):
            new = nn.Identity()
        if new is not None:
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def check_trainable(spec: ModelSpec) -> None:
    """ExportError naming the layer when `spec` has a layer without an exact ExecuTorch training form (an
    overlapping pool, a BatchNorm without affine parameters); cheap (no export), so a server can check every
    registering executorch client."""
    trainable_form(spec, build(spec))


class KDTrainer(nn.Module):
    """forward(x, y, teacher_logits, λ, T, w) → (CE + λ·KL, CE, KL, logits[, BN statistics]), loss first as
    ExecuTorch training needs; w is the KL's direction as a 0-dim weight (fedge.distill.kd_kl), so one program
    serves both. With BatchStatNorm layers the batch statistics of each, in module order, are one more output
    (executorch_program.BN_STATS)."""

    def __init__(self, student: nn.Module) -> None:
        super().__init__()
        self.student = student  # the program's parameters are "student.<name>" (executorch_program.STUDENT)
        self._norms = [m for m in student.modules() if isinstance(m, BatchStatNorm)]

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        teacher_logits: torch.Tensor,
        kd_lambda: torch.Tensor,
        temperature: torch.Tensor,
        kd_direction: torch.Tensor,
    ):
        for norm in self._norms:
            norm.recorded.stats.clear()
        logits = self.student(x).float()  # a float64 twin's loss in float32: portable log_softmax has no float64
        loss, ce, kl = kd_terms(logits, y, teacher_logits, kd_lambda, temperature, kd_direction)
        if not self._norms:
            return loss, ce.detach(), kl.detach(), logits.detach()
        if any(len(norm.recorded.stats) != 1 for norm in self._norms):
            raise ExportError("a BatchNorm layer used more than once per forward has no training program")
        return loss, ce.detach(), kl.detach(), logits.detach(), torch.cat([n.recorded.stats[0] for n in self._norms])


def _refuse_bad_ops(spec: ModelSpec, ep: torch.export.ExportedProgram) -> None:
    """Functional ops the rewrite cannot reach (e.g. F.adaptive_avg_pool2d inside squeeze-excite)."""
    for node in ep.graph.nodes:
        if node.op == "call_function" and op_name(node.target).split(".")[0] in _BAD_TRAINING_OPS:
            stack = node.meta.get("nn_module_stack") or {}
            where = list(stack.values())[-1][0] if stack else "?"
            raise ExportError(
                f"{spec.name!r} cannot be trained under ExecuTorch: {op_name(node.target)} at "
                f"{where} has no correct portable backward kernel and no exact rewrite"
            )


def export_training(
    spec: ModelSpec, state: State, batch_size: int = 32, dtype: torch.dtype = torch.float32
) -> TrainingProgram:
    """An ExecuTorch training program (forward + backward, fixed `batch_size`) of CE + λ·KL for `spec`, in the
    trainable form (pools rewritten, no dropout); λ, T and the KL's direction are inputs.

    The .pte holds the program and the .ptd the weights (`state`), via ExecuTorch's external mutable
    weights; a student with BatchNorm also returns its batch statistics (TrainingProgram.norms says whose). Raises
    ExportError for a layer without an exact rewrite, a bad batch size, weights that do not
    match, or a failing export. `dtype` float64 gives the gradient-parity gate's twin (export.parity): the same
    graph and kernels, without float32's rounding in the student (its loss stays float32).
    """
    require("executorch")
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge
    from torch.export.experimental import _export_forward_backward

    if batch_size < 1:
        raise ExportError(f"batch size must be positive, got {batch_size}")
    student = trainable_form(spec, eager_module(spec, state)).train().to(dtype)
    inputs = zero_train_inputs(batch_size, tuple(spec.input_shape), spec.num_classes, dtype)
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
            config=ExecutorchBackendConfig(external_mutable_weights=True)
        )
        with tempfile.TemporaryDirectory() as tmp:  # the public API writes the .ptd files to a folder
            prog.write_tensor_data_to_file(tmp)
            data = [f.read_bytes() for f in sorted(Path(tmp).glob("*.ptd"))]
    except Exception as e:
        raise ExportError(f"ExecuTorch training export of {spec.name!r} failed: {type(e).__name__}: {e}") from e
    if len(data) != 1:
        raise ExportError(f"ExecuTorch training export of {spec.name!r} gave {len(data)} weight files, expected 1")
    norms = norm_layers(student)
    shape = tuple(spec.input_shape)
    return TrainingProgram(prog.buffer, data[0], batch_size, shape, spec.num_classes, norms, dtype)
