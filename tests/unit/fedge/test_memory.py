"""Every task reply carries the client process's rss_bytes and peak_rss_bytes; they reach metrics.jsonl."""

import pytest

from fedge.memory import memory_metrics, peak_rss_bytes, rss_bytes
from fedge.tasks import TrainTask
from fedge.wire.messages import Task
from launch.client import make_agent
from launch.runs import load_partitioned

from helpers.federation import make_config, read_rows, run_inproc

pytestmark = pytest.mark.timeout(120)


def test_rss_is_positive_and_the_peak_bounds_it() -> None:
    assert 0 < rss_bytes() <= peak_rss_bytes()
    metrics = memory_metrics()
    assert 0 < metrics["rss_bytes"] <= metrics["peak_rss_bytes"]
    assert set(metrics) == {"rss_bytes", "peak_rss_bytes"}


def test_a_train_result_carries_peak_rss(tmp_path) -> None:
    cfg = make_config(tmp_path, clients=2)
    ds, partition = load_partitioned(cfg)
    agent = make_agent(cfg, ds, partition.clients[0], "cnn1", "rpi-4")
    settings = TrainTask(epochs=1, batch_size=32, lr=1e-3, seed=0, upload=False)
    result = agent.handle(Task("train", 0, settings.to_config()))
    assert result.metrics["peak_rss_bytes"] > 0 and result.metrics["rss_bytes"] > 0


def test_an_inproc_run_records_peak_rss_on_every_row(tmp_path) -> None:
    cfg = make_config(tmp_path / "run", clients=2, rounds=1)
    run_inproc(cfg)
    rows = read_rows(tmp_path / "run")
    assert rows and all(r["peak_rss_bytes"] > 0 and r["rss_bytes"] > 0 for r in rows)
