"""The transport-neutral messages of a round: client registration, tasks, and results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.model.spec import ModelSpec
from fedge.model.weights import State

# Named tensors a task or result carries besides models (DC-PFL's class means, FedMN's routing inputs): parameter-
# style names to tensors. Records are JSON values by name (lists, numbers, strings, objects; finite numbers only).
Tensors = dict[str, torch.Tensor]
Records = dict[str, Any]


def client_order(cid: str) -> tuple[int, str]:
    """Sort key that puts numeric client ids in numeric order ("2" before "10")."""
    return len(cid), cid


@dataclass(frozen=True)
class Weights:
    """A model as it travels: its spec and its tensors keyed by parameter name."""

    spec: ModelSpec
    state: State


@dataclass(frozen=True)
class ClientInfo:
    """What a client tells the server when it registers."""

    client_id: str
    spec: ModelSpec
    profile: str
    num_train: int
    num_test: int


@dataclass(frozen=True)
class Task:
    """An instruction for one client: a handler name, the round, JSON config, models by role, and named tensors
    and JSON records for anything that is not a model."""

    type: str
    round: int
    config: dict[str, Any] = field(default_factory=dict)
    models: dict[str, Weights] = field(default_factory=dict)
    tensors: Tensors = field(default_factory=dict)
    records: Records = field(default_factory=dict)


@dataclass(frozen=True)
class Result:
    """A client's reply to a Task: example count, scalar metrics, models by role, named tensors and JSON records;
    or, with `error`, the client's report that it could not execute the task (e.g. training diverged), and why."""

    client_id: str
    round: int
    type: str
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    models: dict[str, Weights] = field(default_factory=dict)
    error: str | None = None
    tensors: Tensors = field(default_factory=dict)
    records: Records = field(default_factory=dict)
