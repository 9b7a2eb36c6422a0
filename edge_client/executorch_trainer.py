"""The `executorch` runtime (Android): local training through an ExecuTorch training program, teacher logits
through the teacher's XNNPACK inference program; the same .pte files an Android app loads.

The training program is loaded once (per batch size) and kept: each round the client's current weights are
copied into its parameters, it steps with ExecuTorch's SGD, and the weights are copied back into the client's
model, which uploads them as any other. A model with BatchNorm trains on batch statistics: the program returns
them and the session folds them into the running statistics after each step (as torch's BatchNorm does in
training mode), which go back into the model's buffers with the weights. `TrainingSession` is that loaded program,
as an Android app's `TrainingModule` is. edge_client may not import export/, so the launcher (launch.client) hands
in how to get a session (a TrainingSession of export.parity's gated program) and, optionally, how to run a teacher
that arrives as weights. A teacher normally arrives as its XNNPACK program, exported on the server
(fedge.teacher_program): the client only loads and runs it (`program_logits`), with no exporter.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Protocol

import torch
from torch import nn

from edge_client.training import Distillation, TrainConfig, TrainStats, check_distillation
from fedge.constants import KD_DIRECTION
from fedge.distill import check_kd_settings
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
from fedge.model.spec import ModelSpec
from fedge.model.weights import State
from fedge.teacher_program import InferenceProgram, sha256_hex
from fedge.wire.messages import Weights


class ProgramSession(Protocol):
    """A loaded training program (TrainingSession, or a stand-in in tests): parameters in and out, SGD steps."""

    def load(self, params: State, running: State | None = None) -> None: ...

    def params(self) -> State: ...

    def running_stats(self) -> State: ...

    def optimizer(self, lr: float, momentum: float) -> Any: ...

    def step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        teacher_logits: torch.Tensor,
        kd_lambda: float,
        temperature: float,
        direction: str,
        optimizer: Any,
    ) -> tuple[float, float, float]: ...


class TrainingSession:
    """A training program loaded once and stepped many times (what `TrainingModule` is in an Android app).

    Parameter names are the student's state names. Raises ProgramError when the program does not load or run
    (and ImportError without the executorch package).
    """

    def __init__(self, program: TrainingProgram) -> None:
        self.program = program  # the runtime reads these buffers for the module's lifetime: keep them referenced
        self.module, self.live = load_training_module(program)
        self.running: State = {}

    def load(self, params: State, running: State | None = None) -> None:
        """Copy `params` (exactly the program's trainable parameters, same shapes) into the live program, and
        the BatchNorm running statistics from `running` (a state holding at least them) into the session;
        ProgramError otherwise."""
        names = running_stat_names(self.program.norms)
        missing = [k for k in names if running is None or k not in running]
        if missing:
            raise ProgramError(f"running statistics missing: {missing[:5]}")
        copy_parameters(self.live, params)
        self.running = {k: running[k].detach().clone() for k in names} if running is not None else {}

    def running_stats(self) -> State:
        """A copy of the BatchNorm running statistics as updated by the steps since `load` (empty without BN)."""
        return {k: v.clone() for k, v in self.running.items()}

    def params(self) -> State:
        """A copy of the live parameters."""
        return by_student_name(self.live)

    def optimizer(self, lr: float, momentum: float = 0.0) -> Any:
        """ExecuTorch's SGD over the live parameters (a new one starts with empty momentum buffers)."""
        from executorch.extension.training import get_sgd_optimizer

        return get_sgd_optimizer(self.live, lr, momentum, 0.0, 0.0, False)

    def step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        teacher_logits: torch.Tensor,
        kd_lambda: float,
        temperature: float,
        direction: str = KD_DIRECTION,
        optimizer: Any = None,
    ) -> tuple[float, float, float]:
        """One forward-backward (and an optimizer step if given) on a batch of exactly the exported size;
        returns (loss, CE, KL). Invalid λ, T or direction, or another batch size, raise ProgramError."""
        try:
            check_kd_settings(kd_lambda, temperature, direction)
        except ValueError as e:
            raise ProgramError(str(e)) from None
        if len(x) != self.program.batch_size:
            raise ProgramError(f"the training program takes batches of {self.program.batch_size}, got {len(x)}")
        inputs = train_inputs(x, y, teacher_logits, kd_lambda, temperature, direction)
        out = self.module.forward_backward("forward", inputs)
        if self.program.norms:
            update_running_stats(self.running, self.program.norms, out[4])
        if optimizer is not None:
            optimizer.step(self.module.named_gradients())
        return float(out[0]), float(out[1]), float(out[2])

    def gradients(self) -> State:
        """The gradients of the last step, by parameter name."""
        return by_student_name(self.module.named_gradients())


def epoch_batches(n: int, batch: int, gen: torch.Generator) -> list[torch.Tensor]:
    """A shuffled epoch in batches of exactly `batch` (the program's fixed size): the last one is filled up
    with the epoch's first samples, so every sample is seen at least once and at most twice."""
    order = torch.randperm(n, generator=gen)
    fill = (-n) % batch
    return list(torch.cat([order, order[:fill]]).split(batch))


class ExecuTorchTrainer:
    """Trains one client's architecture through ExecuTorch training programs; `session_for(batch)` loads the program
    for batches of `batch` (whatever it raises for a model that may not train propagates from the constructor,
    which loads the one for `batch_size`), `teacher_logits(weights, x)` runs a teacher sent as weights (ValueError
    if it cannot; None: such a teacher is refused), `program_logits(program, x)` one sent as its program."""

    runtime = "executorch"

    def __init__(
        self,
        spec: ModelSpec,
        batch_size: int,
        session_for: Callable[[int], ProgramSession],
        teacher_logits: Callable[[Weights, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.spec = spec
        self.session_for = session_for
        self.weights_logits = teacher_logits
        self.sessions: dict[int, ProgramSession] = {}
        self.teacher: tuple[str, InferenceProgram] | None = None  # the last teacher program loaded, by SHA-256
        self.session(batch_size)  # load (and gate) now, so a model that cannot train is refused at start-up

    def teacher_logits(self, weights: Weights, x: torch.Tensor) -> torch.Tensor:
        """A teacher sent as weights, run as the launcher said; ValueError when this client cannot run one."""
        if self.weights_logits is None:
            raise ValueError(
                "an executorch client runs a teacher only as its ExecuTorch program; the task sent "
                f"{weights.spec.name!r}'s weights (give the server's strategy a teacher program exporter)"
            )
        return self.weights_logits(weights, x)

    def program_logits(self, program: bytes, x: torch.Tensor) -> torch.Tensor:
        """A shipped teacher program's logits on `x` (the program is loaded through the ExecuTorch runtime and kept
        until another arrives); TeacherProgramError (a ValueError) when it does not load or run on `x`."""
        sha = sha256_hex(program)
        if self.teacher is None or self.teacher[0] != sha:
            self.teacher = (sha, InferenceProgram(program))
        return self.teacher[1].logits(x)

    def session(self, batch: int) -> ProgramSession:
        """The loaded training program for batches of `batch` (loaded at first use)."""
        if batch not in self.sessions:
            self.sessions[batch] = self.session_for(batch)
        return self.sessions[batch]

    def fit(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, kd: Distillation | None = None
    ) -> TrainStats:
        """Train `model` in place with SGD (cfg.sgd_lr, cfg.sgd_momentum) on CE + λ·KL (pFedClub Eq. (5), the KL
        in kd.kd_direction: the program takes either as an input) through the program; the same contract as
        edge_client.training.fit (ValueError on empty data, bad teacher logits or divergence). Without a teacher
        λ = 0 and the teacher input is zeros, so the update is CE's."""
        if len(x) == 0:
            raise ValueError("no training data")
        if kd is not None:
            check_distillation(kd, x)
        batch = min(cfg.batch_size, len(x))
        session = self.session(batch)
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        session.load({k: p.detach() for k, p in params.items()}, buffers)
        opt = session.optimizer(cfg.sgd_lr, cfg.sgd_momentum)
        lam, temperature, direction = (
            (kd.kd_lambda, kd.temperature, kd.kd_direction) if kd is not None else (0.0, 1.0, KD_DIRECTION)
        )
        teacher = kd.teacher_logits if kd is not None else torch.zeros(len(x), self.spec.num_classes)
        gen = torch.Generator().manual_seed(cfg.seed)
        stats = TrainStats(math.nan, math.nan, 0.0)
        for _ in range(cfg.epochs):
            sums, count = [0.0, 0.0, 0.0], 0
            for idx in epoch_batches(len(x), batch, gen):
                terms = session.step(x[idx], y[idx], teacher[idx], lam, temperature, direction, opt)
                sums = [s + t * len(idx) for s, t in zip(sums, terms)]
                count += len(idx)
            stats = TrainStats(sums[0] / count, sums[1] / count, sums[2] / count if kd is not None else 0.0)
            if not math.isfinite(stats.loss):
                raise ValueError(f"training diverged: loss is {stats.loss}")
        with torch.no_grad():
            for name, value in session.params().items():
                params[name].copy_(value)
            for name, value in session.running_stats().items():
                buffers[name].copy_(value)
        return stats
