"""The simulation launcher: builds a fleet of edge clients and the server for one run, in one process.

Like the CLI, this module may import every package (server, edge_client, device_profiles).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from device_profiles import fits, get_profile
from edge_client.agent import ClientAgent, ClientData
from edge_client.executorch_trainer import ExecuTorchTrainer
from export import ExportError
from export.executorch import TrainingSession, gated_training_program, teacher_logits_pte
from export.run_models import write_final_models
from fedge import constants as C
from fedge.config import ConfigError, RunConfig
from fedge.data import Dataset, load_dataset
from fedge.messages import ClientInfo
from fedge.partition import ClientShard, Partition, PartitionConfig, make_partition
from fedge.transport import InProcTransport, Transport
from fedge.zoo import assign_models, create
from server.coordinator import Coordinator, LoopConfig, RoundFailed
from server.plots import plot_accuracy, plot_phi, plot_server_time
from server.reassembly import STAGES
from server.runlog import RunLog
from server.strategy import STRATEGIES, PublicData, Strategy, StrategyConfig, create_strategy

log = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """'auto' → cuda when available, else cpu; asking for cuda without one raises ConfigError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was requested but no CUDA device is available; use --set device=cpu")
    return device


def partition_config(cfg: RunConfig) -> PartitionConfig:
    """The data split a run's config asks for (the server and every client derive the same one)."""
    return PartitionConfig(scheme=cfg.partition, num_clients=cfg.clients, classes_per_client=cfg.classes_per_client,
                           alpha=cfg.alpha, seed=cfg.seed, max_samples_per_client=cfg.max_samples_per_client,
                           max_public_samples=cfg.max_public_samples)


def make_agent(cfg: RunConfig, ds: Dataset, shard: ClientShard, model: str, profile_name: str,
               state_dir: Path | None = None) -> ClientAgent:
    """One simulated client; its model must fit its device profile (ConfigError says which limit fails) and, on
    an `executorch` profile, pass the ExecuTorch gradient-parity gate (it then trains through ExecuTorch).
    With `state_dir` it keeps its model snapshots there and continues from them when started again."""
    spec = create(model, ds.input_shape, ds.num_classes)
    profile = get_profile(profile_name)
    verdict = fits(spec, profile)
    if not verdict.ok:
        raise ConfigError(f"client {shard.client_id}: model {model} does not fit device profile {profile_name}: "
                          f"{'; '.join(verdict.failures)}. Choose other --set profiles=... or another zoo")
    trainer = None
    if profile.runtime == "executorch":
        try:
            trainer = ExecuTorchTrainer(spec, min(cfg.batch_size, len(shard.train)),
                                        lambda batch: TrainingSession(gated_training_program(spec, batch)),
                                        teacher_logits_pte)
        except ExportError as e:
            raise ConfigError(f"client {shard.client_id}: model {model} cannot train on device profile {profile_name} "
                              f"(runtime executorch): {e}. Choose a BatchNorm-free model (cnn1-cnn3) for "
                              "executorch profiles, or a torch profile") from None
    x_train, y_train = ds.tensors(shard.train)
    x_test, y_test = ds.tensors(shard.test)
    return ClientAgent(str(shard.client_id), spec, ClientData(x_train, y_train, x_test, y_test), profile_name, cfg.seed,
                       state_dir, trainer)


def strategy_config(cfg: RunConfig) -> StrategyConfig:
    """The strategy's settings out of a run's config."""
    return StrategyConfig(local_epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed,
                          device=resolve_device(cfg.device), eta=cfg.eta, clusters=cfg.clusters,
                          ablation=cfg.ablation, cmsr_index=cfg.cmsr_index, kd_lambda=cfg.kd_lambda,
                          finetune_epochs=cfg.finetune_epochs, max_candidates=cfg.max_candidates, sgd_lr=cfg.sgd_lr,
                          sgd_momentum=cfg.sgd_momentum, max_client_share=cfg.max_client_share)


def default_out(cfg: RunConfig) -> Path:
    """runs/<time>-<strategy>-<dataset> when no --out is given."""
    return Path(C.DEFAULT_RUNS_DIR) / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy}-{cfg.dataset}"


def run_folder(cfg: RunConfig, resume: bool) -> Path:
    """cfg.out, else a new default folder; resuming without cfg.out raises ConfigError."""
    if resume and not cfg.out:
        raise ConfigError("resuming needs the run folder: set out to the folder of the run to continue")
    return Path(cfg.out) if cfg.out else default_out(cfg)


def load_partitioned(cfg: RunConfig) -> tuple[Dataset, Partition]:
    """The run's dataset and its split (the server and every client derive the same one)."""
    ds = load_dataset(cfg.dataset, cfg.data)
    return ds, make_partition(ds.y, ds.num_classes, partition_config(cfg))


def make_strategy(cfg: RunConfig, ds: Dataset, partition: Partition) -> Strategy:
    """The server's strategy with its public data (labels kept unless the run asks for unlabeled)."""
    x_public, y_public = ds.tensors(partition.public)
    return create_strategy(cfg.strategy, strategy_config(cfg),
                           PublicData(x_public, y_public if cfg.public == "labeled" else None))


def run_federation_rounds(cfg: RunConfig, strategy: Strategy, transport: Transport,
                          clients: Mapping[str, ClientInfo], progress: bool = True,
                          resume: bool = False) -> dict[str, Any]:
    """Run the rounds over any transport, write the run folder (metrics, checkpoint, summary, plots), return
    the summary. With `resume`, continue the run in cfg.out from its checkpoint.
    A round that misses its quorum on every try writes the summary so far and raises RoundFailed."""
    out = run_folder(cfg, resume)
    runlog = RunLog(out, cfg.to_dict() | {"out": str(out)}, resume=resume)
    loop = LoopConfig(cfg.rounds, cfg.active, cfg.seed, cfg.local_epochs, progress, cfg.min_replies, cfg.round_retries)
    coordinator = Coordinator(strategy, transport, clients, loop, runlog)
    start = time.perf_counter()
    extra = {"dataset": cfg.dataset, "zoo": cfg.zoo, "out": str(out)}
    try:
        summary = coordinator.run(resume)
    except RoundFailed as e:
        runlog.write_json("summary.json", e.summary | extra | transport.report())
        raise
    summary |= extra | {"wall_seconds": time.perf_counter() - start} | transport.report()
    runlog.write_json("summary.json", summary)
    write_plots(runlog.rows(), summary, out, f"{cfg.strategy} on {cfg.dataset}, zoo {cfg.zoo}")
    finals = strategy.final_models()
    if finals:
        write_final_models(out, finals, load_dataset(cfg.dataset, cfg.data), cfg.rounds - 1, cfg.export_onnx,
                           progress)
    return summary


def run_simulation(cfg: RunConfig, progress: bool = True, resume: bool = False) -> dict[str, Any]:
    """Run a whole federation in this process; writes the run folder and returns the summary. Clients keep
    their model snapshots in <out>/clients/<id>; `resume` continues an interrupted run in cfg.out (same cfg)."""
    STRATEGIES.get(cfg.strategy)  # fail fast, before loading data
    out = run_folder(cfg, resume)
    ds, partition = load_partitioned(cfg)
    strategy = make_strategy(cfg, ds, partition)
    models = assign_models(cfg.zoo, cfg.clients, cfg.seed)
    agents = [make_agent(cfg, ds, shard, models[i], cfg.profiles[i % len(cfg.profiles)],
                         out / C.CLIENT_STATE_DIR / str(shard.client_id))
              for i, shard in enumerate(partition.clients)]
    transport = InProcTransport({a.client_id: a.handle for a in agents})
    return run_federation_rounds(dataclasses.replace(cfg, out=str(out)), strategy, transport,
                                 {a.client_id: a.info() for a in agents}, progress, resume)


def write_plots(rows: list[dict[str, Any]], summary: dict[str, Any], out: Path, title: str) -> None:
    """accuracy.png always; phi.png and server_time.png when the strategy built teachers."""
    plot_accuracy(rows, out / "accuracy.png", title)
    if summary.get("phi"):
        plot_phi(summary["phi"], summary["models"], out / "phi.png", f"teacher size change ϕ: {title}")
        plot_server_time(rows, STAGES, out / "server_time.png", f"server time by stage: {title}")
