"""FedProx's client (Li et al., MLSys 2020, Algorithm 2 line 6): the `prox_train` task. Adopt the global model w^t,
minimise h_k(w; w^t) = F_k(w) + μ/2·‖w − w^t‖² (Eq. 2) with the run's local training (E epochs of minibatches:
the γ-inexact solution the paper allows), and upload w."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

from edge_client.agent import ClientAgent, register_task
from edge_client.tasks import from_global, train_config, training_result
from edge_client.training import Objective, fit
from fedge.wire.messages import Result, Task
from methods.fedprox.tasks import ProxTrainTask


def proximal_term(model: nn.Module, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """‖w − w^t‖² over the model's trainable parameters (Eq. 2); BatchNorm's running statistics are no parameters."""
    return sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters() if p.requires_grad)


def proximal_objective(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mu: float) -> Objective:
    """One batch's (CE + μ/2·‖w − w^t‖², CE, ‖w − w^t‖²), w^t the model's parameters when this is called."""
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}

    def terms(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ce = F.cross_entropy(model(x[idx]), y[idx])
        prox = proximal_term(model, anchor)
        return ce + mu / 2 * prox, ce, prox

    return terms


@register_task("prox_train")
def prox_train_task(agent: ClientAgent, task: Task) -> Result:
    """Adopt the task's `global` model, train on Eq. (2) for the task's epochs, and upload the model as `local`,
    with the last epoch's mean proximal term ‖w − w^t‖² as `prox_term`. Only the torch runtime: an ExecuTorch
    training program has no proximal term. A task without a global model raises TaskError."""
    settings = from_global(agent, task, ProxTrainTask)
    x, y = agent.data.x_train, agent.data.y_train
    start = time.perf_counter()
    stats = fit(
        agent.model,
        x,
        y,
        train_config(agent, task, settings),
        objective=proximal_objective(agent.model, x, y, settings.mu),
    )
    seconds = time.perf_counter() - start
    return training_result(
        agent, task, stats.loss, seconds, {"local": agent.weights()}, metrics={"prox_term": stats.kd}
    )
