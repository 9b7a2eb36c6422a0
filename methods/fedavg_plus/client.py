"""FedAvg+'s client half: the `tune_evaluate` task (local tuning, then evaluation; the training rounds are FedAvg's
`train`, edge_client/tasks.py)."""

from __future__ import annotations

import time

from edge_client.agent import ClientAgent, TaskError, register_task
from edge_client.tasks import train_config, train_settings
from edge_client.training import evaluate
from fedge.wire.messages import Result, Task
from methods.fedavg_plus.tasks import TuneEvaluateTask


@register_task("tune_evaluate", mutates=False)
def tune_evaluate_task(agent: ClientAgent, task: Task) -> Result:
    """Fine-tune a copy of the task's `global` model on the client's training data with the device's runtime for the
    task's epochs, and report the copy's accuracy and loss on the client's test data (and the tuning's last-epoch
    loss and seconds). A task without a global model, or asking for an upload, raises TaskError."""
    settings = train_settings(task, TuneEvaluateTask)
    if "global" not in task.models or settings.upload:
        raise TaskError(f"task tune_evaluate of round {task.round} needs a global model and no upload")
    model = agent.module_for(task.models["global"])
    start = time.perf_counter()
    tuned = agent.trainer.fit(model, agent.data.x_train, agent.data.y_train, train_config(agent, task, settings))
    seconds = time.perf_counter() - start
    accuracy, loss = evaluate(model, agent.data.x_test, agent.data.y_test)
    metrics = {"accuracy": accuracy, "loss": loss, "tune_loss": tuned.loss, "tune_seconds": seconds}
    return Result(agent.client_id, task.round, task.type, len(agent.data.y_test), metrics)
