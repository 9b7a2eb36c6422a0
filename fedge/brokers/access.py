"""Who may do what on a fedge broker: user tables, password files and the topic ACL, the same for the
embedded broker and Mosquitto.

Who may do what (the same rules for every broker; fedge.brokers.mosquitto and fedge.brokers.rabbitmq write them).
A client's MQTT username is its client id; each of its connections has the MQTT client id ``<username>.<32 hex>``
(fedge.brokers.mqtt.mqtt_client_id):

- a client publishes only to ``fedge/<run>/{register,result,status}/<itself>``, and its will may name only its
  own ``status`` topic (a CONNECT with any other will topic is refused);
- a client subscribes to (and receives) only ``fedge/<run>/task/<itself>`` and ``fedge/<run>/server``;
- the server user reads and writes everything under ``fedge/#``;
- nothing is retained: Mosquitto runs with ``retain_available false``, RabbitMQ with the no-op retained store; the
  embedded broker refuses a retained will and keeps no retained message (a retained publish is delivered as an
  ordinary one, its flag dropped);
- one connection per user on Mosquitto (use_username_as_clientid) and the embedded broker: a second CONNECT of the
  same user ends the first connection (its will is published), counted in ``EmbeddedBroker.takeovers``. RabbitMQ
  ends only a connection whose client id is reused, which nobody can guess; the server stops the older of two
  live connections of one client (server.fleet).
"""

from __future__ import annotations

import logging
import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from fedge import constants as C
from fedge.errors import UserError
from fedge.wire.topics import ID_PATTERN

log = logging.getLogger(__name__)

DEFAULT_SERVER_USER = "server"

# The ACL, once, as patterns; "%u" stands for the connecting username and fills a whole topic level.
ROOT = C.TOPIC_ROOT
CLIENT_READ = (f"{ROOT}/+/task/%u", f"{ROOT}/+/server")
CLIENT_WRITE = (f"{ROOT}/+/register/%u", f"{ROOT}/+/result/%u", f"{ROOT}/+/status/%u")
SERVER_READWRITE = f"{ROOT}/#"


class BrokerError(UserError, ValueError):
    """A broker could not be configured or started; the message says what to do."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a broker's TLS listener; ``require_certificate`` also demands client certificates."""

    certfile: Path
    keyfile: Path
    cafile: Path | None = None
    require_certificate: bool = False

    def __post_init__(self) -> None:
        if self.require_certificate and self.cafile is None:
            raise BrokerError("require_certificate needs a cafile to check client certificates against")


def check_username(name: str) -> str:
    """Return ``name`` if it is a valid username (and client id); raise BrokerError if it is not."""
    if not isinstance(name, str) or not ID_PATTERN.fullmatch(name):
        raise BrokerError(f"invalid username {name!r}: use 1 to 64 characters from A-Z a-z 0-9 _ -")
    return name


def check_users(users: dict[str, str], server_user: str) -> dict[str, str]:
    """Return a copy of ``users`` after checking every name and password; BrokerError names the first bad entry."""
    for name, password in users.items():
        check_username(name)
        if not isinstance(password, str) or not password or any(c in password for c in "\r\n\0"):
            raise BrokerError(f"user {name!r} has an empty password or one with a line break or NUL in it")
    if server_user not in users:
        raise BrokerError(f"the users must include the server user {server_user!r}")
    return dict(users)


def read_users(path: Path) -> dict[str, str]:
    """Read ``username:password`` lines (blank lines and ``#`` comments are skipped).

    Raises BrokerError naming the file and line for a missing file, a line without ``:``, a bad username,
    an empty password or a duplicate user.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BrokerError(f"cannot read users file {path}: {exc}; give a file of username:password lines") from exc
    if path.stat().st_mode & 0o077:
        log.warning("users file %s is readable by other users; run: chmod 600 %s", path, path)
    users: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, password = line.partition(":")
        where = f"{path}, line {number}"
        if not sep:
            raise BrokerError(f"{where}: expected username:password")
        if not ID_PATTERN.fullmatch(name):
            raise BrokerError(f"{where}: invalid username {name!r}: use 1 to 64 characters from A-Z a-z 0-9 _ -")
        if not password:
            raise BrokerError(f"{where}: user {name!r} has an empty password")
        if name in users:
            raise BrokerError(f"{where}: user {name!r} appears twice")
        users[name] = password
    if not users:
        raise BrokerError(f"users file {path} lists no users; add username:password lines")
    return users


def generate_users(client_ids: Iterable[str], server_user: str = DEFAULT_SERVER_USER) -> dict[str, str]:
    """Random passwords for the server user and each client id; BrokerError on a bad or repeated name."""
    names = [check_username(server_user), *(check_username(c) for c in client_ids)]
    if len(set(names)) != len(names):
        raise BrokerError(f"client ids must be distinct and differ from the server user {server_user!r}")
    return {name: secrets.token_urlsafe(C.PASSWORD_BYTES) for name in names}


def _covers(pattern: str, topic: str) -> bool:
    """Whether the ACL ``pattern`` grants ``topic`` (a topic name, or a filter whose wildcards the pattern also has)."""
    want, have = pattern.split("/"), topic.split("/")
    for i, level in enumerate(want):
        if level == "#":
            return True
        if i >= len(have) or have[i] == "#" or level not in ("+", have[i]):
            return False
    return len(want) == len(have)


def permitted(username: str | None, topic: str, action: str, server_user: str = DEFAULT_SERVER_USER) -> bool:
    """Whether ``username`` may ``action`` ("publish", "subscribe" or "receive") on ``topic``; no username: never."""
    if not username or not ID_PATTERN.fullmatch(username):
        return False
    if username == server_user:
        patterns: tuple[str, ...] = (SERVER_READWRITE,)
    else:
        patterns = tuple(p.replace("%u", username) for p in (CLIENT_WRITE if action == "publish" else CLIENT_READ))
    return any(_covers(p, topic) for p in patterns)


def broker_files(
    directory: Path, port: int, program: str, run_as: str | None, default_user: str
) -> tuple[Path, pwd.struct_passwd | None]:
    """Where a broker's config files go and who will own them: ``directory`` resolved and made, and, as root, the
    account ``program`` switches to (``run_as``, else ``default_user``; see _service_owner), else None. BrokerError
    for a port out of range or an account that cannot read the files."""
    if not 0 < port < 65536:
        raise BrokerError(f"port {port} is out of range 1..65535")
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return directory, None
    return directory, _service_owner(run_as or default_user, directory, program, run_as is None)


def give_files(owner: pwd.struct_passwd | None, paths: Iterable[Path]) -> None:
    """Make ``owner`` (from broker_files) the owner of the written files; nothing when not root."""
    if owner is not None:
        for path in paths:
            os.chown(path, owner.pw_uid, owner.pw_gid)


def _service_owner(name: str, directory: Path, program: str, default: bool) -> pwd.struct_passwd:
    """The account ``program`` (a broker started as root) switches to, ``name``; BrokerError if it does not exist
    or cannot traverse to ``directory``, naming the fix (``default``: the name is the program's own default)."""
    try:
        owner = pwd.getpwnam(name)
    except KeyError:
        hint = f"install Debian's {program.lower()} package (it adds that user) or " if default else ""
        raise BrokerError(
            f"{program} started as root runs as user {name!r}, which does not exist here; {hint}pass "
            "--run-as USER with a user that exists"
        ) from None
    groups = set(os.getgrouplist(name, owner.pw_gid))
    for path in (directory, *directory.parents):
        st = path.stat()
        bit = 0o100 if st.st_uid == owner.pw_uid else 0o010 if st.st_gid in groups else 0o001
        if owner.pw_uid != 0 and not st.st_mode & bit:
            raise BrokerError(
                f"user {name!r}, whom {program} runs as, cannot enter {path} (mode "
                f"{stat.filemode(st.st_mode)}), so it could not read the files written to {directory};"
                f" write them under a directory it can reach (e.g. /etc/{program.lower()}/fedge), or chmod o+x "
                f"{path}"
            )
    return owner
