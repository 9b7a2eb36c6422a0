"""An edge client's MQTT session: register, execute tasks, upload results, stay alive.

A client registers on every connect and whenever a (new) server announces itself, and re-sends an
unacknowledged registration or upload every ACK_TIMEOUT_S (and at once after a reconnect), a bounded
number of times. An instruction the server re-sends (after a broker restart) is recognised by its id
and dropped; the unacknowledged result is what gets re-sent. A restarted server issues new ids, and
the agent re-executes those from its snapshot of the round before, so the result is the same.
Heartbeats and the "offline" will tell the server whether to keep waiting for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

from edge_client.agent import ClientAgent, TaskError
from fedge.brokers.link import Connect
from fedge.brokers.mqtt import Delivery, Inbox, will_frame
from fedge.constants import ACK_TIMEOUT_S, CHUNK_SIZE, HEARTBEAT_S, MAX_ERROR_CHARS, MAX_PAYLOAD_BYTES
from fedge.wire import topics
from fedge.wire.codec import decode_ack, decode_status, decode_task, encode_info, encode_result, encode_status
from fedge.wire.envelope import Envelope, WireError
from fedge.wire.messages import Result, Task

log = logging.getLogger(__name__)
MAX_SENDS = 5  # an upload or registration is sent at most this many times without an acknowledgement
STOP_TASK = "stop"


class ClientStopped(RuntimeError):
    """The server refused this client (bad registration); the message says why and what to change."""


@dataclass
class _Pending:
    """A message waiting for the server's acknowledgement."""

    topic: str
    envelope: Envelope
    payload: bytes
    sends: int
    due: float


class EdgeClient:
    """One client's MQTT session around a ClientAgent, on the link `connect` makes (in production
    `fedge.brokers.mqtt.connector(broker, keepalive)`). `compute` serialises training between the virtual clients of
    one process."""

    def __init__(
        self,
        agent: ClientAgent,
        connect: Connect,
        run: str,
        heartbeat_s: float = HEARTBEAT_S,
        chunk_size: int = CHUNK_SIZE,
        ack_timeout_s: float = ACK_TIMEOUT_S,
        compute: threading.Lock | None = None,
    ) -> None:
        self.agent, self.run, self.cid = agent, run, agent.client_id
        self.heartbeat_s, self.chunk_size, self.ack_timeout_s = heartbeat_s, chunk_size, ack_timeout_s
        self.compute = compute or threading.Lock()
        self.session = uuid.uuid4().hex
        self.inbox = Inbox(run, self._accept)
        self.queue: queue.Queue[Delivery] = queue.Queue()
        self.pending: dict[str, _Pending] = {}  # msg_id → message awaiting an ack
        self.registered = False
        self.server_session: str | None = None
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        task_topic = topics.client_topic(run, topics.DOWNLINK, self.cid)
        self.link = connect(
            self.cid,
            [task_topic, topics.server_topic(run)],
            lambda t, d: self._deliver(self.inbox.receive(t, d)),
            self._on_connect,
            (self.topic("status"), will_frame(run, self.cid, self.session)),
        )

    def topic(self, kind: str) -> str:
        return topics.client_topic(self.run, kind, self.cid)

    def _accept(self, kind: str, client: str | None, env: Envelope) -> int:
        return MAX_PAYLOAD_BYTES  # the server is trusted with size; everything else is checked

    def _deliver(self, d: Delivery | None) -> None:
        if d is not None:
            self.queue.put(d)

    def _on_connect(self) -> None:
        self._resend_soon()
        self._status("online")
        self.register()

    def _resend_soon(self) -> None:
        """Re-send every unacknowledged message at once instead of after ACK_TIMEOUT_S: we or the server just
        (re)connected, and what was sent while either was away is lost (a broker without subscribers drops it)."""
        with self.lock:
            for p in self.pending.values():
                p.due = 0.0

    def _status(self, state: str) -> None:
        self.link.publish(self.topic("status"), "status", 0, encode_status(state, self.session), run=self.run)

    def register(self) -> None:
        """Send the registration (the spec, profile and data sizes) and wait for the server's ack."""
        self._send(self.topic("register"), "register", 0, encode_info(self.agent.info()), None)

    def _send(self, topic: str, type: str, rnd: int, payload: bytes, reply_to: str | None) -> _Pending:
        env = self.link.publish(topic, type, rnd, payload, reply_to=reply_to, chunk_size=self.chunk_size, run=self.run)
        p = _Pending(topic, env, payload, 1, time.monotonic() + self.ack_timeout_s)
        with self.lock:
            self.pending[env.msg_id] = p
        return p

    def run_forever(self, connect_timeout: float) -> None:
        """Connect, then serve until the server says stop or `stopped` is set; ClientStopped if refused."""
        self.link.start(connect_timeout)
        beat = threading.Thread(target=self._heartbeat, daemon=True, name=f"heartbeat-{self.cid}")
        beat.start()
        try:
            while not self.stopped.is_set():
                try:
                    d = self.queue.get(timeout=0.2)
                except queue.Empty:
                    self._resend_due()
                    continue
                try:
                    self._handle(d)
                except WireError as e:
                    self.inbox.reject(d.kind, d.client, e)
        finally:
            self.stopped.set()
            if self.link.connected.is_set():
                self._status("offline")
            self.link.stop()

    def _heartbeat(self) -> None:
        while not self.stopped.wait(self.heartbeat_s):
            if self.link.connected.is_set():
                self._status("alive")

    def _resend_due(self) -> None:
        now = time.monotonic()
        with self.lock:
            due = [p for p in self.pending.values() if p.due <= now]
        for p in due:
            if p.sends >= MAX_SENDS:
                log.warning(
                    "client %s: %s %s was never acknowledged after %d sends; giving up on it",
                    self.cid,
                    p.envelope.type,
                    p.envelope.msg_id,
                    p.sends,
                )
                with self.lock:
                    self.pending.pop(p.envelope.msg_id, None)
                continue
            p.sends += 1
            p.due = now + self.ack_timeout_s
            self.link.send(p.topic, p.envelope, p.payload, self.chunk_size)

    def _handle(self, d: Delivery) -> None:
        if d.kind == topics.SERVER:
            state, session = decode_status(d.payload)
            if state == "online":
                self._resend_soon()
            if state == "online" and session != self.server_session:
                self.server_session = session
                log.info("client %s: server %s is online; registering", self.cid, session[:8])
                self.register()
            return
        if d.envelope.type == "ack":
            self._acknowledged(d.envelope.reply_to, decode_ack(d.payload))
            return
        task = decode_task(d.payload)
        if task.type == STOP_TASK:
            self._stop(task)
            return
        try:
            with self.compute:
                result = self.agent.handle(task)
        except Exception as e:  # noqa: BLE001 - bad weights, a diverged training: report it, keep serving
            log.error("client %s: cannot execute %s of round %d: %s", self.cid, task.type, task.round, e)
            reason = f"{type(e).__name__}: {e}" if not isinstance(e, TaskError) else str(e)
            result = Result(self.cid, task.round, task.type, 0, error=reason[:MAX_ERROR_CHARS])
        self._send(self.topic("result"), "result", task.round, encode_result(result), d.envelope.msg_id)

    def _stop(self, task: Task) -> None:
        """The server ends the run, or (with a session in the config) tells one connection of this client id that
        a newer one took over: that connection stops with ClientStopped, the other ignores the message."""
        session = task.config.get("session")
        if session is None:
            log.info("client %s: the server ended the run", self.cid)
            self.stopped.set()
        elif session == self.session:
            raise ClientStopped(
                f"client {self.cid}: another connection with client id {self.cid} took over this "
                f"one ({task.config.get('reason')}); is a second `fedge client --id {self.cid}` "
                "running? Stopping this one"
            )

    def _acknowledged(self, msg_id: str | None, error: str | None) -> None:
        with self.lock:
            p = self.pending.pop(msg_id or "", None)
        if p is None:
            return
        if error is None:
            if p.envelope.type == "register" and not self.registered:
                self.registered = True
                log.info("client %s: registered with the server", self.cid)
            return
        log.error("client %s: the server refused our %s: %s", self.cid, p.envelope.type, error)
        if p.envelope.type == "register":
            self.stopped.set()
            raise ClientStopped(f"client {self.cid}: the server refused the registration: {error}")
