"""fedge.brokers.access, fedge.brokers.mosquitto and fedge.brokers.rabbitmq without a network: users files, generated
users, the ACL
rules, Mosquitto and RabbitMQ files, permissions and hashes."""

import base64
import hashlib
import json
import os
import pwd
import re

import pytest

from fedge.brokers.access import BrokerError, TlsFiles, check_users, generate_users, permitted, read_users
from fedge.brokers.mosquitto import mosquitto_acl, mosquitto_password_hash, write_mosquitto_config
from fedge.brokers.mqtt import mqtt_client_id
from fedge.brokers.rabbitmq import permissions as rabbitmq_permissions
from fedge.brokers.rabbitmq import rabbitmq_password_hash, write_rabbitmq_config
from fedge.constants import (
    IDLE_QUEUE_EXPIRES_S,
    MAX_MESSAGE_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_QUEUED_BYTES,
    MAX_QUEUED_MESSAGES,
    PERSISTENT_SESSION_EXPIRES_H,
)
from fedge.wire.topics import ID_PATTERN

pytestmark = pytest.mark.timeout(30)
ME = pwd.getpwuid(os.getuid()).pw_name  # the files' owner: as root, Mosquitto would otherwise run as `mosquitto`


# --- read_users


def test_read_users_skips_comments_and_keeps_colons_in_passwords(tmp_path):
    path = tmp_path / "users"
    path.write_text("# fleet\n\nserver:s3cret\n  a:pa:ss  \nclient_b-2:x\n")

    assert read_users(path) == {"server": "s3cret", "a": "pa:ss", "client_b-2": "x"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("server:x\njust-a-name\n", "line 2: expected username:password"),
        ("server:x\nbad name:pw\n", "line 2: invalid username 'bad name'"),
        ("a/b:pw\n", "line 1: invalid username 'a/b'"),
        ("server:\n", "line 1: user 'server' has an empty password"),
        ("server:x\n# c\nserver:y\n", "line 3: user 'server' appears twice"),
        ("# nothing\n\n", "lists no users"),
    ],
)
def test_read_users_names_the_file_and_line_of_a_mistake(tmp_path, text, message):
    path = tmp_path / "users"
    path.write_text(text)

    with pytest.raises(BrokerError, match=message) as info:
        read_users(path)
    assert str(path) in str(info.value)


def test_read_users_of_a_missing_file_says_what_to_give(tmp_path):
    with pytest.raises(BrokerError, match="cannot read users file .*username:password"):
        read_users(tmp_path / "missing")


def test_read_users_warns_about_a_file_others_can_read(tmp_path, caplog):
    path = tmp_path / "users"
    path.write_text("server:x\n")
    path.chmod(0o644)

    read_users(path)

    assert "chmod 600" in caplog.text


# --- generate_users and check_users


def test_generate_users_gives_the_server_and_every_client_a_distinct_strong_password():
    users = generate_users(["a", "b"])

    assert list(users) == ["server", "a", "b"]
    assert len(set(users.values())) == 3
    assert all(len(p) >= 40 and ":" not in p for p in users.values())
    assert generate_users(["a"], server_user="coordinator").keys() == {"coordinator", "a"}


@pytest.mark.parametrize("ids", [["a", "a"], ["server"], ["a b"], [""], ["x" * 65], ["a+"], ["#"]])
def test_generate_users_rejects_bad_or_repeated_names(ids):
    with pytest.raises(BrokerError):
        generate_users(ids)


def test_check_users_requires_the_server_user_and_real_passwords():
    with pytest.raises(BrokerError, match="server user 'server'"):
        check_users({"a": "pw"}, "server")
    with pytest.raises(BrokerError, match="empty password"):
        check_users({"server": ""}, "server")
    with pytest.raises(BrokerError, match="line break"):
        check_users({"server": "a\nb"}, "server")


# --- the ACL


ACL_CASES = pytest.mark.parametrize(
    "user, action, topic, allowed",
    [
        ("a", "subscribe", "fedge/r/task/a", True),
        ("a", "subscribe", "fedge/+/task/a", True),
        ("a", "receive", "fedge/r/task/a", True),
        ("a", "subscribe", "fedge/r/server", True),
        ("a", "publish", "fedge/r/result/a", True),
        ("a", "publish", "fedge/r/register/a", True),
        ("a", "publish", "fedge/r/status/a", True),
        ("a", "subscribe", "fedge/r/task/b", False),
        ("a", "receive", "fedge/r/task/b", False),
        ("a", "subscribe", "fedge/r/task/+", False),
        ("a", "subscribe", "fedge/#", False),
        ("a", "subscribe", "#", False),
        ("a", "subscribe", "fedge/r/task/a/#", False),
        ("a", "publish", "fedge/r/result/b", False),
        ("a", "publish", "fedge/r/task/a", False),
        ("a", "publish", "fedge/r/server", False),
        ("a", "publish", "fedge/r/result/a/extra", False),
        ("a", "subscribe", "fedge/r/result/a", False),
        ("server", "subscribe", "fedge/#", True),
        ("server", "publish", "fedge/r/task/a", True),
        ("server", "subscribe", "#", False),
        ("server", "publish", "other/topic", False),
        (None, "subscribe", "fedge/r/server", False),
        ("", "publish", "fedge/r/result/", False),
        ("a+", "subscribe", "fedge/r/task/a+", False),
    ],
)


@ACL_CASES
def test_permitted(user, action, topic, allowed):
    assert permitted(user, topic, action) is allowed


@ACL_CASES
def test_rabbitmq_topic_permissions_grant_what_the_acl_grants(user, action, topic, allowed):
    """RabbitMQ checks a publish (write) or a subscription's binding key (read) against the user's regexes, over
    the routing key: "/" becomes ".", a filter's "+" becomes "*"; it fills in {username}."""
    if not user or not ID_PATTERN.fullmatch(user):
        pytest.skip("no such user can exist: check_username refuses the name")
    p = rabbitmq_permissions(user)
    regex = (p["topic_write"] if action == "publish" else p["topic_read"]).replace("{username}", user)
    key = ".".join("*" if level == "+" else level for level in topic.split("/"))
    assert bool(re.search(regex, key)) is allowed


def test_rabbitmq_vhost_permissions_confine_a_user_to_its_own_queues():
    own = [f"mqtt-subscription-{mqtt_client_id('a')}qos{q}" for q in (0, 1)]
    others = [f"mqtt-subscription-{mqtt_client_id(name)}qos1" for name in ("b", "ab", "a-b", "server")] + [
        "mqtt-subscription-aqos1",
        "mqtt-subscription-a.guessqos1",
        "amq.direct",
        "amq.topic.x",
    ]
    p = rabbitmq_permissions("a")
    for queue in own:
        assert all(re.search(p[k], queue) for k in ("configure", "write", "read")), queue
    for name in others:
        assert not any(re.search(p[k], name) for k in ("configure", "write", "read")), name
    assert re.search(p["write"], "amq.topic") and re.search(p["read"], "amq.topic")
    assert not re.search(p["configure"], "amq.topic")


def test_rabbitmq_password_hash_is_salted_sha256():
    salt = bytes.fromhex("908db4a3")
    digest = hashlib.sha256(salt + b"pw").digest()
    assert rabbitmq_password_hash("pw", salt) == base64.b64encode(salt + digest).decode()
    assert rabbitmq_password_hash("pw") != rabbitmq_password_hash("pw")


def test_write_rabbitmq_config_writes_hashes_not_passwords(tmp_path):
    users = generate_users(["0", "1"])
    conf = write_rabbitmq_config(tmp_path / "b", users, tmp_path / "users", port=1884, run_as=ME)
    files = {p.name: p for p in (tmp_path / "b").iterdir()}
    assert set(files) == {"rabbitmq.conf", "enabled_plugins", "definitions.json", "users.sh"}
    assert {n: p.stat().st_mode & 0o777 for n, p in files.items()} == {
        "rabbitmq.conf": 0o600,
        "enabled_plugins": 0o600,
        "definitions.json": 0o600,
        "users.sh": 0o700,
    }
    text = "".join(p.read_text() for p in files.values())
    assert not any(password in text for password in users.values())
    assert "mqtt.listeners.tcp.default = 127.0.0.1:1884" in conf.read_text()
    definitions = json.loads(files["definitions.json"].read_text())
    assert sorted(u["name"] for u in definitions["users"]) == ["0", "1", "server"]
    assert {json.dumps(u["limits"]) for u in definitions["users"]} == {json.dumps({"max-connections": 4})}
    (policy,) = definitions["policies"]
    assert policy["pattern"] == "^mqtt-subscription-" and policy["apply-to"] == "queues"
    assert policy["definition"] == {  # the per-client bound Mosquitto and the embedded broker keep too
        "max-length": MAX_QUEUED_MESSAGES,
        "max-length-bytes": MAX_QUEUED_BYTES,
        "overflow": "drop-head",
        "expires": IDLE_QUEUE_EXPIRES_S * 1000,
    }
    assert json.dumps(policy["definition"]) in files["users.sh"].read_text()  # a running cluster gets the same
    with pytest.raises(BrokerError, match="out of range"):
        write_rabbitmq_config(tmp_path / "c", users, tmp_path / "users", port=0, run_as=ME)


def test_mosquitto_acl_grants_patterns_to_all_and_the_server_status_per_client():
    text = mosquitto_acl(["server", "a", "b"])

    assert "pattern read fedge/+/task/%u\n" in text
    for kind in ("register", "result", "status"):
        assert f"pattern write fedge/+/{kind}/%u\n" in text
    assert "user server\ntopic readwrite fedge/#\n" in text
    assert "user a\ntopic read fedge/+/server\n" in text
    assert "user b\ntopic read fedge/+/server\n" in text
    before_users = text.split("\nuser ")[0]
    assert "\ntopic " not in before_users  # such lines would apply to anonymous clients only


# --- Mosquitto files


def test_the_hash_matches_one_made_by_mosquitto_passwd():
    # `mosquitto_passwd -c -b pw alice s3cret` (Mosquitto 2.0.11) wrote this line.
    line = (
        "alice:$7$101$Y7xomH+5/IjC/6h4$rwNLz1N6O/bstPesy/n1lFQpI9UbzuffspX7vYKjsKCnLy7yAAntgWX1gIiNsM44YaWAmkcv"
        "PCW4sZs1FWYHrQ=="
    )
    salt = base64.b64decode("Y7xomH+5/IjC/6h4")

    assert "alice:" + mosquitto_password_hash("s3cret", salt=salt) == line


def test_hashes_are_salted():
    first, second = mosquitto_password_hash("pw"), mosquitto_password_hash("pw")

    assert first != second
    _, scheme, iterations, salt, digest = first.split("$")
    assert (scheme, iterations, len(base64.b64decode(salt))) == ("7", "101", 12)
    assert base64.b64decode(digest) == hashlib.pbkdf2_hmac("sha512", b"pw", base64.b64decode(salt), 101)


def test_write_mosquitto_config_writes_three_private_files(tmp_path):
    users = generate_users(["a", "b"])

    conf = write_mosquitto_config(tmp_path / "etc", users, port=18831, run_as=ME)

    assert conf == (tmp_path / "etc" / "mosquitto.conf").resolve()
    for name in ("mosquitto.conf", "passwd", "acl"):
        assert (tmp_path / "etc" / name).stat().st_mode & 0o777 == 0o600
    lines = conf.read_text().splitlines()
    for expected in (
        "per_listener_settings false",
        "listener 18831 127.0.0.1",
        "allow_anonymous false",
        f"password_file {tmp_path / 'etc' / 'passwd'}",
        f"acl_file {tmp_path / 'etc' / 'acl'}",
        "use_username_as_clientid true",
        f"max_packet_size {MAX_MESSAGE_BYTES}",
        f"max_queued_messages {MAX_QUEUED_MESSAGES}",
        f"max_queued_bytes {MAX_QUEUED_BYTES}",
        f"persistent_client_expiration {PERSISTENT_SESSION_EXPIRES_H}h",
        "max_keepalive 60",
        "persistence false",
    ):
        assert expected in lines
    assert MAX_MESSAGE_BYTES == 4 * 1024 * 1024 + 64 * 1024
    assert MAX_QUEUED_BYTES == 2 * MAX_PAYLOAD_BYTES  # a whole largest task and one re-send
    assert f"user {ME}" in lines and "retain_available false" in lines
    assert not any(line.startswith("certfile") for line in lines)


def test_the_passwd_file_holds_hashes_that_verify_and_no_password(tmp_path):
    users = generate_users(["a"])

    write_mosquitto_config(tmp_path, users, run_as=ME)

    text = (tmp_path / "passwd").read_text()
    assert not any(p in text for p in users.values())
    for line in text.splitlines():
        name, hashed = line.split(":", 1)
        _, _, iterations, salt, digest = hashed.split("$")
        expected = hashlib.pbkdf2_hmac("sha512", users[name].encode(), base64.b64decode(salt), int(iterations))
        assert base64.b64decode(digest) == expected


def test_write_mosquitto_config_persistence_tls_and_user(tmp_path):
    tls = TlsFiles(
        certfile=tmp_path / "s.pem", keyfile=tmp_path / "s.key", cafile=tmp_path / "ca.pem", require_certificate=True
    )

    conf = write_mosquitto_config(
        tmp_path / "etc",
        generate_users([]),
        port=8883,
        host="0.0.0.0",
        tls=tls,
        persistence_dir=tmp_path / "db",
        run_as=ME,
    )

    lines = conf.read_text().splitlines()
    for expected in (
        "listener 8883 0.0.0.0",
        "persistence true",
        f"persistence_location {tmp_path / 'db'}/",
        "autosave_interval 1",
        f"certfile {tmp_path / 's.pem'}",
        f"keyfile {tmp_path / 's.key'}",
        f"cafile {tmp_path / 'ca.pem'}",
        "require_certificate true",
        "tls_version tlsv1.2",
        f"user {ME}",
    ):
        assert expected in lines


def test_write_mosquitto_config_rejects_bad_input(tmp_path):
    with pytest.raises(BrokerError, match="server user"):
        write_mosquitto_config(tmp_path, {"a": "pw"})
    with pytest.raises(BrokerError, match="out of range"):
        write_mosquitto_config(tmp_path, generate_users([]), port=0)
    with pytest.raises(BrokerError, match="cafile"):
        TlsFiles(certfile=tmp_path / "s.pem", keyfile=tmp_path / "s.key", require_certificate=True)
