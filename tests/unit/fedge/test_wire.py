"""Wire format: strict envelopes, a safetensors-only payload container, and chunk reassembly."""

import dataclasses
import json
import math
import os
import pickle
import random

import pytest
import torch

from fedge.constants import MAX_HEADER_BYTES, MAX_TTL_S
from fedge.messages import ClientInfo, Result, Task, Weights
from fedge.spec import build
from fedge.wire import (
    Envelope, Frame, Reassembler, WireError, chunk_stride, decode_ack, decode_info, decode_result, decode_status, decode_task, encode_ack,
    encode_info, encode_result, encode_status, encode_task, frames, sha256_hex, split, unframe,
)
from fedge.zoo import create

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def weights() -> Weights:
    spec = create("cnn1", (1, 8, 8), 10)
    torch.manual_seed(0)
    return Weights(spec, build(spec).state_dict())


def _same_state(a, b) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])


def _container(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


def test_task_round_trip(weights):
    task = Task("train", 3, {"lr": 0.01, "epochs": 2, "names": ["a"]}, {"global": weights, "teacher": weights})
    out = decode_task(encode_task(task))
    assert (out.type, out.round, out.config) == ("train", 3, task.config)
    assert list(out.models) == ["global", "teacher"]
    for w in out.models.values():
        assert w.spec == weights.spec
        _same_state(w.state, weights.state)


def test_result_and_info_round_trip(weights):
    result = Result("7", 2, "train", 120, {"loss": 0.5, "acc": 1}, {"local": weights})
    out = decode_result(encode_result(result))
    assert (out.client_id, out.round, out.type, out.num_examples, out.metrics) == ("7", 2, "train", 120,
                                                                                    {"loss": 0.5, "acc": 1.0})
    _same_state(out.models["local"].state, weights.state)
    info = ClientInfo("7", weights.spec, "rpi4", 100, 20)
    assert decode_info(encode_info(info)) == info
    failed = Result("7", 2, "train", 0, error="training diverged: loss is nan")
    assert decode_result(encode_result(failed)) == failed
    long = _container({"kind": "result", "fields": {**encode_fields(failed), "error": "x" * 1001}, "models": {}})
    with pytest.raises(WireError, match="error must be"):
        decode_result(long)


def test_envelope_round_trip_and_expiry():
    env = Envelope.new("run1", 4, "result", "7", b"payload", reply_to="ab" * 16, ttl_s=5)
    assert Envelope.from_json(env.to_json()) == env
    assert (env.sha256, env.size, env.chunks) == (sha256_hex(b"payload"), 7, 1)
    assert not env.expired(env.created_at + 4) and env.expired(env.created_at + 6)


@pytest.mark.parametrize("change, reason", [
    ({"schema_version": 2}, "schema_version"),
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
])
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


class _Bomb:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_bomb_rejected_without_unpickling(tmp_path):
    marker = tmp_path / "marker"
    blob = pickle.dumps(_Bomb(str(marker)))
    for decode in (decode_task, decode_result, decode_info):
        with pytest.raises(WireError) as e:
            decode(blob)
        assert e.value.reason == "bad_format"
    assert not marker.exists()


def test_pickle_bomb_inside_a_model_slot_rejected(tmp_path, weights):
    marker = tmp_path / "marker"
    blob = pickle.dumps(_Bomb(str(marker)))
    data = _container({"kind": "task", "fields": {"type": "t", "round": 0, "config": {}},
                       "models": {"global": [0, len(blob)]}}, blob)
    with pytest.raises(WireError) as e:
        decode_task(data)
    assert e.value.reason == "bad_weights"
    assert not marker.exists()


def test_malformed_containers(weights):
    good = encode_task(Task("train", 1, {}, {"global": weights}))
    cases = [
        (good[:-10], "bad_format"),  # truncated: spans exceed the body
        (good[:5], "bad_format"),
        ((2**40).to_bytes(8, "little") + good[8:], "bad_format"),  # header length past the data
        ((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{" + b" " * MAX_HEADER_BYTES, "too_large"),
        (_container({"kind": "result", "fields": {}, "models": {}}), "bad_format"),  # wrong kind
        (_container({"kind": "task", "fields": {"type": "t", "round": 0}, "models": {}}), "bad_format"),
        (_container([1, 2]), "bad_format"),
    ]
    for data, reason in cases:
        with pytest.raises(WireError) as e:
            decode_task(data)
        assert e.value.reason == reason, e.value


def test_overlapping_offsets_and_corrupt_blob(weights):
    blob = encode_task(Task("t", 0, {}, {"a": weights}))
    n = int.from_bytes(blob[:8], "little")
    body = blob[8 + n:]
    fields = {"type": "t", "round": 0, "config": {}}
    overlap = _container({"kind": "task", "fields": fields, "models": {"a": [0, len(body)], "b": [10, 5]}}, body)
    with pytest.raises(WireError) as e:
        decode_task(overlap)
    assert e.value.reason == "bad_format" and "overlaps" in str(e.value)
    corrupt = bytearray(blob)
    corrupt[8 + n + 4] ^= 0xFF  # inside the safetensors header length
    with pytest.raises(WireError) as e:
        decode_task(bytes(corrupt))
    assert e.value.reason == "bad_weights"


def encode_fields(result: Result) -> dict:
    """The JSON fields of an encoded result (its header, as the container holds it)."""
    data = encode_result(result)
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])["fields"]


def test_nan_metric_rejected():
    fields = {"client_id": "1", "round": 0, "type": "train", "num_examples": 1, "metrics": {"loss": math.nan},
              "error": None}
    data = _container({"kind": "result", "fields": fields, "models": {}})
    with pytest.raises(WireError) as e:
        decode_result(data)
    assert e.value.reason == "bad_value"
    with pytest.raises(WireError) as e:
        encode_result(Result("1", 0, "train", 1, {"loss": math.inf}))
    assert e.value.reason == "bad_value"


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
    r = Reassembler()
    done = [out for f in arrivals if (out := r.add("a", f, 20_000)) is not None]
    assert done == [payload]
    assert r.add("a", parts[0], 20_000) is None  # late duplicate of a finished message
    assert r.pending == 0 and r.duplicates == 3 and r.held_total == 0


def test_hash_mismatch_oversize_and_inconsistent_chunks():
    r = Reassembler()
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


@pytest.mark.parametrize("size, chunks, index, length, stride", [
    (10, 1, 0, 10, 10), (0, 1, 0, 0, 0), (10, 4, 0, 3, 3), (10, 4, 3, 1, 3), (10, 2, 1, 5, 5), (9, 3, 2, 3, 3),
])
def test_chunk_stride_of_every_uniform_cut(size, chunks, index, length, stride):
    assert chunk_stride(size, chunks, index, length) == stride


@pytest.mark.parametrize("size, chunks, index, length", [
    (10, 1, 0, 9),  # one chunk must hold everything
    (1_000_000, 10**6 + 1, 0, 1),  # more chunks than bytes
    (1_000_000, 10**6, 0, 0),  # empty chunks announcing a million
    (1_000_000, 10**6, 10**6 - 1, 0),  # ... the last one first
    (10, 4, 0, 2),  # chunks of 2 would make 5
    (10, 4, 3, 4),  # a last chunk longer than the others
    (10, 4, 3, 2),  # 8 bytes do not split into 3 equal chunks ... of at least 2
    (0, 2, 1, 0),
])
def test_a_chunk_no_uniform_cut_can_make_is_refused_at_once(size, chunks, index, length):
    with pytest.raises(WireError) as e:
        chunk_stride(size, chunks, index, length)
    assert e.value.reason == "bad_chunk"


def test_a_flood_of_padded_frames_is_held_to_the_senders_budget():
    payload = b"z" * 1000
    env = Envelope.new("r", 0, "register", "x", payload, chunk_size=1)  # 1000 one-byte chunks
    header = json.dumps({"envelope": env.to_dict(), "chunk": 0, "chunk_sha256": sha256_hex(b"z")}).encode()
    padded = header + b" " * (100_000 - len(header))  # legal JSON whitespace: each frame costs 100 kB
    r = Reassembler(sender_budget=1_000_000, total_budget=10_000_000)
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
    r = Reassembler(sender_budget=100_000, total_budget=20_000)
    big, small = message(os.urandom(6000), 1000, "big"), message(os.urandom(3000), 1000, "small")
    r.add("small", small[0], 3000)
    for f in big[:5]:
        r.add("big", dataclasses.replace(f, envelope=dataclasses.replace(f.envelope, msg_id=f"{f.index:032x}")), 6000)
    assert r.held_total <= 20_000 and r.evicted["big"] >= 1 and not r.evicted["small"]


def test_one_message_whose_frames_exceed_its_budget_is_refused():
    r = Reassembler(sender_budget=5_000, total_budget=100_000)
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
    header = json.loads(good[4:4 + n])
    header["chunk"] = 7  # beyond the announced count
    raw = json.dumps(header).encode()
    with pytest.raises(WireError) as e:
        unframe(len(raw).to_bytes(4, "little") + raw + good[4 + n:])
    assert e.value.reason == "bad_chunk"
    with pytest.raises(WireError) as e:
        frames(env, payload + b"x", 300)  # the envelope was made for other bytes
    assert e.value.reason == "bad_chunk"


def test_status_and_ack_bodies():
    session = "ab" * 16  # a uuid4().hex
    assert decode_status(encode_status("alive", session)) == ("alive", session)
    with pytest.raises(WireError, match="session"):
        decode_status(encode_status("alive", "x" * 100_000))  # a session id is a uuid, not a payload
    assert decode_ack(encode_ack(None)) is None
    assert decode_ack(encode_ack("too_large: no")) == "too_large: no"
    with pytest.raises(WireError):
        encode_status("sleepy", "s1")
    with pytest.raises(WireError):
        decode_status(encode_ack(None))  # an ack is not a status
