"""Per-FedAvg's client (Fallah et al., NeurIPS 2020, Algorithm 1 lines 5-9, first-order version): `meta_train`
runs the local MAML steps from the global model and uploads the result; `meta_evaluate` personalizes a copy of the
global model by one SGD step of size α on a batch of the client's training data (§3) and evaluates it."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

from edge_client.agent import ClientAgent, TaskError, register_task
from edge_client.tasks import from_global, train_config, train_settings, training_result
from edge_client.training import evaluate
from fedge.wire.messages import Result, Task
from methods.perfedavg.tasks import MetaTask


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
    """One plain SGD step of size `lr` on CE of the batch (x, y); the batch's loss before the step."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(lr * g)
    return float(loss.detach())


def meta_step(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    outer: tuple[torch.Tensor, torch.Tensor],
    alpha: float,
    beta: float,
) -> float:
    """Algorithm 1 lines 6-8, first order: w̃ = w − α∇f(w, D) (Eq. 8's inner step), then w ← w − β∇f(w̃, D') with
    the gradient taken at w̃ and applied at w (the Hessian term of Eq. 9 dropped: Per-FedAvg (FO)); the loss at w̃
    on D'."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    sgd_step(model, *batch, alpha)
    loss = F.cross_entropy(model(outer[0]), outer[1])
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, w, g in zip(params, start, grads):
            p.copy_(w - beta * g)
    return float(loss.detach())


@register_task("meta_train")
def meta_train_task(agent: ClientAgent, task: Task) -> Result:
    """Adopt the task's `global` model; for each of the task's epochs, draw the training data in random batches
    and take one meta step per consecutive pair (D, D') (a last lone batch waits for the next epoch's draw); upload
    the model as `local`. The reported loss is the mean of the last epoch's losses at w̃. Only the torch runtime."""
    settings = from_global(agent, task, MetaTask)
    x, y = agent.data.x_train, agent.data.y_train
    if len(y) < 2:
        raise TaskError(f"client {agent.client_id}: a meta step needs two batches, it has {len(y)} example(s)")
    cfg = train_config(agent, task, settings)
    batch = min(cfg.batch_size, len(y) // 2)
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # dropout draws from the global generator
    agent.model.train()
    start, losses = time.perf_counter(), []
    for _ in range(settings.epochs):
        idx = torch.randperm(len(y), generator=gen).split(batch)
        losses = [
            meta_step(agent.model, (x[a], y[a]), (x[b], y[b]), settings.alpha, settings.beta)
            for a, b in zip(idx[0::2], idx[1::2])
        ]
    loss = sum(losses) / len(losses)
    return training_result(agent, task, loss, time.perf_counter() - start, {"local": agent.weights()})


@register_task("meta_evaluate", mutates=False)
def meta_evaluate_task(agent: ClientAgent, task: Task) -> Result:
    """Personalize a copy of the task's `global` model by one SGD step of size α on one random batch of the
    client's training data (Per-FedAvg §3), then report its accuracy and loss on the client's test data."""
    settings = train_settings(task, MetaTask)
    if "global" not in task.models:
        raise TaskError(f"task meta_evaluate of round {task.round} carries no global model")
    model = agent.module_for(task.models["global"])
    cfg = train_config(agent, task, settings)
    x, y = agent.data.x_train, agent.data.y_train
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(cfg.seed))[: cfg.batch_size]
    torch.manual_seed(cfg.seed)
    model.train()
    sgd_step(model, x[idx], y[idx], settings.alpha)
    accuracy, loss = evaluate(model, agent.data.x_test, agent.data.y_test)
    return Result(agent.client_id, task.round, task.type, len(agent.data.y_test), {"accuracy": accuracy, "loss": loss})
