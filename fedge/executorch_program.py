"""fedge's ExecuTorch training program as both sides see it: the exporter (export/) that writes it and the device
runtime (edge_client/) that steps it. Its inputs and outputs, the dense tensor layout the runtime needs, and
loading it with parameter handles by the student's own names.

The program is the student wrapped so forward(x, y, teacher_logits, λ, T, w) returns (CE + λ·KL, CE, KL, logits)
(fedge.distill.kd_terms; w picks the KL's direction), with forward and backward in one method and the weights in a
separate .ptd. A student with BatchNorm normalises by batch statistics in the program and returns them as one more
output (BN_STATS); the runtime folds them into the running statistics (update_running_stats), as torch's
BatchNorm does in training mode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedge.constants import KD_DIRECTION
from fedge.distill import direction_weight
from fedge.errors import UserError
from fedge.files import atomic_write
from fedge.model.weights import State

# The training program's positional inputs and user outputs (the runtime appends gradients and parameters).
TRAIN_INPUTS = ("input", "labels", "teacher_logits", "kd_lambda", "temperature", "kd_direction")
TRAIN_OUTPUTS = ("loss", "ce", "kl", "logits")
BN_STATS = "bn_stats"  # the extra output of a program with BatchNorm: per layer its batch mean, then unbiased variance
STUDENT = "student"  # the training wrapper's attribute holding the model: the prefix of the program's parameter names


class ProgramError(UserError, ValueError):
    """A training program does not load or run, or gets parameters or batches that do not fit it."""


@dataclass(frozen=True)
class NormLayer:
    """A BatchNorm layer of a training program: its module path in the student (its state holds
    `<name>.running_mean`, `.running_var`, `.num_batches_tracked`), channels and momentum (None: cumulative
    average, as torch's BatchNorm)."""

    name: str
    channels: int
    momentum: float | None


@dataclass(frozen=True)
class TrainingProgram:
    """A joint forward-backward program (.pte) and its trainable weights kept apart from it (.ptd).

    Inputs TRAIN_INPUTS: float32 (B, C, H, W), int64 (B,), float32 (B, classes), float32 λ, T and the KL's
    direction w (0-dim; fedge.distill.direction_weight: 1 = KL(teacher ‖ student), 0 = KL(student ‖ teacher));
    user outputs TRAIN_OUTPUTS, then BN_STATS when `norms` is not empty (per layer of `norms`, in order: the
    batch mean and the unbiased batch variance, `channels` entries each). `batch_size` B is fixed at export. The
    program holds no weights and no running statistics: a new round's weights replace the .ptd (or are copied into
    the loaded parameters), the program stays.
    """

    program: bytes
    weights: bytes
    batch_size: int
    input_shape: tuple[int, ...]
    num_classes: int
    norms: tuple[NormLayer, ...] = ()
    dtype: torch.dtype = torch.float32  # of the student and its input; float64 only for export.parity's twin

    def write(self, path: str | os.PathLike[str]) -> tuple[Path, Path]:
        """Write the program to `path` and the weights next to it as .ptd (atomically); returns both paths."""
        pte = Path(path)
        ptd = pte.with_suffix(".ptd")
        atomic_write(pte, self.program)
        atomic_write(ptd, self.weights)
        return pte, ptd


def zero_train_inputs(
    batch_size: int, input_shape: tuple[int, ...], num_classes: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """The program's inputs for a batch of zeros with λ = 0, T = 1 and the default direction (plain CE): to trace
    it, and its first run."""
    return (
        torch.zeros(batch_size, *input_shape, dtype=dtype),
        torch.zeros(batch_size, dtype=torch.long),
        torch.zeros(batch_size, num_classes),
        torch.tensor(0.0),
        torch.tensor(1.0),
        torch.tensor(direction_weight(KD_DIRECTION)),
    )


def dense(x: torch.Tensor) -> torch.Tensor:
    """`x` with the canonical strides of its shape. The ExecuTorch runtime reads a tensor's dim order from its
    strides, and a size-1 channel with stride 1 (e.g. torch's view of an (N, 8, 8) array as (N, 1, 8, 8))
    reads as a permuted layout: XNNPACK then fails (0x10) and the portable convolution refuses it (0x12)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    out.copy_(x)
    return out


def train_inputs(
    x: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor,
    kd_lambda: float,
    temperature: float,
    direction: str,
) -> tuple[torch.Tensor, ...]:
    """The program's inputs (TRAIN_INPUTS) for one batch, laid out as the runtime reads them (`x` keeps its
    dtype, the other floats are float32); an unknown direction raises ValueError."""
    return (
        dense(x),
        dense(y.to(torch.long)),
        dense(teacher_logits.float()),
        torch.tensor(float(kd_lambda)),
        torch.tensor(float(temperature)),
        torch.tensor(direction_weight(direction)),
    )


def student_name(name: str) -> str:
    """A program parameter's name as the student's state names it (the wrapper's `student.` prefix stripped)."""
    return name[len(STUDENT) + 1 :] if name.startswith(STUDENT + ".") else name


def load_training_module(program: TrainingProgram) -> tuple[Any, dict[str, torch.Tensor]]:
    """(ExecuTorch TrainingModule, its live parameters by program name). executorch 1.4.1 hands out parameter
    handles only after one forward_backward, so loading runs the program once on zeros (no optimizer step).
    The caller must keep `program` referenced while the module lives (the runtime reads its buffers).
    ProgramError when it does not load or run; ImportError without executorch."""
    from executorch.extension.pybindings.portable_lib import (
        _load_for_executorch_from_buffer,
    )
    from executorch.extension.training import TrainingModule

    try:
        module = TrainingModule(_load_for_executorch_from_buffer(program.program, program.weights))
        module.forward_backward(
            "forward", zero_train_inputs(program.batch_size, program.input_shape, program.num_classes, program.dtype)
        )
    except Exception as e:  # the runtime raises RuntimeError with an error code
        raise ProgramError(f"the training program does not load or run: {type(e).__name__}: {e}") from e
    return module, module.named_parameters()


def copy_parameters(live: dict[str, torch.Tensor], params: State) -> None:
    """Copy `params` (by student name) into a loaded program's live parameters (by program name); ProgramError
    unless the names and shapes match exactly."""
    names = {student_name(k): k for k in live}
    if set(names) != set(params):
        raise ProgramError(
            f"parameters do not match the program: missing {sorted(set(names) - set(params))[:5]}, "
            f"unexpected {sorted(set(params) - set(names))[:5]}"
        )
    for name, full in names.items():
        if tuple(live[full].shape) != tuple(params[name].shape):
            raise ProgramError(
                f"parameter {name!r} has shape {list(params[name].shape)}, the program has {list(live[full].shape)}"
            )
    for name, full in names.items():
        live[full].copy_(params[name])


def by_student_name(tensors: dict[str, torch.Tensor]) -> State:
    """Copies of a program's named tensors (parameters or gradients), keyed by student name."""
    return {student_name(k): v.clone() for k, v in tensors.items()}


def running_stat_names(norms: tuple[NormLayer, ...]) -> list[str]:
    """The state names of the running statistics of `norms` (what a program with BatchNorm does not hold)."""
    return [f"{n.name}.{b}" for n in norms for b in ("running_mean", "running_var", "num_batches_tracked")]


def update_running_stats(running: State, norms: tuple[NormLayer, ...], bn_stats: torch.Tensor) -> None:
    """Fold one step's batch statistics (the program's BN_STATS output) into `running` in place, as torch's
    BatchNorm does in training mode: count += 1; stat ← (1 − m)·stat + m·batch_stat with m the momentum (1/count
    when None), the variance unbiased. ProgramError when `bn_stats` or `running` do not fit `norms`."""
    sizes = [2 * n.channels for n in norms]
    if bn_stats.dim() != 1 or len(bn_stats) != sum(sizes):
        raise ProgramError(f"batch statistics of shape {list(bn_stats.shape)}, the program has {sum(sizes)}")
    missing = [k for k in running_stat_names(norms) if k not in running]
    if missing:
        raise ProgramError(f"running statistics missing: {missing[:5]}")
    for norm, stats in zip(norms, bn_stats.split(sizes)):
        mean, var = stats.split(norm.channels)
        count = running[f"{norm.name}.num_batches_tracked"]
        count.add_(1)
        m = norm.momentum if norm.momentum is not None else 1.0 / float(count)
        running[f"{norm.name}.running_mean"].mul_(1 - m).add_(mean, alpha=m)
        running[f"{norm.name}.running_var"].mul_(1 - m).add_(var, alpha=m)
