"""What the server's fleet and a client's MQTT session need of their connection to the broker: a Link.

Production links are `fedge.brokers.mqtt.Endpoint`s (made by `fedge.brokers.mqtt.connector(broker)`); unit tests pass an
in-memory fake, so the protocol logic above the link runs without a broker or sockets.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

from fedge.constants import CHUNK_SIZE
from fedge.wire.envelope import Envelope

OnFrame = Callable[[str, bytes], None]


class Link(Protocol):
    """One connection publishing and receiving fedge frames.

    `on_frame(topic, frame)` is called for every frame arriving on a subscription, one at a time, on a thread of
    the link's; `on_connect()` after every (re)connect, once the subscriptions are in place. Neither may block.
    """

    broker: object  # where the link goes, for reports (its str() never shows a password)
    connected: threading.Event  # set while connected
    connects: int  # connections made so far (more than 1: it reconnected)
    connected_at: float  # time.monotonic() of the last connect

    def start(self, timeout: float) -> None:
        """Connect within `timeout` s; raises ConnectionError (e.g. MqttError) if refused or unreachable."""
        ...

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
        """Envelope `payload` (sender: the link's client id unless given) and send it; returns the envelope."""
        ...

    def send(self, topic: str, env: Envelope, payload: bytes, chunk_size: int = CHUNK_SIZE) -> None:
        """(Re-)send an already enveloped payload; the receiver recognises a repeat by its msg_id."""
        ...

    def stop(self) -> None:
        """Disconnect cleanly: the broker does not publish the will."""
        ...


# connect(client_id, subscriptions, on_frame, on_connect, will) -> a Link, not started yet. The will is
# (topic, frame): what the broker publishes for the link if it vanishes without stopping.
Connect = Callable[[str, list[str], OnFrame, Callable[[], None], "tuple[str, bytes] | None"], Link]
