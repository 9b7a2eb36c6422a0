"""The round loop, in exactly one place: sample → plan → dispatch → collect → aggregate → evaluate → record."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from device_profiles import get_profile, train_seconds
from fedge.messages import ClientInfo, Result, Task, client_order
from fedge.seeding import derive_seed
from fedge.transport import Transport
from fedge.weights import WeightsError, check_state
from server.runlog import RunLog
from server.strategy import Strategy, StrategyError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopConfig:
    """How many rounds, how many clients per round, the seed, and whether to draw a progress bar."""

    rounds: int
    active: int
    seed: int
    local_epochs: int
    progress: bool = True


def sample_clients(client_ids: Sequence[str], active: int, seed: int, rnd: int) -> list[str]:
    """M of the N clients for a round, without replacement, deterministic in (seed, round)."""
    ids = sorted(client_ids, key=client_order)
    rng = np.random.default_rng(derive_seed(seed, "sample", rnd))
    picked = rng.choice(len(ids), size=min(active, len(ids)), replace=False)
    return [ids[i] for i in sorted(picked)]


def rejection(res: Result, task: Task | None, info: ClientInfo) -> tuple[str, str] | None:
    """(reason code, message) when a reply cannot be used, else None: it must answer the open task,
    report a sane example count and finite metrics, and carry weights matching their spec (the
    client's registered architecture for `local`)."""
    if task is None or res.client_id != info.client_id or res.round != task.round or res.type != task.type:
        return "no_open_task", f"answers no open task (round {res.round}, type {res.type!r})"
    limit = info.num_test if task.type == "evaluate" else info.num_train
    if isinstance(res.num_examples, bool) or not isinstance(res.num_examples, int) \
            or not 1 <= res.num_examples <= limit:
        return "num_examples", f"num_examples {res.num_examples!r} is not an integer in 1..{limit}"
    bad = [k for k, v in res.metrics.items() if not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        return "metrics", f"metrics {bad} are not finite numbers"
    if task.type == "evaluate" and not 0 <= res.metrics.get("accuracy", -1) <= 1:
        return "metrics", "an evaluation without an accuracy in [0, 1]"
    if "local" in res.models and res.models["local"].spec.with_origin(info.client_id) != info.spec:
        return "architecture", f"uploaded model {res.models['local'].spec.name!r} is not the registered one"
    for role, weights in res.models.items():
        try:
            check_state(weights.spec, weights.state)
        except WeightsError as e:
            return "weights", f"model {role!r}: {e}"
    return None


class Coordinator:
    """Drives a strategy over a transport for a number of rounds and records the run."""

    def __init__(self, strategy: Strategy, transport: Transport, clients: Mapping[str, ClientInfo],
                 loop: LoopConfig, runlog: RunLog) -> None:
        if not clients:
            raise StrategyError("no clients registered: a federation needs at least one client")
        self.strategy, self.transport, self.loop, self.runlog = strategy, transport, loop, runlog
        self.clients = dict(clients)
        self.profiles = {cid: get_profile(info.profile) for cid, info in clients.items()}
        self.server_seconds: list[float] = []
        self.participated: set[str] = set()
        self.final: dict[str, float] = {}
        self.last_mean = float("nan")
        self.rejected: Counter[str] = Counter()
        self.bar: tqdm | None = None

    def accepted(self, results: Mapping[str, Result], tasks: Mapping[str, Task]) -> dict[str, Result]:
        """The replies that pass `rejection`; each other one is logged in one line and counted."""
        keep = {}
        for cid, res in results.items():
            reason = rejection(res, tasks.get(cid), self.clients[cid]) if cid in self.clients \
                else ("unknown_client", "not a registered client")
            if reason is None:
                keep[cid] = res
            else:
                log.warning("rejected reply from client %s: %s", cid, reason[1])
                self.rejected[reason[0]] += 1
        return keep

    def run(self) -> dict[str, Any]:
        """Run every round and return the summary (also written to summary.json)."""
        self.strategy.setup(self.clients)
        with tqdm(range(self.loop.rounds), desc=self.strategy.name, unit="round",
                  disable=not self.loop.progress, dynamic_ncols=True) as self.bar:
            for rnd in self.bar:
                self.run_round(rnd)
            self.show("done")
        return self.summary()

    def show(self, phase: str) -> None:
        """Progress bar postfix: what is happening now, and the last round's mean accuracy."""
        mean = self.last_mean
        if self.bar is not None:
            self.bar.set_postfix_str(f"{phase}, acc {mean:.3f}" if mean == mean else phase)

    def run_round(self, rnd: int) -> float:
        """One round; returns the mean accuracy of the clients evaluated (NaN if none replied)."""
        active = sample_clients(list(self.clients), self.loop.active, self.loop.seed, rnd)
        start = time.perf_counter()
        tasks = self.strategy.plan(rnd, active)
        server = time.perf_counter() - start
        self.show(f"{len(tasks)} clients training")
        results = self.accepted(self.transport.exchange(tasks), tasks)
        self.participated |= set(results)
        if len(results) < len(tasks):
            log.warning("round %d: %d of %d clients replied", rnd, len(results), len(tasks))
        self.show("server aggregating")
        start = time.perf_counter()
        self.strategy.aggregate(rnd, results)
        last = rnd == self.loop.rounds - 1
        final = self.participated if self.strategy.personalized else self.clients
        eval_tasks = self.strategy.evaluation(rnd, sorted(final) if last else active)
        server += time.perf_counter() - start
        self.show(f"{len(eval_tasks)} clients evaluating")
        evals = self.accepted(self.transport.exchange(eval_tasks), eval_tasks)
        self.server_seconds.append(server)
        self.runlog.append_rows([self.row(rnd, cid, results.get(cid), evals.get(cid))
                                 for cid in sorted(set(tasks) | set(eval_tasks), key=client_order)])
        if last:
            self.final = {cid: r.metrics["accuracy"] for cid, r in evals.items()}
        accs = [r.metrics["accuracy"] for r in evals.values()]
        self.last_mean = statistics.fmean(accs) if accs else float("nan")
        return self.last_mean

    def row(self, rnd: int, cid: str, trained: Result | None, evaluated: Result | None) -> dict[str, Any]:
        """One metrics.jsonl line: the client, its training reply, its evaluation, the strategy's fields."""
        info = self.clients[cid]
        row: dict[str, Any] = {"round": rnd, "client": cid, "model": info.spec.name, "profile": info.profile,
                               "params": info.spec.params, "macs": info.spec.macs, "trained": trained is not None}
        if trained is not None:
            row = trained.metrics | row  # a client's metric never overwrites a server field
            row.update(num_examples=trained.num_examples,
                       sim_train_seconds=train_seconds(info.spec.macs, trained.num_examples, self.loop.local_epochs,
                                                       self.profiles[cid]))
        if evaluated is not None:
            row.update(accuracy=evaluated.metrics["accuracy"], loss=evaluated.metrics["loss"])
        return row | self.strategy.record(rnd, cid)

    def summary(self) -> dict[str, Any]:
        """summary.json: the contract fields, then whatever the strategy adds (e.g. ϕ)."""
        per_client = {cid: self.final[cid] for cid in sorted(self.final, key=client_order)}
        return {
            "strategy": self.strategy.name,
            "rounds": self.loop.rounds,
            "clients": len(self.clients),
            "active": self.loop.active,
            "final_accuracy": {"mean": statistics.fmean(per_client.values()) if per_client else None,
                               "per_client": per_client},
            "server_seconds": self.server_seconds,
            "never_trained": sorted(set(self.clients) - self.participated, key=client_order),
            "rejected_replies": dict(self.rejected),
            "models": {cid: info.spec.name for cid, info in self.clients.items()},
        } | self.strategy.summary()
