"""A client with valid credentials that lies (issue 10): memory floods and envelopes from the future, on a real
Fleet over a real broker (embedded and Mosquitto), with a hand-driven client (tests/helpers/raw.py)."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest
from helpers.federation import Federation, make_config, read_rows
from helpers.raw import (  # noqa: F401, F811 (broker, fleet and connect are pytest fixtures)
    ONE_FRAME,
    RUN,
    broker,
    connect,
    fleet,
    frame_bytes,
    open_round,
    own,
    rejected_only,
    same_weights,
    valid_result,
    wait_for,
)

from fedge.constants import MAX_CLOCK_SKEW_S, PENDING_SENDER_BYTES, PENDING_TOTAL_BYTES
from fedge.wire import Envelope, decode_result, sha256_hex

pytestmark = pytest.mark.timeout(120)

FLOOD_FRAMES = 300
HEADER_BYTES = 1000 * 1000  # a legal frame header (MAX_HEADER_BYTES is 1 MiB), almost all of it whitespace
RSS_GROWTH_BOUND = 128 * 1024 * 1024  # the flood is 300 MB of frames; the server may keep its 16 MiB budget


def padded_frame(env: dict, index: int, chunk: bytes) -> bytes:
    """A frame whose JSON header is padded with whitespace to HEADER_BYTES: legal JSON of a legal size."""
    header = json.dumps({"envelope": env, "chunk": index, "chunk_sha256": sha256_hex(chunk)}).encode()
    header += b" " * (HEADER_BYTES - len(header))
    return len(header).to_bytes(4, "little") + header + chunk


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
    reassembler = fleet.inbox.reassembler
    wait_for(lambda: reassembler.pending + reassembler.evicted["c"] == FLOOD_FRAMES, "every flood frame to arrive")
    peak = max(peak, rss())
    print(f"RSS {before / 2**20:.0f} MiB before the flood, peak {peak / 2**20:.0f} MiB; held by c "
          f"{reassembler.held['c'] / 2**20:.1f} MiB in {reassembler.pending} partials, evicted {reassembler.evicted}")
    assert reassembler.held["c"] <= PENDING_SENDER_BYTES and reassembler.held_total <= PENDING_TOTAL_BYTES
    assert reassembler.evicted["c"] >= FLOOD_FRAMES - PENDING_SENDER_BYTES // HEADER_BYTES
    assert set(reassembler.evicted) == {"c"}
    assert fleet.report()["evicted_messages"] == {"c": reassembler.evicted["c"]}
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
    """Item 3: `fedge client --id 1` started twice. The broker ends the first connection; when it comes back the
    server counts a takeover and tells it to stop; it exits 2 naming the cause; the newer process serves
    client 1 to the end; no round waits for its deadline."""
    rounds = 10  # long enough for the second process to start (a few seconds) while the run goes on
    cfg = make_config(tmp_path / "run", clients=2, rounds=rounds, local_epochs=2, max_samples_per_client=400,
                      round_deadline_s=120.0, heartbeat_s=1.0)
    with Federation(tmp_path / "fed", cfg, embedded=embedded) as fed:
        zero, first = fed.start_clients(["0"]), fed.start_clients(["1"], name="first-1")
        server = fed.start_server_process("--out", cfg.out)
        fed.wait_for_log(server, "client 1 registered")
        second = fed.start_clients(["1"], name="second-1")
        assert first.wait(60) == 2, first.log()
        assert server.wait(120) == 0, server.log()
        assert zero.wait(30) == 0 and second.wait(30) == 0, second.log()
    assert "another connection with client id 1 took over this one" in first.log()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["transport"]["takeovers"] == {"1": 1}
    assert "deadline_missed" not in summary["transport"], summary["transport"]
    rows = read_rows(tmp_path / "run")
    assert sorted({r["round"] for r in rows}) == list(range(rounds)) and all(r["trained"] for r in rows)
