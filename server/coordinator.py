"""The round loop, in exactly one place: sample → plan → dispatch → collect → aggregate → evaluate → record
→ checkpoint; a round below its quorum is tried again, a run resumes from its checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from tqdm import tqdm

from device_profiles import DeviceProfile, get_profile
from fedge import constants as C
from fedge.brokers.transport import Transport
from fedge.checkpoint import CheckpointError, Tree, nonfinite
from fedge.model.spec import parameter_names
from fedge.seeding import derive_seed
from fedge.wire.messages import ClientInfo, Result, Task, client_order
from fedge.wire.payloads import Expected, payload_rejection
from server.bounds import (
    TENSORS,
    UpdateBounds,
    buffer_norm,
    fresh_norms,
    norm_outliers,
    reference_norm,
    reply_buffer_rejection,
    update_pairs,
    upload_norm,
    with_tensors,
)
from server.client_status import ClientLedger
from server.clock import ClientClock, RunClock, client_clock, task_epochs
from server.runlog import RunLog
from server.strategy import Strategy, StrategyError

log = logging.getLogger(__name__)


class RoundFailed(StrategyError):
    """A round got fewer than min_replies training replies on every try; the run stopped. `summary` is the
    run's summary up to there; the run folder keeps the checkpoint of the last completed round."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


class RunPaused(Exception):
    """The run stopped after a completed round because its time (LoopConfig.stop_at) was up; the run folder's
    checkpoint continues it (resume). Not a failure: summary.json is not written until the last round."""

    def __init__(self, next_round: int, out: object) -> None:
        super().__init__(f"paused before round {next_round}: its time was up; resume from the checkpoint in {out}")
        self.next_round = next_round


@dataclass(frozen=True)
class LoopConfig:
    """Rounds, clients per round, the seed, the quorum (min_replies training replies, else the round is
    tried again up to round_retries more times), whether to draw a progress bar, and the zoo width preset the
    fleet's models were built at (part of what a checkpoint must share with a run that resumes it), and the
    transport's round deadline if it has one (the simulated clock charges it for a client that never replied), and
    the multiple of the round's median update a client's update is clipped to (server/bounds.py; 0: no clipping),
    and when to pause: `stop_at`, a time.time() by which the run stops after whole rounds (RunPaused; None: never).
    A round is started only if the last one's duration still fits before stop_at, and every call runs at least one
    round, so a run continued chunk by chunk always advances."""

    rounds: int
    active: int
    seed: int
    local_epochs: int
    progress: bool = True
    min_replies: int = C.MIN_REPLIES
    round_retries: int = C.ROUND_RETRIES
    widths: str = C.DEFAULT_WIDTHS
    deadline_s: float | None = None
    clip_factor: float = C.CLIP_FACTOR
    stop_at: float | None = None


def sample_clients(client_ids: Sequence[str], active: int, seed: int, rnd: int) -> list[str]:
    """M of the N clients for a round, without replacement, deterministic in (seed, round)."""
    ids = sorted(client_ids, key=client_order)
    rng = np.random.default_rng(derive_seed(seed, "sample", rnd))
    picked = rng.choice(len(ids), size=min(active, len(ids)), replace=False)
    return [ids[i] for i in sorted(picked)]


def rejection(
    res: Result,
    task: Task | None,
    info: ClientInfo,
    expected: Expected,
    profile: DeviceProfile,
    evaluation: bool = False,
) -> tuple[str, str] | None:
    """(reason code, message) when a reply cannot be used, else None: it must answer the open task, report a
    sane example count and finite metrics, and carry what the strategy declared it expects for that task (models of
    the declared architectures with weights matching their spec, named tensors, records: payload_rejection). The
    reply to an evaluation (an `evaluate` task, or any task of the strategy's `evaluation`: FedMN's
    modular_evaluate, FedAvg+'s tune_evaluate) counts test examples and must report an accuracy in [0, 1]."""
    if task is None or res.client_id != info.client_id or res.round != task.round or res.type != task.type:
        return "no_open_task", f"answers no open task (round {res.round}, type {res.type!r})"
    if res.error is not None:
        return "client_failed", f"the client could not execute {task.type} of round {task.round}: {res.error}"
    evaluation = evaluation or task.type == "evaluate"
    limit = info.num_test if evaluation else info.num_train
    if (
        isinstance(res.num_examples, bool)
        or not isinstance(res.num_examples, int)
        or not 1 <= res.num_examples <= limit
    ):
        return "num_examples", f"num_examples {res.num_examples!r} is not an integer in 1..{limit}"
    bad = [k for k, v in res.metrics.items() if not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        return "metrics", f"metrics {bad} are not finite numbers"
    if evaluation and not 0 <= res.metrics.get("accuracy", -1) <= 1:
        return "metrics", "an evaluation without an accuracy in [0, 1]"
    return payload_rejection(res, expected, info, profile)


def run_identity(
    strategy: str,
    clients: Iterable[str],
    seed: int,
    active: int,
    widths: str = C.DEFAULT_WIDTHS,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint must share with a run to be resumed by it: `options` are the strategy's options
    completed with their defaults (dataclasses.asdict of its StrategyOptions; None: the strategy has none)."""
    return {
        "strategy": strategy,
        "clients": sorted(clients, key=client_order),
        "seed": seed,
        "active": active,
        "widths": widths,
        "options": json.loads(json.dumps(dict(options or {}))),  # as a checkpoint holds them: tuples as lists
    }


# Identity fields added after checkpoints were first written, with the value every older checkpoint had.
IDENTITY_BEFORE_RECORDED = {"widths": C.DEFAULT_WIDTHS}
# Identity fields added later whose value older checkpoints do not tell: not checked when absent (logged).
IDENTITY_UNKNOWN_BEFORE = {"options"}


def check_resumable(tree: Tree, identity: Mapping[str, Any], out: Path) -> Tree:
    """`tree` (the checkpoint of the run folder `out`) if it was written by a run of this `identity`; else
    CheckpointError naming the first field that differs (for options, the first option)."""
    for key, mine in identity.items():
        if key not in tree and key in IDENTITY_UNKNOWN_BEFORE:
            log.warning("the checkpoint in %s predates recording %s; resuming without checking them", out, key)
            continue
        theirs = tree.get(key, IDENTITY_BEFORE_RECORDED.get(key))
        if key == "options" and isinstance(theirs, dict):
            # an option the checkpoint lacks was added to the strategy after it was written: not checked; one it
            # has that this run lacks was removed and changes nothing. Compared as JSON (NaN equals NaN).
            differ = [k for k in sorted(set(theirs) & set(mine)) if json.dumps(theirs[k]) != json.dumps(mine[k])]
            if not differ:
                continue
            key, theirs, mine = f"option {differ[0]}", theirs[differ[0]], mine[differ[0]]
        if theirs != mine:
            raise CheckpointError(
                f"the checkpoint in {out} was written with {key}={theirs!r}, this run has "
                f"{mine!r}; resume with the run's own configuration"
            )
    return tree


class Coordinator:
    """Drives a strategy over a transport for a number of rounds, records the run, checkpoints every round."""

    def __init__(
        self,
        strategy: Strategy,
        transport: Transport,
        clients: Mapping[str, ClientInfo],
        loop: LoopConfig,
        runlog: RunLog,
    ) -> None:
        if not clients:
            raise StrategyError("no clients registered: a federation needs at least one client")
        if loop.min_replies > min(loop.active, len(clients)):
            raise StrategyError(
                f"min_replies={loop.min_replies} can never be met with {min(loop.active, len(clients))}"
                f" clients per round; lower min_replies or raise active"
            )
        self.strategy, self.transport, self.loop, self.runlog = strategy, transport, loop, runlog
        self.clients = dict(clients)
        self.profiles = {cid: get_profile(info.profile) for cid, info in clients.items()}
        self.server_seconds: list[float] = []
        self.wall_before = 0.0  # wall seconds of the earlier calls (chunks, or runs before a crash) of a resumed run
        self.participated: set[str] = set()
        self.final: dict[str, float] = {}
        self.last_mean = float("nan")
        self.rejected: Counter[str] = Counter()
        self.upload_norms: dict[str, float] = {}  # "<client>/<role>" -> parameter norm of its last accepted upload
        self.buffer_norms: dict[str, float] = {}  # "<client>/<role>" -> buffer norm of its last accepted upload
        self.bounds = UpdateBounds(loop.clip_factor)  # updates relative to the round: clipping and its history
        self.discarded: list[int] = []  # rounds whose aggregate was not finite and was thrown away
        self.failed: list[dict[str, int]] = []
        self.clock = RunClock()  # simulated seconds, training MACs and bytes (server/clock.py)
        self.ledger = ClientLedger(self.clients)  # what became of each client (server/client_status.py)
        self.bar: tqdm | None = None

    def accepted(
        self, results: Mapping[str, Result], tasks: Mapping[str, Task], evaluation: bool = False
    ) -> dict[str, Result]:
        """The replies that pass `rejection` (`evaluation`: the tasks are the strategy's evaluation), the strategy's
        own `reply_rejection`, `beyond_bound`, `norm_outliers`, sane BatchNorm statistics and the round's update
        bounds (server/bounds.py), with their updates clipped; each other one is logged in one line and counted."""
        keep, reasons = {}, {}
        for cid, res in results.items():
            task = tasks.get(cid)
            if cid not in self.clients:
                reason: tuple[str, str] | None = ("unknown_client", "not a registered client")
            else:
                expected = self.strategy.expects(task, self.clients[cid]) if task is not None else Expected()
                reason = rejection(res, task, self.clients[cid], expected, self.profiles[cid], evaluation)
                if reason is None and task is not None:
                    reason = self.strategy.reply_rejection(task, self.clients[cid], res)
            if reason is None:
                keep[cid] = res
            else:
                reasons[cid] = reason
        norms = {
            (cid, role): (upload_norm(w), buffer_norm(w)) for cid, res in keep.items() for role, w in res.models.items()
        }
        reasons |= {cid: ("norm_bound", message) for cid, message in self.beyond_bound(keep, tasks, norms).items()}
        for code, found in (
            ("norm_outlier", norm_outliers(keep)),
            ("buffers", {cid: why for cid, res in keep.items() if (why := reply_buffer_rejection(res))}),
        ):
            reasons |= {cid: (code, message) for cid, message in found.items() if cid not in reasons}
        reasons |= self.strategy.round_rejections(tasks, {cid: res for cid, res in keep.items() if cid not in reasons})
        refused, clipped = self.bound_updates({cid: res for cid, res in keep.items() if cid not in reasons}, tasks)
        reasons |= {cid: ("update_outlier", message) for cid, message in refused.items()}
        for cid, (code, message) in reasons.items():
            log.warning("rejected reply from client %s: %s", cid, message)
            self.rejected[code] += 1
            self.ledger.refused(cid, code, message)
            keep.pop(cid, None)
        for cid, res in keep.items():
            self.upload_norms.update({f"{cid}/{role}": norms[cid, role][0] for role in res.models})
            self.buffer_norms.update({f"{cid}/{role}": norms[cid, role][1] for role in res.models})
        if clipped:
            log.info(
                "updates clipped to %g x the round's (or recent) median: %s", self.bounds.clip_factor, sorted(clipped)
            )
        return {cid: with_tensors(res, clipped[cid]) if cid in clipped else res for cid, res in keep.items()}

    def bound_updates(
        self, results: Mapping[str, Result], tasks: Mapping[str, Task]
    ) -> tuple[dict[str, str], dict[str, dict[str, torch.Tensor]]]:
        """UpdateBounds.apply over the replies' updates of what their tasks sent (the strategy's `update_of` and
        `tensor_updates`): (client → why its update is an outlier, client → its clipped tensors)."""
        pairs, params = {}, {}
        for cid, res in results.items():
            found = update_pairs(tasks[cid], res, self.strategy.update_of, self.strategy.tensor_updates)
            if found:
                pairs[cid] = found
                params[cid] = {role: parameter_names(w.spec) for role, w in res.models.items()} | {
                    TENSORS: parameter_names(self.clients[cid].spec) - self.strategy.outlier_exempt()
                }
        return self.bounds.apply(pairs, params)

    def beyond_bound(
        self,
        results: Mapping[str, Result],
        tasks: Mapping[str, Task],
        norms: Mapping[tuple[str, str], tuple[float, float]],
    ) -> dict[str, str]:
        """Client → message for each reply with an upload whose parameter norm (`norms`, by client and role:
        parameters, buffers) exceeds UPLOAD_NORM_FACTOR times its reference (see reference_norm), or whose buffer norm
        exceeds UPLOAD_NORM_FACTOR² times the reference's (weights 10 x larger scale a layer's output, and so its
        BatchNorm's running variance, 100 x), or FIRST_BUFFER_FACTOR times a fresh model's where the reference's
        statistics are no larger than a fresh model's placeholders (a first upload, or one trained from a global model
        no client has measured yet): bounds that hold for a round of one or two uploads, where the medians of
        norm_outliers and the update bounds do not exist."""
        out: dict[str, str] = {}
        for cid, res in results.items():
            for role, weights in res.models.items():
                key = f"{cid}/{role}"
                for buffers, factor, what in (
                    (False, C.UPLOAD_NORM_FACTOR, "norm"),
                    (True, C.UPLOAD_NORM_FACTOR**2, "buffer norm"),
                ):
                    previous = (self.buffer_norms if buffers else self.upload_norms).get(key)
                    ref, of = reference_norm(weights, tasks[cid], previous, buffers)
                    if buffers:  # a reference whose running variances shrank below a fresh model's is no floor
                        fresh = fresh_norms(weights.spec.with_origin(None).to_json())[1]
                        if ref <= fresh:  # placeholders (mean 0, variance 1), not measurements: the first ones
                            ref, of, factor = (
                                fresh,
                                "a fresh initialisation's placeholder statistics",
                                C.FIRST_BUFFER_FACTOR,
                            )
                    norm = norms[cid, role][buffers]
                    if norm > factor * ref:
                        out.setdefault(
                            cid, f"model {role!r} has {what} {norm:.4g}, over {factor:g} x the {ref:.4g} of {of}"
                        )
        return out

    def exchange(self, tasks: Mapping[str, Task]) -> dict[str, Result]:
        """The transport's replies, each at most as large as what the strategy expects for its task; a transport
        that raises is logged and counts as no replies."""
        limits = {
            cid: self.strategy.expects(task, self.clients[cid]).reply_bytes(self.profiles[cid])
            for cid, task in tasks.items()
            if cid in self.clients
        }
        try:
            return self.transport.exchange(tasks, limits)
        except Exception:  # a broker or network failure must not end the run: the round fails and is retried
            log.exception("the transport failed to deliver %d tasks; treating them as unanswered", len(tasks))
            return {}

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Run every round and return the summary; with `resume`, continue after the run folder's checkpoint.

        Raises RoundFailed when a round misses its quorum on every try, and CheckpointError when resuming from
        a missing or corrupt checkpoint or one written for another strategy, fleet, seed or sampling.
        """
        self.started = time.perf_counter()
        self.strategy.setup(self.clients)
        first = self.restore() if resume else 0
        with tqdm(
            range(first, self.loop.rounds),
            desc=self.strategy.name,
            unit="round",
            initial=first,
            total=self.loop.rounds,
            disable=not self.loop.progress,
            dynamic_ncols=True,
        ) as self.bar:
            for rnd in self.bar:
                began = time.time()
                self.run_round(rnd)
                self.runlog.write_checkpoint(self.checkpoint(rnd + 1))
                stop_at, last = self.loop.stop_at, time.time() - began
                if stop_at is not None and rnd + 1 < self.loop.rounds and time.time() + last > stop_at:
                    self.show("paused")
                    raise RunPaused(rnd + 1, self.runlog.out)
            self.show("done")
        return self.summary()

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this run to be resumed by it."""
        options = dataclasses.asdict(self.strategy.options)
        return run_identity(
            self.strategy.name, self.clients, self.loop.seed, self.loop.active, self.loop.widths, options
        )

    def checkpoint(self, next_round: int) -> Tree:
        """The checkpoint after a completed round: the next round, this loop's counters, the strategy's state."""
        return self.identity() | {
            "next_round": next_round,
            "participated": sorted(self.participated, key=client_order),
            "server_seconds": list(self.server_seconds),
            "wall_seconds": self.wall_seconds(),
            "final": dict(self.final),
            "last_mean": self.last_mean,
            "rejected": dict(self.rejected),
            "failed_rounds": list(self.failed),
            "client_counts": self.ledger.state(),
            "upload_norms": dict(self.upload_norms),
            "buffer_norms": dict(self.buffer_norms),
            "update_bounds": self.bounds.state(),
            "discarded_aggregates": list(self.discarded),
            "sim_clock": self.clock.state(),
            "strategy_state": self.strategy.state(),
        }

    def restore(self) -> int:
        """Load the run folder's checkpoint into this loop and the strategy; returns the round to run next."""
        tree = check_resumable(self.runlog.read_checkpoint(), self.identity(), self.runlog.out)
        try:
            next_round = int(tree["next_round"])
            self.participated, self.server_seconds = set(tree["participated"]), list(tree["server_seconds"])
            self.final, self.last_mean = dict(tree["final"]), float(tree["last_mean"])
            self.rejected, self.failed = Counter(tree["rejected"]), list(tree["failed_rounds"])
            self.upload_norms, self.discarded = dict(tree["upload_norms"]), list(tree["discarded_aggregates"])
            self.wall_before = float(tree.get("wall_seconds", 0.0))  # absent before chunks were summed: 0
            self.clock.load_state(tree.get("sim_clock"))  # absent in checkpoints from before the clock: zeros
            self.bounds.load_state(tree.get("update_bounds"))  # absent before update bounds: an empty history
            self.buffer_norms = dict(tree.get("buffer_norms", {}))  # absent before buffer bounds: fresh references
            self.ledger.load_state(tree.get("client_counts"))  # absent before client status: zero counts
            self.strategy.load_state(tree["strategy_state"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"the checkpoint in {self.runlog.out} lacks or garbles a field: {e}") from None
        self.runlog.keep_rounds_before(next_round)
        log.info("resuming %s at round %d from %s", self.strategy.name, next_round, self.runlog.out)
        return next_round

    def wall_seconds(self) -> float:
        """Wall seconds of the whole run so far: this call's and, for a resumed run, every earlier call's up to its
        last checkpoint (time lost to a crash after its last checkpoint is not counted)."""
        return self.wall_before + time.perf_counter() - self.started

    def show(self, phase: str) -> None:
        """Progress bar postfix: what is happening now, and the last round's mean accuracy."""
        mean = self.last_mean
        if self.bar is not None:
            self.bar.set_postfix_str(f"{phase}, acc {mean:.3f}" if mean == mean else phase)

    def run_round(self, rnd: int) -> float:
        """One round, tried again (from a fresh plan, nothing aggregated) while fewer than min_replies training
        replies are accepted; returns the mean accuracy of the clients evaluated (NaN if none replied).
        Raises RoundFailed after 1 + round_retries failed tries."""
        active = sample_clients(list(self.clients), self.loop.active, self.loop.seed, rnd)
        tries = 1 + self.loop.round_retries
        for attempt in range(1, tries + 1):
            start = time.perf_counter()
            tasks = self.strategy.plan(rnd, active)
            server = time.perf_counter() - start
            self.show(f"{len(tasks)} clients training")
            replies = self.exchange(tasks)
            self.ledger.sent(tasks)
            self.ledger.unanswered(set(tasks) - set(replies))
            bounds = self.bounds.state()  # a try that fails aggregates nothing, so its updates join no history
            results = self.accepted(replies, tasks)
            if len(results) >= self.loop.min_replies:
                return self.close_round(rnd, active, tasks, results, server, missing=bool(set(tasks) - set(replies)))
            self.bounds.load_state(bounds)
            log.warning(
                "round %d failed (try %d of %d): %d of %d clients replied, min_replies is %d; nothing aggregated",
                rnd,
                attempt,
                tries,
                len(results),
                len(tasks),
                self.loop.min_replies,
            )
            self.failed.append({"round": rnd, "try": attempt, "replies": len(results)})
        raise RoundFailed(
            f"round {rnd} failed {tries} times: fewer than min_replies={self.loop.min_replies} "
            f"clients replied. Check that the clients are running, or lower min_replies; the run "
            f"folder {self.runlog.out} keeps the checkpoint of the last completed round, if any, "
            f"to resume from",
            self.summary() | {"stopped_at_round": rnd},
        )

    def close_round(
        self,
        rnd: int,
        active: Sequence[str],
        tasks: Mapping[str, Task],
        results: Mapping[str, Result],
        server: float,
        missing: bool = False,
    ) -> float:
        """Aggregate a round that met its quorum, evaluate, and record; returns the mean accuracy evaluated.
        `missing`: a selected client never replied (the simulated clock then charges the deadline, if any)."""
        self.participated |= set(results)
        self.ledger.accepted(results)
        clocks = self.client_clocks(tasks, results)
        if len(results) < len(tasks):
            log.warning("round %d: %d of %d clients replied", rnd, len(results), len(tasks))
        self.show("server aggregating")
        start = time.perf_counter()
        self.aggregate(rnd, results)
        last = rnd == self.loop.rounds - 1
        final = self.participated if self.strategy.personalized else self.clients
        eval_tasks = self.strategy.evaluation(rnd, sorted(final) if last else active)
        server += time.perf_counter() - start
        self.show(f"{len(eval_tasks)} clients evaluating")
        replies = self.exchange(eval_tasks)
        self.ledger.unanswered(set(eval_tasks) - set(replies))
        evals = self.accepted(replies, eval_tasks, evaluation=True)
        self.server_seconds.append(server)
        round_fields = self.clock.close_round(clocks, missing, self.loop.deadline_s)
        self.runlog.append_rows(
            [
                self.row(rnd, cid, results.get(cid), evals.get(cid), clocks.get(cid)) | round_fields
                for cid in sorted(set(tasks) | set(eval_tasks), key=client_order)
            ]
        )
        if last:
            self.final = {cid: r.metrics["accuracy"] for cid, r in evals.items()}
        accs = [r.metrics["accuracy"] for r in evals.values()]
        self.last_mean = statistics.fmean(accs) if accs else float("nan")
        return self.last_mean

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        """The strategy's aggregate; a state that comes out non-finite (which every check of the replies should
        prevent) is thrown away, the state before it kept and the round recorded in `discarded_aggregates`."""
        before = self.strategy.state()
        self.strategy.aggregate(rnd, results)
        bad = nonfinite(self.strategy.state())
        if bad:
            log.error(
                "round %d: the aggregate holds non-finite values (%s); it is discarded and the server keeps "
                "its state from before the round",
                rnd,
                ", ".join(bad[:3]),
            )
            self.strategy.load_state(before)
            self.discarded.append(rnd)

    def client_clocks(self, tasks: Mapping[str, Task], results: Mapping[str, Result]) -> dict[str, ClientClock]:
        """The simulated training exchange of each client whose training reply was accepted (server/clock.py)."""
        return {
            cid: client_clock(
                tasks[cid],
                res,
                self.strategy.trained_spec(tasks[cid], self.clients[cid]),
                task_epochs(tasks[cid], self.loop.local_epochs),
                self.profiles[cid],
                self.strategy.other_macs(tasks[cid], self.clients[cid]),
            )
            for cid, res in results.items()
        }

    def row(
        self, rnd: int, cid: str, trained: Result | None, evaluated: Result | None, clock: ClientClock | None = None
    ) -> dict[str, Any]:
        """One metrics.jsonl line: the client, its training reply and simulated exchange, its evaluation, the
        strategy's fields."""
        info = self.clients[cid]
        row: dict[str, Any] = {
            "round": rnd,
            "client": cid,
            "model": info.spec.name,
            "profile": info.profile,
            "runtime": self.profiles[cid].runtime,
            "params": info.spec.params,
            "macs": info.spec.macs,
            "trained": trained is not None,
        }
        if trained is not None:
            row = trained.metrics | row  # a client's metric never overwrites a server field
            row.update(num_examples=trained.num_examples)
        if clock is not None:
            row.update(clock.fields())
        if evaluated is not None:
            row.update(accuracy=evaluated.metrics["accuracy"], loss=evaluated.metrics["loss"])
            # the evaluation ran after the training, so its process peak RSS is the round's
            row.update({k: evaluated.metrics[k] for k in C.MEMORY_METRICS if k in evaluated.metrics})
        return row | self.strategy.record(rnd, cid)

    def summary(self) -> dict[str, Any]:
        """summary.json: the contract fields, then whatever the strategy adds (e.g. ϕ)."""
        per_client = {cid: self.final[cid] for cid in sorted(self.final, key=client_order)}
        return (
            {
                "strategy": self.strategy.name,
                "rounds": self.loop.rounds,
                "clients": len(self.clients),
                "active": self.loop.active,
                "final_accuracy": {
                    "mean": statistics.fmean(per_client.values()) if per_client else None,
                    "per_client": per_client,
                },
                "server_seconds": self.server_seconds,
                "wall_seconds": self.wall_seconds(),
                "never_trained": sorted(set(self.clients) - self.participated, key=client_order),
                "client_status": self.ledger.summary(per_client),
                "rejected_replies": dict(self.rejected),
                "clipped_updates": {
                    cid: self.bounds.clipped[cid] for cid in sorted(self.bounds.clipped, key=client_order)
                },
                "discarded_aggregates": list(self.discarded),
                "failed_rounds": list(self.failed),
                "models": {cid: info.spec.name for cid, info in self.clients.items()},
                "runtimes": {cid: self.profiles[cid].runtime for cid in self.clients},
            }
            | self.clock.summary()
            | self.strategy.summary()
        )
