"""The `kd_train` task: local training distilled from a server-chosen teacher (pFedClub §3.3, pFedHR §3.2)."""

from __future__ import annotations

import logging
import time

from edge_client.agent import ClientAgent, TaskError, register_task
from edge_client.tasks import train_config, train_settings
from edge_client.training import Distillation
from fedge.distill import check_kd_settings
from fedge.model.spec import ModelSpec
from fedge.teacher_program import (
    TEACHER_PROGRAM_ERROR,
    TEACHER_PTE_SHA256,
    TeacherProgramError,
    sha256_hex,
    shipped_program,
)
from fedge.wire.messages import Result, Task

log = logging.getLogger(__name__)


def kd_settings(task: Task) -> tuple[float, float, str]:
    """(λ, T, KL direction) of pFedClub Eq. (5) from the task's config (fedge.tasks.TrainTask: kd_lambda 0.2 as
    in pFedClub §4.1, temperature 1 and kd_direction "teacher_student" unless given). A bad config (a
    non-numeric or non-finite value, an unknown direction), λ < 0 or T ≤ 0 raises TaskError.
    """
    t = train_settings(task)
    try:
        check_kd_settings(t.kd_lambda, t.temperature, t.kd_direction)
    except ValueError as e:
        raise TaskError(f"task {task.type}: {e}") from None
    return t.kd_lambda, t.temperature, t.kd_direction


def _check_teacher_spec(agent: ClientAgent, spec: ModelSpec) -> None:
    if spec.input_shape != agent.spec.input_shape or spec.num_classes != agent.spec.num_classes:
        raise TaskError(
            f"client {agent.client_id}: teacher {spec.name!r} takes "
            f"{list(spec.input_shape)} and gives {spec.num_classes} classes; "
            f"this client needs {list(agent.spec.input_shape)} and {agent.spec.num_classes}"
        )


def _program_distillation(
    agent: ClientAgent, program: bytes, spec: ModelSpec, settings: tuple[float, float, str]
) -> Distillation:
    """The logits of a teacher shipped as its ExecuTorch inference program (the executorch runtime loads and runs
    it; no exporter on the client)."""
    _check_teacher_spec(agent, spec)
    run = getattr(agent.trainer, "program_logits", None)
    if run is None:
        raise TaskError(f"client {agent.client_id} runs {agent.trainer.runtime}; it cannot run a teacher program")
    try:
        logits = run(program, agent.data.x_train)
    except ValueError as e:
        raise TaskError(f"client {agent.client_id}: teacher {spec.name!r}'s program: {e}") from None
    if tuple(logits.shape) != (len(agent.data.x_train), spec.num_classes):
        raise TaskError(f"client {agent.client_id}: teacher program gives logits of shape {list(logits.shape)}")
    return Distillation(logits, *settings)


def _teacher_distillation(agent: ClientAgent, task: Task, settings: tuple[float, float, str]) -> Distillation:
    """The teacher's logits on the client's training data, by the client's runtime (eager, or the teacher's
    ExecuTorch inference program)."""
    weights = task.models["teacher"]
    _check_teacher_spec(agent, weights.spec)
    agent.module_for(weights)  # checks the weights against their spec (TaskError)
    try:
        logits = agent.trainer.teacher_logits(weights, agent.data.x_train)
    except ValueError as e:
        raise TaskError(f"client {agent.client_id}: {e}") from None
    return Distillation(logits, *settings)


@register_task("kd_train", batchable=True)
def kd_train_task(agent: ClientAgent, task: Task) -> Result:
    """Train the own model with CE + λ·KL (pFedClub Eq. (5); KL(teacher ‖ student) unless kd_direction is
    "student_teacher"), CE alone without a teacher, on the client's runtime (eager Adam, or SGD through the
    ExecuTorch training program).

    The teacher (task.models["teacher"], or for an executorch client its XNNPACK program shipped as
    fedge.teacher_program describes; optional: absent at a client's first participation) is any
    architecture with the client's input shape and classes; a shipped program whose SHA-256 differs from the
    task's record is refused, and the result's records carry the SHA-256 of the program that ran. Config: the
    `train` keys (epochs, batch_size, lr, seed), optional kd_lambda (0.2), temperature (1.0), kd_direction
    ("teacher_student"), upload. Bad
    config or a teacher that does not fit raises TaskError. Metrics: train_loss (total), kd_loss (mean KL of
    the last epoch; 0 without a teacher), train_seconds (teacher inference included). Uploads `local` weights
    when config `upload` is true.
    """
    cfg = train_config(agent, task)
    settings = kd_settings(task)
    try:
        shipped = shipped_program(task)
    except TeacherProgramError as e:
        raise TaskError(f"client {agent.client_id}: {e}") from None
    start = time.perf_counter()
    records: dict[str, str] = {}
    if shipped is not None:
        distill = _program_distillation(agent, *shipped, settings)
        records[TEACHER_PTE_SHA256] = sha256_hex(shipped[0])  # what it ran: the server can tie it to what it sent
    elif "teacher" in task.models:
        distill = _teacher_distillation(agent, task, settings)
    else:
        distill = None
        why = task.records.get(TEACHER_PROGRAM_ERROR, "no teacher yet")
        log.debug("client %s round %d: %s, training with CE only", agent.client_id, task.round, why)
    stats = agent.trainer.fit(agent.model, agent.data.x_train, agent.data.y_train, cfg, distill)
    seconds = time.perf_counter() - start
    models = {"local": agent.weights()} if train_settings(task).upload else {}
    return Result(
        agent.client_id,
        task.round,
        task.type,
        len(agent.data.y_train),
        {"train_loss": stats.loss, "train_seconds": seconds, "kd_loss": stats.kd},
        models,
        records=records,
    )
