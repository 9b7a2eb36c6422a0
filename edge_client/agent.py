"""A client's state (its model, its per-round snapshots, its data shard) and the dispatch of tasks to
registered handlers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from edge_client.training import TorchTrainer, Trainer
from fedge.checkpoint import CheckpointError, load_tree, save_tree
from fedge.memory import memory_metrics
from fedge.model.spec import ModelSpec, SpecModel, build
from fedge.model.weights import State, WeightsError, load_module
from fedge.plugins import load_methods
from fedge.registry import Registry
from fedge.seeding import derive_seed
from fedge.wire.messages import ClientInfo, Result, Task, Weights

log = logging.getLogger(__name__)
SNAPSHOTS_KEPT = 3  # model snapshots (by round) an agent keeps, so a re-sent task re-runs from the model before it
INITIAL_ROUND = -1  # the snapshot key of the freshly initialised model (rounds count from 0)


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


@dataclass(frozen=True)
class TaskKind:
    """A registered task type: its handler, whether the handler changes the client's own model, and whether it may
    be batched (see register_task)."""

    handler: TaskHandler
    mutates: bool
    batchable: bool = False


# train, train_model, evaluate (edge_client.tasks) and kd_train (edge_client.distill), and the client halves of the
# `fedge.methods` entry points (fedge.plugins), loaded when first read
TASKS: Registry[TaskKind] = Registry("task type", TaskError, partial(load_methods, "client"))


def register_task(name: str, mutates: bool = True, batchable: bool = False) -> Callable[[TaskHandler], TaskHandler]:
    """Decorator: the client half of a strategy, under a task type name. Say `mutates=False` only for a
    handler that leaves the own model as it is (evaluation); the agent snapshots the model after every
    mutating task so that one re-sent for the same round starts from the same model again. Say `batchable=True`
    only for a handler that trains only through `agent.trainer.fit` and draws no random numbers of its own: the
    simulation's batched clients (launch.batched) then run it beside other clients' and train their models
    together."""

    def add(handler: TaskHandler) -> TaskHandler:
        TASKS.add(name, TaskKind(handler, mutates, batchable))
        return handler

    return add


class ClientAgent:
    """One edge client: its own architecture, weights and data; executes tasks one at a time.

    `trainer` is its runtime's training loop (eager PyTorch by default; see edge_client.executorch_trainer).
    It keeps its model as it was after each of its last SNAPSHOTS_KEPT mutating tasks, by round, and runs
    a task of round r from the newest snapshot before r (mutating tasks) or up to r (the others), so a
    re-sent task gives the same result. With `state_dir` the snapshots are also files there, and an agent
    started again on the same directory continues from the newest readable one.
    """

    def __init__(
        self,
        client_id: str,
        spec: ModelSpec,
        data: ClientData,
        profile: str,
        seed: int,
        state_dir: Path | None = None,
        trainer: Trainer | None = None,
    ) -> None:
        self.client_id = client_id
        self.trainer = TorchTrainer() if trainer is None else trainer
        self.spec = spec.with_origin(client_id)
        self.data = data
        self.profile = profile
        self.seed = seed
        torch.manual_seed(derive_seed(seed, "init", client_id))
        self.model: SpecModel = build(self.spec)
        self.state_dir = None if state_dir is None else Path(state_dir)
        self.snapshots: dict[int, State] = {INITIAL_ROUND: self.weights().state}
        self.current: int | None = INITIAL_ROUND  # the snapshot the model equals; None while a task changes it
        if self.state_dir is not None:
            self.load_snapshots(self.state_dir)
            self.use(max(self.snapshots))

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
        """Run the handler registered for task.type from the model of the right snapshot, and snapshot the
        model after a mutating task; the result's metrics get the process's `rss_bytes` and `peak_rss_bytes`
        (fedge.memory; in one process shared by several clients they are the process's). An unknown type,
        or a round older than every kept snapshot, raises TaskError."""
        result = self.run_handler(task)
        return replace(result, metrics=result.metrics | memory_metrics())

    def run_handler(self, task: Task) -> Result:
        """handle() without the memory metrics."""
        kind = TASKS.get(task.type)
        before = [r for r in self.snapshots if r < task.round or (r == task.round and not kind.mutates)]
        if not before:
            raise TaskError(
                f"client {self.client_id}: round {task.round} is older than its kept model snapshots "
                f"(rounds {sorted(self.snapshots)}); it cannot be run again"
            )
        self.use(max(before))
        if not kind.mutates:
            return kind.handler(self, task)
        self.current = None
        result = kind.handler(self, task)
        self.snapshot(task.round)
        return result

    def use(self, rnd: int) -> None:
        """Load the snapshot of round `rnd` into the model, unless the model holds it already."""
        if self.current != rnd:
            self.model.load_state_dict(self.snapshots[rnd])
            self.current = rnd

    def snapshot(self, rnd: int) -> None:
        """Keep the model as it is now as round `rnd`'s snapshot (a file too with state_dir); drop the oldest."""
        state = self.weights().state
        if self.state_dir is not None:  # the file first: an agent started again on it holds what this one holds
            save_tree(
                snapshot_file(self.state_dir, rnd),
                {"client": self.client_id, "round": rnd, "model": Weights(self.spec, state)},
            )
        self.snapshots[rnd] = state
        self.current = rnd
        for old in sorted(self.snapshots)[:-SNAPSHOTS_KEPT]:
            del self.snapshots[old]
            if self.state_dir is not None and old != INITIAL_ROUND:
                snapshot_file(self.state_dir, old).unlink(missing_ok=True)

    def load_snapshots(self, state_dir: Path) -> None:
        """Read the newest SNAPSHOTS_KEPT readable snapshot files of `state_dir`; a corrupt file, or one of
        another client or architecture, is skipped with a warning (the older ones are used instead)."""
        loaded = 0
        for path in sorted(state_dir.glob("round-*.safetensors"), reverse=True):
            if loaded == SNAPSHOTS_KEPT:
                break
            try:
                tree = load_tree(path)
                model, rnd = tree["model"], int(tree["round"])
                if tree["client"] != self.client_id or model.spec != self.spec:
                    raise CheckpointError(f"it holds client {tree['client']!r}'s {model.spec.name!r}")
            except (CheckpointError, KeyError, TypeError, ValueError, AttributeError) as e:
                log.warning("client %s: snapshot %s is unusable, trying an older one: %s", self.client_id, path, e)
                continue
            self.snapshots[rnd] = model.state
            loaded += 1


def snapshot_file(state_dir: Path, rnd: int) -> Path:
    """The file of round `rnd`'s model snapshot (zero-padded, so name order is round order)."""
    return state_dir / f"round-{rnd:06d}.safetensors"
