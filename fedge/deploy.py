"""The deployment launchers over MQTT: the server process, client processes, and `fedge run`'s whole
federation (embedded broker + server + edge clients as separate OS processes).

Like the simulation launcher and the CLI, this module may import every package.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from device_profiles import ProfileError, fits, get_profile
from export import ExportError
from export.executorch import check_trainable
from edge_client.agent import ClientAgent
from edge_client.runtime import ClientStopped, EdgeClient
from fedge.broker import EmbeddedBroker, generate_users, read_users
from fedge.checkpoint import load_tree
from fedge import constants as C
from fedge.config import ConfigError, RunConfig
from fedge.messages import ClientInfo
from fedge.mqtt import Broker
from fedge.simulation import (
    default_out,
    load_partitioned,
    make_agent,
    make_strategy,
    run_federation_rounds,
    run_folder,
)
from fedge.topics import check_id
from fedge.weights import atomic_write
from fedge.zoo import assign_models
from server.coordinator import check_resumable, run_identity
from server.fleet import Fleet
from server.runlog import CHECKPOINT_FILE

log = logging.getLogger(__name__)


def registration_check(cfg: RunConfig, shard_sizes: Mapping[str, tuple[int, int]] | None = None
                       ) -> Callable[[ClientInfo], str | None]:
    """What the server requires of a registering client: a known profile its model fits (and, on an executorch
    profile, has an ExecuTorch training form: the full gradient-parity gate runs on the client), some data, and,
    where the server made the clients' shards (`shard_sizes`: client id -> (train, test) examples), exactly the
    data sizes of its shard: a client's word on its size sets its weight in FedAvg."""
    def check(info: ClientInfo) -> str | None:
        try:
            profile = get_profile(info.profile)
        except ProfileError as e:
            return f"unknown device profile: {e}"
        verdict = fits(info.spec, profile)
        if not verdict.ok:
            return f"model {info.spec.name} does not fit device profile {info.profile}: {'; '.join(verdict.failures)}"
        if profile.runtime == "executorch":
            try:
                check_trainable(info.spec)
            except ExportError as e:
                return f"model {info.spec.name} cannot train on device profile {info.profile} (runtime executorch): {e}"
        if info.num_train < 1 or info.num_test < 1:
            return f"client {info.client_id} has no training or test data"
        if shard_sizes is not None:
            if info.client_id not in shard_sizes:
                return (f"client id {info.client_id!r} is not a shard of this run's partition "
                        f"(0..{len(shard_sizes) - 1})")
            if (info.num_train, info.num_test) != shard_sizes[info.client_id]:
                train, test = shard_sizes[info.client_id]
                return (f"client {info.client_id} claims {info.num_train} training and {info.num_test} test examples;"
                        f" its shard of the run's partition has {train} and {test}")
        return None
    return check


def serve(cfg: RunConfig, broker: Broker, progress: bool = True, resume: bool = False,
          connect_timeout: float = C.CONNECT_TIMEOUT_S,
          broker_report: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """`fedge server`: wait for `cfg.clients` registrations, run the rounds over MQTT, write the run folder
    (with `broker_report`'s fields, for a broker in this process, in summary.json)."""
    if resume:  # a corrupt or foreign checkpoint is reported now, not after the whole fleet has registered
        out = run_folder(cfg, resume)
        check_resumable(load_tree(out / CHECKPOINT_FILE),
                        run_identity(cfg.strategy, [str(i) for i in range(cfg.clients)], cfg.seed, cfg.active), out)
    ds, partition = load_partitioned(cfg)
    sizes = {str(s.client_id): (len(s.train), len(s.test)) for s in partition.clients}
    fleet = Fleet(broker, cfg.run_id, registration_check(cfg, sizes), cfg.round_deadline_s, cfg.heartbeat_s,
                  cfg.chunk_size, cfg.keepalive_s, broker_report)
    fleet.start(connect_timeout)
    try:
        log.info("server: waiting up to %.0f s for %d clients on %s (run %s)", cfg.register_timeout_s, cfg.clients,
                 broker, cfg.run_id)
        clients = fleet.wait_for_clients(cfg.clients, cfg.register_timeout_s)
        strategy = make_strategy(cfg, ds, partition)
        return run_federation_rounds(cfg, strategy, fleet, clients, progress, resume)
    finally:
        fleet.close()


def client_agents(cfg: RunConfig, ids: list[str], model: str | None = None, profile: str | None = None,
                  state_dir: Path | None = None) -> list[ClientAgent]:
    """The clients `ids` of the run's fleet: each id is a shard number of the run's partition; model and
    profile default to the ones the run assigns to that shard."""
    ds, partition = load_partitioned(cfg)
    models = assign_models(cfg.zoo, cfg.clients, cfg.seed)
    agents = []
    for cid in ids:
        check_id(cid, "client id")
        if not cid.isdigit() or int(cid) >= cfg.clients:
            raise ConfigError(f"client id {cid!r} must be a shard number 0..{cfg.clients - 1} of the run's partition")
        i = int(cid)
        agents.append(make_agent(cfg, ds, partition.clients[i], model or models[i],
                                 profile or cfg.profiles[i % len(cfg.profiles)],
                                 None if state_dir is None else Path(state_dir) / cid))
    return agents


def run_clients(agents: list[ClientAgent], broker_for: Callable[[str], Broker], cfg: RunConfig,
                connect_timeout: float = C.CONNECT_TIMEOUT_S) -> int:
    """`fedge client`: serve each agent over its own MQTT connection (one thread each, one trains at a
    time) until the server ends the run; returns the exit code (2 if the server refused a client)."""
    compute = threading.Lock()
    clients = [EdgeClient(a, broker_for(a.client_id), cfg.run_id, cfg.heartbeat_s, cfg.chunk_size, compute=compute,
                          keepalive_s=cfg.keepalive_s)
               for a in agents]
    codes: dict[str, int] = {}
    finished = threading.Semaphore(0)

    def serve_one(c: EdgeClient) -> None:
        try:
            c.run_forever(connect_timeout)
            codes[c.cid] = 0
        except (ClientStopped, ConnectionError) as e:
            log.error("%s", e)
            codes[c.cid] = 2
        finally:
            finished.release()

    threads = [threading.Thread(target=serve_one, args=(c,), name=f"client-{c.cid}") for c in clients]
    for t in threads:
        t.start()
    try:
        # Wait on a semaphore, not in Thread.join(): Ctrl-C inside join() makes CPython 3.11 mark the thread as
        # finished (bpo-45274), and the process would then exit without saying "offline" or disconnecting.
        for _ in threads:
            finished.acquire()
    except KeyboardInterrupt:
        for c in clients:
            c.stopped.set()
    for t in threads:
        t.join()
    return max(codes.values(), default=0)


def password_for(path: str | Path, username: str) -> str:
    """The password of `username` from a file of username:password lines, or the file's only line."""
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if len(lines) == 1 and ":" not in lines[0]:
        return lines[0]
    users = read_users(Path(path))
    if username not in users:
        raise ConfigError(f"password file {path} has no line for user {username!r}")
    return users[username]


def write_secrets(path: Path, users: dict[str, str]) -> None:
    """A username:password file readable only by its owner."""
    atomic_write(path, "".join(f"{u}:{p}\n" for u, p in users.items()).encode())
    os.chmod(path, 0o600)


def client_command(broker_url: str, config: Path, ids: list[str], secrets: Path, state_dir: Path,
                   threads: int) -> list[str]:
    """The `fedge client` command line of one client process of `fedge run`."""
    return [sys.executable, "-m", "fedge.cli", "client", "--broker", broker_url, "--config", str(config),
            "--id", ",".join(ids), "--password-file", str(secrets), "--state-dir", str(state_dir),
            "--threads", str(threads)]


def run_federation(cfg: RunConfig, progress: bool = True, processes: int | None = None) -> dict[str, Any]:
    """`fedge run` over MQTT: the embedded broker with a password per client and topic ACLs, the server
    in this process, and the clients spread over `processes` OS processes (logs in out/clients-*.log)."""
    ids = [str(i) for i in range(cfg.clients)]
    preflight(cfg, ids)
    users = generate_users(ids)
    processes = max(1, min(processes or min(os.cpu_count() or 1, 4), cfg.clients))
    threads = max(1, (os.cpu_count() or 1) // processes)
    out = Path(cfg.out) if cfg.out else default_out(cfg)
    cfg = dataclasses.replace(cfg, out=str(out))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedge-") as tmp, EmbeddedBroker(users=users) as broker:
        secrets, config = Path(tmp) / "passwords", Path(tmp) / "config.json"
        write_secrets(secrets, users)
        atomic_write(config, cfg.to_json().encode())
        procs = []
        for k in range(processes):
            log_file = (out / f"clients-{k}.log").open("w")
            procs.append(subprocess.Popen(client_command(broker.url, config, ids[k::processes], secrets,
                                                         out / C.CLIENT_STATE_DIR, threads),
                                          stdout=log_file, stderr=subprocess.STDOUT))
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


def set_threads(threads: int | None) -> None:
    """Torch intra-op threads of a client process (several processes share the machine's cores)."""
    if threads:
        torch.set_num_threads(threads)
