"""The `dc_train` task (DC-PFL Algorithm 1 "Client Execute", FedGH's client): adopt the global head φ, train the
own extractor θ and φ on L_sup + λ·L_kd (Eqs. 2-5), then upload each class's feature count, mean (Eq. 6) and,
for DC-PFL, unbiased covariance (Eq. 7) over the training data; never per-sample features."""

from __future__ import annotations

import time

import torch
from torch.nn import functional as F

from edge_client.agent import ClientAgent, TaskError, register_task
from edge_client.tasks import train_config, train_settings, training_result
from edge_client.training import Objective, fit
from fedge.constants import EVAL_BATCH_SIZE
from fedge.model.spec import SpecModel
from fedge.wire.messages import Result, Task
from methods.dcpfl.class_stats import COUNTS, COVARIANCES, GLOBAL_MEANS, KNOWN_CLASSES, MEANS, class_statistics
from methods.dcpfl.heads import HeadError, extract, head_spec, put_head
from methods.dcpfl.tasks import DCTrainTask


def aux_loss(z: torch.Tensor, y: torch.Tensor, means: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """L_kd of Eq. (3) over a batch: 1/|B| Σ_i ‖z_i − µ_{y_i}‖₂ (the unsquared Euclidean distance to the global
    mean of the sample's class); a sample whose class has no global mean yet adds 0."""
    mask = known[y]
    if not bool(mask.any()):
        return z.sum() * 0.0
    distances = torch.linalg.vector_norm(z[mask] - means[y[mask]], dim=1)
    return distances.sum() / len(y)


def anchored_objective(
    model: SpecModel, x: torch.Tensor, y: torch.Tensor, means: torch.Tensor, known: torch.Tensor, lam: float
) -> Objective:
    """Eq. (4): L_sup (Eq. 2, cross-entropy of g_φ(f_θ(x))) + λ·L_kd (Eq. 3). With λ = 0 the loss is exactly the
    cross-entropy (L_kd is then measured without gradient). L_kd depends on θ only, so it gives φ no gradient."""

    def terms(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = extract(model, x[idx])
        ce = F.cross_entropy(model.blocks[-1](z), y[idx])
        if lam > 0:
            kd = aux_loss(z, y[idx], means, known)
            return ce + lam * kd, ce, kd
        with torch.no_grad():
            return ce, ce, aux_loss(z, y[idx], means, known)

    return terms


@torch.no_grad()
def features(model: SpecModel, x: torch.Tensor) -> torch.Tensor:
    """z = f_θ(x) for every sample, in eval mode (dropout off, BatchNorm's running statistics), in batches."""
    model.eval()
    return torch.cat([extract(model, xb) for xb in x.split(EVAL_BATCH_SIZE)])


def global_means(agent: ClientAgent, task: Task, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's global class means (C, d) and which classes have one (C,) bool; none sent: no class known (the
    first round). TaskError for tensors of another shape or dtype."""
    c = agent.spec.num_classes
    if GLOBAL_MEANS not in task.tensors:
        return torch.zeros(c, d), torch.zeros(c, dtype=torch.bool)
    means, known = task.tensors[GLOBAL_MEANS], task.tensors.get(KNOWN_CLASSES)
    if (
        tuple(means.shape) != (c, d)
        or not means.is_floating_point()
        or known is None
        or tuple(known.shape) != (c,)
        or known.dtype != torch.bool
    ):
        raise TaskError(
            f"task dc_train of round {task.round}: global means must be ({c}, {d}) floats with a ({c},) bool "
            f"{KNOWN_CLASSES!r}, got {tuple(means.shape)} and {None if known is None else tuple(known.shape)}"
        )
    return means.float(), known


@register_task("dc_train")
def dc_train_task(agent: ClientAgent, task: Task) -> Result:
    """Algorithm 1, Client Execute: put the sent global head into the own model (line 1), train on Eq. (4) (lines
    2-3), compute Eqs. (6)-(7) over the training data (line 4) and return them as the named tensors class_means
    (C, d), class_counts (C,) and, when the task asks, class_covariances (C, d, d), in float32 (line 5).
    Only the torch runtime: the ExecuTorch training program has no auxiliary loss."""
    settings = train_settings(task, DCTrainTask)
    if agent.trainer.runtime != "torch":
        raise TaskError(f"client {agent.client_id}: the {agent.trainer.runtime} runtime cannot train dc_train")
    head = task.models.get("head")
    try:
        own_head = head_spec(agent.spec)
        if head is None or head.spec.with_origin(None) != own_head:
            raise TaskError(f"task dc_train of round {task.round} carries no head of the shape of {agent.spec.name!r}")
        put_head(agent.model, head.state)
    except HeadError as e:
        raise TaskError(f"client {agent.client_id}: {e}") from None
    d = own_head.input_shape[0]
    means, known = global_means(agent, task, d)
    x, y = agent.data.x_train, agent.data.y_train
    objective = anchored_objective(agent.model, x, y, means, known, settings.aux_lambda)
    start = time.perf_counter()
    stats = fit(agent.model, x, y, train_config(agent, task, settings), objective=objective)
    seconds = time.perf_counter() - start
    s = class_statistics(features(agent.model, x), y, agent.spec.num_classes, settings.covariance)
    tensors = {MEANS: s.means.float(), COUNTS: s.counts}
    if s.covariances is not None:
        tensors[COVARIANCES] = s.covariances.float()
    return training_result(agent, task, stats.loss, seconds, {}, tensors, {"aux_loss": stats.kd})
