"""A complete new strategy defined in this file alone: its options, its server half, its client task handler and
a reply of named tensors and records. It runs in one process and over the embedded broker (server and clients on
their own MQTT connections) with no other file of fedge edited, and both give the same results.

The method: every client sends the per-class mean of its model's logits on its training data, with the class
counts; the server keeps their count-weighted average and sends it back, scaled by an option, in the next round.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import pytest
import torch

from edge_client.agent import TASKS, ClientAgent, register_task
from fedge.checkpoint import Tree
from fedge.config import ConfigError, config_from
from fedge.wire.messages import ClientInfo, Result, Task
from fedge.wire.payloads import Expected, TensorSlot
from launch.simulation import run_simulation
from server.strategy import STRATEGIES, Strategy, StrategyError, StrategyOptions, option, register_strategy

from helpers.federation import over_embedded_broker

pytestmark = pytest.mark.timeout(240)
NAME = "test-class-means"
CLASSES = 10


@dataclass(frozen=True)
class ClassMeansOptions(StrategyOptions):
    """The one option: how strongly the server's means are sent back."""

    scale: float = option(1.0, "factor on the means the server sends back")

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ConfigError(f"scale must be positive, got {self.scale}")


def class_means_task(agent: ClientAgent, task: Task) -> Result:
    """The client half: per-class mean logits and class counts of the own data; the server's prior comes back as
    a record of its sum, so the test sees the tensor the server sent arrive."""
    with torch.no_grad():
        agent.model.eval()
        logits = agent.model(agent.data.x_train)
    y = agent.data.y_train
    counts = torch.bincount(y, minlength=CLASSES)
    means = torch.zeros(CLASSES, CLASSES).index_add_(0, y, logits) / counts.clamp(min=1).unsqueeze(1)
    prior = task.tensors.get("prior")
    return Result(
        agent.client_id,
        task.round,
        task.type,
        len(y),
        {"classes_seen": float((counts > 0).sum())},
        tensors={"means": means, "counts": counts},
        records={
            "present": [int(c) for c in torch.nonzero(counts).flatten()],
            "prior_sum": None if prior is None else float(prior.sum()),
        },
    )


class ClassMeans(Strategy):
    """Count-weighted average of the clients' per-class mean logits (a test strategy)."""

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        self.means = torch.zeros(CLASSES, CLASSES)
        self.priors: dict[str, float | None] = {}

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        prior = {"prior": self.means * self.options.scale} if rnd > 0 else {}
        return {cid: Task("class_means", rnd, tensors=prior) for cid in active}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        if task.type != "class_means":
            return Expected()
        return Expected(
            tensors={"means": TensorSlot((CLASSES, CLASSES)), "counts": TensorSlot((CLASSES,), "int64")},
            records=("present", "prior_sum"),
        )

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        replies = [results[cid] for cid in sorted(results) if "means" in results[cid].tensors]
        if not replies:
            return
        counts = torch.stack([r.tensors["counts"] for r in replies]).double()
        means = torch.stack([r.tensors["means"] for r in replies]).double()
        total = counts.sum(0).clamp(min=1).unsqueeze(1)
        self.means = ((means * counts.unsqueeze(2)).sum(0) / total).float()
        self.priors.update({r.client_id: r.records["prior_sum"] for r in replies})

    def summary(self) -> dict[str, object]:
        return {"means_sum": float(self.means.double().sum()), "priors": dict(sorted(self.priors.items()))}

    def state(self) -> Tree:
        return {"means": self.means, "priors": dict(self.priors)}

    def load_state(self, state: Tree) -> None:
        if tuple(state["means"].shape) != (CLASSES, CLASSES):
            raise StrategyError(f"checkpoint means have shape {tuple(state['means'].shape)}")
        self.means, self.priors = state["means"], dict(state["priors"])


@pytest.fixture(autouse=True, scope="module")
def registered():
    """Register both halves as a plugin would (with the decorators), for this module's tests only: the registries
    are global, and other tests count what they hold."""
    register_task("class_means", mutates=False)(class_means_task)
    register_strategy(NAME, ClassMeansOptions)(ClassMeans)
    yield
    STRATEGIES.remove(NAME)
    TASKS.remove("class_means")


def config(tmp_path, name: str, **kw):
    values = dict(
        strategy=NAME,
        dataset="digits",
        zoo="cnn1",
        clients=3,
        active=3,
        rounds=3,
        max_samples_per_client=60,
        max_public_samples=16,
        seed=4,
        heartbeat_s=1.0,
        round_deadline_s=60.0,
        register_timeout_s=60.0,
        run_id=f"custom{name}",
        out=str(tmp_path / name),
        export_onnx=False,
        scale=0.5,
    )
    return config_from(values | kw)


def test_a_strategy_defined_in_a_test_runs_in_process_and_over_the_embedded_broker_alike(tmp_path):
    inproc = run_simulation(config(tmp_path, "inproc", transport="inproc"), progress=False)
    mqtt, _ = over_embedded_broker(config(tmp_path, "mqtt"))

    # the option reached the strategy and the tensors the server sent reached the clients (round 0 had none)
    assert json.loads((tmp_path / "mqtt" / "config.json").read_text())["options"] == {"scale": 0.5}
    assert all(v is not None for v in mqtt["priors"].values()) and set(mqtt["priors"]) == {"0", "1", "2"}
    for key in ("means_sum", "priors", "final_accuracy", "rejected_replies"):
        assert mqtt[key] == inproc[key]
    assert mqtt["rejected_replies"] == {} and mqtt["rejected_messages"] == {}
    rows = [json.loads(line) for line in (tmp_path / "mqtt" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["round"], r["client"]) for r in rows if r["trained"]) == [(r, c) for r in range(3) for c in "012"]


def test_the_strategys_options_are_checked_and_listed(tmp_path, capsys):
    from launch.cli import main

    with pytest.raises(ConfigError, match=r"has no option\(s\) \['eta'\]; its options: scale"):
        run_simulation(config(tmp_path, "bad", transport="inproc", eta=0.1), progress=False)
    with pytest.raises(ConfigError, match="scale must be positive"):
        run_simulation(config(tmp_path, "bad", transport="inproc", scale=0), progress=False)
    assert main(["strategies"]) == 0
    assert f"{NAME}: Count-weighted average" in capsys.readouterr().out


def test_a_reply_the_strategy_does_not_expect_is_refused(tmp_path):
    """A client half that adds an undeclared tensor: every reply is refused with reason `payload`."""

    def extra(agent: ClientAgent, task: Task) -> Result:
        res = class_means_task(agent, task)
        return dataclasses.replace(res, tensors=res.tensors | {"secret": torch.zeros(3)})

    kind = TASKS.remove("class_means")
    register_task("class_means", mutates=False)(extra)
    try:
        with pytest.raises(StrategyError, match="round 0 failed"):
            run_simulation(config(tmp_path, "extra", transport="inproc", round_retries=0, rounds=1), progress=False)
    finally:
        TASKS.remove("class_means")
        TASKS.add("class_means", kind)
    summary = json.loads((tmp_path / "extra" / "summary.json").read_text())
    assert summary["rejected_replies"] == {"payload": 3}
