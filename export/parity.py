"""The gradient-parity gate of ExecuTorch training programs: one step through a program against eager PyTorch,
and the gated program of an architecture (what the executorch client runtime may train with).

The reference is eager PyTorch in float64. A BN-free CNN's float32 program matches it within GRAD_RTOL. A
BatchNorm model's float32 gradients cannot be held to that, by any float32 implementation: a pre-activation that
BatchNorm centres near a ReLU/ReLU6/hardswish kink, within float32 rounding of it, lands on the other side in one
implementation and not the other, and that element's whole gradient flips (measured: cnn4 at batch 4, one element
of 25,088 at cov5's ReLU gives 2.5 % in conv5's weight gradient; every single op of that program matches eager on
the same inputs, and the float64 twin of the program matches eager float64 to ~1e-12). So a program also passes
when its float64 twin (the same graph and kernels, the student in float64: export_training(dtype=torch.float64))
matches eager float64 within TWIN_RTOL, and the float32 program's loss and running statistics are within
tolerance and its gradients within F32_L2_RTOL of float64 in relative L2 norm over all parameters. A wrong
backward kernel (max-pool's is ~100x off) fails either way."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

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
    running_stat_names,
    train_inputs,
    update_running_stats,
)
from fedge.model.spec import ModelSpec, build
from fedge.model.weights import State

log = logging.getLogger(__name__)

# Gradient-parity limits: each parameter's max|g_pte − g_float64| within GRAD_ATOL + tol·max|g_float64| (the loss and
# the running statistics likewise), tol = max(GRAD_RTOL, GRAD_NOISE_FACTOR × eager float32's worst such error); the
# float64 twin within TWIN_RTOL·max(max|g_float64|, TWIN_FLOOR·the largest gradient entry of the model: a gradient
# that is zero in exact arithmetic, e.g. a BN bias whose shift the next BN removes, is float32 loss-head noise; the
# running statistics likewise, e.g. the mean of a 1×1 conv of a BN's zero-mean output); the
# float32 gradients of a program whose twin passes within F32_L2_RTOL of float64 in relative L2 norm (module docstring).
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6
GRAD_NOISE_FACTOR = 4.0
TWIN_RTOL, TWIN_FLOOR = 1e-5, 1e-3
F32_L2_RTOL = 0.05
GATE_SEED, GATE_KD_LAMBDA, GATE_TEMPERATURE = 0, 0.2, 2.0  # the gradient-parity gate's inputs


@dataclass(frozen=True)
class ParityReport:
    """One training step through a .pte (and its float64 twin, if given) against eager float64: losses, and per
    parameter (and per running statistic of a BatchNorm) the relative error (max|Δ| − atol)⁺ / max|reference|
    (normwise, so near-zero entries do not blow it up; gradients that are zero in exact arithmetic, e.g. a conv
    bias before BatchNorm, count as matching when within atol). `eager_err` is eager float32's worst such gradient
    error, which sets `tolerance`; `passed` as the module docstring says."""

    loss_eager: float
    loss_pte: float
    max_rel_err: dict[str, float]
    passed: bool
    stat_rel_err: dict[str, float] = dataclasses.field(default_factory=dict)
    eager_err: float = 0.0
    tolerance: float = GRAD_RTOL
    l2_rel_err: float = 0.0  # the float32 program's gradients, all parameters: ‖g_pte − g_float64‖₂ / ‖g_float64‖₂
    twin_rel_err: dict[str, float] = dataclasses.field(default_factory=dict)  # the float64 twin: loss, grads, stats

    @property
    def worst(self) -> float:
        return max(self.max_rel_err.values(), default=0.0)

    @property
    def worst_stat(self) -> float:
        return max(self.stat_rel_err.values(), default=0.0)

    @property
    def worst_twin(self) -> float | None:
        return max(self.twin_rel_err.values()) if self.twin_rel_err else None


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
    running: State | None = None,
) -> tuple[float, State, State]:
    """One SGD step (no momentum) through the program freshly loaded at `params`: (loss, new params, gradients).
    A program with BatchNorm updates the running statistics in `running` (in place) from its batch statistics.

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
    if program.norms:
        try:
            update_running_stats(running if running is not None else {}, program.norms, out[4])
        except ProgramError as e:
            raise ExportError(str(e)) from e
    return float(out[0]), by_student_name(live), grads


def train_mode(model: nn.Module) -> nn.Module:
    """`model` as the program computes it: training mode (BatchNorm on batch statistics, updating its running
    statistics) with dropout off."""
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    return model


def _rel_err(got: torch.Tensor, ref: torch.Tensor, atol: float = GRAD_ATOL, floor: float = 0.0) -> float:
    excess = float((got.double() - ref.double()).abs().max()) - atol
    return max(excess, 0.0) / max(float(ref.abs().max()), atol, floor)


def _pte_step(program, spec, state, x, y, t, kd_lambda, temperature, direction) -> tuple[float, State, State]:
    """(loss, gradients, running statistics after the step) through `program` (in its dtype) at `state`."""
    params = {k: v.detach().to(program.dtype) for k, v in eager_module(spec, state).named_parameters()}
    running = {
        k: state[k].clone().to(state[k].dtype if "num_batches" in k else program.dtype)
        for k in running_stat_names(program.norms)
    }
    x = x.to(program.dtype)
    loss, _, grads = train_step_pte(program, params, x, y, t, 0.0, kd_lambda, temperature, direction, running)
    return loss, grads, running


def _eager_step(spec, state, dtype, x, y, t, kd_lambda, temperature, direction) -> tuple[float, State, State]:
    """(loss, gradients, running statistics after the step) of eager PyTorch in `dtype`."""
    model = train_mode(eager_module(spec, state).to(dtype))
    loss = kd_loss(model(x.to(dtype)), y, t.to(dtype), kd_lambda, temperature, direction)
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    return float(loss.detach()), grads, {k: v.detach() for k, v in model.state_dict().items()}


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
    twin: TrainingProgram | None = None,
) -> ParityReport:
    """Loss, every parameter's gradient and (with BatchNorm) every running statistic after one step through a
    .pte, and through its float64 `twin` if given, against eager PyTorch in float64 (the KL in `direction`,
    fedge.distill.kd_kl), within the tolerances of the module docstring.

    Both sides are in training mode without dropout (the program is exported without it). Raises ExportError
    when the model cannot be exported for training; a mismatch is reported (`passed` False), not raised.
    """
    check_input(spec, x)
    if program is None:
        program = export_training(spec, state, batch_size=len(x))
    args = (x, y, teacher_logits, kd_lambda, temperature, direction)
    loss64, grads64, after64 = _eager_step(spec, state, torch.float64, *args)
    _, grads32, _ = _eager_step(spec, state, torch.float32, *args)
    eager_err = max((_rel_err(grads32[k], g) for k, g in grads64.items()), default=0.0)
    tol = max(GRAD_RTOL, GRAD_NOISE_FACTOR * eager_err)
    loss_pte, grads, running = _pte_step(program, spec, state, *args)
    rel = {k: _rel_err(grads[k], g) for k, g in grads64.items()}
    stats = {k: _rel_err(v, after64[k]) for k, v in running.items()}
    l2 = float(
        torch.cat([(grads[k].double() - g).flatten() for k, g in grads64.items()]).norm()
        / torch.cat([g.flatten() for g in grads64.values()]).norm().clamp_min(GRAD_ATOL)
    )
    twin_err = {}
    if twin is not None:
        loss_twin, grads_twin, running_twin = _pte_step(twin, spec, state, *args)
        floor = TWIN_FLOOR * max((float(g.abs().max()) for g in grads64.values()), default=0.0)
        twin_err = {"loss": _rel_err(torch.tensor(loss_twin), torch.tensor(loss64), 0.0, 1e-12)}
        twin_err |= {k: _rel_err(grads_twin[k], g, 0.0, floor) for k, g in grads64.items()}
        stats_scale = max((float(after64[k].abs().max()) for k in running_twin), default=0.0)
        twin_err |= {
            k: _rel_err(v, after64[k], 0.0, max(TWIN_FLOOR * stats_scale, 1e-12)) for k, v in running_twin.items()
        }
    loss_ok = _rel_err(torch.tensor(loss_pte), torch.tensor(loss64)) <= tol
    grads_ok = all(r <= tol for r in rel.values())
    twin_ok = bool(twin_err) and all(r <= TWIN_RTOL for r in twin_err.values()) and l2 <= F32_L2_RTOL
    passed = loss_ok and all(r <= tol for r in stats.values()) and (grads_ok or twin_ok)
    return ParityReport(loss64, loss_pte, rel, passed, stats, eager_err, tol, l2, twin_err)


def checked_parity(
    spec: ModelSpec,
    state: State,
    x: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor,
    kd_lambda: float,
    temperature: float,
    program: TrainingProgram,
    direction: str,
    twins: list[TrainingProgram] | None = None,
) -> ParityReport:
    """gradient_parity of `program`, and when its float32 gradients alone do not pass, again with its float64 twin
    (exported here at `state` unless `twins` holds it; it is appended there for the next call)."""
    report = gradient_parity(spec, state, x, y, teacher_logits, kd_lambda, temperature, program, direction)
    if report.passed:
        return report
    twins = [] if twins is None else twins
    if not twins:  # float32 rounding at an activation's kink (module docstring)
        twins.append(export_training(spec, state, program.batch_size, torch.float64))
    return gradient_parity(spec, state, x, y, teacher_logits, kd_lambda, temperature, program, direction, twins[0])


def gate_inputs(spec: ModelSpec, batch_size: int) -> tuple[State, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate's seeded (initial weights, x, y, teacher logits) for `spec` at `batch_size`."""
    gen = torch.Generator().manual_seed(GATE_SEED)
    torch.manual_seed(GATE_SEED)
    state = {k: v.detach().clone() for k, v in build(spec).state_dict().items()}
    x = torch.randn(batch_size, *spec.input_shape, generator=gen)
    y = torch.randint(0, spec.num_classes, (batch_size,), generator=gen)
    return state, x, y, 3 * torch.randn(batch_size, spec.num_classes, generator=gen)


@functools.lru_cache(maxsize=32)
def _gated(spec_json: str, batch_size: int) -> TrainingProgram:
    spec = ModelSpec.from_json(spec_json)
    state, x, y, t = gate_inputs(spec, batch_size)
    program = export_training(spec, state, batch_size)
    twins: list[TrainingProgram] = []
    worst = 0.0
    for direction in KD_DIRECTIONS:  # one program serves both KL directions: a task may ask for either
        report = checked_parity(spec, state, x, y, t, GATE_KD_LAMBDA, GATE_TEMPERATURE, program, direction, twins)
        if not report.passed:
            name = max(report.max_rel_err, key=report.max_rel_err.get)
            twin_worst = "none" if report.worst_twin is None else f"{report.worst_twin:.2g}"
            raise ExportError(
                f"{spec.name!r} fails the ExecuTorch gradient-parity gate (KL direction {direction}): loss "
                f"{report.loss_pte:.6g} vs eager {report.loss_eager:.6g}, worst parameter {name} (relative "
                f"gradient error {report.max_rel_err[name]:.2g}, L2 {report.l2_rel_err:.2g}, running statistics "
                f"{report.worst_stat:.2g}, tolerance {report.tolerance:.2g}; float64 twin {twin_worst}); it "
                "cannot train under the executorch runtime"
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
    weights and inputs matches eager float64, in each KL direction, directly or through its float64 twin: module
    docstring); ExportError says why a model may not train under
    `executorch`. Cached per architecture and batch size (block origins do not matter)."""
    return _gated(spec.with_origin(None).to_json(), batch_size)
