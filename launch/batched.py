"""The simulation's batched clients (`fedge run --transport inproc --engine batched [--client-device cuda]`): a
round's training tasks run side by side, and the clients whose models share an architecture and settings train
together as one batched computation (edge_client.batched.fit_together), on the CPU (BATCHED_CPU_CLIENTS at a time)
or a GPU (all of them).

A batchable task (edge_client.agent.register_task) runs in a thread of its own, its agent's trainer replaced by a
gate: the handler runs as always up to its `fit`, which hands the job over and waits. When every such thread waits
or is done, the jobs train, grouped; the threads then finish their handlers (upload, snapshot). Other tasks (other
strategies' training, evaluation, an ExecuTorch client's) run one after another in this thread, as in the serial
run. Everything but a group's batched training runs at one torch thread, as in the serial run: so a group of one on
the CPU, which trains by `fit` itself, is bit for bit the serial run.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

import torch
from torch import nn

from edge_client.agent import TASKS, ClientAgent, TaskError
from edge_client.batched import FitJob, fit_together, settings_key
from edge_client.training import Distillation, TorchTrainer, TrainConfig, TrainStats, fit
from fedge.brokers.transport import InProcTransport
from fedge.config import ConfigError
from fedge.constants import BATCHED_CPU_CLIENTS
from fedge.model.spec import SpecModel
from fedge.wire.messages import Result, Task, Weights


def client_device(name: str) -> torch.device:
    """The device batched clients train on: "cpu", or "cuda"/"cuda:N" (RunConfig checked the form) where torch
    sees that GPU, else ConfigError saying so."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"client_device {name}: torch sees no CUDA device here; use client_device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"client_device {name}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
    return device


class _Slot:
    """One waiting `fit`: its job, group key, its task's place in the exchange, and the stats (or error) it gets."""

    def __init__(self, job: FitJob, key: tuple, place: int) -> None:
        self.job, self.key, self.place = job, key, place
        self.result: TrainStats | Exception | None = None
        self.done = threading.Event()


class _Gather:
    """The meeting point of one exchange's threads: `fit` waits here until `train_waiting` has trained its job."""

    def __init__(self, threads: int) -> None:
        self.cond = threading.Condition()
        self.running = threads  # threads whose handler has not returned
        self.waiting: list[_Slot] = []
        self.stopped: BaseException | None = None

    def fit(self, job: FitJob, key: tuple, place: int) -> TrainStats:
        slot = _Slot(job, key, place)
        with self.cond:
            if self.stopped is not None:
                raise RuntimeError(f"the exchange stopped: {self.stopped!r}")
            self.waiting.append(slot)
            self.cond.notify_all()
        slot.done.wait()
        if isinstance(slot.result, Exception):
            raise slot.result
        return slot.result

    def finished(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def stop(self, why: BaseException, taken: list[_Slot]) -> None:
        """Fail every waiting and later `fit`, and those `taken` but not trained (the exchange itself failed, e.g.
        Ctrl-C): no thread waits forever."""
        with self.cond:
            self.stopped = why
            for slot in [*self.waiting, *(s for s in taken if not s.done.is_set())]:
                slot.result = RuntimeError(f"the exchange stopped: {why!r}")
                slot.done.set()
            self.waiting = []

    def next_jobs(self) -> list[_Slot]:
        """Every running thread's waiting job, once all of them wait; [] when all threads are done."""
        with self.cond:
            self.cond.wait_for(lambda: len(self.waiting) == self.running)
            slots, self.waiting = self.waiting, []
            return slots


class _Gate:
    """A client's trainer during a batched exchange: its own trainer's teacher logits; `fit` goes to the gather."""

    runtime = "torch"

    def __init__(self, gather: _Gather, place: int, own: TorchTrainer) -> None:
        self.gather, self.place, self.own = gather, place, own

    def fit(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, kd: Distillation | None = None
    ) -> TrainStats:
        job = FitJob(model, x, y, cfg, kd)
        # models of one spec (origins aside) stack; any other module trains alone
        architecture = model.spec.with_origin(None).to_json() if isinstance(model, SpecModel) else str(id(model))
        return self.gather.fit(job, (architecture, settings_key(job)), self.place)

    def teacher_logits(self, teacher: Weights, x: torch.Tensor) -> torch.Tensor:
        return self.own.teacher_logits(teacher, x)


class BatchedClients:
    """A Transport: the simulation's clients in this process, batchable tasks trained together on `device` with
    `threads` torch threads, the others by `serial` (the serial run's transport of the same agents)."""

    def __init__(self, agents: list[ClientAgent], serial: InProcTransport, device: torch.device, threads: int) -> None:
        self.agents = {a.client_id: a for a in agents}
        self.serial = serial
        self.device = device
        self.threads = threads
        self.counts = {"tasks_batched": 0, "groups": 0, "largest_group": 0}

    def batchable(self, cid: str, task: Task) -> bool:
        agent = self.agents.get(cid)
        try:
            kind = TASKS.get(task.type)
        except TaskError:  # the serial path answers it with its error
            return False
        return agent is not None and kind.batchable and agent.trainer.runtime == "torch"

    def exchange(self, tasks: Mapping[str, Task], limits: Mapping[str, int] | None = None) -> dict[str, Result]:
        """Each client's reply, as the serial run gives it (batched training within float tolerance)."""
        together = {cid: t for cid, t in tasks.items() if self.batchable(cid, t)}
        results = self.serial.exchange({cid: t for cid, t in tasks.items() if cid not in together})
        if together:
            results |= self._together(together)
        return {cid: results[cid] for cid in tasks if cid in results}

    def _together(self, tasks: Mapping[str, Task]) -> dict[str, Result]:
        gather = _Gather(len(tasks))
        results: dict[str, Result] = {}

        def work(place: int, cid: str, task: Task) -> None:
            agent = self.agents[cid]
            trainer = agent.trainer
            agent.trainer = _Gate(gather, place, trainer)
            torch.set_num_threads(1)  # as the serial run, whether torch counts threads per thread or per process
            try:
                results.update(InProcTransport({cid: agent.handle}).exchange({cid: task}))
            finally:
                agent.trainer = trainer
                gather.finished()

        threads = [threading.Thread(target=work, args=(i, *item), daemon=True) for i, item in enumerate(tasks.items())]
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        slots: list[_Slot] = []
        try:
            for t in threads:
                t.start()
            while slots := gather.next_jobs():
                self._train(slots)
        except BaseException as e:
            gather.stop(e, slots)
            raise
        finally:
            torch.set_num_threads(before)
            for t in threads:
                if t.ident is not None:  # started
                    t.join()
        return results

    def _train(self, slots: list[_Slot]) -> None:
        """Train the waiting jobs, grouped by key in the order of their tasks (the same run, the same bits), then
        wake their threads: while any group trains, no handler computes."""
        groups: dict[tuple, list[_Slot]] = {}
        for slot in sorted(slots, key=lambda s: s.place):
            groups.setdefault(slot.key, []).append(slot)
        size = BATCHED_CPU_CLIENTS if self.device.type == "cpu" else len(slots)
        for group in (g[i : i + size] for g in groups.values() for i in range(0, len(g), size)):
            try:
                if len(group) == 1 and self.device.type == "cpu":  # at one thread: bit for bit the serial run
                    job = group[0].job
                    outcomes: list[TrainStats | Exception] = [fit(job.model, job.x, job.y, job.cfg, job.kd)]
                else:
                    torch.set_num_threads(self.threads)
                    outcomes = list(fit_together([s.job for s in group], self.device))
            except Exception as e:  # each of the group's handlers fails with it, as its own fit would
                why = f"training together with {len(group) - 1} other clients: {e!r}"
                outcomes = [RuntimeError(why) for _ in group]
            finally:
                torch.set_num_threads(1)
            self.counts["tasks_batched"] += len(group)
            self.counts["groups"] += 1
            self.counts["largest_group"] = max(self.counts["largest_group"], len(group))
            for slot, outcome in zip(group, outcomes):
                slot.result = outcome
        for slot in slots:
            slot.done.set()

    def report(self) -> dict[str, Any]:
        transport = {"kind": "inproc", "engine": "batched", "client_device": str(self.device), "threads": self.threads}
        return {"transport": transport | self.counts, "rejected_messages": {}}
