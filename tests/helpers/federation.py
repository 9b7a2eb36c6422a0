"""A tiny real federation for fault tests: Mosquitto, the server (thread or `fedge server` process) and
`fedge client` processes on 127.0.0.1, with teardown that kills whatever is left.

The server in a thread runs `launch.server.serve` with an instrumented Fleet (`RecordingFleet`) so a test can
read the fleet's liveness state and the time every exchange took; `Federation.abort()` makes a stuck server
give up at once. Client and server logs are printed at teardown, which pytest shows only for a failed test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from edge_client.agent import ClientAgent
from fedge import constants as C
from fedge.brokers.access import generate_users
from fedge.brokers.embedded_broker import EmbeddedBroker
from fedge.brokers.mqtt import Broker, parse_broker
from fedge.checkpoint import load_tree
from fedge.config import RunConfig, config_from
from fedge.files import atomic_write
from fedge.wire.messages import Result, Task, Weights
from launch import federation, server
from launch.client import client_agents, run_clients
from launch.simulation import run_simulation
from server.fleet import Fleet, FleetError
from server.strategy import STRATEGIES

from helpers.brokers import MosquittoProcess
from helpers.rabbitmq import RabbitCluster

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.05
EXIT_S = 10.0  # how long a process or the server thread gets to finish after it was told to


def make_config(out: Path, **overrides: Any) -> RunConfig:
    """A run small enough for a fault test: 3 cnn1 clients on mnist-5k, 2 rounds of 1 epoch on 64 samples,
    1 s heartbeats, a 15 s round deadline, one epoch of stitch fine-tuning for the strategies that have it; every
    field and option can be overridden."""
    values: dict[str, Any] = dict(
        strategy="fedavg",
        dataset="mnist-5k",
        zoo="cnn1",
        clients=3,
        rounds=2,
        local_epochs=1,
        max_samples_per_client=64,
        max_public_samples=64,
        batch_size=32,
        device="cpu",
        heartbeat_s=1.0,
        round_deadline_s=15.0,
        register_timeout_s=60.0,
        round_retries=0,
        run_id=f"fault{os.getpid()}x{time.monotonic_ns() % 10**6}",
        out=str(out),
    )
    values.update(overrides)
    values.setdefault("active", values["clients"])
    if "finetune_epochs" in {o for o, *_ in STRATEGIES.get(values["strategy"]).options_type.describe()}:
        values.setdefault("finetune_epochs", 1)
        values.setdefault("finetune_min_steps", 0)
    return config_from(values)


def run_inproc(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` run in this process over the in-process transport with one torch thread, as each client process
    trains: the reference a run over MQTT must reproduce bitwise. Returns the run's summary."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_simulation(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)


def over_embedded_broker(cfg: RunConfig) -> tuple[dict[str, Any], list[ClientAgent]]:
    """The server (launch.server.serve) and clients 0..N-1 (launch.client.run_clients, each on its own connection)
    in threads of this process, through the embedded broker with passwords and ACLs: the run's summary and the
    agents (which must all exit with 0)."""
    ids = [str(i) for i in range(cfg.clients)]
    users = generate_users(ids)
    with EmbeddedBroker(users=users) as broker:
        agents = client_agents(cfg, ids)
        codes: list[int] = []
        clients = threading.Thread(
            target=lambda: codes.append(
                run_clients(
                    agents, lambda cid: Broker("127.0.0.1", broker.port, username=cid, password=users[cid]), cfg
                )
            )
        )
        clients.start()
        try:
            summary = server.serve(
                cfg, Broker("127.0.0.1", broker.port, username="server", password=users["server"]), progress=False
            )
        finally:
            clients.join(60)
    assert codes == [0]
    return summary, agents


def final_snapshots(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each client's newest model snapshot in a run folder, as a state dict (none for strategies whose clients
    train only the server's models, e.g. HeteroFL, FedTrans)."""
    clients = Path(out) / C.CLIENT_STATE_DIR
    folders = sorted(clients.iterdir()) if clients.is_dir() else []
    return {d.name: load_tree(max(d.glob("round-*.safetensors")))["model"].state for d in folders}


def same_tree(a, b) -> bool:
    """Bitwise equality of two checkpoint trees (dicts, lists, Weights, tensors, JSON values)."""
    if isinstance(a, Weights) and isinstance(b, Weights):
        return a.spec == b.spec and same_tree(a.state, b.state)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `condition` until it is truthy and return its value; AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(POLL_S)


def read_rows(out: Path) -> list[dict[str, Any]]:
    """The metrics.jsonl rows of a run folder (none if it does not exist yet)."""
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


COMPARED = ("round", "client", "trained", "accuracy", "loss", "num_examples")  # what a model change would move


def outcome(out: Path) -> list[tuple]:
    """The run's per-round, per-client training and evaluation numbers (bitwise floats)."""
    return sorted(tuple(row.get(k) for k in COMPARED) for row in read_rows(out))


# Fields that differ between two runs of one config: wall-clock times, memory, and the reply's bytes, which hold the
# client's wall-clock metrics (their JSON length varies).
WALL_CLOCK_FIELDS = ("seconds", "time_", "bytes_up", "rss_bytes")


def checkpoint_without_wall_clock(out: Path) -> dict[str, Any]:
    """A run folder's checkpoint without the server's wall-clock seconds and the simulated clock's seconds and bytes
    (they count the replies' bytes, which hold wall-clock metrics): what another run of its config, in any mode of
    the simulation, must reproduce bit for bit (same_tree)."""
    tree = load_tree(Path(out) / "checkpoint.safetensors")
    clock = {"train_macs": tree["sim_clock"]["train_macs"]}
    return {k: v for k, v in tree.items() if k not in ("server_seconds", "wall_seconds")} | {"sim_clock": clock}


def rows_without_wall_clock(out: Path) -> list[dict[str, Any]]:
    """A run folder's metrics.jsonl rows without the WALL_CLOCK_FIELDS: what a resumed run must reproduce exactly."""
    return [{k: v for k, v in r.items() if not any(t in k for t in WALL_CLOCK_FIELDS)} for r in read_rows(out)]


def fedge_run_processes(cfg: RunConfig, config_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`fedge run --config <config_path>` (cfg written there as JSON) with clients as 2 OS processes, as a user
    runs it: its exit code, stdout and stderr."""
    Path(config_path).write_text(cfg.to_json())
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "run", "--config", str(config_path), "--processes", "2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Crash(BaseException):
    """The process dying: not an Exception, so nothing between the client and the test catches it."""


def exports_score_their_accuracy(out: Path, summary: dict[str, Any], what: str, dataset: str, folder: Path) -> int:
    """Export every client's `what` model of run `out` to ONNX with `fedge export` (which checks parity and says
    so), then score it with `fedge predict` on the client's test shard of `dataset`: AssertionError unless each
    export succeeds and scores exactly the run's final accuracy for that client. Returns how many were checked."""
    from launch.cli import main as cli_main  # the CLI's command table imports the whole system

    for cid, accuracy in summary["final_accuracy"]["per_client"].items():
        argv = ["export", out, "--client", cid, "--what", what, "--format", "onnx", "--out", folder]
        printed = _printed(cli_main, argv)
        assert "max abs logit difference" in printed, printed
        onnx = folder / f"client{cid}-{what}.onnx"
        printed = _printed(
            cli_main, ["predict", onnx, "--dataset", dataset, "--client", cid, "--config", out / "config.json"]
        )
        correct, total = map(int, re.search(r"\((\d+)/(\d+)\)", printed).groups())
        assert correct / total == accuracy, (cid, printed)
    return len(summary["final_accuracy"]["per_client"])


def _printed(cli_main: Callable[[list[str]], int], argv: list[Any]) -> str:
    """What the CLI printed for `argv`; AssertionError when it exits non-zero."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main([str(a) for a in argv])
    assert code == 0, (argv, out.getvalue())
    return out.getvalue()


def crash_at(monkeypatch: Any, rnd: int, nth: int) -> None:
    """Kill the run (raise Crash) when the nth training task of round `rnd` reaches its client (earlier ones have
    trained)."""
    from edge_client.agent import ClientAgent

    handle, seen = ClientAgent.handle, []

    def crashing(agent: ClientAgent, task: Task) -> Result:
        if task.round == rnd and task.type != "evaluate":
            seen.append(agent.client_id)
            if len(seen) == nth:
                raise Crash
        return handle(agent, task)

    monkeypatch.setattr(ClientAgent, "handle", crashing)


def trained_by_round(out: Path) -> dict[int, list[str]]:
    """Round → the clients whose training reply was aggregated that round (one entry per metrics row)."""
    rounds: dict[int, list[str]] = {}
    for row in read_rows(out):
        rounds.setdefault(row["round"], [])
        if row["trained"]:
            rounds[row["round"]].append(row["client"])
    return rounds


# ---------------------------------------------------------------------------------------------- the server


@dataclass
class Exchange:
    """One Fleet.exchange call as the round loop saw it."""

    round: int
    type: str
    sent: list[str]
    replied: list[str]
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class RecordingFleet(Fleet):
    """The production Fleet, recording every exchange; `abort` makes waits end at once (for teardown).

    `after_send(round, task type)`, when set, is called on the server's thread once an exchange's tasks were
    all published and acknowledged by the broker, before the fleet starts waiting for replies.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exchanges: list[Exchange] = []
        self.aborted = threading.Event()
        self.after_send: Callable[[int, str], None] | None = None
        self._unsent = 0
        self._current = (-1, "")
        send = self.link.send  # every message goes out through Endpoint.send (publish calls it too)

        def send_and_notify(topic: str, env: Any, payload: bytes, *args: Any, **kwargs: Any) -> None:
            send(topic, env, payload, *args, **kwargs)
            if env.type == "task" and self._unsent > 0:
                self._unsent -= 1
                if self._unsent == 0 and self.after_send is not None:
                    self.link.last_sent.wait_for_publish(EXIT_S)
                    self.after_send(*self._current)

        self.link.send = send_and_notify

    def wait_for_clients(self, expected: int, timeout: float):
        deadline = time.monotonic() + timeout
        while not self.aborted.is_set():
            try:
                return super().wait_for_clients(expected, min(1.0, max(0.01, deadline - time.monotonic())))
            except FleetError:
                if time.monotonic() >= deadline:
                    raise
        raise FleetError("aborted by the test")

    def exchange(self, tasks: Mapping[str, Task], limits: Mapping[str, int] | None = None) -> dict[str, Result]:
        if self.aborted.is_set():
            return {}
        first = next(iter(tasks.values()), None)
        self._current = (first.round, first.type) if first else (-1, "")
        self._unsent = len(tasks)
        start = time.monotonic()
        results = super().exchange(tasks, limits)
        self.exchanges.append(
            Exchange(
                first.round if first else -1,
                first.type if first else "",
                sorted(tasks),
                sorted(results),
                start,
                time.monotonic(),
            )
        )
        return results

    def abort(self) -> None:
        """Every client counts as gone from now on, so an exchange in progress returns at its next check."""
        self.aborted.set()
        with self.cond:
            self.cond.notify_all()

    def _gone(self, cid: str) -> bool:  # Fleet's "stop waiting for this client" test
        return self.aborted.is_set() or super()._gone(cid)


class ServerThread:
    """`launch.server.serve(cfg, broker)` in a background thread: `.summary` or `.error` once it ended,
    `.fleet` (a RecordingFleet) once it connected, `.strategy` once the rounds started."""

    def __init__(self, cfg: RunConfig, broker: Broker, monkeypatch: Any) -> None:
        self.cfg, self.broker = cfg, broker
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.fleet: RecordingFleet | None = None
        self.strategy: Any = None
        make_strategy = server.make_strategy

        def fleet(*args: Any, **kwargs: Any) -> RecordingFleet:
            self.fleet = RecordingFleet(*args, **kwargs)
            return self.fleet

        def strategy(*args: Any, **kwargs: Any) -> Any:
            self.strategy = make_strategy(*args, **kwargs)
            return self.strategy

        monkeypatch.setattr(server, "Fleet", fleet)
        monkeypatch.setattr(server, "make_strategy", strategy)
        self.thread = threading.Thread(target=self._run, name="fedge-server", daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        wait_until(
            lambda: self.fleet is not None and self.fleet.link.connected.is_set() or self.error,
            30,
            "the server to connect to the broker",
        )
        if self.error is not None:
            raise AssertionError(f"the server did not start: {self.error!r}") from self.error
        return self

    def _run(self) -> None:
        try:
            self.summary = server.serve(self.cfg, self.broker, progress=False)
        except BaseException as e:  # handed to the test, which asserts on it
            self.error = e

    def join(self, timeout: float) -> None:
        """Wait for the run to end; AssertionError if it is still going after `timeout` s (a hang)."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"the server is still running after {timeout:g} s")

    def stop(self) -> None:
        if self.thread.is_alive() and self.fleet is not None:
            self.fleet.abort()
        self.thread.join(EXIT_S + self.cfg.round_deadline_s)


# ---------------------------------------------------------------------------------------------- processes


def default_sigint() -> None:
    """In a spawned process: Ctrl-C at its default, so Python turns it into KeyboardInterrupt. A test runner
    started in the background of a non-interactive shell inherits SIGINT ignored, and so would every
    `fedge` process it starts: the Ctrl-C tests would then wait for an exit that never comes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Process:
    """A `fedge` subprocess (client or server) and its log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the process dies without a word; its sockets are closed by the kernel."""
        self.signal(signal.SIGKILL)
        self.popen.wait(EXIT_S)

    def wait(self, timeout: float = EXIT_S) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        """Ctrl-C (a clean exit), then SIGKILL if it does not leave within EXIT_S."""
        if not self.alive():
            return
        self.signal(signal.SIGINT)
        try:
            self.popen.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class Federation:
    """A broker with a password per client (Mosquitto, or with `embedded` fedge's own broker in this process, or
    a running RabbitMQ `cluster`, whose users it takes), the run's config and password files, and what was started.

    `extra_users` get passwords too (e.g. a hand-driven test client); `persistence` turns Mosquitto's on. Use
    as a context manager: on exit every process is killed, the server thread aborted, the broker it started
    stopped, and all logs printed.
    """

    tmp: Path
    cfg: RunConfig
    extra_users: tuple[str, ...] = ()
    persistence: bool = False
    embedded: bool = False
    cluster: RabbitCluster | None = None
    users: dict[str, str] = field(init=False)
    broker: MosquittoProcess | EmbeddedBroker | RabbitCluster = field(init=False)
    processes: list[Process] = field(default_factory=list)
    servers: list[ServerThread] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tmp = Path(self.tmp)
        if self.cluster is not None:
            self.broker, self.users = self.cluster, self.cluster.users
        else:
            self.users = generate_users([*(str(i) for i in range(self.cfg.clients)), *self.extra_users])
            self.broker = (
                EmbeddedBroker(users=self.users)
                if self.embedded
                else MosquittoProcess(self.tmp / "mosquitto", self.users, persistence=self.persistence, print_log=True)
            )
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.secrets, self.config = self.tmp / "passwords", self.tmp / "config.json"
        federation.write_secrets(self.secrets, self.users)
        atomic_write(self.config, self.cfg.to_json().encode())

    def __enter__(self) -> Federation:
        if self.cluster is None:
            self.broker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.processes:
            if p.alive():
                p.popen.kill()
                p.popen.wait()
        for s in self.servers:
            s.stop()
        if self.cluster is None:
            self.broker.stop()
        for p in self.processes:
            print(f"--- {p.name} ({p.log_path}) ---\n{p.log()}")

    def credentials(self, user: str, port: int | None = None) -> Broker:
        """Where `user` connects: the broker (every node of a cluster), or a proxy in front of it on `port`."""
        if port is not None:
            return Broker("127.0.0.1", port, username=user, password=self.users[user])
        return parse_broker(self.broker.url, user, self.users[user])

    def start_server(self, monkeypatch: Any, cfg: RunConfig | None = None) -> ServerThread:
        server = ServerThread(cfg or self.cfg, self.credentials("server"), monkeypatch)
        self.servers.append(server)
        return server.start()

    def start_server_process(self, *extra: str) -> Process:
        """`fedge -v server` as a subprocess (its summary or error goes to its log)."""
        cmd = [
            sys.executable,
            "-m",
            "launch.cli",
            "-v",
            "server",
            "--broker",
            self.broker.url,
            "--password-file",
            str(self.secrets),
            "--config",
            str(self.config),
            "--no-progress",
            *extra,
        ]
        return self._spawn("server", cmd)

    def start_clients(
        self,
        ids: list[str],
        port: int | None = None,
        settings: Mapping[str, Any] = (),
        name: str | None = None,
        url: str | None = None,
    ) -> Process:
        """One `fedge -v client` process serving `ids`, through a proxy on `port` if given, or to `url` (default:
        the broker's); `settings` are extra `--set key=value` overrides for this process only."""
        url = f"mqtt://127.0.0.1:{port}" if port else url or self.broker.url
        cmd = federation.client_command(url, self.config, ids, self.secrets, self.tmp / "client-state", threads=1)
        cmd.insert(cmd.index("launch.cli") + 1, "-v")  # INFO logs: registration, acks, reconnects
        for key, value in dict(settings).items():
            cmd += ["--set", f"{key}={value}"]
        return self._spawn(name or f"clients-{','.join(ids)}", cmd)

    def _spawn(self, name: str, cmd: list[str]) -> Process:
        log_path = self.tmp / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ | {"PYTHONUNBUFFERED": "1"},
                preexec_fn=default_sigint,
            )
        process = Process(name, popen, log_path)
        self.processes.append(process)
        return process

    def wait_for_log(self, process: Process, text: str, timeout: float = 60) -> None:
        """Wait until `text` appears in the process's log; AssertionError (with the log) if it dies first."""
        wait_until(lambda: text in process.log() or not process.alive(), timeout, f"{text!r} in {process.name}")
        if text not in process.log():
            raise AssertionError(f"{process.name} exited ({process.popen.returncode}) before logging {text!r}")
