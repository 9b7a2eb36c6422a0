"""The gradient-parity gate of ExecuTorch training programs: one step through a program against eager PyTorch,
and the gated program of an architecture (what the executorch client runtime may train with)."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from export import ExportError, require
from export.pte import check_input, eager_module
from export.training_program import export_training
from fedge.constants import KD_DIRECTION, KD_DIRECTIONS
from fedge.distill import check_kd_settings, kd_loss
from fedge.executorch_program import (
    ProgramError,
    TrainingProgram,
    by_student_name,
    copy_parameters,
    load_training_module,
    train_inputs,
)
from fedge.spec import ModelSpec, build
from fedge.weights import State

log = logging.getLogger(__name__)

# Gradient-parity limits: every gradient entry within GRAD_ATOL + GRAD_RTOL·|eager| (and the loss likewise).
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6
GATE_SEED, GATE_KD_LAMBDA, GATE_TEMPERATURE = 0, 0.2, 2.0  # the gradient-parity gate's inputs


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


def train_step_pte(
    program: TrainingProgram,
    params: State,
    x: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor,
    lr: float,
    kd_lambda: float = 0.2,
    temperature: float = 1.0,
    direction: str = KD_DIRECTION,
) -> tuple[float, State, State]:
    """One SGD step (no momentum) through the program freshly loaded at `params`: (loss, new params, gradients).

    ExportError when λ, T or the direction is invalid, the batch is not of the exported size, the parameters do
    not match the program (names and shapes), or the program does not load or run."""
    try:
        check_kd_settings(kd_lambda, temperature, direction)
    except ValueError as e:
        raise ExportError(str(e)) from None
    if len(x) != program.batch_size:
        raise ExportError(f"the training program takes batches of {program.batch_size}, got {len(x)}")
    require("executorch")
    from executorch.extension.training import get_sgd_optimizer

    try:
        module, live = load_training_module(program)
        copy_parameters(live, params)
        out = module.forward_backward("forward", train_inputs(x, y, teacher_logits, kd_lambda, temperature, direction))
    except ProgramError as e:
        raise ExportError(str(e)) from e
    grads = by_student_name(module.named_gradients())
    get_sgd_optimizer(live, lr, 0.0, 0.0, 0.0, False).step(module.named_gradients())
    return float(out[0]), by_student_name(live), grads


def gradient_parity(
    spec: ModelSpec,
    state: State,
    x: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor,
    kd_lambda: float = 0.2,
    temperature: float = 1.0,
    program: TrainingProgram | None = None,
    direction: str = KD_DIRECTION,
) -> ParityReport:
    """Loss and every parameter's gradient of one step through a .pte against eager PyTorch (the KL in
    `direction`, fedge.distill.kd_kl).

    Dropout is off on both sides (the program is exported without it). Raises ExportError when the model
    cannot be exported for training; a mismatch is reported (`passed` False), not raised.
    """
    check_input(spec, x)
    if program is None:
        program = export_training(spec, state, batch_size=len(x))
    model = eager_module(spec, state).eval()  # eval: dropout off; BN-free models have no other mode difference
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss_pte, _, grads = train_step_pte(program, params, x, y, teacher_logits, 0.0, kd_lambda, temperature, direction)
    loss = kd_loss(model(x), y, teacher_logits, kd_lambda, temperature, direction)
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
    worst = 0.0
    for direction in KD_DIRECTIONS:  # one program serves both KL directions: a task may ask for either
        report = gradient_parity(spec, state, x, y, t, GATE_KD_LAMBDA, GATE_TEMPERATURE, program, direction)
        if not report.passed:
            name = max(report.max_rel_err, key=report.max_rel_err.get)
            raise ExportError(
                f"{spec.name!r} fails the ExecuTorch gradient-parity gate (KL direction {direction}): loss "
                f"{report.loss_pte:.6g} vs eager {report.loss_eager:.6g}, worst parameter {name} (relative "
                f"gradient error {report.max_rel_err[name]:.2g}); it cannot train under the executorch runtime"
            )
        worst = max(worst, report.worst)
    log.info(
        "%s passes the ExecuTorch gradient-parity gate (batch %d, both KL directions, worst relative gradient "
        "error %.2g)",
        spec.name,
        batch_size,
        worst,
    )
    return program


def gated_training_program(spec: ModelSpec, batch_size: int) -> TrainingProgram:
    """The training program of `spec`'s architecture after the gradient-parity gate (one step at seeded random
    weights and inputs matches eager, in each KL direction); ExportError says why a model may not train under
    `executorch`. Cached per architecture and batch size (block origins do not matter)."""
    return _gated(spec.with_origin(None).to_json(), batch_size)
