"""A hand-driven fedge client for fault tests: a raw paho connection that publishes hand-built frames.

The real client (edge_client.session.EdgeClient) only ever sends well-formed messages; this one sends
whatever a test builds: valid frames from fedge.wire.chunks, frames with a forged envelope, or raw bytes. What
it receives from the server (tasks, acknowledgements) is parsed with fedge.brokers.mqtt.Inbox, the client's own
validation. Builders for malformed payloads bypass every check of fedge.wire.codec and fedge.model.weights.

Also the fixtures of tests/fault/test_bad_*.py (a broker of each kind, the server's Fleet on it, registered
RawClients) and their round helpers; those test modules import the fixtures by name.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import paho.mqtt.client as mqtt
import pytest
import torch
from safetensors.torch import save as st_save

from fedge.brokers.access import generate_users
from fedge.brokers.embedded_broker import EmbeddedBroker
from fedge.brokers.mqtt import Inbox, connector, parse_broker
from fedge.constants import MAX_PAYLOAD_BYTES, SPEC_METADATA_KEY
from fedge.model import zoo
from fedge.model.spec import ModelSpec, tensor_shapes
from fedge.wire import topics
from fedge.wire.chunks import frames
from fedge.wire.codec import decode_ack, decode_task, encode_info, encode_result
from fedge.wire.envelope import Envelope, sha256_hex
from fedge.wire.messages import ClientInfo, Result, Task, Weights
from server.coordinator import Coordinator, LoopConfig
from server.fleet import Fleet
from server.registration import registration_check
from server.runlog import RunLog
from server.strategy import StrategyConfig, create_strategy

from helpers.brokers import TIMEOUT_S, MosquittoProcess, close, connect_as, require_mosquitto, subscribe

PROFILE = "rpi-4"
ONE_FRAME = 2 * 1024 * 1024  # default chunk size here: a whole cnn1 upload in one frame, so one message = one count
NUM_TRAIN, NUM_TEST = 100, 20


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------- builders


def state_for(spec: ModelSpec, scale: float = 0.01, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic finite tensors of exactly the spec's keys, shapes and dtypes."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in tensor_shapes(spec).items():
        t = torch.randn(shape, generator=g) * scale if dtype.is_floating_point else torch.zeros(shape)
        out[name] = t.to(dtype)
    return out


def safetensors_blob(spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> bytes:
    """A safetensors blob with the spec in its metadata, as fedge.model.weights.to_bytes writes it, minus the checks."""
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata={SPEC_METADATA_KEY: spec.to_json()})


def container(
    kind: str,
    fields: Any,
    blobs: Mapping[str, bytes] | None = None,
    index: Any = None,
    header: bytes | None = None,
    tensors: Any = None,
) -> bytes:
    """A payload container (8-byte LE header length + JSON header + blobs) with nothing checked.

    `index` replaces the computed model spans, `tensors` the span of the named tensors' blob (none: null),
    `header` the whole JSON header.
    """
    blobs = dict(blobs or {})
    if index is None:
        index, offset = {}, 0
        for role, blob in blobs.items():
            index[role] = [offset, len(blob)]
            offset += len(blob)
    if header is None:
        header = json.dumps(
            {"kind": kind, "fields": fields, "models": index, "tensors": tensors}, sort_keys=True, separators=(",", ":")
        ).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(blobs.values())


def split_blob(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """A safetensors blob's JSON header and its data bytes."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join_blob(header: Any, data: bytes) -> bytes:
    """A safetensors blob from a (possibly edited) header and data; the header is padded to 8 bytes as usual."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


def split_container(payload: bytes) -> tuple[dict[str, Any], bytes]:
    """A payload container's JSON header and its body (the concatenated blobs)."""
    n = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8 : 8 + n]), payload[8 + n :]


def result_fields(
    cid: str, rnd: int, type: str = "train", num_examples: Any = NUM_TRAIN, metrics: Any = None
) -> dict[str, Any]:
    return {
        "client_id": cid,
        "round": rnd,
        "type": type,
        "num_examples": num_examples,
        "metrics": {"train_loss": 0.5} if metrics is None else metrics,
        "error": None,
        "records": {},
    }


def valid_result(
    cid: str,
    rnd: int,
    spec: ModelSpec,
    type: str = "train",
    scale: float = 0.01,
    num_examples: int = NUM_TRAIN,
    seed: int = 0,
) -> bytes:
    """A well-formed result payload, encoded by fedge.wire.codec (what a correct client uploads)."""
    state = state_for(spec, scale, seed)
    return encode_result(Result(cid, rnd, type, num_examples, {"train_loss": 0.5}, {"local": Weights(spec, state)}))


def frame_bytes(env: Mapping[str, Any], index: int, chunk: bytes, chunk_sha256: str | None = None) -> bytes:
    """One frame around an arbitrary envelope dict (e.g. an unknown schema_version); nothing is validated."""
    header = json.dumps(
        {"envelope": dict(env), "chunk": index, "chunk_sha256": chunk_sha256 or sha256_hex(chunk)},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return len(header).to_bytes(4, "little") + header + chunk


PADDED_HEADER_BYTES = 1000 * 1000  # just under MAX_HEADER_BYTES (1 MiB)


def padded_frame(env: Mapping[str, Any], index: int, chunk: bytes) -> bytes:
    """A frame whose JSON header is padded with whitespace to PADDED_HEADER_BYTES: legal JSON of a legal size,
    what a flood of frames that are cheap to send and costly to keep uses."""
    header = json.dumps({"envelope": dict(env), "chunk": index, "chunk_sha256": sha256_hex(chunk)}).encode()
    header += b" " * (PADDED_HEADER_BYTES - len(header))
    return len(header).to_bytes(4, "little") + header + chunk


# ------------------------------------------------------------------------------------------------- the client


class RawClient:
    """One client id on a real broker, driven by hand.

    Everything arriving on its task topic goes through a client-side Inbox; whole tasks are queued in
    `tasks`, acknowledgements are kept by the msg_id they answer in `acks`.
    """

    def __init__(self, broker: Any, cid: str, run: str, subscribe_tasks: bool = True) -> None:
        self.cid, self.run = cid, run
        self.client = connect_as(broker, cid)
        self.inbox = Inbox(run, lambda kind, client, env: MAX_PAYLOAD_BYTES)
        self.tasks: queue.Queue[tuple[Envelope, Task]] = queue.Queue()
        self.acks: dict[str, str | None] = {}
        self.foreign: list[mqtt.MQTTMessage] = []  # anything that arrived on a topic other than our own task topic
        self.cond = threading.Condition()
        self.task_topic = topics.client_topic(run, topics.DOWNLINK, cid)
        self.subscribed = subscribe_tasks
        self.connects = 1
        self.client.on_message, self.client.on_connect = self._on_message, self._on_connect
        if subscribe_tasks:
            assert subscribe(self.client, self.task_topic) == [1]

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        """After paho reconnected by itself: count it and subscribe again (the broker kept no session)."""
        if rc.is_failure:
            return
        with self.cond:
            self.connects += 1
            self.cond.notify_all()
        if self.subscribed:
            client.subscribe(self.task_topic, 1)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if msg.topic != self.task_topic:
            with self.cond:
                self.foreign.append(msg)
            return
        d = self.inbox.receive(msg.topic, msg.payload)
        if d is None:
            return
        with self.cond:
            if d.envelope.type == "ack":
                self.acks[d.envelope.reply_to or ""] = decode_ack(d.payload)
                self.cond.notify_all()
            else:
                self.tasks.put((d.envelope, decode_task(d.payload)))

    def topic(self, kind: str, client: str | None = None) -> str:
        return topics.client_topic(self.run, kind, client or self.cid)

    # ---------------------------------------------------------------------------------------------- sending

    def publish(self, topic: str, data: bytes, qos: int = 1) -> mqtt.MQTTMessageInfo:
        """Publish raw bytes; wait for the PUBACK at QoS 1 (a broker that denies it still acknowledges it)."""
        info = self.client.publish(topic, data, qos=qos)
        if qos:
            info.wait_for_publish(TIMEOUT_S)
            assert info.is_published(), f"{topic}: no PUBACK"
        return info

    def publish_frames(self, kind: str, data: list[bytes], client: str | None = None) -> None:
        for d in data:
            self.publish(self.topic(kind, client), d)

    def send(
        self,
        kind: str,
        type: str,
        rnd: int,
        payload: bytes,
        reply_to: str | None = None,
        sender: str | None = None,
        chunk_size: int = ONE_FRAME,
        client: str | None = None,
    ) -> Envelope:
        """Envelope `payload` (msg_id, hash, size, chunks) and publish its frames on `kind`/<client or us>."""
        env = Envelope.new(self.run, rnd, type, sender or self.cid, payload, reply_to=reply_to, chunk_size=chunk_size)
        self.publish_frames(kind, frames(env, payload, chunk_size), client)
        return env

    def answer(self, task_env: Envelope, payload: bytes, rnd: int | None = None, **kw: Any) -> Envelope:
        """Send `payload` as the result of the task `task_env` (its round unless `rnd` is given)."""
        return self.send(
            "result", "result", task_env.round if rnd is None else rnd, payload, reply_to=task_env.msg_id, **kw
        )

    def register(self, spec: ModelSpec, profile: str = PROFILE, timeout: float = TIMEOUT_S) -> str | None:
        """Register `spec` (with our origin) and return the server's verdict: None accepted, else its reason."""
        info = ClientInfo(self.cid, spec.with_origin(self.cid), profile, NUM_TRAIN, NUM_TEST)
        env = self.send("register", "register", 0, encode_info(info))
        return self.wait_ack(env.msg_id, timeout)

    # ---------------------------------------------------------------------------------------------- receiving

    def wait_ack(self, msg_id: str, timeout: float = TIMEOUT_S) -> str | None:
        """The server's acknowledgement of our message `msg_id`: None (accepted) or the refusal's text."""
        with self.cond:
            if not self.cond.wait_for(lambda: msg_id in self.acks, timeout):
                raise AssertionError(f"{self.cid}: no acknowledgement of {msg_id} within {timeout:g} s")
            return self.acks[msg_id]

    def next_task(self, timeout: float = TIMEOUT_S) -> tuple[Envelope, Task]:
        try:
            return self.tasks.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.cid}: no task within {timeout:g} s") from None

    def close(self) -> None:
        close(self.client)


class Exchange:
    """`fleet.exchange(tasks)` running in a background thread (the server's round), joined by `results()`."""

    def __init__(self, fleet: Any, tasks: Mapping[str, Task]) -> None:
        self.out: dict[str, Result] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fleet, dict(tasks)), daemon=True, name="exchange")
        self.thread.start()

    def _run(self, fleet: Any, tasks: dict[str, Task]) -> None:
        try:
            self.out = fleet.exchange(tasks)
        except BaseException as e:  # reported to the test by results()
            self.error = e

    def results(self, timeout: float = 2 * TIMEOUT_S) -> dict[str, Result]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the exchange did not return within {timeout:g} s"
        if self.error is not None:
            raise self.error
        assert self.out is not None
        return self.out


def tensor_bytes(spec: ModelSpec) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in tensor_shapes(spec).values())


# ------------------------------------------------------------------------------------------------- a fleet to attack
# Fixtures for tests/fault/test_bad_*.py, which import them by name: a broker (embedded and Mosquitto), the
# server's Fleet on it, and registered RawClients.

RUN = "badin"
CLIENTS = ("a", "b", "c")
SPEC = zoo.create("cnn1", (1, 28, 28), 10)
DEADLINE_S = 5.0  # a round that never gets its valid reply ends after this long
HEARTBEAT_S = 60.0  # a registered raw client counts as alive for 3 x this, without heartbeats
GRACE_S = 0.3  # after a barrier arrived, how long a wrongly routed message would still have to show up


def own(cid: str) -> ModelSpec:
    """The spec a client registers (the zoo's cnn1 with its own origin)."""
    return SPEC.with_origin(cid)


def info(cid: str) -> ClientInfo:
    return ClientInfo(cid, own(cid), PROFILE, NUM_TRAIN, NUM_TEST)


# ------------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(params=["embedded", "mosquitto"])
def broker(request, tmp_path):
    """A broker with users a, b, c and the server, on 127.0.0.1: fedge's embedded amqtt one, or Mosquitto."""
    users = generate_users(CLIENTS)
    if request.param == "mosquitto":
        require_mosquitto()
        b = MosquittoProcess(tmp_path / "mosquitto", users, print_log=True)
    else:
        b = EmbeddedBroker(users=users)
    with b:
        yield b


@pytest.fixture
def fleet(broker):
    """The server's transport, connected as the server user."""
    f = Fleet(
        connector(parse_broker(broker.url, "server", broker.users["server"])),
        RUN,
        registration_check(),
        deadline_s=DEADLINE_S,
        heartbeat_s=HEARTBEAT_S,
    )
    f.start(10)
    yield f
    # The raw clients never say "offline" (and count as alive for 3 x HEARTBEAT_S): a close that waited for them
    # would wait out all of STOP_WAIT_S after every test. The stop is still sent once, and the fleet disconnects.
    f.close(wait_s=0.0)


@pytest.fixture
def connect(broker, fleet):
    """connect(cid): a RawClient for cid, registered with the fleet (registration acknowledged)."""
    made: list[RawClient] = []

    def connect(cid: str, register: bool = True) -> RawClient:
        c = RawClient(broker, cid, RUN)
        made.append(c)
        if register:
            assert c.register(SPEC) is None, f"{cid}'s registration was refused"
        return c

    yield connect
    for c in made:
        c.close()


def open_round(fleet: Fleet, clients: list[RawClient], rnd: int, type: str = "train") -> tuple[Exchange, dict]:
    """Start round `rnd` for `clients` (in this order) and return it with each client's task envelope."""
    ex = Exchange(fleet, {c.cid: Task(type, rnd) for c in clients})
    envs = {}
    for c in clients:
        env, task = c.next_task()
        assert (task.type, task.round) == (type, rnd)
        envs[c.cid] = env
    return ex, envs


def coordinator(fleet: Fleet, tmp_path: Path, clients: tuple[str, ...]) -> Coordinator:
    """A Coordinator over the fleet with fedavg set up for these clients, used only for `accepted` (the checks
    after transport, against the upload fedavg's training task declares)."""
    fleet_info = {c: info(c) for c in clients}
    strategy = create_strategy("fedavg", StrategyConfig(1, 16, 1e-3, 0))
    strategy.setup(fleet_info)
    return Coordinator(
        strategy, fleet, fleet_info, LoopConfig(1, len(clients), 0, 1, progress=False), RunLog(tmp_path / "run", {})
    )


def refused(client: RawClient, env: Envelope) -> str:
    """The text of the server's refusal of `env` (AssertionError if it was accepted instead)."""
    error = client.wait_ack(env.msg_id)
    assert error is not None, f"{env.type} {env.msg_id} was accepted"
    return error


def same_weights(x: Result, y: Result) -> bool:
    a, b = x.models["local"].state, y.models["local"].state
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rejected_only(fleet: Fleet, **expected: int) -> None:
    """The fleet's rejection counter holds exactly these reasons (after they all arrived)."""
    wait_for(lambda: sum(fleet.inbox.rejected.values()) >= sum(expected.values()), f"rejections {expected}")
    assert dict(fleet.inbox.rejected) == expected
