"""Every broker (embedded amqtt, real Mosquitto, a real 3-node RabbitMQ cluster) enforces fedge's logins and
per-client topic ACL, on 127.0.0.1. On the cluster, "a", "b" and the server connect to different nodes."""

import gc
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
import pytest

from fedge import constants as C
from fedge.brokers.access import BrokerError, TlsFiles, generate_users
from fedge.brokers.embedded_broker import EmbeddedBroker, serve_forever
from fedge.brokers.mosquitto import write_mosquitto_config
from fedge.brokers.mqtt import Endpoint, MqttError, first_address, mqtt_client_id, parse_broker

from helpers.brokers import (
    MOSQUITTO,
    Inbox,
    MosquittoProcess,
    close,
    closed_by_broker,
    connack_code,
    connect_as,
    free_port,
    mqtt_client,
    next_message,
    pending,
    protocol_of,
    publish,
    require_mosquitto,
    subscribe,
    url_of,
    wait_for_port,
)
from helpers.rabbitmq import RabbitCluster

pytestmark = pytest.mark.timeout(60)

GRACE_S = 0.3  # after a barrier arrived, how long a wrongly routed message would still have to show up


@pytest.fixture(params=["embedded", "mosquitto", "rabbitmq"])
def broker(request):
    """Each test runs against every broker."""
    return request.getfixturevalue(f"{request.param}_broker")


@pytest.fixture
def clients(broker):
    """Connected clients "a", "b" and "server", closed after the test."""
    connected = {name: connect_as(broker, name) for name in ("a", "b", "server")}
    yield connected
    for client in connected.values():
        close(client)


def test_server_sends_a_task_that_only_its_client_receives(clients):
    a, b, server = clients["a"], clients["b"], clients["server"]
    assert subscribe(a, "fedge/r/task/a") == [1]
    assert subscribe(b, "fedge/r/task/b") == [1]

    publish(server, "fedge/r/task/a", b"task for a")

    message = next_message(a)
    assert (message.topic, message.payload) == ("fedge/r/task/a", b"task for a")
    time.sleep(GRACE_S)
    assert pending(b) == []


def test_every_client_receives_the_server_broadcast(clients):
    for name in ("a", "b"):
        assert subscribe(clients[name], "fedge/r/server") == [1]

    publish(clients["server"], "fedge/r/server", b"round 3")

    for name in ("a", "b"):
        assert next_message(clients[name]).payload == b"round 3"


def refused_subscription(broker, client: mqtt.Client, topic: str, user: str = "a") -> mqtt.Client:
    """Subscribe ``client`` (of ``user``) to a topic it may not read and check how ``broker`` refuses; returns a
    connection of ``user`` to go on with (RabbitMQ closes the connection instead of answering)."""
    if isinstance(broker, RabbitCluster):
        client.subscribe(topic, 1)
        assert closed_by_broker(client), "RabbitMQ left the connection open"
        return connect_as(broker, user)
    codes = subscribe(client, topic)
    if isinstance(broker, EmbeddedBroker):
        assert codes == [0x80]  # SUBACK failure
    else:
        assert codes == [1]  # Mosquitto 2.0's acl_file checks reads at delivery only, never at SUBSCRIBE
    return client


def test_a_client_cannot_subscribe_to_another_clients_tasks(broker, clients):
    a, server = clients["a"], clients["server"]

    a = clients["a"] = refused_subscription(broker, a, "fedge/r/task/b")

    # Nothing arrives either: a's own task is the barrier.
    assert subscribe(a, "fedge/r/task/a") == [1]
    publish(server, "fedge/r/task/b", b"secret")
    publish(server, "fedge/r/task/a", b"barrier")
    assert next_message(a).payload == b"barrier"
    time.sleep(GRACE_S)
    assert pending(a) == []


@pytest.mark.parametrize("pattern", ["fedge/#", "fedge/+/task/+", "#", "fedge/r/+/b"])
def test_a_wildcard_subscription_reveals_nothing_of_other_clients(broker, clients, pattern):
    a, server = clients["a"], clients["server"]
    if isinstance(broker, RabbitCluster):  # refused by closing the connection
        a = clients["a"] = refused_subscription(broker, a, pattern)
    else:
        subscribe(a, pattern)  # refused or granted: either way nothing of b's may arrive
    assert subscribe(a, "fedge/r/task/a") == [1]

    publish(server, "fedge/r/task/b", b"secret")
    publish(server, "fedge/r/task/a", b"barrier")

    received = [next_message(a)]
    time.sleep(GRACE_S)
    received += pending(a)
    assert {m.payload for m in received} == {b"barrier"}


@pytest.mark.parametrize(
    "forbidden",
    [
        "fedge/r/result/b",
        "fedge/r/register/b",
        "fedge/r/status/b",  # another client's uploads
        "fedge/r/task/a",
        "fedge/r/server",  # topics only the server writes
    ],
)
def test_a_forbidden_publish_reaches_no_subscriber(broker, clients, forbidden):
    a, server = clients["a"], clients["server"]
    assert subscribe(server, "fedge/#") == [1]

    if isinstance(broker, RabbitCluster):  # the forged publish closes the connection: the barrier needs a new one
        a.publish(forbidden, b"forged", qos=1)
        assert closed_by_broker(a), "RabbitMQ left the connection open"
        a = clients["a"] = connect_as(broker, "a")
    else:
        publish(a, forbidden, b"forged")
    publish(a, "fedge/r/result/a", b"barrier")  # same publisher, later: arrives after the forged one would have

    received = [next_message(server)]
    time.sleep(GRACE_S)
    received += pending(server)
    assert [(m.topic, m.payload) for m in received] == [("fedge/r/result/a", b"barrier")]


@pytest.mark.parametrize("login", ["wrong password", "unknown user", "anonymous", "no password"])
def test_bad_logins_are_refused(broker, login):
    user, password = {
        "wrong password": ("a", broker.users["b"]),
        "unknown user": ("mallory", "x"),
        "anonymous": (None, None),
        "no password": ("a", None),
    }[login]

    code = connack_code(url_of(broker, "a"), user, password, client_id=user or "anon", protocol=protocol_of(broker))

    assert code != 0, f"{login} was accepted"


def test_rabbitmqs_default_user_does_not_exist(rabbitmq_broker):
    assert connack_code(url_of(rabbitmq_broker, "a"), "guest", "guest", protocol=mqtt.MQTTv311) != 0


@pytest.mark.parametrize("impostor", ["right password", "wrong password", "anonymous"])
@pytest.mark.parametrize("claimed", ["b", "b.00000000000000000000000000000000"])
def test_a_connection_claiming_another_clients_id_does_not_disturb_it(broker, clients, impostor, claimed):
    """The impostor can know b's username, not the random part of its connection's client id."""
    b, server = clients["b"], clients["server"]
    assert subscribe(b, "fedge/r/task/b") == [1]
    user, password = {
        "right password": ("a", broker.users["a"]),
        "wrong password": ("b", "guess"),
        "anonymous": (None, None),
    }[impostor]

    connack_code(url_of(broker, "b"), user, password, client_id=claimed, protocol=protocol_of(broker))
    publish(server, "fedge/r/task/b", b"still yours")

    assert next_message(b).payload == b"still yours"
    assert b.is_connected()


def vanish_with_will(broker, topic: str, retain: bool = False) -> int:
    """Connect as "a" with a will on `topic`, then drop the socket without a DISCONNECT, so that a broker that
    took the will publishes it; returns the CONNACK reason code (0: accepted)."""
    codes: list[int] = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=mqtt_client_id("a"), protocol=protocol_of(broker))
    c.username_pw_set("a", broker.users["a"])
    c.will_set(topic, b"forged will", qos=1, retain=retain)
    c.on_connect = lambda client, userdata, flags, rc, props: codes.append(rc.value)
    c.connect("127.0.0.1", urlsplit(url_of(broker, "a")).port)
    c.loop_start()
    deadline = time.monotonic() + 10
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)
    c.loop_stop()
    if c.socket() is not None:
        c.socket().close()
    return codes[0] if codes else -1


@pytest.mark.parametrize("topic", ["fedge/r/task/b", "fedge/r/server", "fedge/r/status/b", "fedge/r/result/b"])
def test_a_will_on_a_topic_the_client_may_not_write_is_never_published(broker, clients, topic):
    """A will is a publish the broker makes for the client: the same ACL holds (the embedded broker refuses the
    CONNECT; Mosquitto accepts it and drops the will at publication)."""
    b, server = clients["b"], clients["server"]
    assert subscribe(server, "fedge/#") == [1] and subscribe(b, "fedge/r/task/b") == [1]
    code = vanish_with_will(broker, topic)
    assert (code not in (0, -1)) if isinstance(broker, EmbeddedBroker) else code == 0  # refused: not authorized
    time.sleep(1.0)  # the broker notices the lost socket at once; give a forged will time to arrive
    publish(server, "fedge/r/task/b", b"barrier")
    assert next_message(b).payload == b"barrier" and pending(b) == []
    assert all(m.payload != b"forged will" for m in pending(server))
    if isinstance(broker, EmbeddedBroker):
        assert broker.report()["refused"] == {"forbidden_will": 1}


def test_a_will_on_the_clients_own_status_topic_is_published(broker, clients):
    server = clients["server"]
    assert subscribe(server, "fedge/r/status/a") == [1]
    assert vanish_with_will(broker, "fedge/r/status/a") == 0
    assert next_message(server).payload == b"forged will"


def test_nothing_is_retained(broker, clients):
    """A retained will is refused at CONNECT (RabbitMQ takes it, its no-op store keeps nothing); a retained
    publish never reaches a later subscriber (Mosquitto disconnects its publisher, the embedded broker and
    RabbitMQ deliver it as an ordinary message), not even one whose SUBSCRIBE was refused."""
    a, b, server = clients["a"], clients["b"], clients["server"]
    rabbit = isinstance(broker, RabbitCluster)
    assert (vanish_with_will(broker, "fedge/r/status/a", retain=True) == 0) == rabbit
    a = connect_as(broker, "a")  # publishes as "a" (ending the fixture's connection of "a")
    try:
        a.publish("fedge/r/status/a", b"retained", qos=1, retain=True).wait_for_publish(5)
        time.sleep(GRACE_S)
        assert subscribe(server, "fedge/#") == [1]  # subscribers that came later ...
        if rabbit:  # ... one refused (RabbitMQ closes its connection; b goes on with a new one)
            b = clients["b"] = refused_subscription(broker, b, "fedge/r/status/#", "b")
        else:  # ... one refused by the embedded broker (Mosquitto grants, never delivers)
            subscribe(b, "fedge/r/status/#")
        publish(server, "fedge/r/server", b"barrier")
        assert next_message(server).payload == b"barrier"
        time.sleep(GRACE_S)
        assert pending(server) == [] and pending(b) == []
        if isinstance(broker, EmbeddedBroker):
            assert broker.report()["refused"] == {"retained_will": 1, "retained_publish": 1}
    finally:
        close(a)


def test_a_second_connection_with_the_same_client_id_ends_the_first(broker):
    """The broker ends the earlier session (Mosquitto does): the first connection is closed, not left deaf."""
    server = connect_as(broker, "server")
    client_id = mqtt_client_id("b")
    first = connect_as(broker, "b", client_id=client_id)
    dropped = threading.Event()
    first.on_disconnect = lambda *args: dropped.set()
    first.reconnect_delay_set(30, 60)  # stay away: a reconnect would in turn end the second connection
    assert subscribe(first, "fedge/r/task/b") == [1]
    second = connect_as(broker, "b", client_id=client_id)
    try:
        assert subscribe(second, "fedge/r/task/b") == [1]
        assert dropped.wait(10), "the first connection was left open"
        publish(server, "fedge/r/task/b", b"task")
        assert next_message(second).payload == b"task"
        if isinstance(broker, EmbeddedBroker):
            assert broker.takeovers == {"b": 1}
    finally:
        for c in (first, second, server):
            close(c)


def test_a_4_mib_payload_passes_both_ways(clients):
    a, server = clients["a"], clients["server"]
    payload = os.urandom(C.MAX_CHUNK_BYTES)
    assert subscribe(a, "fedge/r/task/a") == [1]
    assert subscribe(server, "fedge/r/result/+") == [1]

    publish(server, "fedge/r/task/a", payload)
    assert next_message(a, timeout=30).payload == payload
    publish(a, "fedge/r/result/a", payload[::-1])
    assert next_message(server, timeout=30).payload == payload[::-1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["embedded", "mosquitto"])
def test_many_clients_connect_at_once_and_all_get_their_task(tmp_path, kind):
    names = [f"c{i:03d}" for i in range(120)]
    users = generate_users(names)
    if kind == "mosquitto":
        require_mosquitto()
        broker = MosquittoProcess(tmp_path, users, print_log=True)
    else:
        broker = EmbeddedBroker(users=users)
    with broker:
        fleet = {n: connect_as(broker, n) for n in names}
        server = connect_as(broker, "server")
        try:
            for name, client in fleet.items():
                assert subscribe(client, f"fedge/r/task/{name}") == [1]
            for name in names:
                publish(server, f"fedge/r/task/{name}", name.encode())
            assert all(next_message(client).payload == name.encode() for name, client in fleet.items())
        finally:
            for client in [*fleet.values(), server]:
                close(client)


def test_clients_subscribing_while_the_server_broadcasts_lose_no_broadcast(caplog):
    """amqtt walked its subscription table across awaits while others subscribed: each collision raised
    "dictionary changed size during iteration" in a broadcast task and that message went to nobody after it."""
    names = [f"c{i:02d}" for i in range(60)]
    with EmbeddedBroker(users=generate_users(names)) as broker:
        server, stop = connect_as(broker, "server"), threading.Event()

        def pump() -> None:
            while not stop.is_set():
                server.publish("fedge/r/server", b"status", qos=0)
                time.sleep(0.001)

        pumping = threading.Thread(target=pump, daemon=True)
        pumping.start()
        fleet = [connect_as(broker, n) for n in names]
        try:
            for name, client in zip(names, fleet):
                assert subscribe(client, f"fedge/r/task/{name}") == [1]
                assert subscribe(client, "fedge/r/server") == [1]
            stop.set()
            pumping.join()
            publish(server, "fedge/r/server", b"last")
            for client in fleet:
                while next_message(client).payload != b"last":
                    pass
        finally:
            for client in (*fleet, server):
                close(client)
    gc.collect()  # asyncio reports a task's unretrieved exception when the task is collected
    assert "changed size during iteration" not in caplog.text


def test_the_embedded_broker_never_logs_a_password(caplog):
    users = generate_users(["a"])
    for name in ("amqtt", "transitions", "fedge"):
        caplog.set_level(logging.DEBUG, logger=name)
    with EmbeddedBroker(users=users) as broker:
        close(connect_as(broker, "a"))
        assert connack_code(broker.url, "a", users["server"], protocol=protocol_of(broker)) != 0
        assert connack_code(broker.url, "a", "typed-the-wrong-one", protocol=protocol_of(broker)) != 0

    assert "wrong password for user 'a'" in caplog.text  # the refusal is logged ...
    for secret in (*users.values(), "typed-the-wrong-one"):
        assert secret not in caplog.text  # ... without any password


def test_the_embedded_broker_refuses_mqtt_5_clearly(embedded_broker, caplog):
    caplog.set_level(logging.INFO, logger="fedge.brokers.embedded_broker")

    code = connack_code(embedded_broker.url, "a", embedded_broker.users["a"])  # MQTT 5

    assert code != 0
    assert "only 3.1.1 is served" in caplog.text


def test_anonymous_development_mode_has_no_acl():
    with EmbeddedBroker() as broker:
        a = mqtt_client(broker.url, None, None, client_id="a", protocol=protocol_of(broker))
        try:
            assert subscribe(a, "fedge/r/task/b") == [1]
            publish(a, "fedge/r/task/b", b"anything goes")
            assert next_message(a).payload == b"anything goes"
        finally:
            close(a)


def test_embedded_broker_stop_is_idempotent_and_a_taken_port_is_a_clear_error():
    broker = EmbeddedBroker().start()
    with pytest.raises(BrokerError, match="choose another one"):
        EmbeddedBroker(port=broker.port).start()
    broker.stop()
    broker.stop()
    with pytest.raises(RuntimeError):
        wait_for_port("127.0.0.1", broker.port, timeout=0.2)
    with pytest.raises(BrokerError, match="server user"):
        EmbeddedBroker(users={"a": "pw"})


def test_serve_forever_runs_until_sigterm(tmp_path):
    users = generate_users(["a"])
    users_file = tmp_path / "users"
    users_file.write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
    users_file.chmod(0o600)
    port = free_port()
    code = (
        "import sys, pathlib, fedge.brokers.embedded_broker as b; "
        "b.serve_forever(int(sys.argv[1]), pathlib.Path(sys.argv[2]))"
    )
    process = subprocess.Popen([sys.executable, "-c", code, str(port), str(users_file)], stderr=subprocess.PIPE)
    try:
        wait_for_port("127.0.0.1", port, alive=lambda: process.poll() is None)
        close(mqtt_client(f"mqtt://127.0.0.1:{port}", "a", users["a"], protocol=mqtt.MQTTv311))
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0, process.stderr.read().decode()
    finally:
        process.kill()


def test_serve_forever_reports_bad_input_before_listening(tmp_path):
    with pytest.raises(BrokerError, match="cannot read users file"):
        serve_forever(free_port(), tmp_path / "missing")
    (tmp_path / "users").write_text("a:pw\n")
    with pytest.raises(BrokerError, match="server user"):
        serve_forever(free_port(), tmp_path / "users")
    with pytest.raises(BrokerError, match="refusing an anonymous broker"):
        serve_forever(free_port(), None, host="0.0.0.0")


# ---------------------------------------------------------------------------------------------------------------
# Mosquitto only: the written files, persistence and TLS


def test_written_mosquitto_files_are_private_and_accepted(mosquitto_broker):
    for name in ("mosquitto.conf", "passwd", "acl"):
        assert (mosquitto_broker.directory / name).stat().st_mode & 0o777 == 0o600, name
    close(connect_as(mosquitto_broker, "server"))  # the hashed passwd file works with the real broker
    log = mosquitto_broker.log().replace("Warning: Mosquitto should not be run as root", "")
    assert "Error" not in log and "Warning" not in log, log
    assert not any(p in log for p in mosquitto_broker.users.values())


def test_mosquitto_persistence_keeps_a_queued_message_across_a_crash(tmp_path):
    """Nothing is retained (retain_available false), so persistence is shown on what it is for: a QoS 1 message
    queued for a disconnected persistent session survives a crash and reaches the client when it is back."""
    with MosquittoProcess(tmp_path, generate_users(["a"]), persistence=True, print_log=True) as broker:

        def persistent_a() -> mqtt.Client:
            c = mqtt.Client(
                mqtt.CallbackAPIVersion.VERSION2,
                client_id="a",
                clean_session=False,
                protocol=mqtt.MQTTv311,
                userdata=Inbox(),
            )
            c.username_pw_set("a", broker.users["a"])
            c.on_message = lambda client, inbox, message: inbox.messages.put(message)
            c.connect("127.0.0.1", broker.port)
            c.loop_start()
            return c

        a = persistent_a()
        assert a.subscribe("fedge/r/task/a", 1)[0] == mqtt.MQTT_ERR_SUCCESS
        time.sleep(GRACE_S)
        close(a)
        server = connect_as(broker, "server")
        publish(server, "fedge/r/task/a", b"queued task")
        close(server)
        db, deadline = tmp_path / "db" / "mosquitto.db", time.monotonic() + 10
        while not (db.exists() and b"queued task" in db.read_bytes()) and time.monotonic() < deadline:
            time.sleep(0.1)  # autosave_interval 1: Mosquitto saves every 1 to 2 s (to a temp file, then renames)
        broker.kill()  # a crash: only what was autosaved survives
        broker.start()
        a = persistent_a()
        try:
            assert next_message(a).payload == b"queued task"
        finally:
            close(a)


@pytest.mark.parametrize("run_as", ["mosquitto", None], ids=["--run-as mosquitto", "as root, default user"])
def test_the_written_deployment_starts_as_printed_when_written_as_root(run_as):
    """`fedge broker --write-mosquitto-config DIR [--run-as mosquitto]` as root, then the printed
    `mosquitto -c DIR/mosquitto.conf`: Mosquitto drops to the run-as user, which can read passwd and acl."""
    require_mosquitto()
    if os.geteuid() != 0 or not _user_exists("mosquitto"):
        pytest.skip("needs root and Debian's mosquitto user")
    base = Path(tempfile.mkdtemp(prefix="fedge-broker-", dir="/tmp"))  # pytest's tmp_path is private to root
    base.chmod(0o755)
    port = free_port()
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "launch.cli",
                "broker",
                "--write-mosquitto-config",
                str(base / "broker"),
                "--clients",
                "0,1",
                "--port",
                str(port),
                *(["--run-as", run_as] if run_as else []),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        command = out.split("start it with: ")[1].split("\n")[0].split()
        assert command[:2] == ["mosquitto", "-c"]
        for name in ("passwd", "acl", "mosquitto.conf"):
            st = (base / "broker" / name).stat()
            assert (pwd.getpwuid(st.st_uid).pw_name, st.st_mode & 0o777) == ("mosquitto", 0o600), name
        with open(base / "mosquitto.log", "wb") as log:
            process = subprocess.Popen([MOSQUITTO, *command[1:]], stdout=log, stderr=log)
        try:
            wait_for_port("127.0.0.1", port, alive=lambda: process.poll() is None)
            password = dict(line.split(":", 1) for line in (base / "broker" / "users").read_text().split())["0"]
            assert connack_code(f"mqtt://127.0.0.1:{port}", "0", password) == 0
        finally:
            process.terminate()
            process.wait(10)
    except (RuntimeError, AssertionError):
        print((base / "mosquitto.log").read_text(errors="replace") if (base / "mosquitto.log").exists() else "")
        raise
    finally:
        shutil.rmtree(base)


def test_writing_for_a_user_who_cannot_reach_the_directory_says_how_to_fix_it(tmp_path):
    if os.geteuid() != 0 or not _user_exists("mosquitto"):
        pytest.skip("needs root and Debian's mosquitto user")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(BrokerError, match=r"user 'mosquitto', whom Mosquitto runs as, cannot enter .*chmod o\+x"):
        write_mosquitto_config(private / "broker", generate_users(["0"]), run_as="mosquitto")
    with pytest.raises(BrokerError, match="does not exist here"):
        write_mosquitto_config(tmp_path / "b", generate_users(["0"]), run_as="no-such-user-here")


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def test_mosquitto_tls_listener(tmp_path):
    require_mosquitto()
    if not subprocess.run(["which", "openssl"], capture_output=True).returncode == 0:
        pytest.skip("openssl not installed")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=fedge-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=tmp_path,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=tmp_path,
    )
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
        "-out",
        "server.pem",
        cwd=tmp_path,
    )
    tls = TlsFiles(certfile=tmp_path / "server.pem", keyfile=tmp_path / "server.key", cafile=tmp_path / "ca.pem")
    with MosquittoProcess(tmp_path / "broker", generate_users(["a"]), tls=tls, print_log=True) as broker:
        close(mqtt_client(broker.url, "a", broker.users["a"], ca_certs=tmp_path / "ca.pem"))
        assert connack_code(broker.url, "a", broker.users["a"]) != 0  # plain TCP is not served
        # fedge's own connection: mqtts:// with the CA connects; without it the handshake fails and start() says so
        url = f"mqtts://127.0.0.1:{broker.port}"
        endpoint = Endpoint(
            parse_broker(url, "a", broker.users["a"], cafile=str(tmp_path / "ca.pem")),
            "a",
            [],
            lambda topic, data: None,
        )
        endpoint.start(10)
        endpoint.stop()
        untrusted = Endpoint(parse_broker(url, "a", broker.users["a"]), "a", [], lambda topic, data: None)
        with pytest.raises(MqttError, match="no connection"):
            untrusted.start(2)


def test_an_endpoint_given_several_addresses_skips_one_that_is_down(embedded_broker):
    """A connection starts at the address first_address picks for its name and moves to the next when that one
    is down, with a new client id for each attempt."""
    live = f"mqtt://127.0.0.1:{embedded_broker.port}"
    dead = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there
    urls = [dead, live] if first_address(parse_broker(f"{dead},{live}"), "a") == 0 else [live, dead]
    broker = parse_broker(",".join(urls), "a", embedded_broker.users["a"])
    assert broker.addresses[first_address(broker, "a")] == ("127.0.0.1", int(dead.rsplit(":", 1)[1]))
    endpoint = Endpoint(broker, "a", [], lambda topic, data: None)
    tried: list[tuple[tuple[str, int], str]] = []  # (address, client id) of each attempt, as paho then connects

    def pick(client, userdata) -> None:
        endpoint._pick_address(client, userdata)
        tried.append(((client.host, client.port), client._client_id.decode()))

    endpoint.client.on_pre_connect = pick
    try:
        endpoint.start(20)
        assert [address for address, _ in tried[:2]] == list(
            broker.addresses[::-1] if urls[0] == live else broker.addresses
        )
        assert endpoint.address == ("127.0.0.1", embedded_broker.port) == tried[-1][0]
        ids = [mqtt_id for _, mqtt_id in tried]
        assert len(set(ids)) == len(ids) >= 2 and all(i.startswith("a.") for i in ids)
    finally:
        endpoint.stop()


class _WakesAfterTheDrop(threading.Event):
    """The connected flag as a loaded machine schedules it: the thread waiting in start() runs again only after
    the connection that set the flag has been ended again (once; later waits are plain)."""

    late = True

    def wait(self, timeout: float | None = None) -> bool:
        if not super().wait(timeout):
            return False
        deadline = time.monotonic() + 10
        while self.late and self.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.late = False
        return True


def test_start_returns_when_its_connection_is_taken_over_before_it_wakes(embedded_broker):
    """A second connection of the same client (a second `fedge client --id a`) takes over right after the first
    CONNACK, before start()'s thread runs again: start() has connected and returns, and paho reconnects by itself.
    start() used to read the flag, by then clear, stop the reconnect loop and raise "no connection within 60 s"
    (CI, tests/fault/test_hostile_client.py)."""
    broker = parse_broker(f"mqtt://127.0.0.1:{embedded_broker.port}", "a", embedded_broker.users["a"])
    endpoint = Endpoint(broker, "a", [], lambda topic, data: None)
    endpoint.connected = _WakesAfterTheDrop()
    intruders: list[mqtt.Client] = []

    def take_over() -> None:  # on paho's thread, just after the CONNACK; the broker ends `endpoint` for it
        if not intruders:
            intruders.append(connect_as(embedded_broker, "a"))
            intruders[0].reconnect_delay_set(30, 60)  # stay away once `endpoint` takes the id back

    endpoint.on_connect_hook = take_over
    try:
        endpoint.start(20)
        assert intruders and endpoint.connects >= 1
        assert endpoint.connected.wait(10), "paho did not reconnect after the takeover"
        assert endpoint.connects == 2 and embedded_broker.takeovers == {"a": 2}
    finally:
        endpoint.stop()
        for c in intruders:
            close(c)


def test_a_rabbitmq_user_holds_a_bounded_number_of_connections(rabbitmq_broker):
    """RabbitMQ keeps every connection of a user (their ids differ): the user's limit bounds them."""
    held = [connect_as(rabbitmq_broker, "a") for _ in range(C.MAX_USER_CONNECTIONS)]
    try:
        assert connack_code(url_of(rabbitmq_broker, "a"), "a", rabbitmq_broker.users["a"], protocol=mqtt.MQTTv311) != 0
    finally:
        for client in held:
            close(client)
    close(connect_as(rabbitmq_broker, "a"))  # room again
