"""Whole federations over MQTT with real processes: `fedge run` on the embedded broker, and `fedge server`
+ `fedge client` processes against a Mosquitto configured by `fedge broker --write-mosquitto-config`."""

import json
import os
import pwd
import subprocess
import sys
import threading

import pytest

from fedge.brokers.access import generate_users
from fedge.brokers.mqtt import Broker
from fedge.config import RunConfig, config_from
from launch.federation import write_secrets
from launch.server import serve

from helpers.brokers import MOSQUITTO, free_port, require_mosquitto, wait_for_port
from helpers.federation import final_snapshots, run_inproc, same_tree

pytestmark = pytest.mark.timeout(300)
IDS = ["0", "1", "2"]


def tiny(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        strategy="pfedclub",
        dataset="digits",
        zoo="I",
        clients=3,
        active=3,
        rounds=2,
        local_epochs=1,
        batch_size=16,
        seed=5,
        out=str(tmp_path / name),
        heartbeat_s=1.0,
        round_deadline_s=120.0,
        register_timeout_s=120.0,
        run_id="t1",
    )
    small = {"finetune_epochs": 1, "finetune_min_steps": 0} if kw.get("strategy", "pfedclub") == "pfedclub" else {}
    return config_from(base | small | kw)


def fedge(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, timeout=240, **kw
    )


def client_process(url: str, config: str, ids: str, secrets, state) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "client",
            "--broker",
            url,
            "--config",
            config,
            "--id",
            ids,
            "--password-file",
            str(secrets),
            "--state-dir",
            str(state),
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_fedge_run_over_the_embedded_broker_matches_inproc(tmp_path):
    """`fedge run` (MQTT, clients as processes) gives the same per-client accuracies as the in-process run."""
    cfg = tiny(tmp_path, "mqtt")
    done = fedge("run", "--config", _write(tmp_path, cfg), "--processes", "2", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "mqtt" / "summary.json").read_text())
    assert summary["transport"]["run_id"] == "t1" and not summary["rejected_messages"]
    assert summary["broker"] == {"kind": "embedded", "refused": {}, "takeovers": {}}  # its own broker's counters
    assert sorted(summary["final_accuracy"]["per_client"]) == IDS
    assert {p.name for p in (tmp_path / "mqtt").glob("clients-*.log")} == {"clients-0.log", "clients-1.log"}
    inproc = run_inproc(tiny(tmp_path, "inproc"))
    assert summary["final_accuracy"]["per_client"] == inproc["final_accuracy"]["per_client"]
    # and the same models, bit for bit: each client process trains at one torch thread, as the in-process run does
    mqtt_models, inproc_models = final_snapshots(tmp_path / "mqtt"), final_snapshots(tmp_path / "inproc")
    assert mqtt_models.keys() == inproc_models.keys() == set(IDS)
    assert all(same_tree(mqtt_models[cid], inproc_models[cid]) for cid in IDS)
    # the simulated clock agrees (a reply's bytes hold the client's wall-clock train_seconds, a few bytes apart)
    assert summary["train_macs_total"] == inproc["train_macs_total"] > 0
    assert summary["network_bytes_total"] == pytest.approx(inproc["network_bytes_total"], rel=1e-4)
    assert summary["sim_seconds_total"] == pytest.approx(inproc["sim_seconds_total"], rel=1e-4)


def _write(tmp_path, cfg: RunConfig) -> str:
    path = tmp_path / f"{os.path.basename(cfg.out)}.json"
    path.write_text(cfg.to_json())
    return str(path)


def test_server_and_clients_on_mosquitto_with_acls(tmp_path):
    """The deployment shape: Mosquitto from fedge's config (passwords, ACLs), `fedge client` processes, the
    server; a client presenting another client's password is refused and says so."""
    require_mosquitto()
    users = generate_users(IDS)
    port = free_port()
    written = fedge(
        "broker",
        "--write-mosquitto-config",
        str(tmp_path / "conf"),
        "--users",
        _users(tmp_path, users),
        "--port",
        str(port),
        "--run-as",
        pwd.getpwuid(os.getuid()).pw_name,
    )
    assert written.returncode == 0 and "mosquitto -c" in written.stdout, written.stderr
    with mosquitto_from(tmp_path / "conf" / "mosquitto.conf", port) as mosq:
        cfg = tiny(tmp_path, "run", strategy="fedavg", zoo="cnn1", rounds=2)
        config = _write(tmp_path, cfg)
        secrets = tmp_path / "passwords"
        write_secrets(secrets, users)
        wrong = tmp_path / "wrong"
        write_secrets(wrong, {"1": users["0"]})  # client 1 with client 0's password
        refused = fedge("client", "--broker", mosq.url, "--config", config, "--id", "1", "--password-file", str(wrong))
        assert refused.returncode == 2
        assert "refused" in refused.stderr and users["0"] not in refused.stderr + refused.stdout
        procs = [client_process(mosq.url, config, ids, secrets, tmp_path / "state") for ids in ("0,1", "2")]
        result: dict = {}
        server = threading.Thread(
            target=lambda: result.update(
                serve(cfg, Broker("127.0.0.1", mosq.port, username="server", password=users["server"]), progress=False)
            )
        )
        server.start()
        try:
            server.join(240)
            outputs = [p.communicate(timeout=60)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert not server.is_alive() and result, "\n".join(outputs)
        assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
        assert sorted(result["final_accuracy"]["per_client"]) == IDS and not result["rejected_messages"]
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert {(r["round"], r["client"]) for r in rows if r["trained"]} == {(r, c) for r in range(2) for c in IDS}
        assert all(users[u] not in "".join(outputs) for u in users)  # no secrets in logs


class mosquitto_from:
    """`mosquitto -c CONF`, as a user would start it, stopped on exit."""

    def __init__(self, conf, port: int) -> None:
        self.conf, self.port, self.url = conf, port, f"mqtt://127.0.0.1:{port}"

    def __enter__(self):
        self.process = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        wait_for_port("127.0.0.1", self.port, alive=lambda: self.process.poll() is None)
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(10)


def _users(tmp_path, users: dict[str, str]) -> str:
    path = tmp_path / "users"
    write_secrets(path, users)
    return str(path)
