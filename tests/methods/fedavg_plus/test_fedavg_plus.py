"""FedAvg+: the training rounds are FedAvg's bit for bit, only the evaluation tunes, the tuning changes neither the
global model nor the client's own, and a tuning task that asks for an upload is refused."""

import json

import pytest
import torch

from edge_client.agent import ClientAgent, ClientData, TaskError
from edge_client.tasks import evaluate_task
from fedge.config import config_from
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import Task, Weights
from launch.simulation import run_simulation
from methods.fedavg_plus.client import tune_evaluate_task
from methods.fedavg_plus.tasks import TuneEvaluateTask

pytestmark = pytest.mark.timeout(120)
SPEC = create("cnn1", (1, 8, 8), 10)


def run(out, strategy):
    settings = dict(strategy=strategy, dataset="digits", zoo="cnn1", clients=4, active=3, rounds=2, local_epochs=1)
    summary = run_simulation(
        config_from(settings | {"seed": 5, "transport": "inproc", "out": str(out)}), progress=False
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_training_is_fedavgs_and_the_tuned_evaluation_personalizes(tmp_path):
    fedavg, fedavg_rows = run(tmp_path / "fedavg", "fedavg")
    plus, plus_rows = run(tmp_path / "plus", "fedavg+")
    assert [r.get("train_loss") for r in plus_rows] == [r.get("train_loss") for r in fedavg_rows]
    assert [r["client"] for r in plus_rows] == [r["client"] for r in fedavg_rows]
    # two classes a client (non-IID digits): tuning the global model on them lifts every client's accuracy
    per_client = zip(plus["final_accuracy"]["per_client"].values(), fedavg["final_accuracy"]["per_client"].values())
    assert all(a >= b for a, b in per_client)
    assert plus["final_accuracy"]["mean"] > fedavg["final_accuracy"]["mean"] + 0.1


def agent():
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(32) % 3
    data = ClientData(torch.randn(32, 1, 8, 8, generator=gen), y, torch.randn(8, 1, 8, 8, generator=gen), y[:8])
    return ClientAgent("c", SPEC, data, "rpi-4", seed=0)


def test_tuning_leaves_the_sent_and_the_own_model_as_they_were_and_an_upload_is_refused():
    a = agent()
    own = {k: v.clone() for k, v in a.model.state_dict().items()}
    torch.manual_seed(3)
    sent = Weights(SPEC, build(SPEC).state_dict())
    copy = {k: v.clone() for k, v in sent.state.items()}
    config = TuneEvaluateTask(epochs=2, batch_size=8, lr=1e-2, seed=1, upload=False).to_config()
    tuned = tune_evaluate_task(a, Task("tune_evaluate", 0, config, {"global": sent}))
    untuned = evaluate_task(a, Task("evaluate", 0, models={"global": sent}))
    assert tuned.metrics["loss"] < untuned.metrics["loss"]  # three classes in train and test: tuning fits them
    assert all(torch.equal(v, own[k]) for k, v in a.model.state_dict().items())
    assert all(torch.equal(v, copy[k]) for k, v in sent.state.items())
    upload = TuneEvaluateTask(epochs=1, batch_size=8, lr=1e-2, seed=1, upload=True).to_config()
    with pytest.raises(TaskError, match="no upload"):
        tune_evaluate_task(a, Task("tune_evaluate", 0, upload, {"global": sent}))
