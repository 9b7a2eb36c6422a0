"""Client task handlers shared by the classic strategies: `train` (local / FedAvg), `train_model` (a model the
server chose: HeteroFL, FedTrans) and `evaluate`."""

from __future__ import annotations

import math
import time
from typing import Any, TypeVar

import torch

from edge_client.agent import ClientAgent, TaskError, register_task
from edge_client.training import TrainConfig, evaluate, fit
from fedge.seeding import derive_seed
from fedge.tasks import TaskConfigError, TrainTask, is_cell_weight
from fedge.wire.messages import Result, Task, Tensors, Weights

T = TypeVar("T", bound=TrainTask)


def train_settings(task: Task, kind: type[T] = TrainTask) -> T:
    """The local-training settings a task carries, as `kind` (fedge.tasks.TrainTask or a subclass: DCTrainTask,
    ModularTrainTask); a bad config raises TaskError."""
    try:
        return kind.from_config(task.config)
    except TaskConfigError as e:
        raise TaskError(f"task {task.type} of round {task.round}: {e}") from None


def from_global(agent: ClientAgent, task: Task, kind: type[T]) -> T:
    """The settings of a task that trains the sent `global` model with a loop of its own (not the runtime's `fit`:
    FedProx's, Per-FedAvg's, pFedMe's), read as `kind`, after adopting that model into the client's own. TaskError
    on another runtime than torch (an ExecuTorch training program runs only its own loss), for a task without a
    global model, or with a bad config."""
    settings = train_settings(task, kind)
    if agent.trainer.runtime != "torch":
        raise TaskError(f"client {agent.client_id}: the {agent.trainer.runtime} runtime cannot train {task.type}")
    if "global" not in task.models:
        raise TaskError(f"task {task.type} of round {task.round} carries no global model")
    agent.adopt(task.models["global"])
    return settings


def train_config(agent: ClientAgent, task: Task, settings: TrainTask | None = None) -> TrainConfig:
    """The trainer's settings for a task: its TrainTask (`settings` when the handler read its config already, as
    a subclass) with this client's seed for this round; TaskError when the task's config is bad."""
    t = settings or train_settings(task)
    return TrainConfig(
        epochs=t.epochs,
        batch_size=t.batch_size,
        lr=t.lr,
        seed=derive_seed(t.seed, "train", agent.client_id, task.round),
        sgd_lr=t.sgd_lr,
        sgd_momentum=t.sgd_momentum,
    )


@register_task("train", batchable=True)
def train_task(agent: ClientAgent, task: Task) -> Result:
    """Optionally adopt the server's `global` model, train locally on the client's runtime, upload if asked."""
    if "global" in task.models:
        agent.adopt(task.models["global"])
    cfg = train_config(agent, task)
    start = time.perf_counter()
    loss = agent.trainer.fit(agent.model, agent.data.x_train, agent.data.y_train, cfg).loss
    seconds = time.perf_counter() - start
    models = {"local": agent.weights()} if train_settings(task).upload else {}
    return training_result(agent, task, loss, seconds, models)


def training_result(
    agent: ClientAgent,
    task: Task,
    loss: float,
    seconds: float,
    models: dict[str, Weights],
    tensors: Tensors | None = None,
    metrics: dict[str, float] | None = None,
    **records: Any,
) -> Result:
    """The reply to a local-training task: the client's training-set size, its last-epoch loss and wall time (and
    any further `metrics`), the models, named tensors and records it uploads."""
    return Result(
        agent.client_id,
        task.round,
        task.type,
        len(agent.data.y_train),
        {"train_loss": loss, "train_seconds": seconds} | (metrics or {}),
        models,
        tensors=tensors or {},
        records=records,
    )


class GradientMeans:
    """Running sums of each conv/linear weight's gradient over the steps of one local training (FedTrans §4.1)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weights = {n: p for n, p in model.named_parameters() if is_cell_weight(n, p.shape)}
        self.sums = {n: torch.zeros_like(p) for n, p in self.weights.items()}
        self.steps = 0

    def __call__(self) -> None:
        self.steps += 1
        for name, p in self.weights.items():
            if p.grad is not None:
                self.sums[name] += p.grad

    def activeness(self) -> dict[str, float]:
        """‖mean gradient‖₂ / ‖W‖₂ per weight (FedTrans §4.1 cell activeness), W after training; a weight of
        norm 0 gets 0."""
        out = {}
        for name, p in self.weights.items():
            norm = float(p.detach().norm())
            value = float((self.sums[name] / max(self.steps, 1)).norm()) / norm if norm > 0 else 0.0
            out[name] = value if math.isfinite(value) else 0.0
        return out


@register_task("train_model", mutates=False)
def train_model_task(agent: ClientAgent, task: Task) -> Result:
    """Train the `model` the server sent (any architecture for this client's data: HeteroFL's submodel, FedTrans's
    assigned model) from its weights on the client's data and return it as `model`, with the training loss and, as
    the `activeness` record, ‖mean gradient‖/‖W‖ of every conv/linear weight. The client's own model is left as it
    is. Only the torch runtime trains an architecture it did not register: an ExecuTorch client's training
    program is built for its own model, so it raises TaskError."""
    if "model" not in task.models:
        raise TaskError(f"task train_model of round {task.round} carries no model")
    if agent.trainer.runtime != "torch":
        raise TaskError(
            f"client {agent.client_id}: the {agent.trainer.runtime} runtime trains only its own architecture, "
            "not a model the server sends"
        )
    model = agent.module_for(task.models["model"])
    cfg = train_config(agent, task)
    grads = GradientMeans(model)
    start = time.perf_counter()
    loss = fit(model, agent.data.x_train, agent.data.y_train, cfg, after_backward=grads).loss
    seconds = time.perf_counter() - start
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trained = {"model": Weights(task.models["model"].spec, state)}
    return training_result(agent, task, loss, seconds, trained, activeness=grads.activeness())


@register_task("evaluate", mutates=False)
def evaluate_task(agent: ClientAgent, task: Task) -> Result:
    """Accuracy and loss on the client's own test set, of its own model or of a sent `global` one."""
    model = agent.module_for(task.models["global"]) if "global" in task.models else agent.model
    accuracy, loss = evaluate(model, agent.data.x_test, agent.data.y_test)
    return Result(agent.client_id, task.round, task.type, len(agent.data.y_test), {"accuracy": accuracy, "loss": loss})
