"""The server's side of MQTT: registrations, liveness, and the Transport the round loop talks to.

Everything a client sends is checked by fedge.brokers.mqtt.Inbox (identity, envelope, size, hashes) and then
here: a result must answer an instruction that is still open for that client and round, decode as
JSON + safetensors, and be the first one for (client, round); a registration must name a known
device profile the model fits. Each accepted message is acknowledged on the client's task topic so
the client stops re-sending; rejected ones are logged in one line and counted, and never touch state.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fedge.brokers.link import Connect
from fedge.brokers.mqtt import Delivery, Inbox, will_frame
from fedge.constants import (
    CHUNK_SIZE,
    HEARTBEAT_S,
    MAX_HEADER_BYTES,
    MAX_TASK_RESENDS,
    RECONNECT_GRACE_S,
    RECONNECT_MAX_S,
    REPLY_SLACK_BYTES,
    ROUND_DEADLINE_S,
    STOP_RESEND_S,
    STOP_WAIT_S,
    TASK_RESEND_INTERVAL_S,
)
from fedge.errors import UserError
from fedge.wire import topics
from fedge.wire.codec import decode_info, decode_result, decode_status, encode_ack, encode_status, encode_task
from fedge.wire.envelope import Envelope, WireError
from fedge.wire.messages import ClientInfo, Result, Task, client_order
from fedge.wire.payloads import model_bytes

log = logging.getLogger(__name__)
DEAD_AFTER_HEARTBEATS = 3  # silence for this many heartbeat periods counts as dead
MAX_REPLACED_SESSIONS = 16  # replaced sessions remembered per client, to recognise one that comes back


class FleetError(UserError, RuntimeError):
    """The fleet did not assemble (too few registrations in time); says how many came and what to check."""


def reply_limit(info: ClientInfo) -> int:
    """The default largest reply from a client, for an exchange given no limits: its registered model's tensor
    bytes plus header slack."""
    return model_bytes(info.spec) + REPLY_SLACK_BYTES


@dataclass
class _Open:
    """An instruction sent and not yet answered."""

    client: str
    task: Task
    envelope: Envelope
    payload: bytes
    limit: int  # the largest reply accepted (from what the strategy expects for this task)
    sent_at: float = 0.0  # monotonic time it was last sent
    connects: int = 0  # the client's connection count (see Fleet.connects) when it was last sent
    resends: int = 0  # sends beyond the first that a registration asked for


class Fleet:
    """Implements `fedge.brokers.transport.Transport` over MQTT for the server process, on the link `connect` makes
    (in production `fedge.brokers.mqtt.connector(broker, keepalive)`)."""

    def __init__(
        self,
        connect: Connect,
        run: str,
        check_info: Callable[[ClientInfo], tuple[str, str] | None],
        deadline_s: float = ROUND_DEADLINE_S,
        heartbeat_s: float = HEARTBEAT_S,
        chunk_size: int = CHUNK_SIZE,
        broker_report: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.run, self.check_info, self.broker_report = run, check_info, broker_report
        self.deadline_s, self.heartbeat_s, self.chunk_size = deadline_s, heartbeat_s, chunk_size
        self.session = uuid.uuid4().hex
        self.clients: dict[str, ClientInfo] = {}
        self.limits: dict[str, int] = {}
        self.frozen = False  # after the fleet assembled, only known clients may (re-)register
        self.seen: dict[str, float] = {}
        self.offline: set[str] = set()
        self.offline_since: dict[str, float] = {}
        self.sessions: dict[str, str] = {}  # client -> the session of its newest connection (status messages)
        self.replaced: dict[str, dict[str, bool]] = {}  # client -> sessions a newer one replaced (oldest first)
        # -> whether it came back since (counted)
        self.takeovers: Counter[str] = Counter()  # client -> replaced sessions that came back (two connections)
        self.connects: Counter[str] = Counter()  # client -> "online" statuses of its current sessions (connections)
        self.open: dict[str, _Open] = {}
        self.results: dict[str, Result] = {}
        self.round = -1
        self.counts: Counter[str] = Counter()
        self.cond = threading.Condition()
        self.inbox = Inbox(run, self._accept)
        will = (topics.server_topic(run), will_frame(run, topics.SERVER_ID, self.session))
        self.link = connect(topics.SERVER_ID, topics.uplink_filters(run), self._on_frame, self._announce, will)

    # ------------------------------------------------------------------------------------------ lifecycle

    def _announce(self) -> None:
        """On every (re)connect: tell clients a server is here, so restarted ones register again."""
        self.link.publish(
            topics.server_topic(self.run),
            "status",
            max(self.round, 0),
            encode_status("online", self.session),
            sender=topics.SERVER_ID,
        )
        with self.cond:
            pending = [o for o in self.open.values() if o.client not in self.results]
            for o in pending:
                o.sent_at = time.monotonic()
        for o in pending:  # a broker without persistence forgot what was in flight
            self._send_task(o)

    def start(self, timeout: float) -> None:
        """Connect to the broker (MqttError if it refuses us or cannot be reached within `timeout`)."""
        self.link.start(timeout)

    def wait_for_clients(self, expected: int, timeout: float) -> dict[str, ClientInfo]:
        """Block until `expected` clients registered; fewer within `timeout` s raises FleetError."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.clients) < expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FleetError(
                        f"only {len(self.clients)} of {expected} clients registered within "
                        f"{timeout:.0f} s ({', '.join(sorted(self.clients, key=client_order)) or 'none'}); "
                        "start the missing `fedge client` processes or lower --set clients"
                    )
                self.cond.wait(min(left, 0.5))
            self.frozen = True
            return dict(self.clients)

    def close(self, wait_s: float = STOP_WAIT_S) -> None:
        """Tell every client the run is over, announce going offline, and disconnect. The stop is sent again every
        STOP_RESEND_S to each client still alive that has not said "offline" (a stop can be lost: with the embedded
        broker, a client's stop sent just before the server hung up was seen never to arrive, and the client then
        waited until `fedge run` killed it), for at most `wait_s` seconds."""
        deadline = time.monotonic() + wait_s
        left = sorted(self.clients, key=client_order)
        while left:
            for cid in left:
                self.link.publish(
                    topics.client_topic(self.run, topics.DOWNLINK, cid),
                    "task",
                    max(self.round, 0),
                    encode_task(Task("stop", max(self.round, 0))),
                    sender=topics.SERVER_ID,
                )
            with self.cond:
                self.cond.wait_for(
                    lambda waiting=left: not any(self.alive(cid) for cid in waiting),
                    max(0.0, min(STOP_RESEND_S, deadline - time.monotonic())),
                )
                left = [cid for cid in left if self.alive(cid)]
            if time.monotonic() >= deadline:
                break
        self.link.publish(
            topics.server_topic(self.run),
            "status",
            max(self.round, 0),
            encode_status("offline", self.session),
            sender=topics.SERVER_ID,
        )
        self.link.stop()

    # ------------------------------------------------------------------------------------------ the transport

    def exchange(self, tasks: Mapping[str, Task], limits: Mapping[str, int] | None = None) -> dict[str, Result]:
        """Send each client its task; return the valid replies that arrived before the deadline, without
        waiting for clients that went offline or fell silent. A reply larger than its client's `limits` entry
        (default: its registered model's bytes plus header slack) is refused before any of it is kept."""
        limits = limits or {}
        with self.cond:
            self.results = {}
            self.open = {}
            self.round = max((t.round for t in tasks.values()), default=self.round)
        for cid, task in tasks.items():
            payload = encode_task(task)
            env = Envelope.new(self.run, task.round, "task", topics.SERVER_ID, payload, chunk_size=self.chunk_size)
            with self.cond:  # open before sending: a fast client may answer before publish returns
                o = _Open(cid, task, env, payload, limits.get(cid, self.limits[cid]))
                o.sent_at, o.connects = time.monotonic(), self.connects[cid]
                self.open[env.msg_id] = o
            self._send_task(o)
        deadline = time.monotonic() + self.deadline_s
        reported: set[str] = set()
        with self.cond:
            while True:
                waiting = {o.client for o in self.open.values()} - set(self.results)
                gone = {cid for cid in waiting if self._gone(cid)}  # re-checked: a client may come back
                for cid in sorted(gone - reported, key=client_order):
                    log.warning("round %d: client %s is offline; not waiting for it", self.round, cid)
                reported |= gone
                if not waiting - gone:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "round %d: deadline of %.0f s passed; %d client(s) did not reply: %s",
                        self.round,
                        self.deadline_s,
                        len(waiting),
                        ", ".join(sorted(waiting, key=client_order)),
                    )
                    self.counts["deadline_missed"] += len(waiting)
                    break
                self.cond.wait(min(left, 0.2))
            results, self.open = dict(self.results), {}
        return results

    def report(self) -> dict[str, Any]:
        """Summary fields: the broker and run, missed deadlines, instructions re-sent to re-registering clients
        (`resent_tasks`) and re-sends refused (`suppressed_resends`), takeovers per client, every rejected message by
        reason, the partial messages evicted from the reassembly budget by sender, and, when the broker runs in
        this process, what it refused (`broker_report`)."""
        broker = {} if self.broker_report is None else {"broker": self.broker_report()}
        return {
            "transport": {"kind": "mqtt", "broker": str(self.link.broker), "run_id": self.run}
            | dict(self.counts)
            | {"takeovers": dict(self.takeovers)},
            "rejected_messages": dict(self.inbox.rejected),
            "evicted_messages": dict(self.inbox.joiner.evicted),
        } | broker

    def alive(self, cid: str) -> bool:
        """Not announced offline (will or clean exit) and heard from within a few heartbeats."""
        last = self.seen.get(cid)
        return (
            cid not in self.offline
            and last is not None
            and time.monotonic() - last < DEAD_AFTER_HEARTBEATS * self.heartbeat_s
        )

    def _gone(self, cid: str) -> bool:
        """Not worth waiting for any more: silent for a few heartbeats, or announced offline (will or clean exit)
        and not back within RECONNECT_GRACE_S (a dropped link comes back and re-sends). Nobody is given up on
        while the server itself is cut off from the broker (it hears nobody then), nor within RECONNECT_MAX_S
        of its reconnecting: after a broker restart every client is on its own reconnect backoff."""
        if self.alive(cid) or not self.link.connected.is_set():
            return False
        now = time.monotonic()
        if self.link.connects > 1 and now - self.link.connected_at < RECONNECT_MAX_S + self.heartbeat_s:
            return False
        since = self.offline_since.get(cid)
        return since is None or now - since >= RECONNECT_GRACE_S

    # ------------------------------------------------------------------------------------------ inbound

    def _accept(self, kind: str, client: str | None, env: Envelope) -> int:
        """Per-kind checks before any chunk is stored; returns the payload size allowed."""
        if kind == "result":
            with self.cond:
                o = self.open.get(env.reply_to or "")
                if o is None or o.client != client or env.round != o.task.round:
                    reason = "stale_round" if env.round < self.round else "no_open_task"
                    raise WireError(reason, f"result for round {env.round} answers no open instruction")
                if client in self.results:
                    raise WireError("duplicate", f"a result for round {env.round} was already accepted")
            return o.limit
        return MAX_HEADER_BYTES  # registrations and status messages are small

    def _on_frame(self, topic: str, data: bytes) -> None:
        delivery = self.inbox.receive(topic, data)
        if delivery is None:
            return
        cid = delivery.client
        assert cid is not None  # uplink topics always name a client
        with self.cond:
            self.seen[cid] = time.monotonic()
        try:
            {"register": self._register, "result": self._result, "status": self._status}[delivery.kind](delivery)
        except WireError as e:
            self.inbox.reject(delivery.kind, cid, e)
            if delivery.kind != "status":
                self._ack(cid, delivery.envelope, str(e))

    def _ack(self, cid: str, env: Envelope, error: str | None) -> None:
        self.link.publish(
            topics.client_topic(self.run, topics.DOWNLINK, cid),
            "ack",
            env.round,
            encode_ack(error),
            reply_to=env.msg_id,
            sender=topics.SERVER_ID,
        )

    def _register(self, d: Delivery) -> None:
        info = decode_info(d.payload)
        cid = d.client
        if info.client_id != cid:
            raise WireError("spoof", f"registration names client {info.client_id!r} on {cid!r}'s topic")
        with self.cond:
            known = self.clients.get(cid)
            if self.frozen and known is None:
                raise WireError("bad_format", f"the run has started with a fixed fleet; {cid} is not part of it")
            if known is not None and known != info:
                raise WireError("bad_spec", f"client {cid} registered again with a different model or profile")
        refusal = self.check_info(info)  # (reason code, message), e.g. ("over_memory", ...)
        if refusal is not None:
            raise WireError(*refusal)
        with self.cond:
            if cid not in self.clients:
                log.info(
                    "client %s registered: %s on %s, %d training examples",
                    cid,
                    info.spec.name,
                    info.profile,
                    info.num_train,
                )
            self.clients[cid], self.limits[cid] = info, reply_limit(info)
            self.offline.discard(cid)
            self.offline_since.pop(cid, None)
            resend = self._resends(cid)
            self.cond.notify_all()
        self._ack(cid, d.envelope, None)
        for o in resend:  # a restarted client lost the instruction it was working on
            self._send_task(o)

    def _resends(self, cid: str) -> list[_Open]:
        """The open instructions a registration of `cid` gets again (call with `cond` held). A restarted or
        reconnected client lost what it was working on; a registration repeated on the same connection did not,
        so it gets nothing until TASK_RESEND_INTERVAL_S passed since the last send. The first repeat is always
        honoured (its "online" status may arrive after it), and no instruction is re-sent more than
        MAX_TASK_RESENDS times: a client re-registering in a loop costs the server and the broker at most that
        many copies of its task, the rest are counted as `suppressed_resends`."""
        now, due = time.monotonic(), []
        for o in self.open.values():
            if o.client != cid or cid in self.results:
                continue
            wanted = o.resends == 0 or o.connects != self.connects[cid] or now - o.sent_at >= TASK_RESEND_INTERVAL_S
            if wanted and o.resends < MAX_TASK_RESENDS:
                o.sent_at, o.connects, o.resends = now, self.connects[cid], o.resends + 1
                self.counts["resent_tasks"] += 1
                due.append(o)
            else:
                self.counts["suppressed_resends"] += 1
        return due

    def _send_task(self, o: _Open) -> None:
        self.link.send(topics.client_topic(self.run, topics.DOWNLINK, o.client), o.envelope, o.payload, self.chunk_size)

    def _result(self, d: Delivery) -> None:
        result = decode_result(d.payload)
        cid = d.client
        if result.client_id != cid or result.round != d.envelope.round:
            raise WireError(
                "spoof",
                f"result names client {result.client_id!r}, round {result.round} on {cid!r}'s "
                f"topic for round {d.envelope.round}",
            )
        with self.cond:
            o = self.open.get(d.envelope.reply_to or "")
            if o is None or cid in self.results:  # closed or answered while the chunks arrived
                raise WireError("duplicate" if cid in self.results else "stale_round", "instruction already closed")
            if result.type != o.task.type:
                raise WireError("no_open_task", f"a {result.type!r} result answers a {o.task.type!r} instruction")
            self.results[cid] = result
            self.cond.notify_all()
        self._ack(cid, d.envelope, None)

    def _status(self, d: Delivery) -> None:
        state, session = decode_status(d.payload)
        cid = d.client
        assert cid is not None
        with self.cond:
            revived = self._track_session(cid, session, state)
        if revived:
            if state != "offline":  # it hears this on the task topic both connections subscribe to
                self._stop_session(cid, session)
            return
        with self.cond:
            if state == "offline":
                if cid not in self.offline:
                    log.info("client %s is offline", cid)
                    self.offline_since[cid] = time.monotonic()
                self.offline.add(cid)
                self.seen.pop(cid, None)
            else:
                self.offline.discard(cid)
                self.offline_since.pop(cid, None)
                if state == "online":  # a (re)connection: what was sent before may be lost (see _resends)
                    self.connects[cid] += 1
            self.cond.notify_all()

    def _stop_session(self, cid: str, session: str) -> None:
        """A `stop` task addressed to one connection of `cid`: the other connection ignores it."""
        stop = Task(
            "stop",
            max(self.round, 0),
            {"session": session, "reason": f"taken over by a newer connection with client id {cid}"},
        )
        self.link.publish(
            topics.client_topic(self.run, topics.DOWNLINK, cid),
            "task",
            stop.round,
            encode_task(stop),
            sender=topics.SERVER_ID,
        )

    def _track_session(self, cid: str, session: str, state: str) -> bool:
        """Note which connection (session) of `cid` spoke. A new session replaces the current one (a restart, or
        a second connection with the same id, which makes the broker end the first). A replaced session that
        speaks again means two live connections take turns: count a takeover, log it, and tell that older
        connection to stop (newest wins, as with the broker). Returns True for a replaced session: its status
        messages (and its late will) say nothing about the client's current connection."""
        current = self.sessions.get(cid)
        replaced = self.replaced.setdefault(cid, {})
        if session in replaced:
            if state != "offline" and not replaced[session]:
                replaced[session] = True
                self.takeovers[cid] += 1
                log.warning(
                    "client %s: its connection %s, replaced by connection %s, is back: two processes use "
                    "client id %s; telling the older one to stop (takeover %d)",
                    cid,
                    session[:8],
                    (current or "?")[:8],
                    cid,
                    self.takeovers[cid],
                )
            return True
        if session != current:
            if current is not None:
                replaced[current] = False
                for old in list(replaced)[:-MAX_REPLACED_SESSIONS]:
                    del replaced[old]
            self.sessions[cid] = session
        return False
