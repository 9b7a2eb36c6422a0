"""Soak: a small federation runs to the end while one authenticated device attacks it for the whole run.

The attacker holds valid credentials of its own (user "x", not part of the fleet) and, in a loop until the
server exits (bounded in frames and seconds): connects with forged wills (a `stop` task on client 0's task
topic, an "offline" server status, a retained will on its own status topic), publishes retained messages,
and floods partial messages (~1 MiB whitespace-padded headers with empty chunks announcing a million chunks,
and the same with 1-byte chunks whose count is consistent, so that they must be kept and accounted). The
server runs as a `fedge server` process, the clients as a `fedge client` process, on the embedded broker and
on Mosquitto.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from fedge.wire import topics
from fedge.wire.chunks import frames
from fedge.wire.codec import encode_status, encode_task
from fedge.wire.envelope import Envelope
from fedge.wire.messages import Task

from helpers.brokers import TIMEOUT_S, protocol_of
from helpers.federation import Federation, make_config, read_rows, wait_until
from helpers.raw import padded_frame

pytestmark = pytest.mark.timeout(240)

ATTACKER = "x"
ROUNDS = 6
MAX_FRAMES = 1500  # the flood's bound: about 1.5 GB through the broker at ~1 MiB a frame
MAX_SECONDS = 60.0
FIRST_FLOOD = 80  # frames of one whole flood (20 bursts) out before the clients start: a run takes seconds
RSS_GROWTH_BOUND = 256 * 1024 * 1024  # the server may keep 16 MiB of the attacker's frames, plus data and models


class Attacker:
    """User "x" attacking the run from a thread until `stop` is set or its bounds are reached."""

    def __init__(self, fed: Federation) -> None:
        self.fed, self.run = fed, fed.cfg.run_id
        self.stop = threading.Event()
        self.frames = 0
        self.frames_out = 0  # frames paho has written to the socket (a whole flood at a time)
        self.will_connacks: list[int] = []
        self.thread = threading.Thread(target=self._attack, name="attacker", daemon=True)

    def _client(self, will: tuple[str, bytes, bool] | None = None) -> tuple[mqtt.Client, int]:
        """A connection as "x" with `will` (topic, payload, retain), after its CONNACK: (client, reason code)."""
        got: list[int] = []
        arrived = threading.Event()

        def on_connect(client, userdata, flags, rc, props):
            got.append(rc.value)
            arrived.set()

        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=ATTACKER, protocol=protocol_of(self.fed.broker))
        c.username_pw_set(ATTACKER, self.fed.users[ATTACKER])
        c.on_connect = on_connect
        c.on_disconnect = lambda *a: arrived.set()
        if will is not None:
            c.will_set(will[0], will[1], qos=1, retain=will[2])
        c.connect("127.0.0.1", self.fed.broker.port, keepalive=10)
        c.loop_start()
        arrived.wait(TIMEOUT_S)
        return c, (got[0] if got else -1)

    def _forged_wills(self) -> None:
        """Each will is left for the broker to publish: the socket is closed without a DISCONNECT."""
        stop_task = encode_task(Task("stop", 0))
        offline = encode_status("offline", uuid.uuid4().hex)
        forged = [
            (
                topics.client_topic(self.run, topics.DOWNLINK, "0"),
                frames(Envelope.new(self.run, 0, "task", topics.SERVER_ID, stop_task), stop_task)[0],
                False,
            ),
            (
                topics.server_topic(self.run),
                frames(Envelope.new(self.run, 0, "status", topics.SERVER_ID, offline), offline)[0],
                False,
            ),
            (
                topics.client_topic(self.run, "status", ATTACKER),
                frames(Envelope.new(self.run, 0, "status", ATTACKER, offline), offline)[0],
                True,
            ),
        ]
        for will in forged:
            client, code = self._client(will)
            self.will_connacks.append(code)
            client.loop_stop()
            sock = client.socket()
            if sock is not None:
                sock.close()  # vanish: a broker that accepted the will publishes it now

    def _flood(self, client: mqtt.Client) -> mqtt.MQTTMessageInfo:
        """One burst of partial messages on the attacker's own uplink topics; returns the last one's publish."""
        for kind in ("register", "result", "status"):
            topic = topics.client_topic(self.run, kind, ATTACKER)
            # announces 10^6 one-byte chunks (never sent, so never hashed: the root is that of one byte)
            million = {**Envelope.new(self.run, 0, kind, ATTACKER, b"x").to_dict(), "size": 10**6, "chunks": 10**6}
            client.publish(topic, padded_frame(million, 0, b""), qos=0)
            ones = {**million, "msg_id": uuid.uuid4().hex}
            for index in range(3):
                sent = client.publish(topic, padded_frame(ones, index, b"x"), qos=0)
            self.frames += 4
        return sent

    def _retained(self) -> None:
        """A retained publish on its own connection (Mosquitto, retain_available false, disconnects for it)."""
        client, code = self._client()
        if code == 0:
            client.publish(topics.client_topic(self.run, "status", ATTACKER), b"retained junk", qos=1, retain=True)
            time.sleep(0.1)
        client.disconnect()
        client.loop_stop()

    def _attack(self) -> None:
        deadline = time.monotonic() + MAX_SECONDS
        while not self.stop.is_set() and self.frames < MAX_FRAMES and time.monotonic() < deadline:
            self._forged_wills()
            self._retained()
            client, code = self._client()
            if code == 0:
                for _ in range(20):
                    last = self._flood(client)
                last.wait_for_publish(TIMEOUT_S)  # QoS 0 frames paho still holds would be lost at disconnect
                self.frames_out = self.frames
            client.disconnect()
            client.loop_stop()

    def __enter__(self) -> Attacker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT_S * 3)


def peak_rss(pid: int, stop: threading.Event, samples: list[int]) -> None:
    """Sample a process's resident memory every 50 ms until `stop` (or the process ends)."""
    try:
        process = psutil.Process(pid)
        while not stop.wait(0.05):
            samples.append(process.memory_info().rss)
    except psutil.NoSuchProcess:
        pass


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "mosquitto"])
def test_a_federation_completes_while_one_authenticated_device_floods_and_forges(tmp_path, embedded):
    cfg = make_config(tmp_path / "run", rounds=ROUNDS, round_deadline_s=90.0, heartbeat_s=2.0)
    with Federation(tmp_path / "fed", cfg, extra_users=(ATTACKER,), embedded=embedded) as fed:
        server = fed.start_server_process("--out", cfg.out)
        fed.wait_for_log(server, "waiting up to")
        samples: list[int] = []
        sampling = threading.Event()
        sampler = threading.Thread(target=peak_rss, args=(server.popen.pid, sampling, samples), daemon=True)
        sampler.start()
        time.sleep(0.5)
        baseline = min(samples)
        with Attacker(fed) as attacker:
            wait_until(lambda: attacker.frames_out >= FIRST_FLOOD, TIMEOUT_S, "the attacker's first flood")
            clients = fed.start_clients([str(i) for i in range(cfg.clients)])
            assert server.wait(180) == 0, server.log()
        sampling.set()
        sampler.join()
        assert clients.wait(30) == 0, clients.log()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = read_rows(tmp_path / "run")
    print(
        f"attacker: {attacker.frames} frames, will CONNACKs {sorted(set(attacker.will_connacks))}; server RSS "
        f"{baseline / 2**20:.0f} MiB at start, peak {max(samples) / 2**20:.0f} MiB; summary {summary['transport']}, "
        f"rejected {summary['rejected_messages']}, evicted {summary.get('evicted_messages')}"
    )
    assert attacker.frames >= 200, "the attack did not get going"
    assert sorted({r["round"] for r in rows}) == list(range(ROUNDS))  # every round completed ...
    assert all(r["trained"] for r in rows), [r for r in rows if not r["trained"]]  # ... with every client
    assert max(samples) - baseline < RSS_GROWTH_BOUND
    if embedded:  # fedge's broker refuses every forged will at CONNECT (Mosquitto drops them by its ACL)
        assert attacker.will_connacks and all(code != 0 for code in attacker.will_connacks)
        refused = fed.broker.report()["refused"]
        assert refused["forbidden_will"] == 2 * refused["retained_will"] > 0 and refused["retained_publish"] > 0
    refused = summary["rejected_messages"]
    assert refused.get("bad_chunk", 0) > 0  # the empty chunks announcing 10^6 chunks
    assert sum(summary.get("evicted_messages", {}).values()) + refused.get("too_large", 0) > 0
