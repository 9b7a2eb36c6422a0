"""fedge through a real 3-node RabbitMQ cluster on 127.0.0.1 (helpers.rabbitmq, the session's cluster): the users
script on a running cluster, a federation whose server and clients are spread over the three nodes, and the same
federation losing, mid-round, the node that holds some clients' connections (SIGKILL: no will, no goodbye).

Every connection is given every node's address (`--broker mqtt://n0,mqtt://n1,mqtt://n2`) and starts at the one
fedge.brokers.mqtt.first_address picks; the client processes get the list in different orders so that the server and
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

from fedge.brokers.access import generate_users
from fedge.brokers.mqtt import first_address, mqtt_client_id, parse_broker
from fedge.checkpoint import load_tree
from launch.federation import write_secrets
from server.runlog import CHECKPOINT_FILE

from helpers.brokers import close, closed_by_broker, connack_code, connect_as, mqtt_client, publish, subscribe
from helpers.federation import Federation, make_config, outcome, run_inproc, same_tree, trained_by_round
from helpers.rabbitmq import RABBITMQ_BIN

ALL = ["0", "1", "2"]
GROUPS = (["0", "1"], ["2"])  # two client processes


def final_model(out: Path) -> dict:
    """The server's state after the last round (FedAvg: the global model), from the run's checkpoint."""
    return load_tree(Path(out) / CHECKPOINT_FILE)["strategy_state"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[tuple], dict]:
    """The uninterrupted run of make_config, in-process with one torch thread (as client processes): its
    per-client numbers and its final model."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_inproc(make_config(out))
    return outcome(out), final_model(out)


def same_as(out: Path, reference: tuple[list[tuple], dict]) -> bool:
    """Bitwise the reference's numbers and final model."""
    return outcome(out) == reference[0] and same_tree(final_model(out), reference[1])


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
    assert same_as(Path(cfg.out), reference)


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
    assert same_as(Path(cfg.out), reference)  # the same models as a run without the loss


@pytest.mark.timeout(180)
def test_the_users_script_sets_users_and_permissions_on_a_running_cluster(tmp_path, rabbitmq_cluster):
    """`sh users.sh`, written by `fedge broker --write-rabbitmq-config DIR --users FILE`, on one node: a new user
    exists on every node with fedge's permissions; written again without it, the user is deleted; a users file
    that lacks a user's password stops the script, which names it."""
    first, other = rabbitmq_cluster.nodes[0], rabbitmq_cluster.nodes[2]
    ctl = tmp_path / "rabbitmqctl"  # rabbitmqctl with this cluster's environment
    env = " ".join(f"{k}={shlex.quote(first.env()[k])}" for k in ("HOME", "ERL_EPMD_PORT"))
    ctl.write_text(f'#!/bin/sh\nexec env {env} {RABBITMQ_BIN / "rabbitmqctl"} -n {first.name} "$@"\n')
    ctl.chmod(0o700)

    def apply(users: dict[str, str], *argument: str) -> subprocess.CompletedProcess:
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
        assert not any(p in (tmp_path / "conf" / "users.sh").read_text() for p in users.values())
        return run_script(*argument)

    def run_script(*argument: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["sh", str(tmp_path / "conf" / "users.sh"), *argument],
            env={"PATH": "/usr/bin:/bin", "RABBITMQCTL": str(ctl)},
            capture_output=True,
            text=True,
            timeout=150,
        )

    c_password = generate_users(["c"])["c"]
    try:
        done = apply(rabbitmq_cluster.users | {"c": c_password})
        assert done.returncode == 0 and f"fedge: {len(rabbitmq_cluster.users) + 1} users set" in done.stdout, done
        c = mqtt_client(other.url, "c", c_password, client_id=mqtt_client_id("c"), protocol=MQTTv311)
        assert subscribe(c, "fedge/r/task/c") == [1]
        publish(c, "fedge/r/result/c", b"own topic")
        c.publish("fedge/r/result/a", b"forged", qos=1)
        assert closed_by_broker(c)
        close(connect_as(rabbitmq_cluster, "a"))  # the others' passwords are the ones they had

        done = apply(rabbitmq_cluster.users)
        assert done.returncode == 0, done
        assert connack_code(other.url, "c", c_password, client_id=mqtt_client_id("c"), protocol=MQTTv311) != 0

        (tmp_path / "short").write_text("server:x\n")
        done = run_script(str(tmp_path / "short"))
        assert done.returncode != 0 and "no password for 0 in" in done.stderr, done
    finally:
        if "c" in first.ctl("-s", "list_users"):
            first.ctl("delete_user", "c")
