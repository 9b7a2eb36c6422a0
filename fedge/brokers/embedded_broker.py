"""The embedded MQTT broker (amqtt, in this process) enforcing fedge.brokers.access's rules, for `fedge run` and
`fedge broker`.

Beyond amqtt: a CONNECT whose will is retained or names a topic its user may not publish to is refused; no
message is retained (a retained publish is delivered as an ordinary one, its flag dropped); a client id must be
the username or start with ``<username>.``; one connection per user: a second CONNECT of the same user ends the
first connection (its will is published, as Mosquitto does), counted in ``EmbeddedBroker.takeovers``. What the
broker holds for one connection to deliver (queued or awaiting its PUBACK) is bounded as Mosquitto bounds a client's
queue (MAX_QUEUED_MESSAGES, MAX_QUEUED_BYTES): a delivery over either is dropped and counted (``queue_full``); and
no session outlives its connection (a non-clean one included), so whatever was kept for it is freed when it goes.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import hmac
import ipaddress
import logging
import signal
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amqtt.adapters import BufferReader, ReaderAdapter, StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import Broker
from amqtt.codecs_amqtt import read_or_raise
from amqtt.contexts import Action, BaseContext
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.connack import BAD_USERNAME_PASSWORD, NOT_AUTHORIZED, UNACCEPTABLE_PROTOCOL_VERSION, ConnackPacket
from amqtt.mqtt.connect import ConnectPacket
from amqtt.mqtt.packet import CONNECT, MQTTFixedHeader
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session

from fedge import constants as C
from fedge.brokers.access import DEFAULT_SERVER_USER, BrokerError, check_users, permitted, read_users

log = logging.getLogger(__name__)


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
        if client_id != username and not (client_id or "").startswith(f"{username}."):
            return f"client id {client_id!r} is neither username {username!r} nor starts with {username + '.'!r}"
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


@dataclass
class _Outbox:
    """What the broker holds for one session's delivery: messages handed to amqtt and not yet done with."""

    messages: int = 0
    bytes: int = 0
    peak: int = 0  # the most bytes it held since it last emptied
    dropping: bool = False  # over its limits since it last emptied (logged once)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None (another C library, another OS)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def return_freed_memory() -> None:
    """Hand the memory malloc keeps after large frees back to the OS, where the C library can (glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class _BoundedHandler:
    """A connection's amqtt protocol handler as the broadcast sees it: a delivery that would take the session's
    outbox over its limits is dropped; an accepted one is counted until amqtt is done with it (written and
    acknowledged, or given up on), and its failure ends quietly, keeping nothing."""

    def __init__(self, broker: _FedgeAmqttBroker, session: Session, handler: Any) -> None:
        self._broker, self._session, self._handler = broker, session, handler

    async def mqtt_publish(
        self, topic: str, data: bytes | bytearray | None, qos: int | None, retain: bool, ack_timeout: int | None = None
    ) -> None:
        size = len(data or b"")
        if not self._broker.admit(self._session, size):
            return
        try:
            await self._handler.mqtt_publish(topic, data, qos, retain, ack_timeout)
        except Exception as exc:  # noqa: BLE001 - the connection went (amqtt: a closed stream, no PUBACK in 5 s)
            log.debug("broker: a delivery to %s ended: %s", self._session.client_id, exc or type(exc).__name__)
        finally:
            self._broker.release(self._session, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


class _FedgeAmqttBroker(Broker):
    """amqtt's broker with four changes: it keeps no retained message (fedge never uses one, and amqtt would
    deliver a stored one to a later subscriber without asking the ACL, even one whose SUBSCRIBE it refused), its
    subscription table is iterated over snapshots (see _Snapshots), each session's deliveries in progress are
    bounded (see _BoundedHandler), and `forget` drops a session when its connection ends."""

    refused: Counter[str]  # EmbeddedBroker's counter of refusals, shared

    def __init__(self, *args: Any, queue_messages: int, queue_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._subscriptions = _Snapshots()
        self.queue_messages, self.queue_bytes = queue_messages, queue_bytes
        self.outboxes: dict[int, _Outbox] = {}  # id(session) -> its deliveries in progress (while there are any)

    def _get_handler(self, session: Session) -> Any:
        """amqtt asks for a session's handler only to publish to it: hand it out bounded."""
        handler = super()._get_handler(session)
        return None if handler is None else _BoundedHandler(self, session, handler)

    def admit(self, session: Session, size: int) -> bool:
        """Count a delivery of `size` bytes to `session`, or refuse it (counted as queue_full) when its outbox
        would then hold more than `queue_messages` messages or `queue_bytes` bytes."""
        box = self.outboxes.setdefault(id(session), _Outbox())
        if box.messages + 1 > self.queue_messages or box.bytes + size > self.queue_bytes:
            self.refused["queue_full"] += 1
            if not box.dropping:
                box.dropping = True
                log.warning(
                    "broker: %s is not taking its messages (%d messages, %d bytes held for it); dropping what is "
                    "over %d messages or %d bytes",
                    session.client_id,
                    box.messages,
                    box.bytes,
                    self.queue_messages,
                    self.queue_bytes,
                )
            return False
        box.messages, box.bytes = box.messages + 1, box.bytes + size
        box.peak = max(box.peak, box.bytes)
        return True

    def release(self, session: Session, size: int) -> None:
        """A delivery `admit` counted is over. When it was the session's last one and the session held
        BROKER_TRIM_BYTES or more, the freed memory goes back to the OS."""
        box = self.outboxes[id(session)]
        box.messages, box.bytes = box.messages - 1, box.bytes - size
        if box.messages == 0:
            del self.outboxes[id(session)]
            if box.peak >= C.BROKER_TRIM_BYTES:
                return_freed_memory()

    async def forget(self, client_id: str) -> None:
        """Drop the session of `client_id`, whose connection ended: its subscriptions and anything queued for it
        while it is away. amqtt keeps a non-clean session forever (fedge's clients all connect clean)."""
        if client_id not in self._sessions:
            return
        try:
            await asyncio.wait_for(self._cleanup_session(client_id), C.BROKER_STOP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - never into the connection's task; amqtt would expire it anyway
            log.warning("broker: cannot drop the session of %s: %s", client_id, exc or type(exc).__name__)

    async def retain_message(
        self,
        source_session: Session | None,
        topic_name: str | None,
        data: bytes | bytearray | None,
        qos: int | None = None,
    ) -> None:
        self.refused["retained_publish"] += 1
        log.warning(
            "broker: %s published a retained message on %r; delivered, not retained",
            source_session.client_id if source_session else "the broker",
            topic_name,
        )


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
        queue_messages: int = C.MAX_QUEUED_MESSAGES,
        queue_bytes: int = C.MAX_QUEUED_BYTES,
    ) -> None:
        self.host = host
        self.queue_messages, self.queue_bytes = queue_messages, queue_bytes
        self.port = port
        self.server_user = server_user
        self.users = None if users is None else check_users(users, server_user)
        self._credentials = None if users is None else _Credentials(self.users or {})
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._broker: _FedgeAmqttBroker | None = None
        self._connections: dict[str, _Connection] = {}  # username -> its connection
        self.takeovers: Counter[str] = Counter()  # username -> connections it ended by connecting again
        self.refused: Counter[str] = Counter()  # reason code -> connections or messages refused (see report)

    @property
    def url(self) -> str:
        """``mqtt://host:port`` of the listening broker."""
        return f"mqtt://{self.host}:{self.port}"

    def report(self) -> dict[str, Any]:
        """For summary.json: what the broker refused, by reason (bad_connect, bad_login, forbidden_will,
        retained_will, retained_publish, queue_full: a delivery over a connection's queue limits), and the
        connections it ended because their id connected again."""
        return {"kind": "embedded", "refused": dict(self.refused), "takeovers": dict(self.takeovers)}

    def held(self) -> tuple[int, int]:
        """(messages, bytes) the broker holds for delivery, all connections together (see MAX_QUEUED_BYTES)."""
        boxes = [] if self._broker is None else list(self._broker.outboxes.values())
        return sum(b.messages for b in boxes), sum(b.bytes for b in boxes)

    def start(self) -> EmbeddedBroker:
        """Start the broker and return once it listens; BrokerError if it cannot (the port is taken, ...)."""
        if self._thread is not None:
            raise BrokerError("this broker was already started; create a new EmbeddedBroker")
        for name in ("amqtt", "transitions"):  # amqtt (and its state machines) log every connection at INFO
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        ready = threading.Event()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(ready),), name="fedge-broker", daemon=True
        )
        self._thread.start()
        if not ready.wait(C.BROKER_START_TIMEOUT_S):
            raise BrokerError(f"the embedded broker did not start within {C.BROKER_START_TIMEOUT_S:g} s")
        if self._error is not None:
            self._thread.join(C.BROKER_STOP_TIMEOUT_S)
            hint = "; stop whatever uses that port or choose another one" if isinstance(self._error, OSError) else ""
            raise BrokerError(
                f"cannot start the MQTT broker on {self.host}:{self.port}: {self._error}{hint}"
            ) from self._error
        log.info(
            "MQTT broker listening on %s (%s)",
            self.url,
            "anonymous, no ACL" if self.users is None else f"{len(self.users)} users, ACL on",
        )
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
        return {
            "listeners": {"default": {"type": "external"}},
            "plugins": plugins,
            "timeout_disconnect_delay": max(1, C.KEEPALIVE_S // 2),
        }

    async def _serve(self, ready: threading.Event) -> None:
        """The thread's main coroutine: start amqtt and the listener, wait for stop(), shut both down."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = None
        try:
            self._broker = _FedgeAmqttBroker(
                self._amqtt_config(), loop=self._loop, queue_messages=self.queue_messages, queue_bytes=self.queue_bytes
            )
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
        same user, then give the connection to amqtt."""
        reader: ReaderAdapter = StreamReaderAdapter(stream_reader)
        writer = StreamWriterAdapter(stream_writer)
        user = client_id = None
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
                        code, user, client_id = NOT_AUTHORIZED, connect.username, connect.client_id
            except (asyncio.TimeoutError, AMQTTError, MQTTError, NoDataError, ConnectionError, ValueError) as exc:
                self.refused["bad_connect"] += 1
                log.warning("broker dropped %s: no valid CONNECT (%s)", peer, exc or type(exc).__name__)
                await writer.close()
                return
            if reason:  # a wrong protocol level is routine (clients try MQTT 5 first), a bad login is not
                if code != UNACCEPTABLE_PROTOCOL_VERSION:
                    self.refused[counted] += 1
                log.log(
                    logging.INFO if code == UNACCEPTABLE_PROTOCOL_VERSION else logging.WARNING,
                    "broker refused %s: %s",
                    peer,
                    reason,
                )
                try:
                    await ConnackPacket.build(0, code).to_stream(writer)
                    await writer.close()
                except ConnectionError:
                    pass  # the client left first
                return
            reader = _Replay(raw, reader)
        assert self._broker is not None
        if user is None:
            await self._broker.external_connected(reader, writer, "default")
            return
        await self._end_earlier_connection(user, stream_writer.get_extra_info("peername"))
        mine = self._connections[user] = _Connection(stream_writer)
        try:
            await self._broker.external_connected(reader, writer, "default")
        finally:
            if client_id:  # before the next connection of this user may start (it waits for `done`)
                await self._broker.forget(client_id)
            mine.done.set()
            if self._connections.get(user) is mine:
                del self._connections[user]

    async def _end_earlier_connection(self, user: str, peer: object) -> None:
        """Close the connection `user` already has, if any, and wait until amqtt has finished with it (its will
        published): one connection per user, as Mosquitto's use_username_as_clientid makes it."""
        earlier = self._connections.get(user)
        if earlier is None:
            return
        self.takeovers[user] += 1
        log.warning(
            "broker: client %s connected again from %s; ending its earlier connection (takeover %d)",
            user,
            peer,
            self.takeovers[user],
        )
        earlier.writer.close()
        try:
            await asyncio.wait_for(earlier.done.wait(), C.BROKER_STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("broker: the earlier connection of %s did not end within %g s", user, C.BROKER_STOP_TIMEOUT_S)


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


def serve_forever(
    port: int, users_file: Path | None, host: str = "127.0.0.1", server_user: str = DEFAULT_SERVER_USER
) -> None:
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
