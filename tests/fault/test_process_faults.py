"""Real processes, a real Mosquitto, real failures (reliability-notes §10, tests 1, 2, 3, 6, 7, 12, 28).

Each test runs a tiny federation on 127.0.0.1 (3–4 cnn1 clients on 64 mnist-5k samples, 1 local epoch):
the server in a thread (launch.server.serve with an instrumented Fleet), the clients as `fedge client` processes,
and breaks something: the broker (SIGTERM / SIGKILL, restarted on the same port), a client's link (a TCP
proxy that cuts it mid-upload or stalls it), or client processes (SIGKILL, Ctrl-C).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from edge_client.session import MAX_SENDS
from fedge.brokers.access import generate_users
from fedge.brokers.mqtt import Broker, Endpoint, Inbox, connector
from fedge.checkpoint import load_tree
from fedge.constants import CHUNK_SIZE, MAX_PAYLOAD_BYTES, RECONNECT_GRACE_S
from fedge.model.layers import LayerSpec
from fedge.model.spec import make_spec, tensor_shapes
from fedge.model.zoo import create
from fedge.wire import topics
from fedge.wire.chunks import frames, unframe
from fedge.wire.codec import decode_result, encode_info, encode_result, encode_status
from fedge.wire.envelope import Envelope, chunk_digests, root_sha256
from fedge.wire.messages import Result, Weights
from launch.cli import USER_ERRORS
from launch.client import client_agents
from server.coordinator import RoundFailed
from server.fleet import Fleet
from server.registration import registration_check
from server.runlog import CHECKPOINT_FILE

from helpers.brokers import MosquittoProcess, close, mqtt_client, publish, subscribe
from helpers.federation import (
    Federation,
    make_config,
    outcome,
    read_rows,
    run_inproc,
    same_tree,
    trained_by_round,
    wait_until,
)
from helpers.proxy import TcpProxy

ALL = ["0", "1", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple]:
    """The fault-free outcome of make_config's run, computed in-process with one torch thread (as the client
    processes train), so that a run through faults must reproduce it bitwise."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_inproc(make_config(out))
    return outcome(out)


def upload_bytes(model: str = "cnn1") -> int:
    """Tensor bytes of one client's training reply (cnn1 on 1x28x28, 10 classes)."""
    shapes = tensor_shapes(create(model, (1, 28, 28), 10))
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes.values())


# ---------------------------------------------------------------------------------------------- 1, 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "sig, persistence",
    [(signal.SIGTERM, True), (signal.SIGKILL, False)],
    ids=["graceful-restart-persistent", "crash-no-persistence"],
)
def test_broker_restart_mid_round_loses_no_update_and_duplicates_none(
    tmp_path, monkeypatch, reference, sig, persistence
):
    deadline = 40.0
    cfg = make_config(tmp_path / "run", round_deadline_s=deadline)
    down_s = 3.0
    events: dict[str, float] = {}
    restarted = threading.Event()
    with Federation(tmp_path, cfg, persistence=persistence) as fed:
        server = fed.start_server(monkeypatch)

        def restart_later() -> None:
            time.sleep(down_s)
            fed.broker.start()
            events["restarted"] = time.monotonic()
            restarted.set()

        restarter = threading.Thread(target=restart_later, daemon=True)

        def crash_broker(rnd: int, kind: str) -> None:  # on the server thread, right after round 1's tasks went out
            if (rnd, kind) == (1, "train") and "down" not in events:
                fed.broker.stop(sig)
                events["down"] = time.monotonic()
                restarter.start()

        server.fleet.after_send = crash_broker
        fed.start_clients(ALL)
        try:
            server.join(120)
        finally:
            if restarter.ident is not None:
                restarter.join()  # never leave a broker starting after the teardown

        assert server.error is None, f"the run failed: {server.error!r}"
        assert restarted.is_set()
        round1 = next(e for e in server.fleet.exchanges if (e.round, e.type) == (1, "train"))
        print(
            f"broker {sig.name}: down for {events['restarted'] - events['down']:.2f} s; the server reconnected "
            f"{server.fleet.link.connected_at - events['restarted']:.2f} s after it was back, round 1 closed "
            f"{round1.end - events['restarted']:.2f} s after it was back; rejected "
            f"{server.summary['rejected_messages']}"
        )
    assert round1.replied == ALL and round1.end < round1.start + deadline  # closed by replies, not the deadline
    assert trained_by_round(cfg.out) == {0: ALL, 1: ALL}  # each client's update aggregated exactly once a round
    assert server.summary["failed_rounds"] == [] and server.summary["transport"].get("deadline_missed", 0) == 0
    assert outcome(Path(cfg.out)) == reference  # same models as a run without the crash


# ---------------------------------------------------------------------------------------------- 3


@pytest.mark.timeout(120)
def test_link_cut_mid_upload_is_completed_after_reconnect_and_aggregated_once(tmp_path, monkeypatch, reference):
    cfg = make_config(tmp_path / "run", round_deadline_s=30.0)
    chunk = 16 * 1024  # client 2 uploads ~860 KB in ~53 chunks
    half = upload_bytes() // 2
    seen: dict[str, bool] = {}
    with Federation(tmp_path, cfg) as fed, TcpProxy(fed.broker.port) as proxy:
        server = fed.start_server(monkeypatch)
        fleet = server.fleet

        def arm(rnd: int, kind: str) -> None:
            # Armed once round 0's evaluations are out, not round 1's tasks: those are all published and acknowledged
            # before this hook runs, by when client 2 may have trained and sent more than half its upload (the cut
            # then never came). Until round 1's upload, client 2 sends only an evaluation, acks and heartbeats: a few
            # KB of the ~430 KB counted, so the cut still lands mid-upload.
            if (rnd, kind) == (0, "evaluate"):
                proxy.cut_after(half)

        fleet.after_send = arm
        fed.start_clients(["0", "1"])
        client2 = fed.start_clients(["2"], port=proxy.port, settings={"chunk_size": chunk})
        assert proxy.wait_for_cut(90), "client 2's upload never reached the cut"
        wait_until(lambda: fleet.inbox.joiner.pending, 2, "the first half to reach the server")
        seen["accepted"] = "2" in fleet.results  # the first half is held as a partial message, not accepted
        server.join(60)

        assert server.error is None, f"the run failed: {server.error!r}"
        round1 = next(e for e in fleet.exchanges if (e.round, e.type) == (1, "train"))
        print(
            f"cut after {half} of ~{2 * half} upload bytes; round 1 closed {round1.seconds:.2f} s after its tasks; "
            f"{fleet.inbox.joiner.duplicates} duplicate chunks ignored; rejected {dict(fleet.inbox.rejected)}"
        )
        assert "disconnected" in client2.log()
    assert not seen["accepted"]
    assert proxy.cuts == 1 and proxy.accepted == 2  # one cut, one reconnect
    assert round1.replied == ALL and round1.seconds < cfg.round_deadline_s
    assert not {"hash_mismatch", "bad_chunk"} & set(fleet.inbox.rejected)
    assert trained_by_round(cfg.out) == {0: ALL, 1: ALL}
    assert outcome(Path(cfg.out)) == reference  # the aggregated update is the whole one, exactly once


# ---------------------------------------------------------------------------------------------- 6


class Straggler:
    """A hand-driven client "2" on raw paho: registers, heartbeats, and never answers a task."""

    def __init__(self, fed: Federation, info) -> None:
        self.run, self.cid, self.session = fed.cfg.run_id, "2", uuid.uuid4().hex
        self.client = mqtt_client(fed.broker.url, self.cid, fed.users[self.cid])
        self.tasks: dict[str, Envelope] = {}  # msg_id → envelope of every task received, in order
        self.client.on_message = self._on_message
        subscribe(self.client, topics.client_topic(self.run, topics.DOWNLINK, self.cid))
        self.stopped = threading.Event()
        self.send("status", 0, encode_status("online", self.session))
        self.send("register", 0, encode_info(info))
        self.beat = threading.Thread(target=self._heartbeat, args=(fed.cfg.heartbeat_s,), daemon=True)
        self.beat.start()

    def send(self, kind: str, rnd: int, payload: bytes, reply_to: str | None = None) -> None:
        env = Envelope.new(self.run, rnd, kind, self.cid, payload, reply_to=reply_to)
        for frame in frames(env, payload):
            publish(self.client, topics.client_topic(self.run, kind, self.cid), frame)

    def _heartbeat(self, period: float) -> None:
        while not self.stopped.wait(period):
            self.send("status", 0, encode_status("alive", self.session))

    def _on_message(self, client, userdata, message) -> None:
        frame = unframe(message.payload)
        if frame.envelope.type == "task":
            self.tasks.setdefault(frame.envelope.msg_id, frame.envelope)

    def close(self) -> None:
        self.stopped.set()
        self.beat.join()
        close(self.client)


@pytest.mark.timeout(120)
def test_straggler_is_cut_off_at_the_deadline_every_round_and_its_late_reply_discarded(tmp_path, monkeypatch):
    deadline = 3.0  # every exchange waits it out (4 of them); the others' replies (64 samples of cnn1) take < 1 s
    cfg = make_config(tmp_path / "run", round_deadline_s=deadline)
    with Federation(tmp_path, cfg) as fed:
        server = fed.start_server(monkeypatch)
        fleet = server.fleet
        fed.start_clients(["0", "1"])
        straggler = Straggler(fed, client_agents(cfg, ["2"])[0].info())
        rejected = fleet.inbox.rejected
        try:
            wait_until(lambda: fleet.exchanges, 90, "round 0's training to close")
            train0 = next(iter(straggler.tasks.values()))  # the first instruction: round 0's training
            straggler.send("result", 0, encode_result(Result("2", 0, "train", 1)), reply_to=train0.msg_id)
            wait_until(lambda: rejected["stale_round"] + rejected["no_open_task"], 10, "the late reply's rejection")
            server.join(90)
        finally:
            straggler.close()

    assert server.error is None, f"the run failed: {server.error!r}"
    seconds = [round(e.seconds, 2) for e in fleet.exchanges]
    print(f"exchanges (train/evaluate per round) closed after {seconds} s with a {deadline:g} s deadline")
    assert [(e.round, e.type) for e in fleet.exchanges] == [
        (0, "train"),
        (0, "evaluate"),
        (1, "train"),
        (1, "evaluate"),
    ]
    for e in fleet.exchanges:  # every round waits for the straggler exactly as long as the deadline, no longer
        assert e.sent == ALL and e.replied == ["0", "1"]
        assert abs(e.seconds - deadline) <= 1.0, e
    assert trained_by_round(cfg.out) == {0: ["0", "1"], 1: ["0", "1"]}
    assert server.summary["never_trained"] == ["2"]
    for rnd in (0, 1):  # the simulated clock waits out the deadline for the straggler, as the server did
        rows = [r for r in read_rows(cfg.out) if r["round"] == rnd]
        slowest = max(r["sim_seconds"] for r in rows if r["trained"])
        assert {r["round_sim_seconds"] for r in rows} == {max(deadline, slowest)}
    assert server.summary["transport"]["deadline_missed"] == 4
    assert train0.round == 0
    assert rejected["stale_round"] + rejected["no_open_task"] == 1  # the late reply was logged and discarded


# ---------------------------------------------------------------------------------------------- 7


@pytest.mark.timeout(150)
def test_quorum_aggregates_the_survivors_and_fails_a_round_without_it(tmp_path, monkeypatch, caplog):
    cfg = make_config(tmp_path / "run", clients=4, min_replies=3, round_retries=1, round_deadline_s=20.0)
    caplog.set_level(logging.WARNING)
    killed: dict[str, float] = {}
    with Federation(tmp_path, cfg) as fed:
        server = fed.start_server(monkeypatch)
        fleet = server.fleet
        doomed = fed.start_clients(["3"])  # registers, then dies before the first round
        wait_until(lambda: fleet.alive("3"), 90, "client 3 to register")
        doomed.kill()
        victim = fed.start_clients(["2"])  # dies at the end of round 0, before round 1's tasks go out
        # (killing it after round 1's tasks went out races with its training: a tiny task may be answered first)

        def kill_victim(rnd: int, kind: str) -> None:
            if (rnd, kind) == (0, "evaluate") and "2" not in killed:
                victim.kill()
                killed["2"] = time.monotonic()

        fleet.after_send = kill_victim
        fed.start_clients(["0", "1"])
        server.join(120)

    error = server.error
    assert isinstance(error, RoundFailed), f"expected the run to stop with RoundFailed, got {error!r}"
    print(f"server stopped with: {error}")
    tries = [e for e in fleet.exchanges if e.round == 1]
    print(f"round 1 tries closed {[round(e.end - killed['2'], 2) for e in tries]} s after client 2 was killed")
    assert "round 1 failed 2 times" in str(error) and "min_replies=3" in str(error)
    assert isinstance(error, USER_ERRORS)  # `fedge server` prints it as one line, no traceback
    assert error.summary["failed_rounds"] == [{"round": 1, "try": t, "replies": 2} for t in (1, 2)]
    assert trained_by_round(cfg.out) == {0: ["0", "1", "2"]}  # round 0: the 3 survivors, quorum met
    assert [(e.type, e.replied) for e in tries] == [("train", ["0", "1"])] * 2
    checkpoint = load_tree(Path(cfg.out) / CHECKPOINT_FILE)
    assert checkpoint["next_round"] == 1
    assert same_tree(server.strategy.state(), checkpoint["strategy_state"])  # the failed round changed nothing
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert tries[0].end - killed["2"] <= RECONNECT_GRACE_S + 1.5  # no waiting for the dead beyond the grace


# ---------------------------------------------------------------------------------------------- 12


MOSQUITTO_KEEPALIVE_CHECK_S = 6  # Mosquitto 2.0 looks for expired keep-alives only when 5 s passed since it last did


@pytest.mark.timeout(120)
def test_liveness_via_will_status_and_heartbeats(tmp_path):
    keepalive = 2
    cfg = make_config(tmp_path / "run", keepalive_s=keepalive)
    bound = 1.5 * keepalive + 2
    dead: dict[str, float] = {}  # client → seconds until Fleet.alive() turned False
    offline: dict[str, float] = {}  # client → seconds until it was in Fleet.offline (will or status message)
    with Federation(tmp_path, cfg) as fed, TcpProxy(fed.broker.port) as proxy:
        fleet = Fleet(
            connector(fed.credentials("server"), cfg.keepalive_s),
            cfg.run_id,
            registration_check(),
            cfg.round_deadline_s,
            cfg.heartbeat_s,
            cfg.chunk_size,
        )
        fleet.start(10)
        try:
            crashing, leaving = fed.start_clients(["0"]), fed.start_clients(["1"])
            fed.start_clients(["2"], port=proxy.port)
            fleet.wait_for_clients(3, 90)
            wait_until(lambda: all(fleet.alive(c) for c in ALL), 10, "every client to be alive")

            def watch(cid: str, act) -> None:
                start = time.monotonic()
                act()
                while cid not in offline:
                    if cid not in dead and not fleet.alive(cid):
                        dead[cid] = time.monotonic() - start
                    if cid in fleet.offline:
                        offline[cid] = time.monotonic() - start
                    assert time.monotonic() - start < 30, f"client {cid} was never marked offline"
                    time.sleep(0.01)

            watch("0", crashing.kill)  # SIGKILL: the kernel closes the socket, the broker publishes the will
            watch("1", lambda: leaving.signal(signal.SIGINT))  # Ctrl-C: a clean exit says "offline" itself
            watch("2", proxy.stall)  # a silent link: heartbeats stop; the will after 1.5 x keep-alive
            assert leaving.wait() == 0
        finally:
            fleet.link.stop()
    print(
        f"alive() False after {dead}, in the offline set after {offline} (s); keep-alive {keepalive} s, "
        f"bound {bound:g} s"
    )
    assert offline["0"] <= bound
    assert offline["1"] <= 1.0  # immediately: the status message (a clean exit publishes no will)
    assert dead["2"] <= bound  # the server's own heartbeat check
    # the broker's will: 1.5 x keep-alive after the last heartbeat got through (up to one heartbeat before the stall)
    assert keepalive * 1.5 - cfg.heartbeat_s <= offline["2"] <= bound + MOSQUITTO_KEEPALIVE_CHECK_S


# ---------------------------------------------------------------------------------------------- 28


def big_state(out_features: int = 3200, in_features: int = 4096) -> Weights:
    """A two-layer linear model of ~52 MB of float32 (13.1 M parameters), seeded random."""
    spec = make_spec(
        "big",
        (1, 1, in_features),
        10,
        [
            ("fc1", [LayerSpec("flatten"), LayerSpec("linear", {"out_features": out_features})]),
            ("fc2", [LayerSpec("linear", {"out_features": 10})]),
        ],
    )
    g = torch.Generator().manual_seed(0)
    return Weights(
        spec, {k: torch.randn(shape, generator=g).to(dtype) for k, (shape, dtype) in tensor_shapes(spec).items()}
    )


RESEND_S = 5.0  # the sender re-sends the same message when it did not get through in this long (as EdgeClient does)


@pytest.mark.timeout(90)
def test_a_52_mb_model_crosses_the_broker_in_chunks_bitwise(tmp_path):
    weights = big_state()
    payload = encode_result(Result("a", 0, "train", 1, {}, {"local": weights}))
    assert len(payload) >= 50 * 1024 * 1024
    users = generate_users(["a"])
    run = "big"
    arrived: list = []
    frames: list[int] = []
    whole = threading.Event()

    def on_frame(topic: str, data: bytes) -> None:
        frames.append(len(data))
        delivery = inbox.receive(topic, data)
        if delivery is not None:
            arrived.append(delivery)
            whole.set()

    with MosquittoProcess(tmp_path / "mosquitto", users, print_log=True) as broker:
        inbox = Inbox(run, lambda kind, client, env: MAX_PAYLOAD_BYTES)
        server = Endpoint(
            Broker("127.0.0.1", broker.port, username="server", password=users["server"]),
            "server",
            topics.uplink_filters(run),
            on_frame,
        )
        client = Endpoint(
            Broker("127.0.0.1", broker.port, username="a", password=users["a"]), "a", [], lambda topic, data: None
        )
        server.start(10)
        client.start(10)
        try:
            start = time.monotonic()
            topic = topics.client_topic(run, "result", "a")
            env = client.publish(topic, "result", 0, payload)  # in CHUNK_SIZE chunks, as every fedge upload
            sends = 1
            while not whole.wait(RESEND_S):  # Mosquitto drops what overflows a slow subscriber's queue
                assert sends < MAX_SENDS, f"incomplete after {sends} sends; rejected {dict(inbox.rejected)}"
                client.send(topic, env, payload)
                sends += 1
            seconds = time.monotonic() - start
        finally:
            client.stop()
            server.stop()
    print(
        f"{len(payload) / 1e6:.1f} MB in {env.chunks} chunks in {seconds:.2f} s "
        f"({len(payload) / 1e6 / seconds:.0f} MB/s); {sends} send(s), {len(frames)} frames arrived"
    )
    (delivery,) = arrived
    assert env.chunks > 1 and not inbox.rejected
    assert bytes(delivery.payload) == payload and root_sha256(chunk_digests(payload, CHUNK_SIZE)) == env.sha256
    received = decode_result(delivery.payload).models["local"]
    assert received.spec == weights.spec and same_tree(received.state, weights.state)
