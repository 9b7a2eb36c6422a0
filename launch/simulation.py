"""The in-process simulation: the server and every client of a run in one process, no broker."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from fedge import constants as C
from fedge.brokers.transport import Handler, InProcTransport
from fedge.config import RunConfig
from fedge.wire.messages import Result, Task
from launch.batched import BatchedClients, client_device
from launch.client import client_agents
from launch.runs import load_partitioned, run_folder
from launch.server import make_strategy, resolve_options, run_federation_rounds
from launch.workers import WorkerPool, warm_up


def run_simulation(
    cfg: RunConfig,
    progress: bool = True,
    resume: bool = False,
    adversaries: Mapping[str, Callable[[Handler], Handler]] | None = None,
    stop_at: float | None = None,
) -> dict[str, Any]:
    """Run a whole federation in this process; writes the run folder and returns the summary. Clients keep
    their model snapshots in <out>/clients/<id>; `resume` continues an interrupted run in cfg.out (same cfg).
    With cfg.workers > 1 (or cfg.engine "ray") the clients run on that many worker processes or Ray actors
    (launch.workers.WorkerPool), bit for bit as in this process; with cfg.engine "batched" here, their training
    batched on cfg.client_device (launch.batched; within float tolerance); else here, one after another.
    `adversaries` turns clients into liars: client id -> a function of its honest handler returning the one it runs
    instead (bench/robust.py's attacks; they run in this process, one after another: workers <= 1, engine
    processes); an id that is not a client raises ValueError. Clients run at one torch thread (`one_thread`, or
    each worker's one; batched: cfg.workers threads), the server at cfg.server_threads. `stop_at`: a time.time()
    after which the run pauses after whole rounds (server.coordinator.RunPaused); `resume` continues it."""
    cfg = resolve_options(cfg)  # fail fast on an unknown strategy or option, before loading data
    device = client_device(cfg.client_device)  # a GPU that is not there fails before data are loaded
    if adversaries and (cfg.engine != "processes" or cfg.workers > 1):
        raise ValueError("adversaries run in this process, one client after another: set workers=1 (engine processes)")
    out = run_folder(cfg, resume)
    ds, partition = load_partitioned(cfg)
    strategy = make_strategy(cfg, ds, partition)
    ids = [str(s.client_id) for s in partition.clients]
    state_dir = out / C.CLIENT_STATE_DIR
    cfg = dataclasses.replace(cfg, out=str(out), transport="inproc")  # config.json says where the clients ran
    if cfg.engine == "ray" or (cfg.workers > 1 and cfg.engine == "processes"):
        with WorkerPool(cfg, ids, state_dir, cfg.workers) as pool:
            return run_federation_rounds(cfg, strategy, pool, pool.infos, progress, resume, stop_at=stop_at)
    agents = client_agents(cfg, ids, state_dir=state_dir, partitioned=(ds, partition))  # or own data (data_dir)
    warm_up()
    handlers = {a.client_id: a.handle for a in agents}
    unknown = sorted(set(adversaries or {}) - set(handlers))
    if unknown:
        raise ValueError(f"adversaries {unknown} are not clients of this run ({len(handlers)} clients)")
    transport = InProcTransport(
        {cid: one_thread((adversaries or {}).get(cid, lambda h: h)(h)) for cid, h in handlers.items()}
    )
    if cfg.engine == "batched":
        transport = BatchedClients(agents, transport, device, max(cfg.workers, 1))
    infos = {a.client_id: a.info() for a in agents}
    return run_federation_rounds(cfg, strategy, transport, infos, progress, resume, stop_at=stop_at)


def one_thread(handler: Handler) -> Handler:
    """`handler` run at one torch intra-op thread, the process's count restored after: as each client process of
    `fedge run` over MQTT trains (launch.federation), so both transports do the same arithmetic and give the same
    models bit for bit (a kernel's float rounding can depend on its thread count)."""

    def run(task: Task) -> Result:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return handler(task)
        finally:
            torch.set_num_threads(before)

    return run
