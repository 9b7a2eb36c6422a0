"""`fedge run` over MQTT: the embedded broker, the server in this process, and the edge clients as separate OS
processes (`fedge client`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedge import constants as C
from fedge.brokers.access import generate_users
from fedge.brokers.embedded_broker import EmbeddedBroker
from fedge.brokers.mqtt import Broker
from fedge.config import RunConfig
from fedge.files import atomic_write
from launch.client import client_agents
from launch.runs import default_out, load_partitioned
from launch.server import make_strategy, serve

log = logging.getLogger(__name__)


def write_secrets(path: Path, users: dict[str, str]) -> None:
    """A username:password file readable only by its owner."""
    atomic_write(path, "".join(f"{u}:{p}\n" for u, p in users.items()).encode(), mode=0o600)


def client_command(
    broker_url: str, config: Path, ids: list[str], secrets: Path, state_dir: Path, threads: int
) -> list[str]:
    """The `fedge client` command line of one client process of `fedge run`."""
    return [
        sys.executable,
        "-m",
        "launch.cli",
        "client",
        "--broker",
        broker_url,
        "--config",
        str(config),
        "--id",
        ",".join(ids),
        "--password-file",
        str(secrets),
        "--state-dir",
        str(state_dir),
        "--threads",
        str(threads),
    ]


def run_federation(cfg: RunConfig, progress: bool = True, processes: int | None = None) -> dict[str, Any]:
    """`fedge run` over MQTT: the embedded broker with a password per client and topic ACLs, the server
    in this process, and the clients spread over `processes` OS processes (logs in out/clients-*.log)."""
    ids = [str(i) for i in range(cfg.clients)]
    preflight(cfg, ids)  # make_strategy checks the strategy's options, before any process starts
    users = generate_users(ids)
    processes = max(1, min(processes or min(os.cpu_count() or 1, 4), cfg.clients))
    # The server takes one torch thread unless told otherwise, and each client process one: as the in-process
    # simulation runs its clients (launch.simulation.one_thread), so the two transports give the same models bit for
    # bit (a kernel's rounding can depend on its thread count).
    server_threads = cfg.server_threads or 1
    out = Path(cfg.out) if cfg.out else default_out(cfg)
    cfg = dataclasses.replace(cfg, out=str(out), server_threads=server_threads)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedge-") as tmp, EmbeddedBroker(users=users) as broker:
        secrets, config = Path(tmp) / "passwords", Path(tmp) / "config.json"
        write_secrets(secrets, users)
        atomic_write(config, cfg.to_json().encode())
        procs = []
        for k in range(processes):
            log_file = (out / f"clients-{k}.log").open("w")
            procs.append(
                subprocess.Popen(
                    client_command(broker.url, config, ids[k::processes], secrets, out / C.CLIENT_STATE_DIR, 1),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            )
            log_file.close()
        try:
            server = Broker("127.0.0.1", broker.port, username="server", password=users["server"])
            return serve(cfg, server, progress, broker_report=broker.report)
        finally:
            stop_processes(procs)


def preflight(cfg: RunConfig, ids: list[str]) -> None:
    """Fail in a second, before any broker or process starts, on what would fail later: the dataset, the zoo,
    a model that does not fit its profile, a strategy that cannot run on this fleet."""
    agents = client_agents(cfg, ids)
    make_strategy(cfg, *load_partitioned(cfg)).setup({a.client_id: a.info() for a in agents})


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """Give client processes time to exit after the server's stop, then terminate, then kill."""
    deadline = time.monotonic() + C.CLIENT_EXIT_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
