"""The simulation launcher: builds a fleet of edge clients and the server for one run, in one process.

Like the CLI, this module may import every package (server, edge_client, device_profiles).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from device_profiles import fits, get_profile
from edge_client.agent import ClientAgent, ClientData
from fedge import constants as C
from fedge.config import ConfigError, RunConfig
from fedge.data import Dataset, load_dataset
from fedge.partition import ClientShard, PartitionConfig, make_partition
from fedge.transport import InProcTransport
from fedge.zoo import assign_models, create
from server.coordinator import Coordinator, LoopConfig
from server.plots import plot_accuracy, plot_phi, plot_server_time
from server.reassembly import STAGES
from server.runlog import RunLog
from server.strategy import STRATEGIES, PublicData, StrategyConfig

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


def make_agent(cfg: RunConfig, ds: Dataset, shard: ClientShard, model: str, profile_name: str) -> ClientAgent:
    """One simulated client; its model must fit its device profile (ConfigError says which limit fails)."""
    spec = create(model, ds.input_shape, ds.num_classes)
    verdict = fits(spec, get_profile(profile_name))
    if not verdict.ok:
        raise ConfigError(f"client {shard.client_id}: model {model} does not fit device profile {profile_name}: "
                          f"{'; '.join(verdict.failures)}. Choose other --set profiles=... or another zoo")
    x_train, y_train = ds.tensors(shard.train)
    x_test, y_test = ds.tensors(shard.test)
    return ClientAgent(str(shard.client_id), spec, ClientData(x_train, y_train, x_test, y_test), profile_name, cfg.seed)


def strategy_config(cfg: RunConfig) -> StrategyConfig:
    """The strategy's settings out of a run's config."""
    return StrategyConfig(local_epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed,
                          device=resolve_device(cfg.device), eta=cfg.eta, clusters=cfg.clusters,
                          ablation=cfg.ablation, cmsr_index=cfg.cmsr_index, kd_lambda=cfg.kd_lambda,
                          finetune_epochs=cfg.finetune_epochs, max_candidates=cfg.max_candidates)


def default_out(cfg: RunConfig) -> Path:
    """runs/<time>-<strategy>-<dataset> when no --out is given."""
    return Path(C.DEFAULT_RUNS_DIR) / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy}-{cfg.dataset}"


def run_simulation(cfg: RunConfig, progress: bool = True) -> dict[str, Any]:
    """Run a whole federation in this process; writes the run folder and returns the summary."""
    out = Path(cfg.out) if cfg.out else default_out(cfg)
    strategy_cls = STRATEGIES.get(cfg.strategy)  # fail fast, before loading data
    ds = load_dataset(cfg.dataset, cfg.data)
    partition = make_partition(ds.y, ds.num_classes, partition_config(cfg))
    x_public, y_public = ds.tensors(partition.public)
    strategy = strategy_cls(strategy_config(cfg), PublicData(x_public, y_public if cfg.public == "labeled" else None))
    models = assign_models(cfg.zoo, cfg.clients, cfg.seed)
    agents = [make_agent(cfg, ds, shard, models[i], cfg.profiles[i % len(cfg.profiles)])
              for i, shard in enumerate(partition.clients)]
    runlog = RunLog(out, cfg.to_dict() | {"out": str(out)})
    loop = LoopConfig(cfg.rounds, cfg.active, cfg.seed, cfg.local_epochs, progress)
    coordinator = Coordinator(strategy, InProcTransport({a.client_id: a.handle for a in agents}),
                              {a.client_id: a.info() for a in agents}, loop, runlog)
    start = time.perf_counter()
    summary = coordinator.run() | {"dataset": cfg.dataset, "zoo": cfg.zoo, "out": str(out),
                                   "wall_seconds": time.perf_counter() - start}
    runlog.write_json("summary.json", summary)
    write_plots(runlog.rows(), summary, out, f"{cfg.strategy} on {cfg.dataset}, zoo {cfg.zoo}")
    return summary


def write_plots(rows: list[dict[str, Any]], summary: dict[str, Any], out: Path, title: str) -> None:
    """accuracy.png always; phi.png and server_time.png when the strategy built teachers."""
    plot_accuracy(rows, out / "accuracy.png", title)
    if summary.get("phi"):
        plot_phi(summary["phi"], summary["models"], out / "phi.png", f"teacher size change ϕ: {title}")
        plot_server_time(rows, STAGES, out / "server_time.png", f"server time by stage: {title}")
