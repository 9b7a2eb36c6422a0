"""A client keeps its model per round: a re-sent task re-runs from the model before it, and a restarted client
continues from its newest readable snapshot file (reliability notes §10 test 11)."""

import logging

import pytest
import torch

import edge_client  # noqa: F401  (registers the task handlers)
from edge_client.agent import SNAPSHOTS_KEPT, TASKS, ClientAgent, ClientData, TaskError, snapshot_file
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import make_spec
from fedge.wire.messages import Task

pytestmark = pytest.mark.timeout(60)

IN = (1, 4, 4)
SPEC = make_spec("tiny", IN, 3, [("fc", [L("flatten"), L("linear", {"out_features": 3})])])
TRAIN = {"epochs": 1, "batch_size": 4, "lr": 1e-2, "seed": 7, "upload": True}


def data() -> ClientData:
    gen = torch.Generator().manual_seed(0)
    return ClientData(
        torch.randn(12, *IN, generator=gen),
        torch.randint(0, 3, (12,), generator=gen),
        torch.randn(4, *IN, generator=gen),
        torch.randint(0, 3, (4,), generator=gen),
    )


def agent(state_dir=None) -> ClientAgent:
    return ClientAgent("c1", SPEC, data(), "rpi-4", seed=0, state_dir=state_dir)


def train(a: ClientAgent, rnd: int) -> dict[str, torch.Tensor]:
    return a.handle(Task("train", rnd, dict(TRAIN))).models["local"].state


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_only_evaluations_and_train_model_leave_the_own_model_alone():
    """train_model trains a copy of the model the server sent, never the client's own; so does every evaluation
    (FedAvg+'s tune_evaluate and Per-FedAvg's meta_evaluate tune or step a copy of the global model). Every other
    task changes the own model. Over every registered task, a method's own included."""
    keeps = {name for name in TASKS if not TASKS.get(name).mutates}
    assert keeps == {name for name in TASKS if name == "train_model" or name.endswith("evaluate")}
    assert {"evaluate", "modular_evaluate", "train_model", "tune_evaluate", "meta_evaluate"} <= keeps


def test_a_resent_task_gives_the_same_result():
    a = agent()
    first = train(a, 0)
    second = train(a, 1)
    assert not equal(first, second)  # round 1 starts from round 0's model, so it moves on
    assert equal(train(a, 1), second)  # round 1 again: from round 0's model again, bit for bit
    assert equal(train(a, 0), first)
    assert equal(a.weights().state, first)


def test_evaluate_uses_the_model_of_its_round():
    a, b = agent(), agent()
    train(a, 0)
    train(b, 0)
    train(b, 1)
    metrics_b, metrics_a = b.handle(Task("evaluate", 0)).metrics, a.handle(Task("evaluate", 0)).metrics
    assert (metrics_b["accuracy"], metrics_b["loss"]) == (metrics_a["accuracy"], metrics_a["loss"])
    assert equal(b.weights().state, a.weights().state)


def test_only_the_last_snapshots_are_kept_and_older_rounds_are_refused(tmp_path):
    a = agent(tmp_path)
    for rnd in range(5):
        train(a, rnd)
    assert sorted(a.snapshots) == [2, 3, 4] and SNAPSHOTS_KEPT == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [snapshot_file(tmp_path, r).name for r in (2, 3, 4)]
    with pytest.raises(TaskError, match="older than"):
        train(a, 2)


def test_a_restarted_client_continues_from_its_files(tmp_path):
    a = agent(tmp_path)
    train(a, 0)
    after_1 = train(a, 1)
    after_2 = train(a, 2)  # trained, then the client crashed before its upload was acknowledged
    b = agent(tmp_path)
    assert equal(b.weights().state, after_2)
    assert equal(train(b, 2), after_2)  # the re-sent round 2 starts from round 1's model again
    assert equal(train(b, 3), train(a, 3))
    b.handle(Task("evaluate", 1))
    assert equal(b.weights().state, after_1)


def test_a_corrupt_snapshot_falls_back_to_the_previous_one(tmp_path, caplog):
    a = agent(tmp_path)
    after_0 = train(a, 0)
    train(a, 1)
    newest = snapshot_file(tmp_path, 1)
    blob = bytearray(newest.read_bytes())
    blob[-1] ^= 0xFF
    newest.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING):
        b = agent(tmp_path)
    assert "unusable" in caplog.text and newest.name in caplog.text
    assert sorted(b.snapshots) == [-1, 0]
    assert equal(b.weights().state, after_0)


def test_a_snapshot_of_another_client_is_not_loaded(tmp_path, caplog):
    other = ClientAgent("c2", SPEC, data(), "rpi-4", seed=0, state_dir=tmp_path)
    train(other, 0)
    with caplog.at_level(logging.WARNING):
        a = agent(tmp_path)
    assert sorted(a.snapshots) == [-1] and "c2" in caplog.text
