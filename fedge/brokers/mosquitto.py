"""Mosquitto deployment files for fedge.brokers.access's rules: mosquitto.conf, a hashed password file and the ACL."""

from __future__ import annotations

import base64
import hashlib
import secrets
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
    check_username,
    check_users,
    give_files,
)
from fedge.files import atomic_write

MOSQUITTO_DEFAULT_USER = "mosquitto"  # whom Mosquitto started as root switches to when its config names no user


def mosquitto_password_hash(password: str, salt: bytes | None = None, iterations: int = C.PBKDF2_ITERATIONS) -> str:
    """Mosquitto 2.0's ``$7$`` password hash: ``$7$<iterations>$<base64 salt>$<base64 PBKDF2-SHA512>``."""
    salt = secrets.token_bytes(C.PBKDF2_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def mosquitto_acl(users: Iterable[str], server_user: str = DEFAULT_SERVER_USER) -> str:
    """The Mosquitto ``acl_file`` text for this module's rules and these users.

    Per-client topics are ``pattern`` lines (they apply to every user). The server-status topic is granted in
    each client's ``user`` block: a ``topic`` line before any ``user`` line would apply only to anonymous
    clients, and a pattern without ``%u`` draws a warning from Mosquitto.
    """
    lines = ["# fedge topic ACL (written by fedge.brokers.mosquitto): clients reach only their own topics.", ""]
    lines += [f"pattern read {p}" for p in CLIENT_READ if "%u" in p]
    lines += [f"pattern write {p}" for p in CLIENT_WRITE]
    lines += ["", f"user {check_username(server_user)}", f"topic readwrite {SERVER_READWRITE}"]
    for name in sorted(set(users) - {server_user}):
        lines += ["", f"user {check_username(name)}"]
        lines += [f"topic read {p}" for p in CLIENT_READ if "%u" not in p]
    return "\n".join(lines) + "\n"


def write_mosquitto_config(
    directory: Path,
    users: dict[str, str],
    port: int = 1883,
    host: str = "127.0.0.1",
    tls: TlsFiles | None = None,
    server_user: str = DEFAULT_SERVER_USER,
    persistence_dir: Path | None = None,
    run_as: str | None = None,
) -> Path:
    """Write ``mosquitto.conf``, ``passwd`` (hashed) and ``acl`` into ``directory`` (all 0600); return the conf.

    ``persistence_dir`` turns on persistence, saved every second. ``run_as`` sets Mosquitto's ``user``: started
    as root, Mosquitto switches to that user before it reads ``passwd`` and ``acl``. Written as root, the three
    files then belong to that user (mode 600: readable by it only); without ``run_as`` it is Mosquitto's own
    default, ``mosquitto``. Raises BrokerError for a bad user table, a port out of range, a run-as user that
    does not exist, or a directory that user cannot reach (with the fix).
    """
    users = check_users(users, server_user)
    directory, owner = broker_files(directory, port, "Mosquitto", run_as, MOSQUITTO_DEFAULT_USER)
    run_as = run_as if owner is None else owner.pw_name
    passwd, acl, conf = directory / "passwd", directory / "acl", directory / "mosquitto.conf"
    hashed = "".join(f"{u}:{mosquitto_password_hash(p)}\n" for u, p in sorted(users.items()))
    atomic_write(passwd, hashed.encode(), mode=0o600)  # private from the first byte
    atomic_write(acl, mosquitto_acl(users, server_user).encode(), mode=0o600)
    lines = [
        "# Mosquitto 2.0 configuration written by fedge.brokers.mosquitto.",
        "per_listener_settings false",
        f"listener {port} {host}",
        "allow_anonymous false",
        f"password_file {passwd}",
        f"acl_file {acl}",
        "use_username_as_clientid true",
        "retain_available false",
        f"max_packet_size {C.MAX_MESSAGE_BYTES}",
        f"max_queued_messages {C.MAX_QUEUED_MESSAGES}",
        f"max_queued_bytes {C.MAX_QUEUED_BYTES}",
        f"persistent_client_expiration {C.PERSISTENT_SESSION_EXPIRES_H}h",
        f"max_keepalive {C.MAX_KEEPALIVE_S}",
    ]
    if run_as is not None:
        lines.append(f"user {run_as}")
    if persistence_dir is None:
        lines.append("persistence false")
    else:
        lines += ["persistence true", f"persistence_location {Path(persistence_dir).resolve()}/", "autosave_interval 1"]
    if tls is not None:
        lines += [
            f"certfile {Path(tls.certfile).resolve()}",
            f"keyfile {Path(tls.keyfile).resolve()}",
            "tls_version tlsv1.2",
            f"require_certificate {str(tls.require_certificate).lower()}",
        ]
        if tls.cafile is not None:
            lines.append(f"cafile {Path(tls.cafile).resolve()}")
    atomic_write(conf, ("\n".join(lines) + "\n").encode(), mode=0o600)
    give_files(owner, (passwd, acl, conf))
    return conf
