"""fedge through a real 3-node RabbitMQ cluster on 127.0.0.1 (helpers.rabbitmq, the session's cluster): the users
script on a running cluster, a federation whose server and clients are spread over the three nodes, and the same
federation losing, mid-round, the node that holds some clients' connections (SIGKILL: no will, no goodbye).

Every connection is given every node's address (`--broker mqtt://n0,mqtt://n1,mqtt://n2`) and starts at the one
fedge.mqtt.first_address picks; the client processes get the list in different orders so that the server and
the clients land on all three nodes.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paho.mqtt.client import MQTTv311

from fedge.access import generate_users
from fedge.mqtt import first_address, parse_broker
from launch.federation import write_secrets

from helpers.brokers import close, closed_by_broker, connack_code, mqtt_client, publish, subscribe
from helpers.federation import Federation, make_config, read_rows, run_inproc, trained_by_round
from helpers.rabbitmq import RABBITMQ_BIN

ALL = ["0", "1", "2"]
GROUPS = (["0", "1"], ["2"])  # two client processes
COMPARED = ("round", "client", "trained", "accuracy", "loss", "num_examples")  # what a model change would move


def outcome(out: Path) -> list[tuple]:
    """The run's per-round, per-client training and evaluation numbers (bitwise floats)."""
    return sorted(tuple(row.get(k) for k in COMPARED) for row in read_rows(out))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple]:
    """The uninterrupted outcome of make_config's run, in-process with one torch thread (as client processes)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_inproc(make_config(out))
    return outcome(out)


def spread(cluster) -> tuple[dict[str, int], list[str]]:
    """Where each connection starts (node index per name) and each client process's --broker list: the first
    process gets the nodes in order, the second rotated by two."""
    urls = [node.url for node in cluster.nodes]
    lists = [urls, urls[2:] + urls[:2]]
    placement = {"server": first_address(parse_broker(",".join(urls)), "server")}
    for group, order in zip(GROUPS, lists):
        for cid in group:
            placement[cid] = urls.index(order[first_address(parse_broker(",".join(order)), cid)])
    return placement, [",".join(order) for order in lists]


def run_spread(fed: Federation, monkeypatch, kill_node=None):
    """The server in a thread, the two client processes; with `kill_node`, that node is SIGKILLed right after
    round 1's training tasks went out. Returns the server thread once the run ended."""
    placement, lists = spread(fed.cluster)
    assert set(placement.values()) == {0, 1, 2}, placement  # server and clients on all three nodes
    server = fed.start_server(monkeypatch)
    if kill_node is not None:

        def kill(rnd: int, kind: str) -> None:
            if (rnd, kind) == (1, "train") and kill_node.process is not None:
                kill_node.kill()
                server.killed_at = time.monotonic()

        server.fleet.after_send = kill
    processes = [fed.start_clients(group, url=url) for group, url in zip(GROUPS, lists)]
    server.join(150)
    for process in processes:
        assert process.popen.wait(30) == 0, process.log()
    return server, placement, processes


@pytest.mark.timeout(240)
def test_a_federation_spread_over_three_nodes_completes(tmp_path, monkeypatch, rabbitmq_cluster, reference):
    cfg = make_config(tmp_path / "run", round_deadline_s=40.0)
    with Federation(tmp_path, cfg, cluster=rabbitmq_cluster) as fed:
        server, placement, processes = run_spread(fed, monkeypatch)
        logs = {cid: p.log() for p, group in zip(processes, GROUPS) for cid in group}
    assert server.error is None, f"the run failed: {server.error!r}"
    for cid, node in placement.items():  # each connection is where it was meant to be
        if cid != "server":
            assert f"{cid}: connected to 127.0.0.1:{rabbitmq_cluster.nodes[node].port}" in logs[cid]
    assert server.summary["failed_rounds"] == [] and sum(server.summary["rejected_messages"].values()) == 0
    assert trained_by_round(cfg.out) == {0: ALL, 1: ALL}
    assert outcome(Path(cfg.out)) == reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lost", ["0", "server"], ids=["node-of-clients-0-and-1", "node-of-the-server"])
def test_losing_a_node_mid_round_loses_nothing(tmp_path, monkeypatch, rabbitmq_cluster, reference, lost):
    """The node holding clients 0 and 1 (not the server's), or the server's (no client's), is killed right after
    round 1's tasks went out: its connections move to the next node, the round completes there before its
    deadline, each update is aggregated once, and the models equal an uninterrupted run's."""
    deadline = 40.0
    cfg = make_config(tmp_path / "run", round_deadline_s=deadline)
    placement, _ = spread(rabbitmq_cluster)
    victim = rabbitmq_cluster.nodes[placement[lost]]
    on_victim = sorted(name for name, node in placement.items() if node == placement[lost])
    assert on_victim == (["0", "1"] if lost == "0" else ["server"])
    try:
        with Federation(tmp_path, cfg, cluster=rabbitmq_cluster) as fed:
            server, _, processes = run_spread(fed, monkeypatch, kill_node=victim)
            log = processes[0].log()
    finally:
        if victim.process is None:
            rabbitmq_cluster.restart(victim)  # the session's cluster is whole again for the tests after this one
    assert server.error is None, f"the run failed: {server.error!r}"
    assert (
        server.fleet.link.connects >= 2
        if lost == "server"
        else all(
            f"{cid}: connected to 127.0.0.1:" in log.split(f"{cid}: disconnected from 127.0.0.1:{victim.port}")[1]
            for cid in on_victim
        )
    )  # they moved
    round1 = next(e for e in server.fleet.exchanges if (e.round, e.type) == (1, "train"))
    print(
        f"{victim.name} killed (holding {', '.join(on_victim)}); round 1 closed {round1.end - server.killed_at:.2f} s "
        f"later; rejected {server.summary['rejected_messages']}"
    )
    assert round1.replied == ALL and round1.end < round1.start + deadline  # closed by replies, not the deadline
    assert trained_by_round(cfg.out) == {0: ALL, 1: ALL}  # each client's update aggregated exactly once a round
    assert server.summary["failed_rounds"] == [] and server.summary["transport"].get("deadline_missed", 0) == 0
    assert outcome(Path(cfg.out)) == reference  # same models as a run without the loss


@pytest.mark.timeout(120)
def test_the_users_script_sets_users_and_permissions_on_a_running_cluster(tmp_path, rabbitmq_cluster):
    """`sh users.sh`, written by `fedge broker --write-rabbitmq-config DIR --users FILE`, on one node: the user
    exists on every node with fedge's permissions; run again with a new password, it updates the user."""
    first, other = rabbitmq_cluster.nodes[0], rabbitmq_cluster.nodes[2]
    ctl = tmp_path / "rabbitmqctl"  # rabbitmqctl with this cluster's environment
    env = " ".join(f"{k}={shlex.quote(first.env()[k])}" for k in ("HOME", "ERL_EPMD_PORT"))
    ctl.write_text(f'#!/bin/sh\nexec env {env} {RABBITMQ_BIN / "rabbitmqctl"} -n {first.name} "$@"\n')
    ctl.chmod(0o700)

    def apply(users: dict[str, str]) -> None:
        write_secrets(tmp_path / "users", users)
        written = subprocess.run(
            [sys.executable, "-m", "launch.cli", "broker", "--write-rabbitmq-config", str(tmp_path / "conf")]
            + ["--users", str(tmp_path / "users"), "--run-as", "root"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert written.returncode == 0, written.stderr
        assert f"A running cluster: sh {tmp_path / 'conf' / 'users.sh'} on any node" in written.stdout
        done = subprocess.run(
            ["sh", str(tmp_path / "conf" / "users.sh")],
            env={"PATH": "/usr/bin:/bin", "RABBITMQCTL": str(ctl)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "fedge: 2 users set" in done.stdout

    users = {"server": rabbitmq_cluster.users["server"], "c": generate_users(["c"])["c"]}
    try:
        apply(users)
        c = mqtt_client(other.url, "c", users["c"], client_id=f"c.{'0' * 32}", protocol=MQTTv311)
        assert subscribe(c, "fedge/r/task/c") == [1]
        publish(c, "fedge/r/result/c", b"own topic")
        c.publish("fedge/r/result/a", b"forged", qos=1)
        assert closed_by_broker(c)
        old = users["c"]
        users["c"] = generate_users(["c"])["c"]
        apply(users)
        assert connack_code(other.url, "c", old, client_id=f"c.{'1' * 32}", protocol=MQTTv311) != 0
        close(mqtt_client(other.url, "c", users["c"], client_id=f"c.{'2' * 32}", protocol=MQTTv311))
        assert not any(p in (tmp_path / "conf" / "users.sh").read_text() for p in users.values())
    finally:
        first.ctl("delete_user", "c")
