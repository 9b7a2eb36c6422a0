"""MQTT brokers for fedge: an embedded amqtt broker with per-client topic ACLs, and Mosquitto config files.

Who may do what (the same rules for both brokers; a client's MQTT username is its client id):

- a client publishes only to ``fedge/<run>/{register,result,status}/<itself>``, and its will may name only its
  own ``status`` topic (a CONNECT with any other will topic is refused);
- a client subscribes to (and receives) only ``fedge/<run>/task/<itself>`` and ``fedge/<run>/server``;
- the server user reads and writes everything under ``fedge/#``;
- nothing is retained: Mosquitto runs with ``retain_available false``; the embedded broker refuses a retained
  will and keeps no retained message (a retained publish is delivered as an ordinary one, its flag dropped);
- one connection per client id: a second CONNECT with the same id ends the first connection (its will is
  published, as Mosquitto does), counted in ``EmbeddedBroker.takeovers``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import logging
import os
import pwd
import secrets
import signal
import stat
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from amqtt.adapters import BufferReader, ReaderAdapter, StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action, BaseContext
from amqtt.codecs_amqtt import read_or_raise
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.connack import BAD_USERNAME_PASSWORD, NOT_AUTHORIZED, UNACCEPTABLE_PROTOCOL_VERSION, ConnackPacket
from amqtt.mqtt.connect import ConnectPacket
from amqtt.mqtt.packet import CONNECT, MQTTFixedHeader
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session

from fedge import constants as C
from fedge.topics import ID_PATTERN

log = logging.getLogger(__name__)

DEFAULT_SERVER_USER = "server"
MOSQUITTO_DEFAULT_USER = "mosquitto"  # whom Mosquitto started as root switches to when its config names no user

# The ACL, once, as patterns; "%u" stands for the connecting username and fills a whole topic level.
ROOT = C.TOPIC_ROOT
CLIENT_READ = (f"{ROOT}/+/task/%u", f"{ROOT}/+/server")
CLIENT_WRITE = (f"{ROOT}/+/register/%u", f"{ROOT}/+/result/%u", f"{ROOT}/+/status/%u")
SERVER_READWRITE = f"{ROOT}/#"


class BrokerError(ValueError):
    """A broker could not be configured or started; the message says what to do."""


# ---------------------------------------------------------------------------------------------------------------
# Users and access rules


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


# ---------------------------------------------------------------------------------------------------------------
# The embedded broker


class _Credentials:
    """Checks a CONNECT's username, password and client id against the user table."""

    def __init__(self, users: dict[str, str]) -> None:
        self._users = {name: password.encode() for name, password in users.items()}

    def refusal(self, username: str | None, password: str | None, client_id: str | None) -> str | None:
        """Why this connection must be refused (never mentioning the password), or None when it may proceed."""
        expected = self._users.get(username or "")
        if expected is None or password is None:
            return f"unknown user {username!r}" if username else "anonymous connection"
        if not hmac.compare_digest(expected, password.encode()):
            return f"wrong password for user {username!r}"
        if client_id != username:
            return f"client id {client_id!r} differs from username {username!r} (they must be equal)"
        return None


def will_refusal(connect: ConnectPacket, server_user: str) -> tuple[str, str] | None:
    """(reason code, why) a CONNECT's will must be refused: it is retained, or names a topic its user may not
    publish to; None for no will or an allowed one."""
    if not connect.will_flag:
        return None
    if connect.will_retain_flag:
        return "retained_will", f"a retained will on {connect.will_topic!r} (nothing is retained)"
    if not permitted(connect.username, connect.will_topic or "", "publish", server_user):
        return "forbidden_will", f"a will on {connect.will_topic!r}, which user {connect.username!r} may not publish to"
    return None


class _Snapshots(dict):
    """A dict whose iteration runs over a copy: amqtt walks its subscription table across awaits while other
    connections subscribe ("dictionary changed size during iteration", and that broadcast is lost)."""

    def __iter__(self) -> Any:
        return iter(list(super().keys()))

    def items(self) -> Any:
        return [(key, list(value)) for key, value in super().items()]


class _FedgeAmqttBroker(Broker):
    """amqtt's broker with two changes: it keeps no retained message (fedge never uses one, and amqtt would
    deliver a stored one to a later subscriber without asking the ACL, even one whose SUBSCRIBE it refused), and
    its subscription table is iterated over snapshots (see _Snapshots)."""

    refused: Counter[str]  # EmbeddedBroker's counter of refusals, shared

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._subscriptions = _Snapshots()

    async def retain_message(self, source_session: Session | None, topic_name: str | None,
                             data: bytes | bytearray | None, qos: int | None = None) -> None:
        self.refused["retained_publish"] += 1
        log.warning("broker: %s published a retained message on %r; delivered, not retained",
                    source_session.client_id if source_session else "the broker", topic_name)


@dataclass
class _Connection:
    """A client's live connection as the embedded broker's gate handed it to amqtt; `done` once amqtt let go."""

    writer: asyncio.StreamWriter
    done: asyncio.Event = field(default_factory=asyncio.Event)


class FedgeAuthPlugin(BaseAuthPlugin):
    """amqtt authentication: known user, right password, client id equal to the username.

    EmbeddedBroker already refuses bad logins before amqtt sees them (see ``_accept``); amqtt still needs an
    auth plugin to admit anyone, and this one repeats the same check.
    """

    @dataclass
    class Config:
        credentials: _Credentials = field(default_factory=lambda: _Credentials({}))

    def __init__(self, context: BaseContext) -> None:
        super().__init__(context)
        self._credentials: _Credentials = self.context.config.credentials  # type: ignore[union-attr]

    async def authenticate(self, *, session: Session) -> bool:
        reason = self._credentials.refusal(session.username, session.password, session.client_id)
        if reason:
            log.warning("broker refused %s:%s: %s", session.remote_address, session.remote_port, reason)
        return reason is None


class FedgeTopicPlugin(BaseTopicPlugin):
    """amqtt topic ACL: fedge's per-client rules (see the module docstring) for publish, subscribe and receive."""

    @dataclass
    class Config:
        server_user: str = DEFAULT_SERVER_USER

    async def topic_filtering(
        self, *, session: Session | None = None, topic: str | None = None, action: Action | None = None
    ) -> bool:
        username = session.username if session else None
        server_user = self.context.config.server_user  # type: ignore[union-attr]
        allowed = bool(topic) and permitted(username, topic or "", str(action), server_user)
        if not allowed and action != Action.RECEIVE:
            log.info("broker denied %s %s on %r", username, action, topic)
        return allowed


class _Replay(ReaderAdapter):
    """A reader that first returns bytes already read (the CONNECT the gate checked), then the stream."""

    def __init__(self, head: bytes, rest: ReaderAdapter) -> None:
        self._head, self._rest = head, rest

    async def read(self, n: int = -1) -> bytes:
        """Read exactly ``n`` bytes (amqtt always asks for an exact count); ``n < 0``: what is buffered or next."""
        if not self._head:
            return await self._rest.read(n)
        take = len(self._head) if n < 0 else n
        data, self._head = self._head[:take], self._head[take:]
        return data if n < 0 or len(data) == n else data + await self._rest.read(n - len(data))

    def feed_eof(self) -> None:
        self._rest.feed_eof()


class EmbeddedBroker:
    """amqtt's MQTT 3.1.1 broker, in this process, on its own event loop in a background thread.

    ``users=None`` is development mode: anonymous clients, no ACL. With ``users`` (username → password, including
    ``server_user``) every connection must authenticate with a client id equal to its username, and the topic
    ACL of this module is enforced on publish, subscribe and delivery. Credentials are checked before amqtt sees
    the connection, so a refused client cannot disturb another client's session. amqtt speaks MQTT 3.1.1 only:
    an MQTT 5 client is refused with "unacceptable protocol version".
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        users: dict[str, str] | None = None,
        server_user: str = DEFAULT_SERVER_USER,
    ) -> None:
        self.host = host
        self.port = port
        self.server_user = server_user
        self.users = None if users is None else check_users(users, server_user)
        self._credentials = None if users is None else _Credentials(self.users or {})
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._broker: Broker | None = None
        self._connections: dict[str, _Connection] = {}
        self.takeovers: Counter[str] = Counter()  # client id -> connections it ended by connecting again
        self.refused: Counter[str] = Counter()  # reason code -> connections or messages refused (see report)

    @property
    def url(self) -> str:
        """``mqtt://host:port`` of the listening broker."""
        return f"mqtt://{self.host}:{self.port}"

    def report(self) -> dict[str, Any]:
        """For summary.json: what the broker refused, by reason (bad_connect, bad_login, forbidden_will,
        retained_will, retained_publish), and the connections it ended because their id connected again."""
        return {"kind": "embedded", "refused": dict(self.refused), "takeovers": dict(self.takeovers)}

    def start(self) -> EmbeddedBroker:
        """Start the broker and return once it listens; BrokerError if it cannot (the port is taken, ...)."""
        if self._thread is not None:
            raise BrokerError("this broker was already started; create a new EmbeddedBroker")
        for name in ("amqtt", "transitions"):  # amqtt (and its state machines) log every connection at INFO
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(ready),), name="fedge-broker",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(C.BROKER_START_TIMEOUT_S):
            raise BrokerError(f"the embedded broker did not start within {C.BROKER_START_TIMEOUT_S:g} s")
        if self._error is not None:
            self._thread.join(C.BROKER_STOP_TIMEOUT_S)
            hint = "; stop whatever uses that port or choose another one" if isinstance(self._error, OSError) else ""
            raise BrokerError(f"cannot start the MQTT broker on {self.host}:{self.port}: {self._error}{hint}") \
                from self._error
        log.info("MQTT broker listening on %s (%s)", self.url,
                 "anonymous, no ACL" if self.users is None else f"{len(self.users)} users, ACL on")
        return self

    def stop(self) -> None:
        """Disconnect every client, close the listener and join the thread; calling it again does nothing."""
        thread, self._thread = self._thread, None
        if thread is None or not thread.is_alive():
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        thread.join(C.BROKER_STOP_TIMEOUT_S)
        if thread.is_alive():
            log.warning("the embedded broker did not stop within %g s", C.BROKER_STOP_TIMEOUT_S)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _amqtt_config(self) -> dict:
        if self._credentials is None:
            plugins: dict = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
        else:
            plugins = {
                f"{__name__}.FedgeAuthPlugin": {"credentials": self._credentials},
                f"{__name__}.FedgeTopicPlugin": {"server_user": self.server_user},
            }
        # An "external" listener: this class owns the socket (port 0, backlog, the credential gate) and hands
        # each connection to amqtt through its public Broker.external_connected.
        return {"listeners": {"default": {"type": "external"}}, "plugins": plugins,
                "timeout_disconnect_delay": max(1, C.KEEPALIVE_S // 2)}

    async def _serve(self, ready: threading.Event) -> None:
        """The thread's main coroutine: start amqtt and the listener, wait for stop(), shut both down."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = None
        try:
            self._broker = _FedgeAmqttBroker(self._amqtt_config(), loop=self._loop)
            self._broker.refused = self.refused
            await self._broker.start()
            server = await asyncio.start_server(self._accept, self.host, self.port, backlog=C.LISTEN_BACKLOG)
            self.port = server.sockets[0].getsockname()[1]
        except Exception as exc:  # reported by start() in the caller's thread
            self._error = exc
        ready.set()
        if self._error is None:
            await self._stop.wait()
        if server is not None:
            server.close()
        if self._broker is not None and self._broker.transitions.is_started():
            await self._broker.shutdown()

    async def _accept(self, stream_reader: asyncio.StreamReader, stream_writer: asyncio.StreamWriter) -> None:
        """Check a new connection's CONNECT (when users are set: login, will), end an earlier connection of the
        same client id, then give the connection to amqtt."""
        reader: ReaderAdapter = StreamReaderAdapter(stream_reader)
        writer = StreamWriterAdapter(stream_writer)
        client_id = None
        if self._credentials is not None:
            peer = stream_writer.get_extra_info("peername")
            try:
                level, raw = await asyncio.wait_for(_read_connect(reader), C.CONNECT_PACKET_TIMEOUT_S)
                if level != 4:
                    reason, code = f"MQTT protocol level {level} (only 3.1.1 is served)", UNACCEPTABLE_PROTOCOL_VERSION
                else:
                    connect = await ConnectPacket.from_stream(BufferReader(raw))
                    reason = self._credentials.refusal(connect.username, connect.password, connect.client_id)
                    code, counted = BAD_USERNAME_PASSWORD, "bad_login"
                    if reason is None:
                        counted, reason = will_refusal(connect, self.server_user) or (None, None)
                        code, client_id = NOT_AUTHORIZED, connect.client_id
            except (asyncio.TimeoutError, AMQTTError, MQTTError, NoDataError, ConnectionError, ValueError) as exc:
                self.refused["bad_connect"] += 1
                log.warning("broker dropped %s: no valid CONNECT (%s)", peer, exc or type(exc).__name__)
                await writer.close()
                return
            if reason:  # a wrong protocol level is routine (clients try MQTT 5 first), a bad login is not
                if code != UNACCEPTABLE_PROTOCOL_VERSION:
                    self.refused[counted] += 1
                log.log(logging.INFO if code == UNACCEPTABLE_PROTOCOL_VERSION else logging.WARNING,
                        "broker refused %s: %s", peer, reason)
                try:
                    await ConnackPacket.build(0, code).to_stream(writer)
                    await writer.close()
                except ConnectionError:
                    pass  # the client left first
                return
            reader = _Replay(raw, reader)
        assert self._broker is not None
        if client_id is None:
            await self._broker.external_connected(reader, writer, "default")
            return
        await self._end_earlier_connection(client_id, stream_writer.get_extra_info("peername"))
        mine = self._connections[client_id] = _Connection(stream_writer)
        try:
            await self._broker.external_connected(reader, writer, "default")
        finally:
            mine.done.set()
            if self._connections.get(client_id) is mine:
                del self._connections[client_id]

    async def _end_earlier_connection(self, client_id: str, peer: object) -> None:
        """Close the connection `client_id` already has, if any, and wait until amqtt has finished with it (its
        will published), so that amqtt never sees two connections of one client at once."""
        earlier = self._connections.get(client_id)
        if earlier is None:
            return
        self.takeovers[client_id] += 1
        log.warning("broker: client %s connected again from %s; ending its earlier connection (takeover %d)",
                    client_id, peer, self.takeovers[client_id])
        earlier.writer.close()
        try:
            await asyncio.wait_for(earlier.done.wait(), C.BROKER_STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("broker: the earlier connection of %s did not end within %g s", client_id,
                        C.BROKER_STOP_TIMEOUT_S)


async def _read_connect(reader: ReaderAdapter) -> tuple[int, bytes]:
    """Read a connection's first packet, which must be an MQTT CONNECT: its protocol level and its bytes."""
    fixed = await MQTTFixedHeader.from_stream(reader)
    if fixed is None or fixed.packet_type != CONNECT:
        raise MQTTError("the first packet is not a CONNECT")
    if fixed.remaining_length > C.MAX_MESSAGE_BYTES:
        raise MQTTError(f"a CONNECT of {fixed.remaining_length} bytes")
    body = await read_or_raise(reader, fixed.remaining_length)
    if body[:6] != b"\x00\x04MQTT":
        raise MQTTError("the CONNECT does not name the MQTT protocol")
    return body[6], bytes(fixed.to_bytes()) + body


def serve_forever(port: int, users_file: Path | None, host: str = "127.0.0.1",
                  server_user: str = DEFAULT_SERVER_USER) -> None:
    """Run the embedded broker in the foreground until SIGINT or SIGTERM (call from the main thread).

    ``users_file`` holds ``username:password`` lines and turns on authentication and the ACL; without it the
    broker is anonymous and is only allowed on a loopback address. Raises BrokerError for a bad users file,
    a port in use, or an anonymous broker on a public address.
    """
    users = None if users_file is None else read_users(users_file)
    if users is None and not ipaddress.ip_address(host).is_loopback:
        raise BrokerError(f"refusing an anonymous broker on {host}: pass a users file (username:password lines)")
    if users is not None and server_user not in users:
        raise BrokerError(f"users file {users_file} has no line for the server user {server_user!r}; add one")
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with EmbeddedBroker(host, port, users, server_user):
            done.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("MQTT broker stopped")


# ---------------------------------------------------------------------------------------------------------------
# Mosquitto


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a Mosquitto TLS listener; ``require_certificate`` also demands client certificates."""

    certfile: Path
    keyfile: Path
    cafile: Path | None = None
    require_certificate: bool = False

    def __post_init__(self) -> None:
        if self.require_certificate and self.cafile is None:
            raise BrokerError("require_certificate needs a cafile to check client certificates against")


def mosquitto_password_hash(password: str, salt: bytes | None = None, iterations: int = C.PBKDF2_ITERATIONS) -> str:
    """Mosquitto 2.0's ``$7$`` password hash: ``$7$<iterations>$<base64 salt>$<base64 PBKDF2-SHA512>``."""
    salt = secrets.token_bytes(C.PBKDF2_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 from the first byte (atomically, via a temp file and rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def mosquitto_acl(users: Iterable[str], server_user: str = DEFAULT_SERVER_USER) -> str:
    """The Mosquitto ``acl_file`` text for this module's rules and these users.

    Per-client topics are ``pattern`` lines (they apply to every user). The server-status topic is granted in
    each client's ``user`` block: a ``topic`` line before any ``user`` line would apply only to anonymous
    clients, and a pattern without ``%u`` draws a warning from Mosquitto.
    """
    lines = ["# fedge topic ACL (written by fedge.broker): clients reach only their own topics.", ""]
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
    if not 0 < port < 65536:
        raise BrokerError(f"port {port} is out of range 1..65535")
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    owner = _run_as_owner(run_as, directory) if os.geteuid() == 0 else None
    run_as = run_as if owner is None else owner.pw_name
    passwd, acl, conf = directory / "passwd", directory / "acl", directory / "mosquitto.conf"
    _write_private(passwd, "".join(f"{u}:{mosquitto_password_hash(p)}\n" for u, p in sorted(users.items())))
    _write_private(acl, mosquitto_acl(users, server_user))
    lines = [
        "# Mosquitto 2.0 configuration written by fedge.broker.",
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
        f"max_keepalive {C.MAX_KEEPALIVE_S}",
    ]
    if run_as is not None:
        lines.append(f"user {run_as}")
    if persistence_dir is None:
        lines.append("persistence false")
    else:
        lines += ["persistence true", f"persistence_location {Path(persistence_dir).resolve()}/", "autosave_interval 1"]
    if tls is not None:
        lines += [f"certfile {Path(tls.certfile).resolve()}", f"keyfile {Path(tls.keyfile).resolve()}",
                  "tls_version tlsv1.2", f"require_certificate {str(tls.require_certificate).lower()}"]
        if tls.cafile is not None:
            lines.append(f"cafile {Path(tls.cafile).resolve()}")
    _write_private(conf, "\n".join(lines) + "\n")
    if owner is not None:
        for path in (passwd, acl, conf):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    return conf


def _run_as_owner(run_as: str | None, directory: Path) -> pwd.struct_passwd:
    """The account Mosquitto started as root will run as (``run_as``, else its default ``mosquitto``); BrokerError
    if it does not exist or cannot traverse to ``directory``, naming the fix."""
    name = run_as or MOSQUITTO_DEFAULT_USER
    try:
        owner = pwd.getpwnam(name)
    except KeyError:
        hint = "install Debian's mosquitto package (it adds that user) or " if run_as is None else ""
        raise BrokerError(f"Mosquitto started as root runs as user {name!r}, which does not exist here; {hint}pass "
                          "--run-as USER with a user that exists") from None
    groups = set(os.getgrouplist(name, owner.pw_gid))
    for path in (directory, *directory.parents):
        st = path.stat()
        bit = 0o100 if st.st_uid == owner.pw_uid else 0o010 if st.st_gid in groups else 0o001
        if owner.pw_uid != 0 and not st.st_mode & bit:
            raise BrokerError(f"user {name!r}, whom Mosquitto runs as, cannot enter {path} (mode "
                              f"{stat.filemode(st.st_mode)}), so it could not read the files written to {directory};"
                              f" write them under a directory it can reach (e.g. /etc/mosquitto/fedge), or chmod o+x "
                              f"{path}")
    return owner
