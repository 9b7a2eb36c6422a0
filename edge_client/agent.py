"""A client's state (its model and its data shard) and the dispatch of tasks to registered handlers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fedge.messages import ClientInfo, Result, Task, Weights
from fedge.registry import Registry
from fedge.seeding import derive_seed
from fedge.spec import ModelSpec, SpecModel, build
from fedge.weights import WeightsError, load_module


class TaskError(ValueError):
    """A task this client cannot execute (unknown type, missing config, wrong model); says why."""


@dataclass(frozen=True)
class ClientData:
    """A client's own shard as tensors; it never leaves the device."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


TaskHandler = Callable[["ClientAgent", Task], Result]
TASKS: Registry[TaskHandler] = Registry("task type", TaskError)
register_task = TASKS.register  # decorator: the client half of a strategy, under a task type name


class ClientAgent:
    """One edge client: its own architecture, weights and data; executes tasks one at a time."""

    def __init__(self, client_id: str, spec: ModelSpec, data: ClientData, profile: str, seed: int) -> None:
        self.client_id = client_id
        self.spec = spec.with_origin(client_id)
        self.data = data
        self.profile = profile
        self.seed = seed
        torch.manual_seed(derive_seed(seed, "init", client_id))
        self.model: SpecModel = build(self.spec)

    def info(self) -> ClientInfo:
        """What this client registers with: id, architecture, profile, data sizes (never the data)."""
        return ClientInfo(self.client_id, self.spec, self.profile, len(self.data.y_train), len(self.data.y_test))

    def weights(self) -> Weights:
        """A copy of the current model as spec + tensors (what an upload carries)."""
        return Weights(self.spec, {k: v.detach().clone() for k, v in self.model.state_dict().items()})

    def module_for(self, weights: Weights) -> SpecModel:
        """A module built from received weights, after checking them against their spec."""
        try:
            return load_module(weights.spec, weights.state)
        except WeightsError as e:
            raise TaskError(f"client {self.client_id}: received weights rejected: {e}") from None

    def adopt(self, weights: Weights) -> None:
        """Replace the own model's weights; the architecture must be this client's own."""
        if weights.spec.with_origin(self.client_id) != self.spec:
            raise TaskError(f"client {self.client_id}: received model {weights.spec.name!r} is not its architecture")
        self.model.load_state_dict(self.module_for(weights).state_dict())

    def handle(self, task: Task) -> Result:
        """Run the handler registered for task.type; an unknown type raises TaskError."""
        return TASKS.get(task.type)(self, task)
