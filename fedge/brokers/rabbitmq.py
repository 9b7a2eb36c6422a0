"""RabbitMQ deployment files for fedge.brokers.access's rules: rabbitmq.conf (an MQTT listener and nothing else),
enabled_plugins, definitions.json (the users with hashed passwords and their permissions, loaded when a node boots)
and users.sh (the same users and permissions, applied with rabbitmqctl to a cluster that is already running).

How fedge's ACL maps onto RabbitMQ 3.10's MQTT plugin: a PUBLISH (and a will) goes to the topic exchange
``amq.topic`` with the topic as routing key, ``/`` turned into ``.`` (``fedge/r/task/a`` → ``fedge.r.task.a``); a
SUBSCRIBE binds the connection's queue ``mqtt-subscription-<MQTT client id>qos<0|1>`` with the filter as binding key
(``+`` → ``*``). A user's *topic permissions* on ``amq.topic`` are two regular expressions over those keys, write
(publish, will) and read (subscribe), in which RabbitMQ replaces ``{username}``: they are fedge.brokers.access's
patterns,
translated. Its *vhost permissions* (configure, write, read over queue and exchange names) confine it to the queues
of its own client ids (fedge.brokers.mqtt.mqtt_client_id) and ``amq.topic``. A refused publish or subscribe closes the
connection; a refused will is dropped (RabbitMQ logs "Could not send last will").
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import shlex
from pathlib import Path
from typing import Iterable

from fedge import constants as C
from fedge.brokers.access import (
    CLIENT_READ,
    CLIENT_WRITE,
    DEFAULT_SERVER_USER,
    SERVER_READWRITE,
    TlsFiles,
    broker_files,
    check_users,
    give_files,
)
from fedge.brokers.mqtt import mqtt_client_id_regex
from fedge.files import atomic_write

RABBITMQ_DEFAULT_USER = "rabbitmq"  # whom Debian's rabbitmq-server started as root switches to
VHOST = "/"
EXCHANGE = "amq.topic"  # the MQTT plugin's default exchange
HASHING = "rabbit_password_hashing_sha256"  # RabbitMQ's default password hashing


def routing_key_regex(patterns: Iterable[str]) -> str:
    """A topic-permission regular expression granting exactly the routing keys of these fedge.brokers.access patterns.

    ``+`` is one level (it also grants the ``*`` a subscription's binding key has there), a final ``#`` any
    further levels, ``%u`` the connecting user (``{username}``, which RabbitMQ fills in)."""
    alternatives = []
    for pattern in patterns:
        levels, tail = pattern.split("/"), ""
        if levels[-1] == "#":
            levels, tail = levels[:-1], r"(\..+)?"
        alternatives.append(
            r"\.".join("[^.]+" if lv == "+" else "{username}" if lv == "%u" else re.escape(lv) for lv in levels) + tail
        )
    return f"^({'|'.join(alternatives)})$"


def permissions(user: str, server_user: str = DEFAULT_SERVER_USER) -> dict[str, str]:
    """One user's vhost permissions (configure, write, read) and topic permissions on amq.topic (topic_write,
    topic_read). The server user reads and writes everything under fedge/; a client only its own topics."""
    queue = rf"mqtt-subscription-{mqtt_client_id_regex(user)}qos[01]"
    resources = rf"^({re.escape(EXCHANGE)}|{queue})$"
    server = user == server_user
    return {
        "configure": f"^{queue}$",
        "write": resources,
        "read": resources,
        "topic_write": routing_key_regex([SERVER_READWRITE] if server else CLIENT_WRITE),
        "topic_read": routing_key_regex([SERVER_READWRITE] if server else CLIENT_READ),
    }


def rabbitmq_password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's rabbit_password_hashing_sha256: base64(salt + SHA-256(salt + password)), a 4-byte salt."""
    salt = secrets.token_bytes(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


USER_LIMITS = {"max-connections": C.MAX_USER_CONNECTIONS}
QUEUE_POLICY = {  # every MQTT subscription's queue: bounded as Mosquitto bounds a client's queue
    "vhost": VHOST,
    "name": "fedge-mqtt-subscriptions",
    "pattern": "^mqtt-subscription-",
    "apply-to": "queues",
    "priority": 0,
    "definition": {
        "max-length": C.MAX_QUEUED_MESSAGES,
        "max-length-bytes": C.MAX_QUEUED_BYTES,
        "overflow": "drop-head",  # not reject-publish: RabbitMQ 3.10's MQTT plugin closes a publisher it nacks
        "expires": C.IDLE_QUEUE_EXPIRES_S * 1000,
    },
}


def rabbitmq_definitions(users: dict[str, str], server_user: str = DEFAULT_SERVER_USER) -> dict:
    """The definitions a node imports at boot: the vhost, the users (hashed passwords, a connection limit), their
    permissions, and the policy bounding every subscription queue."""
    rows = [(name, permissions(name, server_user)) for name in sorted(users)]
    return {
        "vhosts": [{"name": VHOST}],
        "users": [
            {
                "name": n,
                "password_hash": rabbitmq_password_hash(users[n]),
                "hashing_algorithm": HASHING,
                "tags": [],
                "limits": USER_LIMITS,
            }
            for n, _ in rows
        ],
        "policies": [QUEUE_POLICY],
        "permissions": [
            {"user": n, "vhost": VHOST, "configure": p["configure"], "write": p["write"], "read": p["read"]}
            for n, p in rows
        ],
        "topic_permissions": [
            {"user": n, "vhost": VHOST, "exchange": EXCHANGE, "write": p["topic_write"], "read": p["topic_read"]}
            for n, p in rows
        ],
    }


def rabbitmq_users_script(users: Iterable[str], users_file: Path, server_user: str = DEFAULT_SERVER_USER) -> str:
    """users.sh: make a running cluster's users those of ``users``: create or update each (password, connection
    limit, permissions), delete every other user (``guest`` included), and set the subscription-queue policy.

    Passwords are read from ``users_file`` (or the script's first argument), as fedge.brokers.access.read_users reads
    them,
    and given to rabbitmqctl on standard input, never on a command line."""
    q = shlex.quote
    names = sorted(set(users))
    lines = [
        "#!/bin/sh",
        "# fedge's users, permissions and queue policy on a running RabbitMQ node or cluster (written by",
        "# fedge.brokers.rabbitmq). Users not listed here are deleted. Run on any node, as a user that may run",
        "# rabbitmqctl and read USERS_FILE:  sh users.sh [USERS_FILE]   (RABBITMQCTL: another rabbitmqctl)",
        "set -eu",
        f"USERS=${{1:-{q(str(users_file))}}}",
        "CTL=${RABBITMQCTL:-rabbitmqctl}",
        '[ -r "$USERS" ] || { echo "users.sh: cannot read $USERS (username:password lines)" >&2; exit 1; }',
        "existing=$($CTL -s list_users | cut -f1)",
        "user() {  # NAME CONFIGURE WRITE READ TOPIC_WRITE TOPIC_READ",
        r'    line=$(sed -e "s/\r$//" -e "s/^[[:space:]]*//" -e "s/[[:space:]]*$//" "$USERS" | grep -m1 "^$1:") ||',
        '        { echo "users.sh: no password for $1 in $USERS" >&2; exit 1; }',
        "    pw=${line#*:}",
        '    [ -n "$pw" ] || { echo "users.sh: empty password for $1 in $USERS" >&2; exit 1; }',
        r'    if printf "%s\n" "$existing" | grep -qx "$1"; then',
        r'        printf "%s\n" "$pw" | $CTL -q change_password "$1"',
        "    else",
        r'        printf "%s\n" "$pw" | $CTL -q add_user "$1"',
        "    fi",
        f'    $CTL -q set_user_limits "$1" {q(json.dumps(USER_LIMITS))}',
        f'    $CTL -q set_permissions -p {q(VHOST)} "$1" "$2" "$3" "$4"',
        f'    $CTL -q set_topic_permissions -p {q(VHOST)} "$1" {EXCHANGE} "$5" "$6"',
        "}",
    ]
    for name in names:
        p = permissions(name, server_user)
        fields = (name, p["configure"], p["write"], p["read"], p["topic_write"], p["topic_read"])
        lines.append("user " + " ".join(q(f) for f in fields))
    lines += [
        "for u in $existing; do  # everyone else, guest included, loses access",
        f'    case " {" ".join(names)} " in *" $u "*) ;; *) $CTL -q delete_user "$u" ;; esac',
        "done",
        f"$CTL -q set_policy -p {q(VHOST)} --apply-to queues {QUEUE_POLICY['name']} "
        f"{q(QUEUE_POLICY['pattern'])} {q(json.dumps(QUEUE_POLICY['definition']))}",
        f'echo "fedge: {len(names)} users set"',
    ]
    return "\n".join(lines) + "\n"


def write_rabbitmq_config(
    directory: Path,
    users: dict[str, str],
    users_file: Path,
    port: int = 1883,
    host: str = "127.0.0.1",
    tls: TlsFiles | None = None,
    server_user: str = DEFAULT_SERVER_USER,
    run_as: str | None = None,
) -> Path:
    """Write rabbitmq.conf, enabled_plugins, definitions.json and users.sh into ``directory``; return the conf.

    Every node of a cluster uses the same files (give each its own ``port`` when they share a machine). As root,
    the files then belong to ``run_as`` (default ``rabbitmq``, whom Debian's rabbitmq-server switches to).
    Raises BrokerError for a bad user table, a port out of range or a run-as user who cannot read the files.
    """
    users = check_users(users, server_user)
    directory, owner = broker_files(directory, port, "RabbitMQ", run_as, RABBITMQ_DEFAULT_USER)
    conf, plugins = directory / "rabbitmq.conf", directory / "enabled_plugins"
    definitions, script = directory / "definitions.json", directory / "users.sh"
    lines = [
        "# RabbitMQ 3.10 configuration written by fedge.brokers.rabbitmq: MQTT only, fedge's users and permissions.",
        "# No AMQP listener: fedge speaks MQTT only.",
        "listeners.tcp = none",
        *(["mqtt.listeners.tcp = none"] if tls else []),
        f"mqtt.listeners.{'ssl' if tls else 'tcp'}.default = {host}:{port}",
        "mqtt.allow_anonymous = false",
        f"mqtt.vhost = {VHOST}",
        f"mqtt.exchange = {EXCHANGE}",
        "# Nothing is retained.",
        "mqtt.retained_message_store = rabbit_mqtt_retained_msg_store_noop",
        "# The largest message: one chunk plus its headers.",
        f"max_message_size = {C.MAX_MESSAGE_BYTES}",
        "# Users (hashed passwords) and permissions, imported at every boot; no guest user is created.",
        f"load_definitions = {definitions}",
        "# The minority side of a network partition pauses, closing its connections: clients move to the majority.",
        "cluster_partition_handling = pause_minority",
    ]
    if tls is not None:
        lines += [
            f"ssl_options.certfile = {Path(tls.certfile).resolve()}",
            f"ssl_options.keyfile = {Path(tls.keyfile).resolve()}",
            "ssl_options.versions.1 = tlsv1.3",
            "ssl_options.versions.2 = tlsv1.2",
            f"ssl_options.verify = {'verify_peer' if tls.cafile else 'verify_none'}",
            f"ssl_options.fail_if_no_peer_cert = {str(tls.require_certificate).lower()}",
        ]
        if tls.cafile is not None:
            lines.append(f"ssl_options.cacertfile = {Path(tls.cafile).resolve()}")
    atomic_write(conf, ("\n".join(lines) + "\n").encode(), mode=0o600)
    atomic_write(plugins, b"[rabbitmq_mqtt].\n", mode=0o600)
    atomic_write(definitions, json.dumps(rabbitmq_definitions(users, server_user), indent=1).encode(), mode=0o600)
    atomic_write(script, rabbitmq_users_script(users, Path(users_file).resolve(), server_user).encode(), mode=0o700)
    give_files(owner, (conf, plugins, definitions, script))
    return conf
