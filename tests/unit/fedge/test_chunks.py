"""fedge.wire.chunks: frames, chunk geometry, and joining chunks in any order within memory budgets."""

import dataclasses
import json
import os
import pickle
import random

import pytest

from fedge.wire.chunks import ChunkJoiner, Frame, chunk_stride, frames, split, unframe
from fedge.wire.envelope import Envelope, WireError, sha256_hex

pytestmark = pytest.mark.timeout(60)


def message(payload: bytes, chunk_size: int, sender: str = "a") -> list[Frame]:
    """The frames of `payload`, as a receiver parses them."""
    env = Envelope.new("r", 0, "result", sender, payload, reply_to="0" * 32, chunk_size=chunk_size)
    return [unframe(f) for f in frames(env, payload, chunk_size)]


def test_chunks_shuffled_and_duplicated_reassemble_once():
    payload = os.urandom(10_000)
    chunks = split(payload, 1000)
    assert len(chunks) == 10 and b"".join(chunks) == payload
    parts = message(payload, 1000)
    arrivals = parts + [parts[2], parts[5]]
    random.Random(1).shuffle(arrivals)
    r = ChunkJoiner()
    done = [out for f in arrivals if (out := r.add("a", f, 20_000)) is not None]
    assert done == [payload]
    assert r.add("a", parts[0], 20_000) is None  # late duplicate of a finished message
    assert r.pending == 0 and r.duplicates == 3 and r.held_total == 0


def test_hash_mismatch_oversize_and_inconsistent_chunks():
    r = ChunkJoiner()
    (lie,) = message(b"abc", 10)
    lie = dataclasses.replace(lie, envelope=dataclasses.replace(lie.envelope, sha256=sha256_hex(b"abd")))
    with pytest.raises(WireError) as e:
        r.add("a", lie, 100)
    assert e.value.reason == "hash_mismatch" and r.pending == 0
    with pytest.raises(WireError) as e:
        r.add("a", message(b"x" * 180, 60)[0], 100)  # announces 180 bytes where 100 are allowed
    assert e.value.reason == "too_large" and r.pending == 0
    first, second = message(b"x" * 30, 10)[0], message(b"y" * 40, 10)[1]
    r.add("a", first, 100)
    other = dataclasses.replace(second, envelope=first.envelope)  # same message id, other geometry
    with pytest.raises(WireError) as e:
        r.add("a", dataclasses.replace(other, stride=20), 100)
    assert e.value.reason == "bad_chunk" and r.pending == 0 and r.held_total == 0


@pytest.mark.parametrize(
    "size, chunks, index, length, stride",
    [
        (10, 1, 0, 10, 10),
        (0, 1, 0, 0, 0),
        (10, 4, 0, 3, 3),
        (10, 4, 3, 1, 3),
        (10, 2, 1, 5, 5),
        (9, 3, 2, 3, 3),
    ],
)
def test_chunk_stride_of_every_uniform_cut(size, chunks, index, length, stride):
    assert chunk_stride(size, chunks, index, length) == stride


@pytest.mark.parametrize(
    "size, chunks, index, length",
    [
        (10, 1, 0, 9),  # one chunk must hold everything
        (1_000_000, 10**6 + 1, 0, 1),  # more chunks than bytes
        (1_000_000, 10**6, 0, 0),  # empty chunks announcing a million
        (1_000_000, 10**6, 10**6 - 1, 0),  # ... the last one first
        (10, 4, 0, 2),  # chunks of 2 would make 5
        (10, 4, 3, 4),  # a last chunk longer than the others
        (10, 4, 3, 2),  # 8 bytes do not split into 3 equal chunks ... of at least 2
        (0, 2, 1, 0),
    ],
)
def test_a_chunk_no_uniform_cut_can_make_is_refused_at_once(size, chunks, index, length):
    with pytest.raises(WireError) as e:
        chunk_stride(size, chunks, index, length)
    assert e.value.reason == "bad_chunk"


def test_a_flood_of_padded_frames_is_held_to_the_senders_budget():
    payload = b"z" * 1000
    env = Envelope.new("r", 0, "register", "x", payload, chunk_size=1)  # 1000 one-byte chunks
    header = json.dumps({"envelope": env.to_dict(), "chunk": 0, "chunk_sha256": sha256_hex(b"z")}).encode()
    padded = header + b" " * (100_000 - len(header))  # legal JSON whitespace: each frame costs 100 kB
    r = ChunkJoiner(sender_budget=1_000_000, total_budget=10_000_000)
    honest = message(os.urandom(5000), 1000, sender="b")
    r.add("b", honest[0], 10_000)
    for i in range(40):  # 40 messages of one frame each, 4 MB of frames, from one sender
        e = dataclasses.replace(env, msg_id=f"{i:032x}")
        h = padded.replace(env.msg_id.encode(), e.msg_id.encode())
        r.add("x", unframe(len(h).to_bytes(4, "little") + h + b"z"), 1000)
        assert r.held["x"] <= 1_000_000  # every byte of every frame counted
    assert r.evicted["x"] >= 30 and "b" not in r.evicted
    assert [r.add("b", f, 10_000) for f in honest[1:]][-1] is not None  # the honest message still completes


def test_the_total_budget_evicts_the_biggest_holders_oldest_message():
    r = ChunkJoiner(sender_budget=100_000, total_budget=20_000)
    big, small = message(os.urandom(6000), 1000, "big"), message(os.urandom(3000), 1000, "small")
    r.add("small", small[0], 3000)
    for f in big[:5]:
        r.add("big", dataclasses.replace(f, envelope=dataclasses.replace(f.envelope, msg_id=f"{f.index:032x}")), 6000)
    assert r.held_total <= 20_000 and r.evicted["big"] >= 1 and not r.evicted["small"]


def test_one_message_whose_frames_exceed_its_budget_is_refused():
    r = ChunkJoiner(sender_budget=5_000, total_budget=100_000)
    parts = message(os.urandom(6000), 100)  # 60 frames of ~650 bytes: over 2 x 6000 bytes in all
    with pytest.raises(WireError) as e:
        for f in parts:
            r.add("a", f, 6000)
    assert e.value.reason == "too_large" and r.pending == 0 and r.held_total == 0


def test_frames_round_trip_in_any_order():
    payload = os.urandom(1000)
    env = Envelope.new("r", 3, "result", "a", payload, reply_to="0" * 32, chunk_size=300)
    parts = frames(env, payload, 300)
    assert len(parts) == env.chunks == 4
    got = {unframe(p).index: unframe(p) for p in reversed(parts)}
    assert got[0].envelope == env and b"".join(got[i].data for i in range(4)) == payload


def test_frame_corruption_and_lies_rejected():
    payload = os.urandom(600)
    env = Envelope.new("r", 0, "task", "server", payload, chunk_size=300)
    good = frames(env, payload, 300)[1]
    with pytest.raises(WireError) as e:
        unframe(good[:-1] + bytes([good[-1] ^ 1]))  # one flipped bit in the chunk
    assert e.value.reason == "bad_chunk"
    with pytest.raises(WireError) as e:
        unframe(b"\xff\xff\xff\x7f{}")  # header length beyond the message
    assert e.value.reason == "bad_format"
    with pytest.raises(WireError) as e:
        unframe(pickle.dumps({"x": 1}))
    assert e.value.reason == "bad_format"
    n = int.from_bytes(good[:4], "little")
    header = json.loads(good[4 : 4 + n])
    header["chunk"] = 7  # beyond the announced count
    raw = json.dumps(header).encode()
    with pytest.raises(WireError) as e:
        unframe(len(raw).to_bytes(4, "little") + raw + good[4 + n :])
    assert e.value.reason == "bad_chunk"
    with pytest.raises(WireError) as e:
        frames(env, payload + b"x", 300)  # the envelope was made for other bytes
    assert e.value.reason == "bad_chunk"


def test_the_joined_payload_is_writable_memory():
    payload = os.urandom(2500)
    r = ChunkJoiner()
    out = [r.add("a", f, 10_000) for f in message(payload, 1000)][-1]
    assert isinstance(out, bytearray) and out == payload  # decoded tensors view it in place


def test_a_payload_other_than_the_envelopes_is_refused():
    """Frames reuse the digests the envelope was made with: other bytes of the same size go out under them,
    and the receiver refuses every such chunk as corrupted; bytes of another size are refused by the sender."""
    payload, other = os.urandom(600), os.urandom(600)
    env = Envelope.new("r", 0, "task", "server", payload, chunk_size=300)
    for f in frames(env, other, 300):
        with pytest.raises(WireError) as e:
            unframe(f)
        assert e.value.reason == "bad_chunk" and "SHA-256 mismatch" in str(e.value)
    received = Envelope.from_json(env.to_json())  # an envelope without digests: frames hashes the payload
    with pytest.raises(WireError) as e:
        frames(received, other, 300)
    assert e.value.reason == "bad_chunk" and "sha" in str(e.value)
