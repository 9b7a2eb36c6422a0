"""Envelope and transport attacks on a real Fleet over a real broker (reliability-notes §10: 4, 5, 23, 24, 26).

A raw paho client (tests/helpers/raw.py) authenticates as a registered client id and publishes hand-built
frames while the server's round (Fleet.exchange) runs in a background thread. Each test asserts the server's
counters (`fleet.inbox.rejected`, `fleet.inbox.joiner`) and the round's results, and that a valid
message sent afterwards is still accepted. Every test runs on the embedded broker and on Mosquitto.
"""

from __future__ import annotations

import os
import time

import pytest

from fedge.brokers.embedded_broker import EmbeddedBroker
from fedge.constants import (
    MAX_CHUNK_BYTES,
    MAX_HEADER_BYTES,
    MAX_MESSAGE_BYTES,
    REPLY_SLACK_BYTES,
    SUPPORTED_SCHEMA_VERSIONS,
)
from fedge.wire.chunks import frames
from fedge.wire.codec import decode_result
from fedge.wire.envelope import Envelope

from helpers.brokers import MosquittoProcess, subscribe
from helpers.raw import (  # noqa: F401, F811 (broker, fleet and connect are pytest fixtures)
    GRACE_S,
    NUM_TRAIN,
    ONE_FRAME,
    RUN,
    broker,
    connect,
    fleet,
    frame_bytes,
    open_round,
    own,
    refused,
    rejected_only,
    same_weights,
    tensor_bytes,
    valid_result,
    wait_for,
)

pytestmark = pytest.mark.timeout(90)


# ------------------------------------------------------------------------------------------------------ 4, 5


def test_an_upload_delivered_three_times_is_taken_once(fleet, connect):
    """§10.4: the same envelope (same msg_id) three times → one result, bitwise the single delivery, 2 duplicates."""
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    payload = valid_result("a", 1, own("a"))
    env = Envelope.new(RUN, 1, "result", "a", payload, reply_to=envs["a"].msg_id, chunk_size=ONE_FRAME)
    [frame] = frames(env, payload, ONE_FRAME)

    for _ in range(3):
        a.publish(a.topic("result"), frame)

    results = ex.results()
    wait_for(lambda: fleet.inbox.joiner.duplicates == 2, "both repeats to be counted")
    assert set(results) == {"a"} and same_weights(results["a"], decode_result(payload))
    assert a.wait_ack(env.msg_id) is None
    assert fleet.inbox.joiner.duplicates == 2 and not fleet.inbox.rejected  # a repeat is not an error

    # A late repeat, once the next round is open, is still a duplicate (not a stale result) and changes nothing.
    ex, envs = open_round(fleet, [a], 2)
    a.publish(a.topic("result"), frame)
    wait_for(lambda: fleet.inbox.joiner.duplicates == 3, "the late repeat to be counted")
    second = valid_result("a", 2, own("a"), seed=1)
    assert a.wait_ack(a.answer(envs["a"], second).msg_id) is None
    assert same_weights(ex.results()["a"], decode_result(second)) and not fleet.inbox.rejected


def test_a_repeated_chunked_upload_counts_every_repeated_chunk(fleet, connect):
    """The duplicate counter counts transport messages: a 4-chunk upload delivered twice adds 4."""
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    payload = valid_result("a", 1, own("a"))
    env = Envelope.new(RUN, 1, "result", "a", payload, reply_to=envs["a"].msg_id)
    parts = frames(env, payload)
    assert len(parts) == 4

    a.publish_frames("result", parts[::-1] + parts)  # out of order, then all again

    assert set(ex.results()) == {"a"}
    wait_for(lambda: fleet.inbox.joiner.duplicates == 4, "4 repeated chunks")
    assert not fleet.inbox.rejected and fleet.inbox.joiner.pending == 0


def test_a_result_for_the_previous_round_is_stale(fleet, connect):
    """§10.5: a valid upload for round r−1 during round r → `stale_round`, and round r's results are unchanged."""
    a = connect("a")
    ex, envs1 = open_round(fleet, [a], 1)
    assert a.wait_ack(a.answer(envs1["a"], valid_result("a", 1, own("a"))).msg_id) is None
    ex.results()

    ex, envs2 = open_round(fleet, [a], 2)
    a.answer(envs1["a"], valid_result("a", 1, own("a"), seed=7))  # a fresh upload answering round 1's task
    rejected_only(fleet, stale_round=1)
    a.answer(envs2["a"], valid_result("a", 1, own("a"), seed=8), rnd=1)  # round 1, naming round 2's task
    rejected_only(fleet, stale_round=2)
    a.answer(envs2["a"], valid_result("a", 3, own("a"), seed=9), rnd=3)  # a future round answers nothing
    rejected_only(fleet, stale_round=2, no_open_task=1)

    good = valid_result("a", 2, own("a"), seed=2)
    assert a.wait_ack(a.answer(envs2["a"], good).msg_id) is None
    results = ex.results()
    assert results["a"].round == 2 and same_weights(results["a"], decode_result(good))
    assert dict(fleet.inbox.rejected) == {"stale_round": 2, "no_open_task": 1}


# ------------------------------------------------------------------------------------------------------ 23


def test_an_upload_announcing_twice_the_expected_size_is_refused_at_its_first_chunk(fleet, connect):
    """§10.23: the envelope announces 2x the client's limit (its model's tensor bytes + slack): the first chunk is
    refused `too_large` and nothing is stored. An upload whose chunks could not add up to its announced size
    (here: a first chunk holding all of it, of two) is refused `bad_chunk` at that first chunk."""
    a = connect("a")
    limit = fleet.limits["a"]
    assert limit == tensor_bytes(own("a")) + REPLY_SLACK_BYTES
    ex, envs = open_round(fleet, [a], 1)

    payload = os.urandom(2 * limit)
    env = Envelope.new(RUN, 1, "result", "a", payload, reply_to=envs["a"].msg_id)
    parts = frames(env, payload)
    a.publish(a.topic("result"), parts[0])
    rejected_only(fleet, too_large=1)
    assert fleet.inbox.joiner.pending == 0

    liar = {**Envelope.new(RUN, 1, "result", "a", payload[:limit], reply_to=envs["a"].msg_id).to_dict(), "chunks": 2}
    a.publish(a.topic("result"), frame_bytes(liar, 0, payload[:limit]))  # 2 chunks of `limit` bytes in all
    rejected_only(fleet, too_large=1, bad_chunk=1)
    assert fleet.inbox.joiner.pending == 0

    good = valid_result("a", 1, own("a"))
    assert a.wait_ack(a.answer(envs["a"], good).msg_id) is None
    assert same_weights(ex.results()["a"], decode_result(good))
    assert env.msg_id not in a.acks and liar["msg_id"] not in a.acks  # refused before decoding: never answered


def test_a_publish_over_the_brokers_packet_limit_reaches_no_subscriber(broker, fleet, connect):
    """§10.23 at broker level. Mosquitto (max_packet_size, which in 2.0 replaces the deprecated
    message_size_limit) drops the packet and the connection: the server never sees it, and a's next message,
    sent after it reconnected, is the barrier. The embedded amqtt broker has no packet limit: there the
    server's inbox refuses the message `too_large` before parsing it."""
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    big = os.urandom(MAX_CHUNK_BYTES + MAX_HEADER_BYTES + 1)  # over the broker's limit and the inbox's per-message cap
    assert len(big) > MAX_MESSAGE_BYTES
    connects = a.connects

    a.client.publish(a.topic("result"), big, qos=0)  # QoS 0: paho must not re-send it after the reconnect

    if isinstance(broker, MosquittoProcess):
        wait_for(lambda: a.connects > connects, "Mosquitto to drop a and paho to reconnect")
        assert subscribe(a.client, a.task_topic) == [1]  # in place before the barrier's acknowledgement comes
    else:
        rejected_only(fleet, too_large=1)
    good = valid_result("a", 1, own("a"))
    assert a.wait_ack(a.answer(envs["a"], good).msg_id) is None  # the barrier
    assert same_weights(ex.results()["a"], decode_result(good))
    time.sleep(GRACE_S)
    assert dict(fleet.inbox.rejected) == ({} if isinstance(broker, MosquittoProcess) else {"too_large": 1})


# ------------------------------------------------------------------------------------------------------ 24


def test_a_client_cannot_speak_for_another(broker, fleet, connect):
    """§10.24: a's envelope naming b on a's topic is `spoof`; a's publish into b's result topic is dropped by
    the broker (a's later message is the barrier); a cannot read b's tasks."""
    a, b = connect("a"), connect("b")
    codes = subscribe(a.client, a.topic("task", "b"))
    # amqtt refuses the SUBSCRIBE; Mosquitto 2.0's acl_file grants it and checks reads at delivery, so nothing comes
    assert codes == ([0x80] if isinstance(broker, EmbeddedBroker) else [1])
    ex, envs = open_round(fleet, [b, a], 1)  # b's task is published first: a's own task is the barrier for it

    a.answer(envs["a"], valid_result("a", 1, own("a")), sender="b")  # a's topic, envelope says b
    rejected_only(fleet, spoof=1)
    named_b = valid_result("b", 1, own("b"))  # a's topic and envelope, the result inside names b
    assert refused(a, a.answer(envs["a"], named_b)).startswith("spoof:")
    forged = valid_result("b", 1, own("b"), num_examples=1, seed=66)  # b's open task, b's topic, b as sender
    a.send("result", "result", 1, forged, reply_to=envs["b"].msg_id, sender="b", client="b")
    good = valid_result("a", 1, own("a"))
    assert a.wait_ack(a.answer(envs["a"], good).msg_id) is None  # the barrier: sent after the forgery
    time.sleep(GRACE_S)
    assert "b" not in fleet.results and dict(fleet.inbox.rejected) == {"spoof": 2}
    assert a.foreign == []  # nothing of b's task topic ever reached a

    genuine = valid_result("b", 1, own("b"), seed=5)
    assert b.wait_ack(b.answer(envs["b"], genuine).msg_id) is None
    results = ex.results()
    assert set(results) == {"a", "b"} and same_weights(results["b"], decode_result(genuine))
    assert results["b"].num_examples == NUM_TRAIN


# ------------------------------------------------------------------------------------------------------ 26


def test_an_unknown_schema_version_is_refused_and_the_oldest_supported_accepted(fleet, connect):
    """§10.26: envelopes of versions this server does not know are `schema_version`; the oldest supported version
    is accepted."""
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    good = valid_result("a", 1, own("a"))
    base = Envelope.new(RUN, 1, "result", "a", good, reply_to=envs["a"].msg_id, chunk_size=ONE_FRAME).to_dict()

    for version in (max(SUPPORTED_SCHEMA_VERSIONS) + 1, min(SUPPORTED_SCHEMA_VERSIONS) - 1, 10**6):
        a.publish(
            a.topic("result"), frame_bytes({**base, "schema_version": version, "msg_id": os.urandom(16).hex()}, 0, good)
        )
    rejected_only(fleet, schema_version=3)
    a.publish(a.topic("result"), frame_bytes({**base, "schema_version": "1", "msg_id": os.urandom(16).hex()}, 0, good))
    rejected_only(fleet, schema_version=3, bad_format=1)

    oldest = {**base, "schema_version": min(SUPPORTED_SCHEMA_VERSIONS)}
    a.publish(a.topic("result"), frame_bytes(oldest, 0, good))
    assert a.wait_ack(oldest["msg_id"]) is None
    assert same_weights(ex.results()["a"], decode_result(good))
