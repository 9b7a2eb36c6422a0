"""What every launcher derives from a run's config alone: the data split, the run folder, the torch device."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fedge import constants as C
from fedge.config import ConfigError, RunConfig
from fedge.data.datasets import Dataset, load_dataset
from fedge.data.own_data import DataTask
from fedge.data.partition import Partition, PartitionConfig, describe, make_partition


def resolve_device(device: str) -> str:
    """'auto' → cuda when available, else cpu; asking for cuda without one raises ConfigError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was requested but no CUDA device is available; use --set device=cpu")
    return device


def partition_config(cfg: RunConfig) -> PartitionConfig:
    """The data split a run's config asks for (the server and every client derive the same one)."""
    return PartitionConfig(
        scheme=cfg.partition,
        num_clients=cfg.clients,
        classes_per_client=cfg.classes_per_client,
        alpha=cfg.alpha,
        label_clusters=cfg.label_clusters,
        seed=cfg.seed,
        max_samples_per_client=cfg.max_samples_per_client,
        max_public_samples=cfg.max_public_samples,
    )


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


def data_task(cfg: RunConfig) -> DataTask:
    """The task own data is read into: input_shape, class_names, norm_mean and norm_std from the config, each
    unset one from the run's dataset (loaded only then). Inconsistent keys raise OwnDataError."""
    keys = (cfg.input_shape, cfg.class_names, cfg.norm_mean, cfg.norm_std)
    if all(k is not None for k in keys):
        return DataTask(tuple(cfg.input_shape), tuple(cfg.class_names), tuple(cfg.norm_mean), tuple(cfg.norm_std))
    base = DataTask.of(load_dataset(cfg.dataset, cfg.data))
    return DataTask(
        tuple(cfg.input_shape or base.input_shape),
        tuple(cfg.class_names or base.classes),
        tuple(cfg.norm_mean or base.mean),
        tuple(cfg.norm_std or base.std),
    )


def clients_task(cfg: RunConfig) -> DataTask:
    """The task the run's clients read their data into: the dataset's own (shape, classes, statistics) for shards
    of it, the config's (data_task) when they read their own data."""
    return DataTask.of(load_dataset(cfg.dataset, cfg.data)) if cfg.data_dir is None else data_task(cfg)


def run_metadata(cfg: RunConfig, run_dir: str | Path, personalized: bool) -> dict[str, str]:
    """The metadata props every model exported from a run carries: where it comes from, whether its strategy
    makes personalized models, and the clients' task (class names, normalisation), beside export.run_models'
    per-model ones."""
    task = clients_task(cfg)
    return {
        "run": str(Path(run_dir).resolve()),
        "run_id": cfg.run_id,
        "strategy": cfg.strategy,
        "personalized": json.dumps(personalized),
        "dataset": cfg.dataset,
        "class_names": json.dumps(list(task.classes)),
        "mean": json.dumps(list(task.mean)),
        "std": json.dumps(list(task.std)),
    }


def client_classes(cfg: RunConfig) -> dict[str, dict[str, int]]:
    """Per client id, the classes of its training data and how many samples of each ({class name: count}), from
    the run's split; empty when the clients read their own data (the server never sees a device's labels)."""
    if cfg.data_dir is not None:
        return {}
    ds, partition = load_partitioned(cfg)
    return {
        str(r["client"]): {ds.classes[c]: int(n) for c, n in r["train_counts"].items()}
        for r in describe(partition, ds.y)
    }


def own_data_path(cfg: RunConfig, client_id: str) -> Path | None:
    """Where client `client_id` reads its own data (cfg.data_dir with `{id}` replaced), or None for a shard."""
    return None if cfg.data_dir is None else Path(cfg.data_dir.replace("{id}", client_id)).expanduser()
