"""A federation of many simulated clients over a broker: rounds per minute and memory, 10 → 300 clients.

    python bench/scale.py [--clients 10,30,100] [--rounds 3] [--processes 4] [--broker mosquitto,rabbitmq]

For each broker and fleet size, in this one run: the broker with a fedge-written config (a password per client,
topic ACLs or permissions): one Mosquitto, or a 3-node RabbitMQ cluster on this machine (tests/helpers/rabbitmq.py,
every node given to every connection, which start spread over the nodes); `fedge server` as its own process, and
the clients as `--processes` `fedge client` processes (each client with its own MQTT connection), every client
active in every round, FedAvg on a tiny CNN with a few samples each, so the numbers show the system's overhead
rather than training. Prints rounds per minute, the server process's and the broker's peak RSS (the cluster's: its
three Erlang VMs together, peak since the cluster started), and the rounds' time and server memory relative to the
first row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers.rabbitmq: a local cluster

from bench.compare import hardware  # noqa: E402
from bench.transfer import MOSQUITTO  # noqa: E402
from fedge.brokers.access import generate_users  # noqa: E402
from fedge.brokers.mosquitto import write_mosquitto_config  # noqa: E402
from fedge.config import config_from  # noqa: E402
from launch.federation import write_secrets  # noqa: E402

from helpers.brokers import free_port  # noqa: E402
from helpers.rabbitmq import RabbitCluster, rabbitmq_available  # noqa: E402

TIMEOUT_S = 900


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, in MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def fedge_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


def one_fleet(n: int, rounds: int, processes: int, work: Path, cluster: RabbitCluster | None) -> dict[str, float]:
    """Run one federation of `n` clients on a new Mosquitto, or on the running RabbitMQ `cluster` (whose users
    include them); rounds per minute and the server's and broker's peak RSS."""
    ids = [str(i) for i in range(n)]
    kind = "rabbitmq" if cluster else "mosquitto"
    if cluster is None:
        users = generate_users(ids)
        port = free_port()
        conf = write_mosquitto_config(work / f"mosq-{n}", users, port=port, run_as="root")
        mosq = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url, broker_pids = f"mqtt://127.0.0.1:{port}", [mosq.pid]
    else:
        users = {u: cluster.users[u] for u in (*ids, "server")}
        url = cluster.url
        broker_pids = [node.vm_pid for node in cluster.nodes]
    secrets = work / f"passwords-{kind}-{n}"
    write_secrets(secrets, users)
    cfg = config_from(
        dict(
            strategy="fedavg",
            dataset="mnist-5k",
            zoo="cnn1",
            clients=n,
            active=n,
            rounds=rounds,
            local_epochs=1,
            max_samples_per_client=16,
            heartbeat_s=5.0,
            register_timeout_s=600.0,
            out=str(work / f"run-{kind}-{n}"),
            run_id=f"scale-{kind}-{n}",
        )
    )
    config = work / f"config-{kind}-{n}.json"
    config.write_text(cfg.to_json())
    time.sleep(0.5)
    server = subprocess.Popen(
        fedge_cmd("server", "--broker", url, "--config", str(config), "--password-file", str(secrets), "--no-progress"),
        stdout=subprocess.DEVNULL,
        stderr=open(work / f"server-{kind}-{n}.log", "w"),
    )
    clients = [
        subprocess.Popen(
            fedge_cmd(
                "client",
                "--broker",
                url,
                "--config",
                str(config),
                "--id",
                ",".join(ids[k::processes]),
                "--password-file",
                str(secrets),
                "--threads",
                "1",
            ),
            stdout=subprocess.DEVNULL,
            stderr=open(work / f"clients-{kind}-{n}-{k}.log", "w"),
        )
        for k in range(min(processes, n))
    ]
    peak = 0.0
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while server.poll() is None and time.monotonic() < deadline:
            peak = max(peak, peak_rss_mb(server.pid) or 0.0)
            time.sleep(0.2)
        broker_mb = sum(peak_rss_mb(pid) or 0.0 for pid in broker_pids)
        if server.returncode != 0:
            raise RuntimeError(f"server failed for {n} clients on {kind}: see {work}/server-{kind}-{n}.log")
        summary = json.loads((work / f"run-{kind}-{n}" / "summary.json").read_text())
    finally:
        for p in (server, *clients):
            if p.poll() is None:
                p.terminate()
        for p in clients:
            p.wait(30)
        if cluster is None:
            mosq.terminate()
            mosq.wait()
    round_seconds = summary["wall_seconds"] / rounds
    return {
        "broker": kind,
        "broker_peak_mb": broker_mb,
        "clients": n,
        "rounds_per_min": 60 / round_seconds,
        "round_s": round_seconds,
        "server_peak_mb": peak,
        "rejected": sum(summary["rejected_messages"].values()),
        "replies": sum(
            1
            for line in (work / f"run-{kind}-{n}" / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["trained"]
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="10,30,100")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--broker", default="mosquitto", help="comma-separated: mosquitto, rabbitmq (a 3-node cluster)")
    args = p.parse_args()
    brokers = [b.strip() for b in args.broker.split(",")]
    sizes = [int(c) for c in args.clients.split(",")]
    if "mosquitto" in brokers and not os.path.exists(MOSQUITTO):
        sys.exit(f"needs Mosquitto at {MOSQUITTO} (apt-get install mosquitto)")
    if "rabbitmq" in brokers and not rabbitmq_available():
        sys.exit("needs RabbitMQ (apt-get install rabbitmq-server)")
    print(
        f"hardware: {hardware()}; {args.processes} client processes, FedAvg cnn1, 1 epoch of 16 samples, "
        f"{args.rounds} rounds, all clients active"
    )
    print(
        f"{'broker':>9s} {'clients':>7s} {'rounds/min':>10s} {'s/round':>8s} {'server MB':>9s} {'broker MB':>9s} "
        f"{'x s/round':>9s} {'x MB':>6s} {'replies':>7s} {'rejected':>8s}"
    )
    base = None
    with tempfile.TemporaryDirectory(prefix="fedge-scale-") as tmp:
        for kind in brokers:
            cluster = None
            if kind == "rabbitmq":
                cluster = RabbitCluster(Path(tmp) / "rabbitmq", generate_users(str(i) for i in range(max(sizes))))
                cluster.start()
            try:
                for n in sizes:
                    r = one_fleet(n, args.rounds, args.processes, Path(tmp), cluster)
                    base = base or r
                    print(
                        f"{kind:>9s} {n:7d} {r['rounds_per_min']:10.1f} {r['round_s']:8.2f} "
                        f"{r['server_peak_mb']:9.0f} {r['broker_peak_mb']:9.0f} {r['round_s'] / base['round_s']:9.2f} "
                        f"{r['server_peak_mb'] / base['server_peak_mb']:6.2f} {r['replies']:7.0f} {r['rejected']:8.0f}",
                        flush=True,
                    )
            finally:
                if cluster is not None:
                    cluster.stop()


if __name__ == "__main__":
    main()
