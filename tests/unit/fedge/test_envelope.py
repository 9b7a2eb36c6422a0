"""fedge.wire.envelope: strict envelopes, the schema version, and the chunk digests and root an envelope carries."""

import hashlib
import json
import os

import pytest

from fedge.constants import HASH_PARALLEL_MIN_BYTES, MAX_TTL_S, SUPPORTED_SCHEMA_VERSIONS, WIRE_SCHEMA_VERSION
from fedge.wire.envelope import Envelope, WireError, chunk_digests, root_sha256

pytestmark = pytest.mark.timeout(60)


def test_envelope_round_trip_and_expiry():
    env = Envelope.new("run1", 4, "result", "7", b"payload", reply_to="ab" * 16, ttl_s=5)
    assert Envelope.from_json(env.to_json()) == env
    root = hashlib.sha256(hashlib.sha256(b"payload").digest()).hexdigest()  # over the one chunk's digest
    assert (env.sha256, env.size, env.chunks) == (root, 7, 1)
    assert not env.expired(env.created_at + 4) and env.expired(env.created_at + 6)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"schema_version": 3}, "schema_version"),
        ({"schema_version": "1"}, "bad_format"),
        ({"extra": 1}, "bad_format"),
        ({"round": True}, "bad_format"),
        ({"round": -1}, "bad_format"),
        ({"type": "hello"}, "bad_format"),
        ({"msg_id": "not-hex"}, "bad_format"),
        ({"sha256": "00"}, "bad_format"),
        ({"ttl_s": 0}, "bad_ttl"),
        ({"ttl_s": 1e300}, "bad_ttl"),  # a message that would never expire
        ({"ttl_s": MAX_TTL_S + 1}, "bad_ttl"),
        ({"chunks": 0}, "bad_format"),
        ({"size": 10**12}, "too_large"),
    ],
)
def test_envelope_rejections(change, reason):
    d = Envelope.new("run1", 0, "task", "server", b"x").to_dict()
    d.update(change)
    with pytest.raises(WireError) as e:
        Envelope.from_json(json.dumps(d))
    assert e.value.reason == reason


def test_envelope_missing_field_and_not_json():
    d = Envelope.new("run1", 0, "task", "server", b"x").to_dict()
    del d["sender"]
    for text in (json.dumps(d), "[1]", "{nope"):
        with pytest.raises(WireError) as e:
            Envelope.from_json(text)
        assert e.value.reason == "bad_format"


@pytest.mark.parametrize(
    "version, says",
    [
        (1, "schema version 1, this side speaks 2; upgrade the sender"),
        (3, "schema version 3, this side speaks 2; upgrade this side"),
    ],
)
def test_a_peer_of_another_schema_version_is_told_which_side_to_upgrade(version, says):
    assert (WIRE_SCHEMA_VERSION, SUPPORTED_SCHEMA_VERSIONS) == (2, (2,))
    d = {**Envelope.new("run1", 0, "result", "7", b"x", reply_to="ab" * 16).to_dict(), "schema_version": version}
    with pytest.raises(WireError) as e:
        Envelope.from_json(json.dumps(d))
    assert e.value.reason == "schema_version" and str(e.value) == f"schema_version: {says}"


def test_chunk_digests_and_their_root_by_hand():
    def sha(b: bytes) -> bytes:
        return hashlib.sha256(b).digest()

    assert chunk_digests(b"abcdef", 4) == [sha(b"abcd"), sha(b"ef")]
    assert chunk_digests(b"", 4) == [sha(b"")]  # an empty payload is one empty chunk
    assert root_sha256([sha(b"abcd"), sha(b"ef")]) == hashlib.sha256(sha(b"abcd") + sha(b"ef")).hexdigest()
    env = Envelope.new("r", 0, "task", "server", b"abcdef", chunk_size=4)
    assert (env.sha256, env.size, env.chunks) == (root_sha256([sha(b"abcd"), sha(b"ef")]), 6, 2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(WireError) as e:
            chunk_digests(b"abc", bad)
        assert e.value.reason == "bad_chunk"


def test_a_large_payload_is_hashed_in_parallel_to_the_same_digests():
    payload = os.urandom(HASH_PARALLEL_MIN_BYTES + 12345)
    step = 100_000
    assert chunk_digests(payload, step) == [
        hashlib.sha256(payload[i : i + step]).digest() for i in range(0, len(payload), step)
    ]


def test_the_digests_an_envelope_keeps_never_travel():
    env = Envelope.new("r", 0, "task", "server", b"abcdef", chunk_size=4)
    assert env.digests == tuple(chunk_digests(b"abcdef", 4))
    assert "digests" not in env.to_dict() and "digests" not in env.to_json()
    back = Envelope.from_json(env.to_json())
    assert back == env and back.digests is None
