"""pFedMe's client (Dinh et al., NeurIPS 2020, Algorithm 1 lines 4-8): the `pfedme_train` task. From the global model
w, for each batch: solve Eq. (7), θ̂ ≈ argmin_θ f(θ; D) + λ/2·‖θ − w‖², by K SGD steps from the current θ, then move
the local model w ← w − ηλ(w − θ̂) (Eq. 8). The client keeps θ as its personalized (own) model and uploads w."""

from __future__ import annotations

import time

import torch
from torch.nn import functional as F

from edge_client.agent import ClientAgent, register_task
from edge_client.tasks import from_global, train_config, training_result
from fedge.wire.messages import Result, Task, Weights
from methods.pfedme.tasks import MoreauTask


def moreau_step(
    model: torch.nn.Module, local: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, settings: MoreauTask
) -> float:
    """One batch of Algorithm 1: K SGD steps of θ (the model's parameters) on f(θ; D) + λ/2·‖θ − w‖² (Eq. 7), then
    w ← w − ηλ(w − θ) (Eq. 8), `local` holding w in the parameters' order; the batch's last f(θ; D)."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.zeros(())
    for _ in range(settings.inner_steps):
        loss = F.cross_entropy(model(x), y)
        moreau = sum(((p - w) ** 2).sum() for p, w in zip(params, local))
        grads = torch.autograd.grad(loss + settings.lamda / 2 * moreau, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(settings.personal_lr * g)
    with torch.no_grad():
        for p, w in zip(params, local):
            w.sub_(settings.eta * settings.lamda * (w - p))
    return float(loss.detach())


@register_task("pfedme_train")
def pfedme_train_task(agent: ClientAgent, task: Task) -> Result:
    """Adopt the task's `global` model as both θ and w; for each of the task's epochs, one `moreau_step` per random
    batch of the training data. The own model keeps θ (what the client is evaluated on); the upload `local` is w
    (θ's buffers, e.g. BatchNorm statistics, with w's parameters). Only the torch runtime."""
    settings = from_global(agent, task, MoreauTask)
    names = [n for n, p in agent.model.named_parameters() if p.requires_grad]
    local = [p.detach().clone() for n, p in agent.model.named_parameters() if p.requires_grad]
    x, y = agent.data.x_train, agent.data.y_train
    cfg = train_config(agent, task, settings)
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # dropout draws from the global generator
    agent.model.train()
    start, losses = time.perf_counter(), []
    for _ in range(settings.epochs):
        losses = [
            moreau_step(agent.model, local, x[i], y[i], settings)
            for i in torch.randperm(len(y), generator=gen).split(cfg.batch_size)
        ]
    uploaded = agent.weights().state | dict(zip(names, (w.clone() for w in local)))
    loss = sum(losses) / len(losses)
    return training_result(agent, task, loss, time.perf_counter() - start, {"local": Weights(agent.spec, uploaded)})
