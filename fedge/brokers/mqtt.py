"""One MQTT connection speaking fedge frames (paho-mqtt), and the inbox that validates what arrives.

The connection prefers MQTT v5 and falls back to 3.1.1 when the broker refuses v5 (the embedded amqtt
broker and RabbitMQ 3.10 speak only 3.1.1). It reconnects by itself with jittered, doubling backoff and
re-subscribes on every CONNACK (a broker that restarted without persistence remembers nothing). Given several
addresses (the nodes of a broker cluster), every attempt after a lost connection or a failed one goes to the
next address. Authentication and TLS failures are final: they are reported, never retried forever.
"""

from __future__ import annotations

import functools
import logging
import queue
import random
import re
import secrets
import ssl
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as paho
from paho.mqtt.reasoncodes import ReasonCode

from fedge.brokers.link import Connect
from fedge.constants import (
    CHUNK_SIZE,
    FLUSH_TIMEOUT_S,
    FRAME_QUEUE_LENGTH,
    KEEPALIVE_S,
    MAX_CHUNK_BYTES,
    MAX_CLOCK_SKEW_S,
    MAX_HEADER_BYTES,
    MQTT_QOS,
    RECONNECT_MAX_S,
    RECONNECT_MIN_S,
    WILL_TTL_S,
)
from fedge.wire import topics
from fedge.wire.chunks import ChunkJoiner, frames, iter_frames, unframe
from fedge.wire.codec import encode_status
from fedge.wire.envelope import Envelope, WireError

log = logging.getLogger(__name__)
_FATAL_CONNACK = {
    "Not authorized",
    "Bad user name or password",
    "Banned",
    "Client identifier not valid",
    "Bad authentication method",
}


class MqttError(ConnectionError):
    """The broker cannot be reached, or refused us (credentials, TLS); says what to check."""


@dataclass(frozen=True)
class Broker:
    """Where and how to connect: mqtt://host:port or mqtts://host:port (TLS), with optional credentials.

    ``fallbacks`` are more (host, port) addresses of the same broker (the other nodes of a cluster), tried in
    turn when a connection cannot be made or is lost."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    fallbacks: tuple[tuple[str, int], ...] = ()

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        return ((self.host, self.port), *self.fallbacks)

    def __str__(self) -> str:  # never shows the password
        user = f"{self.username}@" if self.username else ""
        return ",".join(f"{'mqtts' if self.tls else 'mqtt'}://{user}{h}:{p}" for h, p in self.addresses)


def parse_broker(
    url: str,
    username: str | None = None,
    password: str | None = None,
    cafile: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> Broker:
    """mqtt://[user[:password]@]host[:port] or mqtts://...; explicit username/password win over the URL's.

    A comma-separated list names the nodes of one broker cluster (``mqtt://n1:1883,mqtt://n2:1883`` or
    ``mqtt://n1,n2:1884``): one scheme for all; credentials, if any, in the first."""
    first, *more = [u.strip() for u in url.split(",")]
    scheme = first.split("://")[0].lower() if "://" in first else "mqtt"
    addresses, creds = [], urlsplit(first if "://" in first else f"mqtt://{first}")
    for k, one in enumerate((first, *more)):
        parts = urlsplit(one if "://" in one else f"{scheme}://{one}")
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise MqttError(
                f"broker URL {one!r} must look like mqtt://host:1883 or mqtts://host:8883 (a comma separates "
                "the nodes of a cluster; write one in a password as %2C)"
            )
        if parts.scheme != scheme:
            raise MqttError(f"broker URLs {url!r} mix mqtt:// and mqtts://; give every node the same scheme")
        if k and (parts.username or parts.password):
            raise MqttError(f"broker URLs {url!r}: give credentials once, in the first URL (or --password-file)")
        try:
            port = parts.port or (8883 if parts.scheme == "mqtts" else 1883)
        except ValueError:
            raise MqttError(f"broker URL {one!r} has an invalid port") from None
        addresses.append((parts.hostname, port))
    return Broker(
        addresses[0][0],
        addresses[0][1],
        scheme == "mqtts",
        username if username is not None else (unquote(creds.username) if creds.username else None),
        password if password is not None else (unquote(creds.password) if creds.password else None),
        cafile,
        certfile,
        keyfile,
        tuple(addresses[1:]),
    )


MQTT_ID_HEX = 32  # random hex digits after "<name>." in an MQTT client id


def mqtt_client_id(name: str) -> str:
    """The MQTT client id of one connection of ``name`` (a client id or the server user): ``<name>.<32 hex>``,
    new for every connection. RabbitMQ ends a connection when another connects with its client id, whoever logs in,
    so an id nobody can guess is what keeps one client from ending another's connection there; Mosquitto
    replaces it by the username (use_username_as_clientid) and the embedded broker checks its prefix."""
    return f"{name}.{secrets.token_hex(MQTT_ID_HEX // 2)}"


def mqtt_client_id_regex(name: str) -> str:
    """A regular expression matching exactly the client ids mqtt_client_id makes for ``name``."""
    return rf"{re.escape(name)}\.[0-9a-f]{{{MQTT_ID_HEX}}}"


def first_address(broker: Broker, name: str) -> int:
    """Which of the broker's addresses ``name`` tries first: a stable pick from the name, so that a fleet given
    one list spreads over the cluster's nodes."""
    return zlib.crc32(name.encode()) % len(broker.addresses)


@dataclass(frozen=True)
class Delivery:
    """A whole, validated message: topic kind, the client level of its topic, envelope and payload."""

    kind: str
    client: str | None
    envelope: Envelope
    payload: bytes | bytearray  # a writable bytearray when joined from chunks: decoded tensors view it


def will_frame(run: str, sender: str, session: str) -> bytes:
    """The "offline" status the broker publishes for us if we vanish (valid for as long as we may live)."""
    payload = encode_status("offline", session)
    return frames(Envelope.new(run, 0, "status", sender, payload, ttl_s=WILL_TTL_S), payload)[0]


Accept = Callable[[str, "str | None", Envelope], int]


class Inbox:
    """Checks every arriving frame, cheapest first, and joins chunks into whole messages.

    Order (reliability-notes §6): run and topic shape; frame size; envelope schema and TTL; chunk geometry
    (a chunk count the announced size cannot need) and hash; identity (the sender named in the envelope must be
    the topic's client level, or "server" on a client's own topics); the run; expiry and clock skew; a repeat
    of a message already delivered is dropped and counted in `joiner.duplicates`, not rejected; then
    `accept(kind, client, envelope)`, which may raise WireError (e.g. no open instruction) and returns the
    largest payload allowed; only then are the bytes kept, within the joiner's per-sender and total
    budgets (evictions are counted per sender in `joiner.evicted`), and the root over the chunks' SHA-256
    digests is checked against the envelope. Rejections are logged in one line each and counted in `rejected` by reason.
    """

    def __init__(self, run: str, accept: Accept) -> None:
        self.run = run
        self.accept = accept
        self.rejected: Counter[str] = Counter()
        self.joiner = ChunkJoiner()
        self._lock = threading.Lock()

    def reject(self, kind: str, client: str | None, error: WireError) -> None:
        """Log one line and count the reason; the message is dropped and nothing else changes."""
        with self._lock:
            self.rejected[error.reason] += 1
        log.warning("rejected %s message from %s: %s", kind, client or "the server", error)

    def check(self, topic: str, data: bytes) -> Delivery | None:
        """Validate one frame; the whole message once its last chunk arrived, else None. Raises WireError."""
        try:
            run, kind, client = topics.parse(topic)
        except topics.TopicError as e:
            raise WireError("bad_format", str(e)) from None
        if run != self.run:
            raise WireError("wrong_run", f"topic {topic!r} belongs to run {run!r}, not {self.run!r}")
        if len(data) > MAX_CHUNK_BYTES + MAX_HEADER_BYTES:
            raise WireError("too_large", f"a {len(data)}-byte message exceeds the per-chunk cap")
        frame = unframe(data)
        env = frame.envelope
        owner = client if kind in topics.UPLINK else topics.SERVER_ID
        if env.sender != owner:
            raise WireError("spoof", f"envelope sender {env.sender!r} on topic {topic!r} (expected {owner!r})")
        expected = {
            "register": ("register",),
            "result": ("result",),
            "status": ("status",),
            topics.DOWNLINK: ("task", "ack"),
            topics.SERVER: ("status",),
        }[kind]
        if env.type not in expected:
            raise WireError("bad_format", f"a {env.type!r} message on a {kind} topic")
        if env.run != self.run:
            raise WireError("wrong_run", f"envelope of run {env.run!r} on run {self.run!r}")
        now = time.time()
        if env.expired(now):
            raise WireError(
                "expired", f"message {env.msg_id} expired {now - env.created_at:.0f} s after it was created"
            )
        if env.created_at > now + MAX_CLOCK_SKEW_S:
            raise WireError(
                "clock_skew",
                f"message {env.msg_id} was created {env.created_at - now:.0f} s in the "
                f"future (tolerance {MAX_CLOCK_SKEW_S:g} s); check the sender's clock",
            )
        with self._lock:
            if self.joiner.repeated(owner, env.msg_id):  # a QoS 1 redelivery of a message already delivered:
                return None  # not an error, whether or not the instruction it answered is still open
        limit = self.accept(kind, client, env)
        if env.size > limit:
            raise WireError(
                "too_large", f"{env.type} of {env.size} bytes exceeds the {limit} bytes expected from {owner}"
            )
        with self._lock:
            payload = self.joiner.add(owner, frame, limit)
        return None if payload is None else Delivery(kind, client, env, payload)

    def receive(self, topic: str, data: bytes) -> Delivery | None:
        """`check`, with a rejection logged and counted instead of raised."""
        try:
            return self.check(topic, data)
        except WireError as e:
            parts = topic.split("/")
            self.reject(parts[2] if len(parts) > 2 else "?", parts[3] if len(parts) > 3 else None, e)
            return None


class Endpoint:
    """A paho client that keeps itself connected, re-subscribes on every connect, and publishes
    fedge messages as QoS 1 chunk frames: the production fedge.brokers.link.Link. `on_frame(topic, bytes)` runs on one
    worker thread, in arrival order, so that checking and hashing a frame overlaps paho reading the next; at most
    FRAME_QUEUE_LENGTH frames wait for it (then paho's network thread waits too, and TCP slows the sender)."""

    def __init__(
        self,
        broker: Broker,
        client_id: str,
        subscriptions: list[str],
        on_frame: Callable[[str, bytes], None],
        on_connect: Callable[[], None] | None = None,
        will: tuple[str, bytes] | None = None,
        keepalive: int = KEEPALIVE_S,
    ) -> None:
        self.broker, self.client_id, self.subscriptions = broker, client_id, list(subscriptions)
        self.mqtt_id = mqtt_client_id(client_id)  # a new one for every connection attempt (_pick_address)
        self.attempts = first_address(broker, client_id)  # the next connection attempt goes to address attempts % n
        self.address = broker.addresses[self.attempts]
        # On a cluster, subscriptions are QoS 0: a subscription's queue lives on one node and is lost with it at any
        # QoS (fedge acknowledges and re-sends every message itself), and RabbitMQ 3.10 keeps a QoS 1 subscription's
        # queue (durable) after its node died: publishes routed to it are nacked, which closes the publisher.
        self.subscribe_qos = MQTT_QOS if len(broker.addresses) == 1 else 0
        self.on_frame, self.on_connect_hook, self.will, self.keepalive = on_frame, on_connect, will, keepalive
        self.connected = threading.Event()
        self.fatal: str | None = None
        self.protocol = paho.MQTTv5
        self.connects = 0
        self.connected_at = 0.0  # time.monotonic() of the last CONNACK
        self.stopping = False
        self.last_sent: paho.MQTTMessageInfo | None = None
        self.refusals = 0  # connections closed before any CONNACK (a broker that does not speak v5 may do so)
        self.frames: queue.Queue[tuple[str, bytes] | None] = queue.Queue(FRAME_QUEUE_LENGTH)
        self.worker = threading.Thread(target=self._handle_frames, daemon=True, name=f"frames-{client_id}")
        self.client = self._make_client()

    def _make_client(self) -> paho.Client:
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.mqtt_id, protocol=self.protocol)
        if self.broker.username is not None:
            c.username_pw_set(self.broker.username, self.broker.password)
        if self.broker.tls:
            c.tls_set(
                ca_certs=self.broker.cafile,
                certfile=self.broker.certfile,
                keyfile=self.broker.keyfile,
                cert_reqs=ssl.CERT_REQUIRED,
            )
        if self.will is not None:
            c.will_set(self.will[0], self.will[1], qos=MQTT_QOS, retain=False)
        c.reconnect_delay_set(RECONNECT_MIN_S, RECONNECT_MAX_S)
        c.max_inflight_messages_set(64)
        c.on_connect, c.on_disconnect, c.on_message = self._on_connect, self._on_disconnect, self._on_message
        c.on_pre_connect = self._pick_address
        return c

    def _pick_address(self, client: paho.Client, userdata: object) -> None:
        """Before each connection attempt (paho's first one and every reconnect): the next of the broker's
        addresses, and a new client id, so that no broker ties the new connection to the last one's state (a
        RabbitMQ node that died keeps the names of its queues). paho's setters refuse while a reconnect is under
        way, so its fields are set."""
        addresses = self.broker.addresses
        self.address = addresses[self.attempts % len(addresses)]
        self.attempts += 1
        self.mqtt_id = mqtt_client_id(self.client_id)
        client._host, client._port = self.address
        client._client_id = self.mqtt_id.encode()

    def _on_connect(self, client: paho.Client, userdata: object, flags: object, rc: ReasonCode, props: object) -> None:
        if rc.is_failure:
            self.fatal = str(rc)
            if str(rc) in _FATAL_CONNACK or str(rc) == "Unsupported protocol version":
                client.disconnect()  # final: stop the reconnect loop
            return
        self.fatal = None
        self.connects += 1
        self.connected_at = time.monotonic()
        if len(self.broker.addresses) > 1:
            log.info("%s: connected to %s:%d", self.client_id, *self.address)
        for topic in self.subscriptions:
            client.subscribe(topic, qos=self.subscribe_qos)
        self.connected.set()
        if self.on_connect_hook is not None:
            try:
                self.on_connect_hook()
            except Exception:  # a hook's bug must not kill the network thread
                log.exception("%s: on-connect hook failed", self.client_id)

    def _on_disconnect(
        self, client: paho.Client, userdata: object, flags: object, rc: ReasonCode, props: object
    ) -> None:
        if self.connected.is_set() and not self.stopping:
            log.warning("%s: disconnected from %s:%d (%s); reconnecting", self.client_id, *self.address, rc)
        elif self.connects == 0:
            self.refusals += 1
        self.connected.clear()
        # jitter the first retry so a fleet does not reconnect in lock-step after a broker restart
        client.reconnect_delay_set(RECONNECT_MIN_S * random.uniform(1.0, 4.0), RECONNECT_MAX_S)

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        self.frames.put((msg.topic, msg.payload))

    def _handle_frames(self) -> None:
        while (item := self.frames.get()) is not None:
            try:
                self.on_frame(*item)
            except Exception:  # never let a handler bug kill the worker
                log.exception("%s: handling a message on %s failed", self.client_id, item[0])

    def start(self, timeout: float) -> None:
        """Connect (v5, else 3.1.1) and wait up to `timeout` s; refused credentials or TLS raise MqttError."""
        deadline = time.monotonic() + timeout
        connects = self.connects
        if not self.worker.is_alive():
            self.worker.start()
        while True:
            try:
                self.client.connect_async(self.broker.host, self.broker.port, self.keepalive)
                self.client.loop_start()
            except (OSError, ssl.SSLError, ValueError) as e:
                raise MqttError(f"cannot connect to {self.broker}: {e}") from None
            # Connected is a CONNACK counted, not the flag: the broker may end the connection again before this
            # thread runs (a second connection of this id took over) and the flag is then clear; paho reconnects.
            while self.connects == connects and not self.connected.wait(0.05):
                if self._final_refusal() or time.monotonic() > deadline or self.refusals >= 2:
                    break  # a refusal that is not final goes on to the next address
            if self.connects > connects:
                return
            self.client.disconnect()
            self.client.loop_stop()
            v5_refused = self.fatal == "Unsupported protocol version" or self.refusals >= 2
            if v5_refused and self.protocol == paho.MQTTv5:
                log.info("%s: broker does not speak MQTT v5; using 3.1.1", self.client_id)
                self.protocol, self.fatal, self.refusals = paho.MQTTv311, None, 0
                self.attempts = first_address(self.broker, self.client_id)  # the refusals moved it on: start over
                self.client = self._make_client()
                continue
            if self._final_refusal():
                raise MqttError(
                    f"broker {self.broker} refused {self.client_id}: {self.fatal}. Check the username, "
                    "password file and TLS settings"
                )
            refused = f" (last refusal: {self.fatal})" if self.fatal else ""
            raise MqttError(
                f"no connection to {self.broker} within {timeout:.0f} s{refused}; is the broker running and reachable?"
            )

    def _final_refusal(self) -> bool:
        """Whether the last CONNACK refused us for good (credentials, protocol), not for a node's passing trouble."""
        return self.fatal in _FATAL_CONNACK or self.fatal == "Unsupported protocol version"

    def publish(
        self,
        topic: str,
        type: str,
        round: int,
        payload: bytes,
        reply_to: str | None = None,
        chunk_size: int = CHUNK_SIZE,
        sender: str | None = None,
        run: str | None = None,
    ) -> Envelope:
        """Send `payload` as chunk frames at QoS 1 and return its envelope (for acknowledgements).

        paho queues what it cannot send now and sends it after a reconnect; callers that need the
        message to arrive wait for an application-level acknowledgement and re-send."""
        run = run if run is not None else topics.parse(topic)[0]
        env = Envelope.new(
            run, round, type, sender or self.client_id, payload, reply_to=reply_to, chunk_size=chunk_size
        )
        self.send(topic, env, payload, chunk_size)
        return env

    def send(self, topic: str, env: Envelope, payload: bytes, chunk_size: int = CHUNK_SIZE) -> None:
        """(Re-)send an already enveloped payload; a repeat is recognised by its msg_id and ignored."""
        for data in iter_frames(env, payload, chunk_size):
            self.last_sent = self.client.publish(topic, data, qos=MQTT_QOS)

    def stop(self) -> None:
        """Disconnect cleanly (the broker then does not publish the will) and stop the network thread."""
        self.stopping = True
        if self.last_sent is not None and self.connected.is_set():
            try:  # flush what we queued last (e.g. the server's stop) before hanging up
                self.last_sent.wait_for_publish(FLUSH_TIMEOUT_S)
            except (RuntimeError, ValueError):
                pass  # not sendable any more: the connection is already gone
        self.client.disconnect()
        self.client.loop_stop()
        self.connected.clear()
        if self.worker.is_alive():  # paho delivers nothing more: let the worker finish what arrived, then end
            self.frames.put(None)
            self.worker.join(FLUSH_TIMEOUT_S)


def connector(broker: Broker, keepalive: int = KEEPALIVE_S) -> Connect:
    """How the fleet and the client sessions connect in production: each call makes an Endpoint to `broker`
    (a fedge.brokers.link.Link; it connects on `start`)."""
    return functools.partial(Endpoint, broker, keepalive=keepalive)
