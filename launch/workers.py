"""The in-process simulation's clients on a pool of worker processes (`--workers N`), one torch thread each.

Each client has a home worker that builds its agent (model, data) once and keeps it between rounds; tasks and
results cross the process boundary as the same container bytes MQTT carries (fedge.codec), so a pooled run trains
the same models bit for bit as the serial one (each client's randomness is its own, and its agent reseeds torch's
global generator before it trains). A worker that has run its own clients' tasks takes a waiting task of another
worker's client instead of idling: that client moves to it, its agent rebuilt from its snapshot files (a client's
state is its model snapshots, written before it replies), so a round is not as slow as its most loaded worker.
A worker process that dies loses the task it was running (that client does not reply, as a vanished device); its
clients move to the others, and a new worker takes its place at the next exchange.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Mapping

import torch

from edge_client.agent import ClientAgent
from fedge.codec import decode_info, decode_result, decode_task, encode_info, encode_result, encode_task
from fedge.config import ConfigError, RunConfig, config_from
from fedge.errors import UserError
from fedge.messages import ClientInfo, Result, Task
from launch.client import client_agents
from launch.runs import load_partitioned

log = logging.getLogger(__name__)
STOP_S = 10.0  # how long a worker gets to exit after it was told to stop, before it is killed


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warm_up() -> None:
    """What every process that trains clients pays once, paid at its start rather than in its first client's task:
    torch's first optimizer imports torch._dynamo (1.6 s on this project's CI machine)."""
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
        if ids and self.cfg.data_dir is None and self.partitioned is None:
            self.partitioned = load_partitioned(self.cfg)
        for agent in client_agents(self.cfg, ids, state_dir=self.state_dir, partitioned=self.partitioned):
            self.agents[agent.client_id] = agent
        return [self.agents[cid].info() for cid in ids]

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


def serve_worker(conn: Connection, cfg_json: str, ids: list[str], state_dir: str) -> None:
    """A worker process: build the home clients `ids`, send their infos, then answer tasks until told to stop.

    Messages, each a send_bytes: to the worker a JSON header {"client", "fresh", "forget"} and the encoded task,
    or {"stop": true}; from it {"ready": n} and n encoded infos (or {"error", "user"}), then one encoded result
    per task."""
    torch.set_num_threads(1)  # as each client process of `fedge run` over MQTT trains: the same arithmetic
    try:
        host = ClientHost(config_from(json.loads(cfg_json)), Path(state_dir))
        infos = host.build(ids)
        warm_up()
    except Exception as e:  # reported to the parent, which raises it there
        user = isinstance(e, UserError)
        conn.send_bytes(json.dumps({"error": str(e) if user else traceback.format_exc(), "user": user}).encode())
        return
    conn.send_bytes(json.dumps({"ready": len(infos)}).encode())
    for info in infos:
        conn.send_bytes(encode_info(info))
    while True:
        try:
            header = json.loads(conn.recv_bytes())
            if header.get("stop"):
                return
            for cid in header["forget"]:
                host.agents.pop(cid, None)
            conn.send_bytes(host.run(header["client"], conn.recv_bytes(), header["fresh"]))
        except (EOFError, BrokenPipeError):  # the parent is gone
            return


class _Worker:
    """The parent's handle on one worker process: its pipe, the client it is running, the clients it dropped."""

    def __init__(self, ctx: Any, cfg: RunConfig, ids: list[str], state_dir: Path, name: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve_worker, args=(child, cfg.to_json(), ids, str(state_dir)), name=name, daemon=True
        )
        self.process.start()
        child.close()
        self.running: str | None = None
        self.forget: list[str] = []

    def ready(self) -> list[ClientInfo]:
        """The infos of its home clients, once built; ConfigError (a user's mistake) or RuntimeError otherwise."""
        try:
            header = json.loads(self.conn.recv_bytes())
        except EOFError:
            name, code = self.process.name, self.process.exitcode
            raise RuntimeError(f"worker {name} exited ({code}) before it was ready") from None
        if "error" in header:
            raise (ConfigError if header["user"] else RuntimeError)(header["error"])
        return [decode_info(self.conn.recv_bytes()) for _ in range(header["ready"])]

    def send(self, cid: str, task: Task, fresh: bool) -> None:
        self.conn.send_bytes(json.dumps({"client": cid, "fresh": fresh, "forget": self.forget}).encode())
        self.conn.send_bytes(encode_task(task))
        self.running, self.forget = cid, []

    def stop(self) -> None:
        try:
            self.conn.send_bytes(json.dumps({"stop": True}).encode())
        except OSError:
            pass
        self.process.join(STOP_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class WorkerPool:
    """A Transport that runs the clients `ids` of a run on `workers` processes (see the module's docstring); use it
    as a context manager, or call close(). `infos` are the clients' registration infos, by id."""

    def __init__(self, cfg: RunConfig, ids: list[str], state_dir: Path, workers: int) -> None:
        self.cfg, self.state_dir = cfg, Path(state_dir)
        self.ctx = multiprocessing.get_context("spawn")  # never fork a process whose torch may hold threads
        count = max(1, min(workers, len(ids)))
        homes = [ids[i::count] for i in range(count)]
        self.workers = [self._start(home, i) for i, home in enumerate(homes)]
        try:
            infos = [info for w in self.workers for info in w.ready()]
        except BaseException:
            self.close()
            raise
        self.infos = {info.client_id: info for info in sorted(infos, key=lambda i: ids.index(i.client_id))}
        self.home: dict[str, int | None] = {cid: i for i, home in enumerate(homes) for cid in home}
        self.replacements = self.moves = 0
        self.dead: set[int] = set()  # workers found dead during the current exchange

    def _start(self, ids: list[str], index: int) -> _Worker:
        return _Worker(self.ctx, self.cfg, ids, self.state_dir, f"fedge-worker-{index}")

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []

    def _replace_dead(self) -> None:
        """A new, empty worker for each one that died; the dead one's clients have no home (they are rebuilt)."""
        self.dead = set()
        for i, w in enumerate(self.workers):
            if not w.process.is_alive():
                log.error("worker %s died (exit code %s); starting another", w.process.name, w.process.exitcode)
                w.stop()
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
        busy: dict[Connection, int] = {}
        for i in range(len(self.workers)):
            self._next(i, queues, tasks, busy)
        while busy:
            for conn in wait(list(busy)):
                i = busy.pop(conn)
                cid, self.workers[i].running = self.workers[i].running, None
                try:
                    results[cid] = decode_result(conn.recv_bytes())
                except (EOFError, OSError):
                    name = self.workers[i].process.name
                    log.error("worker %s died running client %s, which does not reply", name, cid)
                    self._lost(i, queues, tasks, busy)
                    continue
                self._next(i, queues, tasks, busy)
        return {cid: results[cid] for cid in tasks if cid in results}

    def _lost(self, i: int, queues: list[deque[str]], tasks: Mapping[str, Task], busy: dict[Connection, int]) -> None:
        """Worker i died: its clients lose their home and its waiting tasks go to the live workers, the idle ones
        started on them (the next exchange starts a new worker in its place)."""
        self.home.update({c: None for c, home in self.home.items() if home == i})
        self.dead.add(i)
        alive = [j for j in range(len(queues)) if j not in self.dead]
        for c in queues[i] if alive else ():
            queues[min(alive, key=lambda j: len(queues[j]))].append(c)
        queues[i].clear()
        for j in alive:
            if j not in busy.values():
                self._next(j, queues, tasks, busy)

    def _next(self, i: int, queues: list[deque[str]], tasks: Mapping[str, Task], busy: dict[Connection, int]) -> None:
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
        except OSError:  # it died after its last reply: the task waits for another worker
            log.error("worker %s died", self.workers[i].process.name)
            queues[i].appendleft(cid)
            self._lost(i, queues, tasks, busy)
            return
        if previous is not None and previous != i:
            self.workers[previous].forget.append(cid)
            self.moves += 1
        self.home[cid] = i
        busy[self.workers[i].conn] = i

    def report(self) -> dict[str, Any]:
        return {
            "transport": {
                "kind": "inproc",
                "workers": len(self.workers),
                "clients_moved": self.moves,  # tasks an idle worker took from another's waiting clients
                "workers_replaced": self.replacements,
            },
            "rejected_messages": {},
        }
