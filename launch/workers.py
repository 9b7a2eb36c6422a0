"""The in-process simulation's clients on a pool of workers (`--workers N`), one torch thread each: processes of this
machine, or actors of a Ray cluster (`--engine ray`).

Each client has a home worker that builds its agent (model, data) once and keeps it between rounds; tasks and
results cross the process boundary as the same container bytes MQTT carries (fedge.wire.codec), so a pooled run trains
the same models bit for bit as the serial one (each client's randomness is its own, and its agent reseeds torch's
global generator before it trains). A worker that has run its own clients' tasks takes a waiting task of another
worker's client instead of idling: that client moves to it, its agent rebuilt from its snapshot files (a client's
state is its model snapshots, written before it replies), so a round is not as slow as its most loaded worker.
A worker process that dies loses the task it was running (that client does not reply, as a vanished device); its
clients move to the others, and a new worker takes its place at the next exchange. (A Ray actor that died is found
only when the task sent to it fails: that task is lost too.)
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Mapping

import torch

from edge_client.agent import ClientAgent
from fedge.config import ConfigError, RunConfig, config_from
from fedge.errors import UserError
from fedge.extras import require
from fedge.wire.codec import decode_info, decode_result, decode_task, encode_info, encode_result, encode_task
from fedge.wire.messages import ClientInfo, Result, Task
from launch.client import client_agents
from launch.runs import load_partitioned

log = logging.getLogger(__name__)
STOP_S = 10.0  # how long a worker gets to exit after it was told to stop, before it is killed


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warm_up() -> None:
    """What every process that trains clients pays once, paid at its start rather than in its first client's task:
    torch's first optimizer imports torch._dynamo (1.6 s on a 2-core EPYC)."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


class ClientHost:
    """The clients one worker runs: agents built from the run's config and kept, rebuilt from their snapshot files
    (state_dir) when told they are `fresh` (another worker ran them since). The run's dataset and split are loaded
    once, at the first client that needs them."""

    def __init__(self, cfg: RunConfig, state_dir: Path) -> None:
        self.cfg, self.state_dir = cfg, state_dir
        self.agents: dict[str, ClientAgent] = {}
        self.partitioned = None

    def build(self, ids: list[str]) -> list[ClientInfo]:
        """Build (again) the agents of `ids`; their registration infos."""
        if not ids:  # a worker started in place of one that died: its clients come as tasks do
            return []
        if self.cfg.data_dir is None and self.partitioned is None:
            self.partitioned = load_partitioned(self.cfg)
        for agent in client_agents(self.cfg, ids, state_dir=self.state_dir, partitioned=self.partitioned):
            self.agents[agent.client_id] = agent
        return [self.agents[cid].info() for cid in ids]

    def forget(self, ids: list[str]) -> None:
        """Drop the agents of clients that moved to another worker."""
        for cid in ids:
            self.agents.pop(cid, None)

    def run(self, cid: str, payload: bytes, fresh: bool) -> bytes:
        """Client `cid`'s reply to the encoded task, encoded; a task the client fails (or a reply that cannot be
        encoded) is a failed Result whose `error` says why, as the MQTT edge client answers."""
        task = decode_task(payload)
        try:
            if fresh or cid not in self.agents:
                self.build([cid])
            return encode_result(self.agents[cid].handle(task))
        except Exception as e:  # a crashing client is a failed reply, not a crashed worker
            log.exception("client %s failed on task %s of round %d", cid, task.type, task.round)
            return encode_result(Result(cid, task.round, task.type, 0, error=f"{type(e).__name__}: {e}"))


def start_host(cfg_json: str, ids: list[str], state_dir: str) -> tuple[ClientHost | None, dict[str, Any], list[bytes]]:
    """A worker's start, in its own process (or Ray actor): one torch thread, as each client process of `fedge run`
    over MQTT trains (the same arithmetic), its home clients `ids` built. The host, a header ({"ready": n}, or
    {"error", "user"} for the parent to raise) and the n encoded infos."""
    torch.set_num_threads(1)
    try:
        host = ClientHost(config_from(json.loads(cfg_json)), Path(state_dir))
        infos = [encode_info(info) for info in host.build(ids)]
        warm_up()
    except Exception as e:  # reported to the parent, which raises it there
        user = isinstance(e, UserError)
        return None, {"error": str(e) if user else traceback.format_exc(), "user": user}, []
    return host, {"ready": len(infos)}, infos


def read_infos(header: dict[str, Any], infos: list[bytes]) -> list[ClientInfo]:
    """The infos a worker started with; ConfigError (a user's mistake, e.g. a model that does not fit its profile)
    or RuntimeError when it could not start."""
    if "error" in header:
        raise (ConfigError if header["user"] else RuntimeError)(header["error"])
    return [decode_info(info) for info in infos]


def serve_worker(conn: Connection, cfg_json: str, ids: list[str], state_dir: str) -> None:
    """A worker process: start_host, then answer tasks until told to stop.

    Messages, each a send_bytes: to the worker a JSON header {"client", "fresh", "forget"} and the encoded task,
    or {"stop": true}; from it the start header and its encoded infos, then one encoded result per task."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops its workers
    host, header, infos = start_host(cfg_json, ids, state_dir)
    for message in [json.dumps(header).encode(), *infos]:
        conn.send_bytes(message)
    while host is not None:
        try:
            header = json.loads(conn.recv_bytes())
            if header.get("stop"):
                return
            host.forget(header["forget"])
            conn.send_bytes(host.run(header["client"], conn.recv_bytes(), header["fresh"]))
        except (EOFError, BrokenPipeError):  # the parent is gone
            return


class WorkerLost(Exception):
    """A worker died: the task it was running has no reply."""


class ProcessWorker:
    """The parent's handle on one worker process: its pipe, the client it is running, the clients it dropped."""

    def __init__(self, cfg: RunConfig, ids: list[str], state_dir: Path, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process whose torch may hold threads
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve_worker, args=(child, cfg.to_json(), ids, str(state_dir)), name=name, daemon=True
        )
        self.process.start()
        child.close()
        self.name = name
        self.running: str | None = None
        self.forget: list[str] = []
        self.waitable: Any = self.conn

    @staticmethod
    def wait(waitables: list[Any]) -> list[Any]:
        """The waitables of the workers that have replied (or died), once one has."""
        return wait(waitables)

    def ready(self) -> list[ClientInfo]:
        """The infos of its home clients, once built (see read_infos)."""
        try:
            header = json.loads(self.conn.recv_bytes())
            return read_infos(header, [self.conn.recv_bytes() for _ in range(header.get("ready", 0))])
        except EOFError:
            raise RuntimeError(f"worker {self.name} exited ({self.process.exitcode}) before it was ready") from None

    def alive(self) -> bool:
        return self.process.is_alive()

    def send(self, cid: str, task: Task, fresh: bool) -> None:
        try:
            self.conn.send_bytes(json.dumps({"client": cid, "fresh": fresh, "forget": self.forget}).encode())
            self.conn.send_bytes(encode_task(task))
        except OSError:
            raise WorkerLost from None
        self.running, self.forget = cid, []

    def receive(self) -> Result:
        try:
            return decode_result(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise WorkerLost from None

    def stop(self) -> None:
        """Tell the worker to stop, without waiting; one running a task is killed at once."""
        if self.running is not None:
            self.process.kill()
        try:
            self.conn.send_bytes(json.dumps({"stop": True}).encode())
        except OSError:
            pass

    def reap(self, timeout: float = STOP_S) -> None:
        """Wait for the stopped worker to exit, killed after `timeout` seconds."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class RayHost:
    """A worker as a Ray actor (`--engine ray`): start_host at creation, then one task per `run` call."""

    def __init__(self, cfg_json: str, ids: list[str], state_dir: str) -> None:
        self.host, self.header, self.infos = start_host(cfg_json, ids, state_dir)

    def started(self) -> tuple[dict[str, Any], list[bytes]]:
        return self.header, self.infos

    def run(self, cid: str, payload: bytes, fresh: bool, forget: list[str]) -> bytes:
        assert self.host is not None  # the pool never sends a task to a worker that did not start
        self.host.forget(forget)
        return self.host.run(cid, payload, fresh)


class RayWorker:
    """The driver's handle on one RayHost actor (one CPU); the same protocol as ProcessWorker."""

    def __init__(self, cfg: RunConfig, ids: list[str], state_dir: Path, name: str) -> None:
        import ray

        self.ray = ray
        self.actor = ray.remote(num_cpus=1)(RayHost).remote(cfg.to_json(), ids, str(state_dir))
        self.name = name
        self.running: str | None = None
        self.forget: list[str] = []
        self.waitable: Any = None
        self.lost = False

    @staticmethod
    def wait(waitables: list[Any]) -> list[Any]:
        import ray

        return ray.wait(waitables, num_returns=1)[0]

    def ready(self) -> list[ClientInfo]:
        try:
            return read_infos(*self.ray.get(self.actor.started.remote()))
        except self.ray.exceptions.RayActorError as e:
            raise RuntimeError(f"Ray worker {self.name} died before it was ready: {e}") from None

    def alive(self) -> bool:
        return not self.lost

    def send(self, cid: str, task: Task, fresh: bool) -> None:
        self.waitable = self.actor.run.remote(cid, encode_task(task), fresh, self.forget)
        self.running, self.forget = cid, []

    def receive(self) -> Result:
        try:
            return decode_result(self.ray.get(self.waitable))
        except self.ray.exceptions.RayActorError:
            self.lost = True
            raise WorkerLost from None

    def stop(self) -> None:
        self.ray.kill(self.actor)

    def reap(self, timeout: float = STOP_S) -> None:
        """Nothing to wait for: Ray has killed the actor."""


class WorkerPool:
    """A Transport that runs the clients `ids` of a run on `workers` workers (see the module's docstring): processes
    of this machine, or with cfg.engine "ray" actors of a Ray cluster (cfg.ray_address; a local instance if unset).
    Use it as a context manager, or call close(). `infos` are the clients' registration infos, by id."""

    def __init__(self, cfg: RunConfig, ids: list[str], state_dir: Path, workers: int) -> None:
        self.cfg, self.state_dir = cfg, Path(state_dir)
        self.kind: Any = ProcessWorker
        self.ray_started = False
        self.workers: list[Any] = []
        try:
            if cfg.engine == "ray":
                self.kind, workers = RayWorker, self._ray_workers(workers)
            count = max(1, min(workers, len(ids)))
            homes = [ids[i::count] for i in range(count)]
            for i, home in enumerate(homes):
                self.workers.append(self._start(home, i))
            infos = [info for w in self.workers for info in w.ready()]
        except BaseException:
            self.close()
            raise
        self.infos = {info.client_id: info for info in sorted(infos, key=lambda i: ids.index(i.client_id))}
        self.home: dict[str, int | None] = {cid: i for i, home in enumerate(homes) for cid in home}
        self.replacements = self.moves = 0
        self.dead: set[int] = set()  # workers found dead during the current exchange

    def _ray_workers(self, workers: int) -> int:
        """Connect to the Ray cluster at cfg.ray_address (or start a local instance, or use the one this process
        has already); how many actors of one CPU to run: `workers`, or 0 for one per CPU of the cluster. More than
        its CPUs would wait for ever to be scheduled: ConfigError."""
        require("ray", what="the ray engine (engine=ray)")
        import ray

        if not ray.is_initialized():
            ray.init(address=self.cfg.ray_address, include_dashboard=False, log_to_driver=False)
            self.ray_started = True
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus < 1 or workers > cpus:
            raise ConfigError(
                f"the Ray cluster has {cpus} CPUs, too few for {workers or 1} workers of one CPU each: set workers to "
                "at most its CPUs (0: one per CPU), or add nodes"
            )
        return workers or cpus

    def _start(self, ids: list[str], index: int) -> Any:
        return self.kind(self.cfg, ids, self.state_dir, f"fedge-worker-{index}")

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker (all told at once; one still running a task is killed), and a Ray instance this pool
        started."""
        try:
            for w in self.workers:
                w.stop()
            deadline = time.monotonic() + STOP_S
            for w in self.workers:
                w.reap(max(0.0, deadline - time.monotonic()))
        finally:
            self.workers = []
            if self.ray_started:
                import ray

                ray.shutdown()
                self.ray_started = False

    def _replace_dead(self) -> None:
        """A new, empty worker for each one that died; the dead one's clients have no home (they are rebuilt)."""
        dead, self.dead = self.dead, set()
        for i, w in enumerate(self.workers):
            if i in dead or not w.alive():
                log.error("worker %s died; starting another", w.name)
                w.stop()
                w.reap()
                self.home.update({cid: None for cid, home in self.home.items() if home == i})
                self.workers[i] = self._start([], i)
                self.workers[i].ready()
                self.replacements += 1

    def exchange(self, tasks: Mapping[str, Task], limits: Mapping[str, int] | None = None) -> dict[str, Result]:
        """Each client's reply, in the order of `tasks`; a client whose worker died while running it is absent.
        `limits` is not needed: replies come from this run's own workers."""
        self._replace_dead()
        queues: list[deque[str]] = [deque() for _ in self.workers]
        for cid in tasks:
            if cid not in self.home:
                log.warning("no client %s registered; task %s dropped", cid, tasks[cid].type)
                continue
            home = self.home[cid]
            queues[min(range(len(queues)), key=lambda i: len(queues[i])) if home is None else home].append(cid)
        results: dict[str, Result] = {}
        busy: dict[Any, int] = {}  # a busy worker's waitable -> its index
        for i in range(len(self.workers)):
            if i not in busy.values():  # a failed send may have started the others already
                self._next(i, queues, tasks, busy)
        while busy:
            for waitable in self.kind.wait(list(busy)):
                i = busy.pop(waitable)
                worker = self.workers[i]
                cid, worker.running = worker.running, None
                try:
                    results[cid] = worker.receive()
                except WorkerLost:
                    log.error("worker %s died running client %s, which does not reply", worker.name, cid)
                    self._lost(i, queues, tasks, busy)
                    continue
                self._next(i, queues, tasks, busy)
        return {cid: results[cid] for cid in tasks if cid in results}

    def _lost(self, i: int, queues: list[deque[str]], tasks: Mapping[str, Task], busy: dict[Any, int]) -> None:
        """Worker i died: its clients lose their home and its waiting tasks go to the live workers, the idle ones
        started on them (the next exchange starts a new worker in its place)."""
        self.home.update({c: None for c, home in self.home.items() if home == i})
        self.dead.add(i)
        alive = [j for j in range(len(queues)) if j not in self.dead]
        for c in queues[i] if alive else ():
            queues[min(alive, key=lambda j: len(queues[j]))].append(c)
        if queues[i] and not alive:
            log.error("every worker died: clients %s do not reply this time", ", ".join(queues[i]))
        queues[i].clear()
        for j in alive:
            if j not in busy.values():
                self._next(j, queues, tasks, busy)

    def _next(self, i: int, queues: list[deque[str]], tasks: Mapping[str, Task], busy: dict[Any, int]) -> None:
        """Send worker i its next task: one of its own clients', else the last waiting one of the worker with the
        most waiting (that client moves to worker i and is rebuilt there). Nothing left: it stays idle."""
        if i in self.dead:
            return
        if queues[i]:
            cid = queues[i].popleft()
        else:
            j = max(range(len(queues)), key=lambda j: len(queues[j]))
            if not queues[j]:
                return
            cid = queues[j].pop()
        previous = self.home[cid]
        try:
            self.workers[i].send(cid, tasks[cid], fresh=previous != i)
        except WorkerLost:  # it died after its last reply: the task waits for another worker
            log.error("worker %s died", self.workers[i].name)
            queues[i].appendleft(cid)
            self._lost(i, queues, tasks, busy)
            return
        if previous is not None and previous != i:
            self.workers[previous].forget.append(cid)
            self.moves += 1
        self.home[cid] = i
        busy[self.workers[i].waitable] = i

    def report(self) -> dict[str, Any]:
        return {
            "transport": {
                "kind": "inproc",
                "engine": self.cfg.engine,
                "workers": len(self.workers),
                "clients_moved": self.moves,  # tasks an idle worker took from another's waiting clients
                "workers_replaced": self.replacements,
            },
            "rejected_messages": {},
        }
