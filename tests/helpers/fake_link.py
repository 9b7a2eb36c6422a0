"""An in-memory broker for unit tests of the server's Fleet and the client's EdgeClient: no broker, no sockets.

`FakeBroker.connect` is a fedge.brokers.link.Connect. The links it makes hand each frame, as the real ones would put it
on the wire (fedge.wire.chunks.iter_frames), to the `on_frame` of every started link subscribed to its topic, which
then validates it through its real fedge.brokers.mqtt.Inbox. Delivery is synchronous, in the publisher's thread, one
frame at a time across the whole broker (one lock): once a publish returned, nothing of it is in flight (an
EdgeClient still handles what it received on its own thread, from its queue).
Unlike a real broker it does not end an older connection when a second one with the same client id arrives:
both stay connected, which is what a takeover looks like to the server between the broker's kicks.

`FakeFederation` puts a Fleet and EdgeClients (around `EchoAgent`s, each serving on a thread) on one.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from paho.mqtt.client import topic_matches_sub

from edge_client.session import EdgeClient
from fedge.brokers.link import OnFrame
from fedge.constants import CHUNK_SIZE
from fedge.model import zoo
from fedge.wire import topics
from fedge.wire.chunks import iter_frames, unframe
from fedge.wire.envelope import Envelope
from fedge.wire.messages import ClientInfo, Result, Task
from server.fleet import Fleet

Drop = Callable[[str, Envelope], bool]
RUN = "unit"
SPEC = zoo.create("cnn1", (1, 28, 28), 10)
WAIT_S = 10.0  # how long a test waits for what must happen before it fails (never reached when it passes)


class FakeLink:
    """One connection to a FakeBroker (a fedge.brokers.link.Link). `crash()` vanishes without stopping: the broker
    publishes the will."""

    def __init__(
        self,
        net: FakeBroker,
        client_id: str,
        subscriptions: list[str],
        on_frame: OnFrame,
        on_connect: Callable[[], None],
        will: tuple[str, bytes] | None,
    ) -> None:
        self.net, self.client_id, self.subscriptions = net, client_id, list(subscriptions)
        self.on_frame, self.on_connect, self.will = on_frame, on_connect, will
        self.broker = "memory"
        self.connected = threading.Event()
        self.connects = 0
        self.connected_at = 0.0

    def start(self, timeout: float) -> None:
        with self.net.lock:
            self.connects += 1
            self.connected_at = time.monotonic()
            self.connected.set()
        self.on_connect()

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
        env = Envelope.new(
            run or topics.parse(topic)[0],
            round,
            type,
            sender or self.client_id,
            payload,
            reply_to=reply_to,
            chunk_size=chunk_size,
        )
        self.send(topic, env, payload, chunk_size)
        return env

    def send(self, topic: str, env: Envelope, payload: bytes, chunk_size: int = CHUNK_SIZE) -> None:
        for data in iter_frames(env, payload, chunk_size):
            if self.connected.is_set():  # what a link sends while it is down is lost
                self.net.route(topic, data)

    def stop(self) -> None:
        self.connected.clear()

    def crash(self) -> None:
        """The connection is gone without a DISCONNECT: the broker publishes the will."""
        self.connected.clear()
        if self.will is not None:
            self.net.route(*self.will)


class FakeBroker:
    """Routes frames between the FakeLinks it made. `sent` records every routed frame's (topic, envelope);
    `drop_next(predicate)` loses the next frame matching it (recorded in `dropped` instead); `errors` holds
    what an `on_frame` raised (a real Endpoint would log and swallow it; a test should see it)."""

    def __init__(self) -> None:
        self.links: list[FakeLink] = []
        self.sent: list[tuple[str, Envelope]] = []
        self.dropped: list[tuple[str, Envelope]] = []
        self.errors: list[BaseException] = []
        self.drops: list[Drop] = []
        self.lock = threading.RLock()

    def connect(
        self,
        client_id: str,
        subscriptions: list[str],
        on_frame: OnFrame,
        on_connect: Callable[[], None],
        will: tuple[str, bytes] | None,
    ) -> FakeLink:
        link = FakeLink(self, client_id, subscriptions, on_frame, on_connect, will)
        with self.lock:
            self.links.append(link)
        return link

    def drop_next(self, predicate: Drop) -> None:
        with self.lock:
            self.drops.append(predicate)

    def route(self, topic: str, data: bytes) -> None:
        with self.lock:
            env = unframe(data).envelope
            for drop in self.drops:
                if drop(topic, env):
                    self.drops.remove(drop)
                    self.dropped.append((topic, env))
                    return
            self.sent.append((topic, env))
            for link in self.links:
                if link.connected.is_set() and any(topic_matches_sub(s, topic) for s in link.subscriptions):
                    try:
                        link.on_frame(topic, data)
                    except Exception as e:  # noqa: BLE001 - handed to the test
                        self.errors.append(e)

    def count(self, type: str, topic: str | None = None) -> int:
        """Frames of message type `type` routed so far (on `topic` if given)."""
        with self.lock:
            return sum(1 for t, env in self.sent if env.type == type and topic in (None, t))


class EchoAgent:
    """Stands in for edge_client.agent.ClientAgent: registers cnn1 and answers every task with a metrics-only
    Result, once `go` is set (it is, unless a test clears it to hold the reply back)."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.go = threading.Event()
        self.go.set()
        self.tasks: list[Task] = []

    def info(self) -> ClientInfo:
        return ClientInfo(self.client_id, SPEC.with_origin(self.client_id), "rpi-4", 100, 20)

    def handle(self, task: Task) -> Result:
        self.tasks.append(task)
        assert self.go.wait(WAIT_S), "the test never let the agent reply"
        return Result(self.client_id, task.round, task.type, 100, {"loss": 0.5})


class Serving:
    """`client.run_forever` on a thread of its own; `error` is what it raised, once it returned."""

    def __init__(self, client: EdgeClient) -> None:
        self.client = client
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"serving-{client.cid}")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.client.run_forever(WAIT_S)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def stop(self) -> None:
        self.client.stopped.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), f"client {self.client.cid} did not stop"


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class FakeFederation:
    """A started Fleet on a FakeBroker, and the clients a test adds; closing it stops them all and fails the
    test if an `on_frame` raised. The fleet's and clients' heartbeats are a minute apart unless given, so no
    heartbeat or liveness timeout happens during a test unless the test makes it; a round's deadline is WAIT_S
    unless given, so a round that waits for what it should not fails as a missed deadline, not a hang."""

    def __init__(
        self, check_info: Callable[[ClientInfo], tuple[str, str] | None] = lambda info: None, **fleet_options: float
    ) -> None:
        self.net = FakeBroker()
        options = {"heartbeat_s": 60.0, "deadline_s": WAIT_S} | fleet_options
        self.fleet = Fleet(self.net.connect, RUN, check_info, **options)
        self.fleet.start(WAIT_S)
        self.serving: list[Serving] = []

    def client(self, cid: str, registered: bool = True, **options: float) -> Serving:
        """Start an EdgeClient for an EchoAgent named `cid`; by default wait until its registration was acked."""
        agent = EchoAgent(cid)
        client = EdgeClient(agent, self.net.connect, RUN, **({"heartbeat_s": 60.0} | options))
        serving = Serving(client)
        self.serving.append(serving)
        if registered:
            wait_until(lambda: client.registered or serving.done(), f"client {cid} to register")
            assert client.registered, f"client {cid} was not registered: {serving.error!r}"
        return serving

    def task_topic(self, cid: str) -> str:
        return topics.client_topic(RUN, topics.DOWNLINK, cid)

    def __enter__(self) -> FakeFederation:
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.serving:
            s.client.agent.go.set()
        self.fleet.close()
        for s in self.serving:
            s.stop()
        assert not self.net.errors, f"on_frame raised: {self.net.errors!r}"
