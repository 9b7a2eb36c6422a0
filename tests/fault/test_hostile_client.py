"""A client with valid credentials that lies (issue 10): memory floods and envelopes from the future, on a real
Fleet over a real broker (embedded and Mosquitto), with a hand-driven client (tests/helpers/raw.py)."""

from __future__ import annotations

import json
import math
import os
import threading
import time

import psutil
import pytest

from fedge.checkpoint import load_tree, nonfinite
from fedge.constants import MAX_CLOCK_SKEW_S, PENDING_SENDER_BYTES, PENDING_TOTAL_BYTES
from fedge.model.zoo import create
from fedge.wire.codec import decode_result, encode_info, encode_result
from fedge.wire.envelope import Envelope
from fedge.wire.messages import ClientInfo, Result, Weights
from launch.runs import load_partitioned

from helpers.federation import Federation, make_config, read_rows
from helpers.raw import (  # noqa: F401, F811 (broker, fleet and connect are pytest fixtures)
    ONE_FRAME,
    PADDED_HEADER_BYTES,
    RUN,
    RawClient,
    broker,
    connect,
    fleet,
    frame_bytes,
    open_round,
    own,
    padded_frame,
    rejected_only,
    same_weights,
    valid_result,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

FLOOD_FRAMES = 300
RSS_GROWTH_BOUND = 128 * 1024 * 1024  # the flood is 300 MB of frames; the server may keep its 16 MiB budget


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("registered", [False, True], ids=["before registering", "registered"])
def test_a_flood_of_padded_partial_frames_is_held_to_the_senders_budget(fleet, connect, registered):
    """Item 4: ~1 MiB frames each carrying one byte of a message that announces a million one-byte chunks (a
    consistent geometry, so they must be kept): everything kept is counted, the sender's budget holds, the
    oldest partials are evicted and counted per sender, and an honest client's round goes on."""
    a, c = connect("a"), connect("c", register=registered)
    empty = Envelope.new(RUN, 0, "register", "c", b"x" * 1000, chunk_size=1).to_dict()  # 1000 empty chunks
    c.publish(c.topic("register"), padded_frame(empty, 0, b""))
    rejected_only(fleet, bad_chunk=1)  # no uniform cut makes empty chunks: refused at the first frame

    before = rss()
    peak = before
    for i in range(FLOOD_FRAMES):
        env = Envelope.new(RUN, 0, "register", "c", b"x" * 1000, chunk_size=1).to_dict()
        c.publish(c.topic("register"), padded_frame(env, i % 1000, b"x"), qos=0 if i % 10 else 1)
        peak = max(peak, rss())
    joiner = fleet.inbox.joiner
    wait_for(lambda: joiner.pending + joiner.evicted["c"] == FLOOD_FRAMES, "every flood frame to arrive")
    peak = max(peak, rss())
    print(
        f"RSS {before / 2**20:.0f} MiB before the flood, peak {peak / 2**20:.0f} MiB; held by c "
        f"{joiner.held['c'] / 2**20:.1f} MiB in {joiner.pending} partials, evicted {joiner.evicted}"
    )
    assert joiner.held["c"] <= PENDING_SENDER_BYTES and joiner.held_total <= PENDING_TOTAL_BYTES
    assert joiner.evicted["c"] >= FLOOD_FRAMES - PENDING_SENDER_BYTES // PADDED_HEADER_BYTES
    assert set(joiner.evicted) == {"c"}
    assert fleet.report()["evicted_messages"] == {"c": joiner.evicted["c"]}
    assert peak - before < RSS_GROWTH_BOUND

    ex, envs = open_round(fleet, [a], 1)
    good = valid_result("a", 1, own("a"))
    assert a.wait_ack(a.answer(envs["a"], good).msg_id) is None
    assert same_weights(ex.results()["a"], decode_result(good))


def test_envelopes_from_the_future_and_immortal_ones_are_refused(fleet, connect):
    """Item 7: created decades ahead is `clock_skew`, a TTL of 1e300 `bad_ttl`; within the tolerance is fine."""
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    good = valid_result("a", 1, own("a"))
    base = Envelope.new(RUN, 1, "result", "a", good, reply_to=envs["a"].msg_id, chunk_size=ONE_FRAME).to_dict()
    future = {**base, "created_at": time.time() + 30 * 365 * 24 * 3600, "msg_id": os.urandom(16).hex()}
    immortal = {**base, "ttl_s": 1e300, "msg_id": os.urandom(16).hex()}
    a.publish(a.topic("result"), frame_bytes(future, 0, good))
    a.publish(a.topic("result"), frame_bytes(immortal, 0, good))
    rejected_only(fleet, clock_skew=1, bad_ttl=1)

    skewed = {**base, "created_at": time.time() + MAX_CLOCK_SKEW_S / 2}  # a clock a little fast is tolerated
    a.publish(a.topic("result"), frame_bytes(skewed, 0, good))
    assert a.wait_ack(skewed["msg_id"]) is None
    assert same_weights(ex.results()["a"], decode_result(good))
    assert fleet.report()["rejected_messages"] == {"clock_skew": 1, "bad_ttl": 1}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "mosquitto"])
def test_a_second_client_process_with_the_same_id_takes_over_and_the_first_stops(tmp_path, embedded):
    """Item 3: `fedge client --id 1` started twice. Each connection ends the other's at the broker, and each
    ended one reconnects: once the server sees a replaced connection come back it counts a takeover and tells
    that one to stop; it exits 2 naming the cause; the other serves client 1 to the end; no round waits for its
    deadline."""
    rounds = 10
    cfg = make_config(
        tmp_path / "run",
        clients=2,
        rounds=rounds,
        local_epochs=2,
        max_samples_per_client=400,
        round_deadline_s=120.0,
        heartbeat_s=1.0,
    )
    with Federation(tmp_path / "fed", cfg, embedded=embedded) as fed:
        zero = fed.start_clients(["0"])
        twins = [fed.start_clients(["1"], name=f"twin-{k}") for k in (1, 2)]
        server = fed.start_server_process("--out", cfg.out)
        assert server.wait(180) == 0, server.log()
        codes = sorted(((twin.wait(60), twin) for twin in twins), key=lambda pair: pair[0])
        assert zero.wait(30) == 0, zero.log()
    (kept, _), (code, stopped) = codes
    assert (kept, code) == (0, 2), [t.log() for t in twins]
    assert "another connection with client id 1 took over this one" in stopped.log()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["transport"]["takeovers"] == {"1": 1}
    assert "deadline_missed" not in summary["transport"], summary["transport"]
    rows = read_rows(tmp_path / "run")
    assert sorted({r["round"] for r in rows}) == list(range(rounds)) and all(r["trained"] for r in rows)


class Hostile:
    """Client 1 of a Federation driven by hand: registers with `num_train` and answers every training task with
    `scale` times the model it was sent, every evaluation with a plausible score, until the server says stop."""

    def __init__(self, fed: Federation, num_train: int, num_test: int, scale: float = 1e30) -> None:
        self.client = RawClient(fed.broker, "1", fed.cfg.run_id)
        self.spec = create(fed.cfg.zoo, (1, 28, 28), 10).with_origin("1")
        self.profile = fed.cfg.profiles[1 % len(fed.cfg.profiles)]
        self.num_train, self.num_test, self.scale = num_train, num_test, scale
        self.thread = threading.Thread(target=self._serve, daemon=True, name="hostile")

    def register(self, num_train: int | None = None) -> str | None:
        """The server's verdict on a registration claiming `num_train` (default: the true size)."""
        info = ClientInfo("1", self.spec, self.profile, num_train or self.num_train, self.num_test)
        return self.client.wait_ack(self.client.send("register", "register", 0, encode_info(info)).msg_id)

    def _serve(self) -> None:
        while True:
            env, task = self.client.next_task(timeout=120)
            if task.type == "stop":
                return
            if task.type == "evaluate":
                result = Result("1", task.round, "evaluate", self.num_test, {"accuracy": 0.1, "loss": 2.3})
            else:
                sent = task.models["global"]
                huge = {k: v * self.scale if v.is_floating_point() else v for k, v in sent.state.items()}
                result = Result(
                    "1", task.round, task.type, self.num_train, {"train_loss": 0.1}, {"local": Weights(self.spec, huge)}
                )
            self.client.answer(env, encode_result(result))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "mosquitto"])
def test_a_finite_1e30_upload_in_rounds_of_two_cannot_poison_the_run(tmp_path, monkeypatch, embedded):
    """Item 5: active = 2, so the median check has too few uploads; the bound against the model the server sent
    rejects the upload every round, the global model and the checkpoint stay finite, the honest client trains in
    every round and the run completes."""
    cfg = make_config(tmp_path / "run", clients=2, active=2, rounds=3)
    shard = load_partitioned(cfg)[1].clients[1]
    with Federation(tmp_path / "fed", cfg, embedded=embedded) as fed:
        honest = fed.start_clients(["0"])
        server = fed.start_server(monkeypatch)
        hostile = Hostile(fed, len(shard.train), len(shard.test))
        assert hostile.register() is None
        hostile.thread.start()
        server.join(180)
        assert server.error is None, server.error
        assert honest.wait(30) == 0, honest.log()
        hostile.client.close()
    summary = server.summary
    assert summary["rejected_replies"] == {"norm_bound": 3} and summary["discarded_aggregates"] == []
    assert nonfinite(load_tree(tmp_path / "run" / "checkpoint.safetensors")) == []
    assert nonfinite(server.strategy.global_model.state) == []
    assert [r["round"] for r in read_rows(tmp_path / "run") if r["client"] == "0" and r["trained"]] == [0, 1, 2]
    assert math.isfinite(summary["final_accuracy"]["per_client"]["0"])


@pytest.mark.timeout(120)
def test_a_registration_claiming_another_data_size_is_refused(tmp_path, monkeypatch):
    """Item 6: the server made the partition, so it knows client 1's shard: a claim of a million examples (which
    would set its FedAvg weight) is refused with both numbers; the true size is accepted."""
    cfg = make_config(tmp_path / "run", clients=2)
    shard = load_partitioned(cfg)[1].clients[1]
    with Federation(tmp_path / "fed", cfg, embedded=True) as fed:
        server = fed.start_server(monkeypatch)
        hostile = Hostile(fed, len(shard.train), len(shard.test))
        refusal = hostile.register(num_train=1_000_000)
        assert (
            refusal is not None
            and f"claims 1000000 training and {len(shard.test)} test examples; its shard" in refusal
            and f"has {len(shard.train)} and {len(shard.test)}" in refusal
        ), refusal
        assert hostile.register() is None
        assert server.fleet.inbox.rejected == {"bad_spec": 1} and "1" in server.fleet.clients
        hostile.client.close()
