"""Fixtures of the export tests: a real run folder (one tiny pFedClub round on digits, zoo III), real digits, and
the training program of helpers.export_models.POOLS."""

import numpy as np
import pytest
import torch

from fedge.config import config_from
from fedge.data.datasets import load_dataset
from launch.simulation import run_simulation

from helpers.export_models import POOLS, weights


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "pfedclub"
    cfg = config_from(
        dict(
            strategy="pfedclub",
            dataset="digits",
            zoo="III",
            clients=3,
            active=3,
            rounds=1,
            local_epochs=1,
            batch_size=32,
            finetune_epochs=1,
            finetune_min_steps=0,
            max_candidates=1,
            seed=0,
            transport="inproc",
            out=str(out),
        )
    )
    run_simulation(cfg, progress=False)
    return out


@pytest.fixture(scope="session")
def mnist8() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight real digits of eight classes (every 625th of the 5,000 images: labels 0-3 and 5-8)."""
    return load_dataset("mnist-5k").tensors(np.arange(0, 5000, 625))


@pytest.fixture(scope="session")
def pools_program():
    """POOLS exported for training with weights A (seed 0), batches of 8, dropout off."""
    from export.training_program import export_training

    return export_training(POOLS, weights(POOLS, seed=0), batch_size=8)
