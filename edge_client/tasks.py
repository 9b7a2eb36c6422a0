"""Client task handlers shared by the classic strategies: `train` (local / FedAvg) and `evaluate`."""

from __future__ import annotations

import time

from edge_client.agent import ClientAgent, TaskError, register_task
from edge_client.training import TrainConfig, evaluate
from fedge import constants as C
from fedge.messages import Result, Task
from fedge.seeding import derive_seed


def train_config(agent: ClientAgent, task: Task) -> TrainConfig:
    """The TrainConfig a task asks for; a missing or non-positive setting raises TaskError."""
    try:
        cfg = TrainConfig(epochs=int(task.config["epochs"]), batch_size=int(task.config["batch_size"]),
                          lr=float(task.config["lr"]),
                          seed=derive_seed(int(task.config["seed"]), "train", agent.client_id, task.round),
                          sgd_lr=float(task.config.get("sgd_lr", C.SGD_LR)),
                          sgd_momentum=float(task.config.get("sgd_momentum", C.SGD_MOMENTUM)))
    except (KeyError, TypeError, ValueError) as e:
        raise TaskError(f"task {task.type} of round {task.round}: bad or missing config {e}") from None
    if cfg.epochs < 1 or cfg.batch_size < 1 or not cfg.lr > 0 or not cfg.sgd_lr > 0 or not 0 <= cfg.sgd_momentum < 1:
        raise TaskError(f"task {task.type}: epochs, batch_size, lr and sgd_lr must be positive and sgd_momentum "
                        f"in [0, 1), got {cfg}")
    return cfg


@register_task("train")
def train_task(agent: ClientAgent, task: Task) -> Result:
    """Optionally adopt the server's `global` model, train locally on the client's runtime, upload if asked."""
    if "global" in task.models:
        agent.adopt(task.models["global"])
    cfg = train_config(agent, task)
    start = time.perf_counter()
    loss = agent.trainer.fit(agent.model, agent.data.x_train, agent.data.y_train, cfg).loss
    seconds = time.perf_counter() - start
    models = {"local": agent.weights()} if task.config.get("upload") else {}
    return Result(agent.client_id, task.round, task.type, len(agent.data.y_train),
                  {"train_loss": loss, "train_seconds": seconds}, models)


@register_task("evaluate", mutates=False)
def evaluate_task(agent: ClientAgent, task: Task) -> Result:
    """Accuracy and loss on the client's own test set, of its own model or of a sent `global` one."""
    model = agent.module_for(task.models["global"]) if "global" in task.models else agent.model
    accuracy, loss = evaluate(model, agent.data.x_test, agent.data.y_test)
    return Result(agent.client_id, task.round, task.type, len(agent.data.y_test),
                  {"accuracy": accuracy, "loss": loss})
