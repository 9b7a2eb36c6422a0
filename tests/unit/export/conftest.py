"""A real run folder shared by the export tests (one tiny pFedClub round on digits, zoo III)."""

import pytest

from fedge.config import config_from
from launch.simulation import run_simulation


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "pfedclub"
    cfg = config_from(dict(strategy="pfedclub", dataset="digits", zoo="III", clients=3, active=3, rounds=1, local_epochs=1,
                    batch_size=32, finetune_epochs=1, max_candidates=1, seed=0, transport="inproc", out=str(out)))
    run_simulation(cfg, progress=False)
    return out
