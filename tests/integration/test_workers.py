"""The simulation's worker pool (launch/workers.py) against real worker processes: an idle worker takes another's
waiting client, a worker killed between rounds or in the middle of a task is replaced, and every reply is the one
the client gives in this process, bit for bit; a worker's configuration error reaches the caller as ConfigError."""

import dataclasses

import pytest

from fedge.config import ConfigError
from launch.client import client_agents
from launch.runs import load_partitioned
from launch.server import make_strategy
from launch.simulation import one_thread, run_simulation
from launch.workers import ProcessWorker, WorkerPool

from helpers.federation import (
    checkpoint_without_wall_clock,
    final_snapshots,
    make_config,
    rows_without_wall_clock,
    same_tree,
)

pytestmark = pytest.mark.timeout(300)
IDS = ["0", "1", "2", "3"]  # on 2 workers: 0 and 2 live on worker 0, 1 and 3 on worker 1


def same_results(a, b) -> bool:
    """Two replies with the same models, tensors and numbers (the memory and wall-clock metrics aside)."""
    numbers = [{k: v for k, v in r.metrics.items() if "rss" not in k and "seconds" not in k} for r in (a, b)]
    return (
        a.error is None
        and (a.client_id, a.round, a.type, a.num_examples) == (b.client_id, b.round, b.type, b.num_examples)
        and numbers[0] == numbers[1]
        and same_tree(a.models, b.models)
        and same_tree(a.tensors, b.tensors)
    )


def test_workers_move_idle_clients_survive_killed_workers_and_reply_as_this_process(tmp_path, monkeypatch):
    cfg = make_config(tmp_path / "run", clients=4)
    agents = client_agents(cfg, IDS, state_dir=tmp_path / "here")
    here = {a.client_id: one_thread(a.handle) for a in agents}
    with WorkerPool(cfg, IDS, tmp_path / "pool", workers=2) as pool:
        assert pool.infos == {a.client_id: a.info() for a in agents}
        fedavg = make_strategy(cfg, *load_partitioned(cfg))
        fedavg.setup(pool.infos)

        def check(rnd, active, replied):
            tasks = fedavg.plan(rnd, active)  # the same global model every round: enough here
            got = pool.exchange(tasks)
            assert list(got) == replied  # in the order of the tasks, the lost ones absent
            for cid in got:
                assert same_results(got[cid], here[cid](tasks[cid])), f"client {cid} in round {rnd}"

        # only worker 0's clients: worker 1 takes client 2, which then lives there
        check(0, ["0", "2"], ["0", "2"])
        assert pool.report()["transport"]["clients_moved"] == 1 and pool.home["2"] == 1
        check(1, ["0", "2", "1"], ["0", "2", "1"])

        pool.workers[1].process.kill()  # between rounds: its clients are rebuilt from their snapshots elsewhere
        pool.workers[1].process.join()
        check(2, IDS, IDS)
        assert pool.report()["transport"]["workers_replaced"] == 1

        send = ProcessWorker.send

        def killed_after_sending(worker, cid, task, fresh):
            send(worker, cid, task, fresh)
            if cid == "3":
                worker.process.kill()

        monkeypatch.setattr(ProcessWorker, "send", killed_after_sending)
        check(3, IDS, ["0", "1", "2"])  # client 3's worker died running it: no reply, the others are served
        monkeypatch.undo()
        check(4, IDS, IDS)  # client 3 trains again from its snapshot before round 3, here as there
        assert pool.report()["transport"]["workers_replaced"] == 2


def test_a_workers_configuration_error_is_the_callers(tmp_path):
    cfg = make_config(tmp_path / "run", zoo="mobilenet_v2", widths="paper", profiles=("rpi-zero-2w",), workers=2)
    with pytest.raises(ConfigError, match="does not fit device profile"):
        run_simulation(cfg, progress=False)


@pytest.mark.parametrize("mode", [{"workers": 2}, {"engine": "batched", "workers": 1}])
def test_adversaries_need_the_serial_simulation(tmp_path, mode):
    cfg = dataclasses.replace(make_config(tmp_path / "run"), **mode)
    with pytest.raises(ValueError, match="workers=1"):
        run_simulation(cfg, progress=False, adversaries={"0": lambda h: h})
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


def test_on_a_local_ray_instance_a_federation_trains_as_in_this_process(tmp_path):
    cfg = make_config(tmp_path / "serial", strategy="pfedclub", zoo="I", clients=4, active=3, rounds=2)
    run_simulation(cfg, progress=False)
    ray = dataclasses.replace(cfg, engine="ray", workers=2, out=str(tmp_path / "ray"))
    summary = run_simulation(ray, progress=False)
    assert summary["transport"]["engine"] == "ray" and summary["transport"]["workers"] == 2
    assert rows_without_wall_clock(tmp_path / "ray") == rows_without_wall_clock(tmp_path / "serial")
    assert same_tree(
        checkpoint_without_wall_clock(tmp_path / "ray"), checkpoint_without_wall_clock(tmp_path / "serial")
    )
    assert same_tree(final_snapshots(tmp_path / "ray"), final_snapshots(tmp_path / "serial"))


def test_more_ray_workers_than_the_cluster_has_cpus_is_a_configuration_error(tmp_path):
    cfg = make_config(tmp_path / "run", engine="ray", workers=64)  # a local instance: one CPU per core here
    with pytest.raises(ConfigError, match="too few for 64 workers"):
        run_simulation(cfg, progress=False)
