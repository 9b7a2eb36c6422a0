"""A real RabbitMQ cluster on 127.0.0.1 for tests and benchmarks: nodes configured by fedge.brokers.rabbitmq's files,
each
with its own node name, MQTT port and Erlang distribution port, one epmd on a port of the cluster's own; every
listener (MQTT, distribution, epmd) bound to 127.0.0.1.

The fixture ``rabbitmq_cluster`` is one 3-node cluster for the whole test session, with users "a", "b", "0".."2"
and the server. It skips without RabbitMQ (``apt-get install rabbitmq-server``), unless FEDGE_REQUIRE_RABBITMQ is
set (CI), in which case it fails. A test that kills a node starts it again before it ends (``restart``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from fedge.brokers.access import generate_users
from fedge.brokers.rabbitmq import write_rabbitmq_config
from launch.federation import write_secrets

from helpers.brokers import CLIENT_IDS, free_port, require_broker, wait_for_port

RABBITMQ_BIN = Path(os.environ.get("FEDGE_RABBITMQ", "/usr/lib/rabbitmq/bin"))
BOOT_S = 90.0  # a node's boot, plugins and MQTT listener included (about 5 s here, far more on a loaded machine)
CTL_S = 60.0
FEDERATION_IDS = ("0", "1", "2")  # the clients a federation test may run on the session cluster


def rabbitmq_available() -> bool:
    return (RABBITMQ_BIN / "rabbitmq-server").exists() and shutil.which("erl") is not None


def require_rabbitmq() -> None:
    """Skip the calling test without RabbitMQ, or fail it when FEDGE_REQUIRE_RABBITMQ is set."""
    missing = f"RabbitMQ not found in {RABBITMQ_BIN} (apt-get install rabbitmq-server, or set FEDGE_RABBITMQ)"
    require_broker(rabbitmq_available(), missing, "FEDGE_REQUIRE_RABBITMQ")


class RabbitNode:
    """One node: its name, ports, files (written by fedge.brokers.rabbitmq into its own directory) and process."""

    def __init__(self, cluster: RabbitCluster, index: int) -> None:
        self.cluster, self.index = cluster, index
        self.name = f"fedge{index}@localhost"
        self.port, self.dist_port = free_port(), free_port()
        self.directory = cluster.directory / f"node{index}"
        self.conf = write_rabbitmq_config(
            self.directory, cluster.users, cluster.users_file, port=self.port, run_as="root"
        )  # started directly (not by Debian's wrapper), RabbitMQ runs as whoever starts it
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "log" / f"{self.name}.log"

    def env(self) -> dict[str, str]:
        d = self.directory
        return os.environ | {
            "HOME": str(self.cluster.home),  # the Erlang cookie, shared by the nodes and rabbitmqctl
            "RABBITMQ_CONF_ENV_FILE": str(d / "no-rabbitmq-env.conf"),  # not /etc/rabbitmq's
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(self.conf),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PID_FILE": str(d / "pid"),
            "ERL_EPMD_PORT": str(self.cluster.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            # distribution on loopback only; no busy-waiting schedulers (the nodes share 2 cores with the suite)
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1} "
            "+sbwt none +sbwtdcpu none +sbwtdio none",
        }

    def launch(self) -> None:
        """Start the node's process (it boots in the background)."""
        with open(self.directory / "stdout.log", "ab") as out:
            self.process = subprocess.Popen(
                [str(RABBITMQ_BIN / "rabbitmq-server")], env=self.env(), stdout=out, stderr=out, cwd=self.directory
            )

    def wait_ready(self) -> None:
        """Return once the node's MQTT listener accepts connections; RuntimeError (with its log) if it does not."""
        try:
            wait_for_port("127.0.0.1", self.port, BOOT_S, alive=lambda: self.process.poll() is None)
        except RuntimeError:
            raise RuntimeError(f"RabbitMQ node {self.name} did not start:\n{self.log()}") from None

    def ctl(self, *args: str, input: str | None = None) -> str:
        """rabbitmqctl against this node; RuntimeError with its output when it fails."""
        done = subprocess.run(
            [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.name, *args],
            env=self.env(),
            input=input,
            capture_output=True,
            text=True,
            timeout=CTL_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} on {self.name} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    @property
    def vm_pid(self) -> int | None:
        """The node's Erlang VM (the start script's child), from the pid file it writes once booted."""
        pid_file = self.directory / "pid"
        return int(pid_file.read_text().split()[0]) if pid_file.exists() else None

    def kill(self) -> None:
        """SIGKILL the Erlang VM: a crash; its connections vanish without a will or a goodbye."""
        if self.process is None:
            return
        os.kill(self.vm_pid, signal.SIGKILL)
        self.process.wait(CTL_S)
        self.process = None

    def stop(self) -> None:
        """Stop gracefully (SIGTERM to the start script, which stops the VM), SIGKILL after a while."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(CTL_S)
            except subprocess.TimeoutExpired:
                if self.vm_pid is not None:
                    os.kill(self.vm_pid, signal.SIGKILL)
                process.kill()
                process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20_000:] if self.log_path.exists() else "(no log)"


class RabbitCluster:
    """``nodes`` RabbitMQ nodes on 127.0.0.1 joined into one cluster, with fedge's users and permissions (loaded
    from definitions.json at boot). ``url`` lists every node's MQTT listener."""

    def __init__(self, directory: Path, users: dict[str, str], nodes: int = 3) -> None:
        require_rabbitmq()
        self.directory, self.users = Path(directory), users
        self.directory.mkdir(parents=True, exist_ok=True)
        self.home = self.directory / "home"
        self.home.mkdir(exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20))
        cookie.chmod(0o400)
        self.users_file = self.directory / "users"
        write_secrets(self.users_file, users)
        self.epmd_port = free_port()
        self.nodes = [RabbitNode(self, i) for i in range(nodes)]

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def start(self) -> RabbitCluster:
        """Boot every node at once, then join the others to the first (stop_app, reset, join_cluster, start_app)."""
        try:
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.wait_ready()
            first = self.nodes[0]
            for node in self.nodes[1:]:
                node.ctl("stop_app")
                node.ctl("reset")
                node.ctl("join_cluster", first.name)
                node.ctl("start_app")
                node.wait_ready()
            running = first.ctl("eval", "length(rabbit_nodes:all_running()).").strip()
            assert running == str(len(self.nodes)), f"{running} of {len(self.nodes)} nodes running"
        except BaseException:
            for node in self.nodes:
                print(f"--- {node.name} ---\n{node.log()}")
            self.stop()
            raise
        return self

    def restart(self, node: RabbitNode) -> None:
        """Start a stopped or killed node again: it rejoins the cluster from its own database."""
        node.launch()
        node.wait_ready()

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        subprocess.run(["epmd", "-kill"], env=os.environ | {"ERL_EPMD_PORT": str(self.epmd_port)}, capture_output=True)

    def __enter__(self) -> RabbitCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def rabbitmq_cluster(tmp_path_factory):
    """One 3-node RabbitMQ cluster for the session: users "a", "b", "0".."2" and the server."""
    require_rabbitmq()
    users = generate_users([*CLIENT_IDS, *FEDERATION_IDS])
    with RabbitCluster(tmp_path_factory.mktemp("rabbitmq"), users) as cluster:
        yield cluster
