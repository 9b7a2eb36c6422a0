"""Client task handlers shared by the classic strategies: `train` (local / FedAvg) and `evaluate`."""

from __future__ import annotations

import time

from edge_client.agent import ClientAgent, TaskError, register_task
from edge_client.training import TrainConfig, evaluate
from fedge.messages import Result, Task
from fedge.seeding import derive_seed
from fedge.tasks import TaskConfigError, TrainTask


def train_settings(task: Task) -> TrainTask:
    """The local-training settings a task carries (fedge.tasks.TrainTask); a bad config raises TaskError."""
    try:
        return TrainTask.from_config(task.config)
    except TaskConfigError as e:
        raise TaskError(f"task {task.type} of round {task.round}: {e}") from None


def train_config(agent: ClientAgent, task: Task) -> TrainConfig:
    """The trainer's settings for a task: its TrainTask with this client's seed for this round; TaskError when the
    task's config is bad."""
    t = train_settings(task)
    return TrainConfig(
        epochs=t.epochs,
        batch_size=t.batch_size,
        lr=t.lr,
        seed=derive_seed(t.seed, "train", agent.client_id, task.round),
        sgd_lr=t.sgd_lr,
        sgd_momentum=t.sgd_momentum,
    )


@register_task("train")
def train_task(agent: ClientAgent, task: Task) -> Result:
    """Optionally adopt the server's `global` model, train locally on the client's runtime, upload if asked."""
    if "global" in task.models:
        agent.adopt(task.models["global"])
    cfg = train_config(agent, task)
    start = time.perf_counter()
    loss = agent.trainer.fit(agent.model, agent.data.x_train, agent.data.y_train, cfg).loss
    seconds = time.perf_counter() - start
    models = {"local": agent.weights()} if train_settings(task).upload else {}
    return Result(
        agent.client_id,
        task.round,
        task.type,
        len(agent.data.y_train),
        {"train_loss": loss, "train_seconds": seconds},
        models,
    )


@register_task("evaluate", mutates=False)
def evaluate_task(agent: ClientAgent, task: Task) -> Result:
    """Accuracy and loss on the client's own test set, of its own model or of a sent `global` one."""
    model = agent.module_for(task.models["global"]) if "global" in task.models else agent.model
    accuracy, loss = evaluate(model, agent.data.x_test, agent.data.y_test)
    return Result(agent.client_id, task.round, task.type, len(agent.data.y_test), {"accuracy": accuracy, "loss": loss})
