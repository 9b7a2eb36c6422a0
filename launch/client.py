"""The device side of a run: each client's agent (its model, data and runtime) and `fedge client`'s MQTT sessions.

Imports no module of server/ and not the embedded broker: this is what a Raspberry Pi runs.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

import torch

from device_profiles import fits, get_profile, training_fits
from edge_client.agent import ClientAgent, ClientData
from edge_client.session import ClientStopped, EdgeClient
from fedge import constants as C
from fedge.brokers.access import read_users
from fedge.brokers.mqtt import Broker, connector
from fedge.config import ConfigError, RunConfig
from fedge.data.datasets import Dataset
from fedge.data.own_data import own_data_limit, read_own_data
from fedge.data.partition import ClientShard, Partition
from fedge.model.zoo import assign_models, create
from fedge.plugins import load_methods
from fedge.seeding import derive_seed
from fedge.wire.messages import Weights
from fedge.wire.topics import check_id
from launch.runs import data_task, load_partitioned, own_data_path

log = logging.getLogger(__name__)


def make_agent(
    cfg: RunConfig, ds: Dataset, shard: ClientShard, model: str, profile_name: str, state_dir: Path | None = None
) -> ClientAgent:
    """One simulated client, on its shard of the run's dataset (see `build_agent`)."""
    x_train, y_train = ds.tensors(shard.train)
    x_test, y_test = ds.tensors(shard.test)
    data = ClientData(x_train, y_train, x_test, y_test)
    return build_agent(cfg, str(shard.client_id), data, ds.input_shape, ds.num_classes, model, profile_name, state_dir)


def build_agent(
    cfg: RunConfig,
    client_id: str,
    data: ClientData,
    input_shape: tuple[int, int, int],
    num_classes: int,
    model: str,
    profile_name: str,
    state_dir: Path | None = None,
) -> ClientAgent:
    """One client on `data` with the zoo's `model` at the run's widths; its model must fit its device profile,
    its training footprint at the run's batch size included (ConfigError says which limit fails; the server checks
    the same at registration) and, on an `executorch` profile, pass the ExecuTorch gradient-parity gate
    (it then trains through ExecuTorch). With `state_dir` it keeps its model snapshots there and continues from
    them when started again."""
    spec = create(model, input_shape, num_classes, cfg.widths)
    profile = get_profile(profile_name)
    batch = min(cfg.batch_size, max(len(data.y_train), 1))
    failures = fits(spec, profile).failures + training_fits(spec, profile, batch).failures
    if failures:
        smaller = ", widths=cpu" if cfg.widths != C.DEFAULT_WIDTHS else ""
        raise ConfigError(
            f"client {client_id}: model {model} (widths {cfg.widths}) does not fit device profile "
            f"{profile_name}: {'; '.join(failures)}. Choose other --set profiles=...{smaller} or another zoo"
        )
    trainer = None
    if profile.runtime == "executorch":  # export and executorch load only for the devices that train through them
        from edge_client.executorch_trainer import ExecuTorchTrainer, TrainingSession
        from export import ExportError
        from export.parity import gated_training_program
        from fedge.executorch_program import ProgramError

        try:
            trainer = ExecuTorchTrainer(
                spec,
                min(cfg.batch_size, len(data.y_train)),
                lambda batch: TrainingSession(gated_training_program(spec, batch)),
                teacher_logits_from_weights,
            )
        except (ExportError, ProgramError) as e:
            raise ConfigError(
                f"client {client_id}: model {model} cannot train on device profile {profile_name} "
                f"(runtime executorch): {e}. Choose a model that passes the gate (docs/android.md lists them) for "
                "executorch profiles, or a torch profile"
            ) from None
    return ClientAgent(client_id, spec, data, profile_name, cfg.seed, state_dir, trainer)


def teacher_logits_from_weights(teacher: Weights, x: torch.Tensor) -> torch.Tensor:
    """An executorch client's teacher logits for a teacher sent as weights (a server without a teacher program
    exporter): the client exports the teacher's XNNPACK program itself. A teacher shipped as its program never
    comes here, and the exporter is imported only when one does. ValueError when it cannot run."""
    from export.pte import teacher_logits_pte

    return teacher_logits_pte(teacher, x)


def client_agents(
    cfg: RunConfig,
    ids: list[str],
    model: str | None = None,
    profile: str | None = None,
    state_dir: Path | None = None,
    partitioned: tuple[Dataset, Partition] | None = None,
) -> list[ClientAgent]:
    """The clients `ids` of the run's fleet: each id is a shard number of the run's partition; model and
    profile default to the ones the run assigns to that shard. With cfg.data_dir each client reads its own data
    there (`{id}` replaced by its id; fedge.data.own_data) instead of its shard, within its profile's own-data limit
    (OwnDataError before anything is decoded when the files declare more). `partitioned`: the run's dataset and
    split (load_partitioned) when the caller holds them already."""
    models = assign_models(cfg.zoo, cfg.clients, cfg.seed)
    for cid in ids:
        check_id(cid, "client id")
        if not cid.isdigit() or int(cid) >= cfg.clients:
            raise ConfigError(f"client id {cid!r} must be a shard number 0..{cfg.clients - 1} of the run's partition")
    if cfg.data_dir is None:
        ds, partition = partitioned or load_partitioned(cfg)
        shards = {cid: partition.clients[int(cid)] for cid in ids}
    else:
        task = data_task(cfg)
    agents = []
    for cid in ids:
        i = int(cid)
        chosen = model or models[i], profile or cfg.profiles[i % len(cfg.profiles)]
        where = None if state_dir is None else Path(state_dir) / cid
        if cfg.data_dir is None:
            agents.append(make_agent(cfg, ds, shards[cid], *chosen, where))
            continue
        limit = own_data_limit(get_profile(chosen[1]).memory_bytes)  # checked before anything is decoded
        own = read_own_data(own_data_path(cfg, cid), task, derive_seed(cfg.seed, "own-data", cid), max_bytes=limit)
        data = ClientData(own.x_train, own.y_train, own.x_test, own.y_test)
        agents.append(build_agent(cfg, cid, data, task.input_shape, len(task.classes), *chosen, where))
    return agents


def run_clients(
    agents: list[ClientAgent],
    broker_for: Callable[[str], Broker],
    cfg: RunConfig,
    connect_timeout: float = C.CONNECT_TIMEOUT_S,
) -> int:
    """`fedge client`: serve each agent over its own MQTT connection (one thread each, one trains at a
    time) until the server ends the run; returns the exit code (2 if the server refused a client). The methods'
    client halves load first (fedge.plugins), so a method package that fails to import stops the client here,
    before it registers, not at its first task."""
    load_methods("client")
    compute = threading.Lock()
    clients = [
        EdgeClient(
            a,
            connector(broker_for(a.client_id), cfg.keepalive_s),
            cfg.run_id,
            cfg.heartbeat_s,
            cfg.chunk_size,
            compute=compute,
        )
        for a in agents
    ]
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


def set_threads(threads: int | None) -> None:
    """Torch intra-op threads of a client process (several processes share the machine's cores)."""
    if threads:
        torch.set_num_threads(threads)
