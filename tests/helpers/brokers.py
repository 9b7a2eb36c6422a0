"""Real MQTT brokers and clients for tests: free ports, a Mosquitto subprocess, fixtures, small paho helpers.

Fixtures: ``embedded_broker`` (fedge's amqtt broker), ``mosquitto_broker`` (a real Mosquitto) and
``rabbitmq_broker`` (the session's RabbitMQ cluster, helpers.rabbitmq), each with users for clients "a" and "b"
plus the server user. The Mosquitto fixture skips when the binary is missing, unless FEDGE_REQUIRE_MOSQUITTO is
set (CI), in which case it fails; RabbitMQ's likewise with FEDGE_REQUIRE_RABBITMQ.
"""

from __future__ import annotations

import os
import pwd
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedge.brokers.access import DEFAULT_SERVER_USER, TlsFiles, generate_users
from fedge.brokers.embedded_broker import EmbeddedBroker
from fedge.brokers.mosquitto import write_mosquitto_config
from fedge.brokers.mqtt import first_address, mqtt_client_id, parse_broker

MOSQUITTO = os.environ.get("FEDGE_MOSQUITTO", "/usr/sbin/mosquitto")
CLIENT_IDS = ("a", "b")
TIMEOUT_S = 10.0  # any single wait for a broker or a packet


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS's pick for port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float = TIMEOUT_S, alive=lambda: True) -> None:
    """Return once ``host:port`` accepts a TCP connection; RuntimeError after ``timeout`` or when not ``alive()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing accepts connections on {host}:{port}")


def mosquitto_available() -> bool:
    return shutil.which(MOSQUITTO) is not None


def require_broker(available: bool, missing: str, required_by: str) -> None:
    """Skip the calling test when a broker is not ``available`` (saying what is ``missing``), or fail it when the
    environment variable ``required_by`` is set (CI)."""
    if available:
        return
    if os.environ.get(required_by):
        pytest.fail(missing)
    pytest.skip(missing)


def require_mosquitto() -> None:
    """Skip the calling test without Mosquitto, or fail it when FEDGE_REQUIRE_MOSQUITTO is set."""
    missing = f"Mosquitto not found at {MOSQUITTO} (apt-get install mosquitto, or set FEDGE_MOSQUITTO)"
    require_broker(mosquitto_available(), missing, "FEDGE_REQUIRE_MOSQUITTO")


class MosquittoProcess:
    """A Mosquitto subprocess configured by fedge.brokers.mosquitto.write_mosquitto_config in ``directory``.

    Its log goes to ``directory/mosquitto.log`` and is printed by stop() only when ``print_log`` is set (a
    fixture's output is shown by pytest only for a failed test).
    """

    def __init__(
        self,
        directory: Path,
        users: dict[str, str],
        port: int | None = None,
        *,
        tls: TlsFiles | None = None,
        persistence: bool = False,
        server_user: str = DEFAULT_SERVER_USER,
        print_log: bool = False,
    ) -> None:
        require_mosquitto()  # every test that starts one skips without Mosquitto (fails under FEDGE_REQUIRE_MOSQUITTO)
        self.directory = Path(directory)
        self.users = users
        self.port = port or free_port()
        self.print_log = print_log
        self.conf = write_mosquitto_config(
            self.directory,
            users,
            port=self.port,
            tls=tls,
            server_user=server_user,
            persistence_dir=self.directory / "db" if persistence else None,
            run_as=pwd.getpwuid(os.getuid()).pw_name,
        )  # as root, Mosquitto would switch to "mosquitto" otherwise
        if persistence:
            (self.directory / "db").mkdir(exist_ok=True)
        self.log_path = self.directory / "mosquitto.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> MosquittoProcess:
        """Start Mosquitto and return once its port accepts connections; RuntimeError (with its log) if not."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=log, stderr=log)
        try:
            wait_for_port("127.0.0.1", self.port, alive=lambda: self.process.poll() is None)
        except RuntimeError:
            self.kill()
            raise RuntimeError(f"Mosquitto did not start:\n{self.log()}") from None
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Send ``sig`` and wait for the exit (SIGKILL after TIMEOUT_S); return the exit status."""
        if self.process is None:
            return None
        process, self.process = self.process, None
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.print_log:
            print(f"--- {self.log_path} ---\n{self.log()}")
        return process.returncode

    def kill(self) -> int | None:
        """SIGKILL: a crash, no chance to save state."""
        return self.stop(signal.SIGKILL)

    def restart(self) -> MosquittoProcess:
        """Stop (gracefully) and start again on the same port with the same files."""
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> MosquittoProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------------------------
# paho clients


@dataclass
class Inbox:
    """What a test client received: messages, CONNACK and SUBACK reason codes (paho's userdata)."""

    messages: queue.Queue[mqtt.MQTTMessage] = field(default_factory=queue.Queue)
    connack: queue.Queue[int] = field(default_factory=queue.Queue)
    subacks: dict[int, list[int]] = field(default_factory=dict)
    suback_arrived: threading.Condition = field(default_factory=threading.Condition)


def _on_connect(client, inbox: Inbox, flags, reason_code, properties) -> None:
    inbox.connack.put(reason_code.value)


def _on_subscribe(client, inbox: Inbox, mid, reason_codes, properties) -> None:
    with inbox.suback_arrived:
        inbox.subacks[mid] = [rc.value for rc in reason_codes]
        inbox.suback_arrived.notify_all()


def _on_message(client, inbox: Inbox, message) -> None:
    inbox.messages.put(message)


def _client(
    url: str,
    username: str | None,
    password: str | None,
    client_id: str | None,
    protocol: mqtt.MQTTProtocolVersion,
    ca_certs: Path | None,
) -> tuple[mqtt.Client, int]:
    """A paho client after its first CONNACK (or connection loss): the client and the CONNACK code (-1: none)."""
    inbox = Inbox()
    client_id = client_id if client_id is not None else (username or "")
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, userdata=inbox, protocol=protocol)
    client.on_connect, client.on_subscribe, client.on_message = _on_connect, _on_subscribe, _on_message
    client.on_connect_fail = lambda c, inbox: inbox.connack.put(-1)
    client.on_disconnect = lambda c, inbox, flags, rc, props: inbox.connack.put(-1)
    if username is not None:
        client.username_pw_set(username, password)
    if ca_certs is not None:
        client.tls_set(ca_certs=str(ca_certs))
    parts = urlsplit(url)
    client.connect(parts.hostname, parts.port, keepalive=10)
    client.loop_start()
    try:
        code = inbox.connack.get(timeout=TIMEOUT_S)
    except queue.Empty:
        code = -1
    return client, code


def connack_code(
    url: str,
    username: str | None,
    password: str | None = None,
    client_id: str | None = None,
    protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv5,
    ca_certs: Path | None = None,
) -> int:
    """The broker's CONNACK reason code for this login (0 accepted, ≥ 1 refused, -1 connection lost); disconnects."""
    try:
        client, code = _client(url, username, password, client_id, protocol, ca_certs)
    except (OSError, ValueError):
        return -1
    close(client)
    return code


def mqtt_client(
    url: str,
    username: str,
    password: str,
    client_id: str | None = None,
    protocol: mqtt.MQTTProtocolVersion = mqtt.MQTTv5,
    ca_certs: Path | None = None,
) -> mqtt.Client:
    """A connected paho client (callback API 2, loop running) whose userdata is an Inbox; AssertionError if refused.

    The client id defaults to the username, as fedge requires.
    """
    client, code = _client(url, username, password, client_id, protocol, ca_certs)
    if code != 0:
        close(client)
        raise AssertionError(f"{username} could not connect to {url}: CONNACK {code}")
    return client


def connect_as(broker, username: str, **kw) -> mqtt.Client:
    """mqtt_client for one of ``broker``'s users, in the protocol the broker speaks (amqtt and RabbitMQ 3.10: 3.1.1
    only), with a client id as fedge makes them (fedge.brokers.mqtt.mqtt_client_id); on a RabbitMQ cluster, to the node
    fedge would pick for ``username`` first (so "a", "b" and the server meet on different nodes)."""
    kw.setdefault("protocol", protocol_of(broker))
    kw.setdefault("client_id", mqtt_client_id(username))
    return mqtt_client(url_of(broker, username), username, broker.users[username], **kw)


def protocol_of(broker) -> mqtt.MQTTProtocolVersion:
    return mqtt.MQTTv5 if isinstance(broker, MosquittoProcess) else mqtt.MQTTv311


def url_of(broker, username: str) -> str:
    """The single broker URL ``username`` connects to: on a cluster (a comma-separated ``url``), the node fedge's
    Endpoint tries first for that name."""
    if "," not in broker.url:
        return broker.url
    return broker.url.split(",")[first_address(parse_broker(broker.url), username)]


def closed_by_broker(client: mqtt.Client, timeout: float = TIMEOUT_S) -> bool:
    """Whether the broker closes ``client``'s connection within ``timeout`` (RabbitMQ's answer to a forbidden
    publish or subscribe); the client is then closed, so that it does not reconnect."""
    inbox: Inbox = client.user_data_get()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if inbox.connack.get(timeout=max(0.01, deadline - time.monotonic())) == -1:
                return True
    except queue.Empty:
        pass
    finally:
        close(client)
    return False


def subscribe(client: mqtt.Client, topic: str, qos: int = 1) -> list[int]:
    """Subscribe and return the SUBACK reason codes (≥ 0x80 means refused)."""
    inbox: Inbox = client.user_data_get()
    result, mid = client.subscribe(topic, qos)
    assert result == mqtt.MQTT_ERR_SUCCESS, result
    with inbox.suback_arrived:
        assert inbox.suback_arrived.wait_for(lambda: mid in inbox.subacks, TIMEOUT_S), f"no SUBACK for {topic}"
        return inbox.subacks.pop(mid)


def publish(client: mqtt.Client, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
    """Publish and wait until the broker acknowledged it (QoS ≥ 1) or it was written (QoS 0)."""
    info = client.publish(topic, payload, qos=qos, retain=retain)
    info.wait_for_publish(TIMEOUT_S)
    assert info.is_published(), f"{topic} was not acknowledged"


def next_message(client: mqtt.Client, timeout: float = TIMEOUT_S) -> mqtt.MQTTMessage:
    """The next message the client received; AssertionError if none comes within ``timeout``."""
    try:
        return client.user_data_get().messages.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no message within {timeout:g} s") from None


def pending(client: mqtt.Client) -> list[mqtt.MQTTMessage]:
    """Messages received and not yet taken by next_message (emptied)."""
    out, messages = [], client.user_data_get().messages
    while not messages.empty():
        out.append(messages.get_nowait())
    return out


def close(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


# ---------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture
def embedded_broker():
    """fedge's embedded amqtt broker with users "a", "b" and the server (``.users`` holds the passwords)."""
    with EmbeddedBroker(users=generate_users(CLIENT_IDS)) as broker:
        yield broker


@pytest.fixture
def rabbitmq_broker(rabbitmq_cluster):
    """The session's 3-node RabbitMQ cluster (users "a", "b" and the server among others)."""
    return rabbitmq_cluster


@pytest.fixture
def mosquitto_broker(tmp_path):
    """A real Mosquitto with users "a", "b" and the server, configured by write_mosquitto_config."""
    require_mosquitto()
    with MosquittoProcess(tmp_path / "mosquitto", generate_users(CLIENT_IDS), print_log=True) as broker:
        yield broker
