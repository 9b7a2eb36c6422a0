"""A federation of many simulated clients over Mosquitto: rounds per minute and server memory, 10 → 100 clients.

    python bench/scale.py [--clients 10,30,100] [--rounds 3] [--processes 4]

For each fleet size, in this one run: Mosquitto with a fedge-written config (a password per client,
topic ACLs), `fedge server` as its own process, and the clients as `--processes` `fedge client`
processes (each client with its own MQTT connection), every client active in every round, FedAvg on a
tiny CNN with a few samples each, so the numbers show the system's overhead rather than training.
Prints rounds per minute, the server process's peak RSS, and both relative to the smallest fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from bench.transfer import MOSQUITTO  # noqa: E402
from fedge.access import generate_users  # noqa: E402
from fedge.config import config_from  # noqa: E402
from fedge.mosquitto import write_mosquitto_config  # noqa: E402
from launch.federation import write_secrets  # noqa: E402

TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def one_fleet(n: int, rounds: int, processes: int, work: Path) -> dict[str, float]:
    """Run one federation of `n` clients; rounds per minute and the server's peak RSS."""
    ids = [str(i) for i in range(n)]
    users = generate_users(ids)
    port = free_port()
    conf = write_mosquitto_config(work / f"mosq-{n}", users, port=port, run_as="root")
    mosq = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    secrets = work / f"passwords-{n}"
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
            out=str(work / f"run-{n}"),
            run_id=f"scale{n}",
        )
    )
    config = work / f"config-{n}.json"
    config.write_text(cfg.to_json())
    url = f"mqtt://127.0.0.1:{port}"
    time.sleep(0.5)
    server = subprocess.Popen(
        fedge_cmd("server", "--broker", url, "--config", str(config), "--password-file", str(secrets), "--no-progress"),
        stdout=subprocess.DEVNULL,
        stderr=open(work / f"server-{n}.log", "w"),
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
            stderr=open(work / f"clients-{n}-{k}.log", "w"),
        )
        for k in range(min(processes, n))
    ]
    peak = 0.0
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while server.poll() is None and time.monotonic() < deadline:
            peak = max(peak, peak_rss_mb(server.pid) or 0.0)
            time.sleep(0.2)
        if server.returncode != 0:
            raise RuntimeError(f"server failed for {n} clients: see {work}/server-{n}.log")
        summary = json.loads((work / f"run-{n}" / "summary.json").read_text())
    finally:
        for p in (server, *clients):
            if p.poll() is None:
                p.terminate()
        for p in clients:
            p.wait(30)
        mosq.terminate()
        mosq.wait()
    round_seconds = summary["wall_seconds"] / rounds
    return {
        "clients": n,
        "rounds_per_min": 60 / round_seconds,
        "round_s": round_seconds,
        "server_peak_mb": peak,
        "rejected": sum(summary["rejected_messages"].values()),
        "replies": sum(
            1 for line in (work / f"run-{n}" / "metrics.jsonl").read_text().splitlines() if json.loads(line)["trained"]
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="10,30,100")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--processes", type=int, default=4)
    args = p.parse_args()
    if not os.path.exists(MOSQUITTO):
        sys.exit(f"needs Mosquitto at {MOSQUITTO} (apt-get install mosquitto)")
    print(
        f"hardware: {hardware()}; {args.processes} client processes, FedAvg cnn1, 1 epoch of 16 samples, "
        f"{args.rounds} rounds, all clients active"
    )
    print(
        f"{'clients':>7s} {'rounds/min':>10s} {'s/round':>8s} {'server MB':>9s} {'x clients':>9s} "
        f"{'x s/round':>9s} {'x MB':>6s} {'replies':>7s} {'rejected':>8s}"
    )
    base = None
    with tempfile.TemporaryDirectory(prefix="fedge-scale-") as tmp:
        for n in (int(c) for c in args.clients.split(",")):
            r = one_fleet(n, args.rounds, args.processes, Path(tmp))
            base = base or r
            print(
                f"{n:7d} {r['rounds_per_min']:10.1f} {r['round_s']:8.2f} {r['server_peak_mb']:9.0f} "
                f"{n / base['clients']:9.1f} {r['round_s'] / base['round_s']:9.2f} "
                f"{r['server_peak_mb'] / base['server_peak_mb']:6.2f} {r['replies']:7.0f} {r['rejected']:8.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
