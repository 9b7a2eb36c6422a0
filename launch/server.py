"""The server side of a run: its strategy with public data, the rounds over any transport, the run folder, and
`fedge server` over MQTT."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from fedge import constants as C
from fedge.brokers.mqtt import Broker, connector
from fedge.brokers.transport import Transport
from fedge.checkpoint import load_tree
from fedge.config import RunConfig
from fedge.data.datasets import Dataset, load_dataset
from fedge.data.own_data import read_public_data
from fedge.data.partition import Partition
from fedge.model.spec import ModelSpec
from fedge.wire.messages import ClientInfo, Weights
from launch.runs import client_classes, data_task, load_partitioned, resolve_device, run_folder, run_metadata
from methods.reassembly.strategy import STAGES
from server.aggregation import Aggregation
from server.coordinator import Coordinator, LoopConfig, RoundFailed, check_resumable, run_identity
from server.fleet import Fleet
from server.plots import plot_accuracy, plot_phi, plot_server_time, plot_time_to_accuracy
from server.registration import registration_check
from server.runlog import CHECKPOINT_FILE, RunLog
from server.strategy import PublicData, Strategy, StrategyConfig, create_strategy, parse_options

log = logging.getLogger(__name__)


def _executorch_trainable(spec: ModelSpec) -> None:
    """ExportError (a ValueError) when `spec` has no ExecuTorch training form; export is imported only when an
    executorch client registers."""
    from export.training_program import check_trainable

    check_trainable(spec)


RUNTIME_CHECKS = {"executorch": _executorch_trainable}


def strategy_config(cfg: RunConfig) -> StrategyConfig:
    """The run-level settings every strategy gets out of a run's config."""
    return StrategyConfig(
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
        device=resolve_device(cfg.device),
        sgd_lr=cfg.sgd_lr,
        sgd_momentum=cfg.sgd_momentum,
        aggregation=Aggregation(cfg.aggregator, cfg.trim_fraction, cfg.byzantine),
    )


def resolve_options(cfg: RunConfig) -> RunConfig:
    """`cfg` with its strategy's options checked and completed with their defaults (what config.json records);
    an unknown strategy raises StrategyError, an unknown option or a bad value ConfigError."""
    options = parse_options(cfg.strategy, cfg.options)
    return dataclasses.replace(cfg, options=dataclasses.asdict(options))


def make_strategy(cfg: RunConfig, ds: Dataset, partition: Partition) -> Strategy:
    """The server's strategy with its options and the public data (with labels where it has them; a strategy may
    drop them): the operator's folder or .npz at cfg.public_data, read into the run's task (OwnDataError on bad
    input), else the partition's public split of the dataset. A strategy that sends teachers gets the exporter
    that ships executorch clients their programs."""
    if cfg.public_data is None:
        public = PublicData(*ds.tensors(partition.public))
    else:
        public = PublicData(*read_public_data(cfg.public_data, data_task(cfg)))
        log.info("server: public set of %d images from %s", len(public.x), cfg.public_data)
    strategy = create_strategy(cfg.strategy, strategy_config(cfg), public, parse_options(cfg.strategy, cfg.options))
    if hasattr(strategy, "program_for"):
        strategy.program_for = teacher_program_exporter(public.x)
    return strategy


def teacher_program_exporter(sample: torch.Tensor) -> Callable[[Weights], bytes]:
    """The server's teacher program exporter (ReassemblyStrategy.program_for): a teacher's XNNPACK inference
    program, loaded back and checked against eager on EXECUTORCH_TEACHER_BATCH samples spread over `sample` (the
    public data). ExportError (a ValueError) when it cannot be exported or differs from eager; export and
    executorch are imported only at the first export, i.e. only when an executorch client gets a teacher."""

    def export(teacher: Weights) -> bytes:
        from export.pte import teacher_program

        return teacher_program(teacher, sample)

    return export


def run_federation_rounds(
    cfg: RunConfig,
    strategy: Strategy,
    transport: Transport,
    clients: Mapping[str, ClientInfo],
    progress: bool = True,
    resume: bool = False,
    deadline_s: float | None = None,
    stop_at: float | None = None,
) -> dict[str, Any]:
    """Run the rounds over any transport, write the run folder (metrics, checkpoint, summary, plots), return
    the summary. With `resume`, continue the run in cfg.out from its checkpoint. The server's torch threads are
    cfg.server_threads (0: as they are); summary.json records the number used. `deadline_s`: the transport's
    round deadline, if it has one (the simulated clock charges it for a client that never replied). `stop_at`: a
    time.time() after which the run pauses after whole rounds (server.coordinator.RunPaused; resume continues it).
    A round that misses its quorum on every try writes the summary so far and raises RoundFailed. The process's
    torch thread count is restored on return (a caller in the same process, a test, keeps its own)."""
    before = torch.get_num_threads()
    if cfg.server_threads:
        torch.set_num_threads(cfg.server_threads)
    try:
        return _rounds(cfg, strategy, transport, clients, progress, resume, deadline_s, stop_at)
    finally:
        torch.set_num_threads(before)


def _rounds(
    cfg: RunConfig,
    strategy: Strategy,
    transport: Transport,
    clients: Mapping[str, ClientInfo],
    progress: bool,
    resume: bool,
    deadline_s: float | None,
    stop_at: float | None,
) -> dict[str, Any]:
    """run_federation_rounds at the server's torch threads."""
    out = run_folder(cfg, resume)
    runlog = RunLog(out, cfg.to_dict() | {"out": str(out)}, resume=resume)
    loop = LoopConfig(
        cfg.rounds,
        cfg.active,
        cfg.seed,
        cfg.local_epochs,
        progress,
        cfg.min_replies,
        cfg.round_retries,
        cfg.widths,
        deadline_s,
        cfg.clip_factor,
        stop_at,
    )
    coordinator = Coordinator(strategy, transport, clients, loop, runlog)
    extra = {"dataset": cfg.dataset, "zoo": cfg.zoo, "widths": cfg.widths, "out": str(out)}
    extra["server_threads"] = torch.get_num_threads()  # what cfg.server_threads (config.json) came to
    try:
        summary = coordinator.run(resume)
    except RoundFailed as e:
        runlog.write_json("summary.json", e.summary | extra | transport.report())
        raise
    summary |= extra | transport.report()
    runlog.write_json("summary.json", summary)
    write_plots(runlog.rows(), summary, out, f"{cfg.strategy} on {cfg.dataset}, zoo {cfg.zoo} ({cfg.widths} widths)")
    finals = strategy.final_models()
    if finals:
        from export.run_models import write_final_models  # ONNX export loads only when there is something to export

        ds, rnd = load_dataset(cfg.dataset, cfg.data), cfg.rounds - 1
        run = run_metadata(cfg, out, strategy.personalized)
        classes = client_classes(cfg) if strategy.personalized else {}  # a shared model is not its client's alone
        write_final_models(out, finals, ds, rnd, run, classes, cfg.export_onnx, progress)
    return summary


def write_plots(rows: list[dict[str, Any]], summary: dict[str, Any], out: Path, title: str) -> None:
    """accuracy.png and time_to_accuracy.png always; phi.png and server_time.png when the strategy built
    teachers."""
    plot_accuracy(rows, out / "accuracy.png", title)
    plot_time_to_accuracy({summary["strategy"]: rows}, out / "time_to_accuracy.png", f"time to accuracy: {title}")
    if summary.get("phi"):
        plot_phi(summary["phi"], summary["models"], out / "phi.png", f"teacher size change ϕ: {title}")
        plot_server_time(rows, STAGES, out / "server_time.png", f"server time by stage: {title}")


def serve(
    cfg: RunConfig,
    broker: Broker,
    progress: bool = True,
    resume: bool = False,
    connect_timeout: float = C.CONNECT_TIMEOUT_S,
    broker_report: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`fedge server`: wait for `cfg.clients` registrations, run the rounds over MQTT, write the run folder
    (with `broker_report`'s fields, for a broker in this process, in summary.json)."""
    cfg = resolve_options(cfg)  # a bad option is reported now, not after the whole fleet has registered
    if resume:  # a corrupt or foreign checkpoint is reported now, not after the whole fleet has registered
        out = run_folder(cfg, resume)
        check_resumable(
            load_tree(out / CHECKPOINT_FILE),
            run_identity(
                cfg.strategy, [str(i) for i in range(cfg.clients)], cfg.seed, cfg.active, cfg.widths, cfg.options
            ),
            out,
        )
    ds, partition = load_partitioned(cfg)
    # Clients reading their own data (cfg.data_dir) register their sizes; shards have sizes the server knows.
    sizes = None if cfg.data_dir else {str(s.client_id): (len(s.train), len(s.test)) for s in partition.clients}
    fleet = Fleet(
        connector(broker, cfg.keepalive_s),
        cfg.run_id,
        registration_check(sizes, RUNTIME_CHECKS, cfg.batch_size),
        cfg.round_deadline_s,
        cfg.heartbeat_s,
        cfg.chunk_size,
        broker_report,
    )
    fleet.start(connect_timeout)
    try:
        log.info(
            "server: waiting up to %.0f s for %d clients on %s (run %s)",
            cfg.register_timeout_s,
            cfg.clients,
            broker,
            cfg.run_id,
        )
        clients = fleet.wait_for_clients(cfg.clients, cfg.register_timeout_s)
        strategy = make_strategy(cfg, ds, partition)
        return run_federation_rounds(cfg, strategy, fleet, clients, progress, resume, cfg.round_deadline_s)
    finally:
        fleet.close()
