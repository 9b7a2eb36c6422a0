"""fedge.wire.codec: the JSON + safetensors payload container, strict in what it decodes, never unpickling."""

import json
import math
import os
import pickle

import pytest
import torch
from safetensors.torch import save as st_save

from fedge.constants import MAX_HEADER_BYTES
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire import tensorblob
from fedge.wire.codec import (
    decode_ack,
    decode_info,
    decode_result,
    decode_status,
    decode_task,
    encode_ack,
    encode_info,
    encode_result,
    encode_status,
    encode_task,
)
from fedge.wire.envelope import WireError
from fedge.wire.messages import ClientInfo, Result, Task, Weights

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
    """A container with `header` (no named tensors unless it says so) and `body`, nothing checked."""
    raw = json.dumps({"tensors": None, **header} if isinstance(header, dict) else header).encode()
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
    assert (out.client_id, out.round, out.type, out.num_examples, out.metrics) == (
        "7",
        2,
        "train",
        120,
        {"loss": 0.5, "acc": 1.0},
    )
    _same_state(out.models["local"].state, weights.state)
    info = ClientInfo("7", weights.spec, "rpi4", 100, 20)
    assert decode_info(encode_info(info)) == info
    failed = Result("7", 2, "train", 0, error="training diverged: loss is nan")
    assert decode_result(encode_result(failed)) == failed
    long = _container({"kind": "result", "fields": {**encode_fields(failed), "error": "x" * 1001}, "models": {}})
    with pytest.raises(WireError, match="error must be"):
        decode_result(long)


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
    data = _container(
        {
            "kind": "task",
            "fields": {"type": "t", "round": 0, "config": {}, "records": {}},
            "models": {"global": [0, len(blob)]},
        },
        blob,
    )
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
    body = blob[8 + n :]
    fields = {"type": "t", "round": 0, "config": {}, "records": {}}
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
    return json.loads(data[8 : 8 + n])["fields"]


def test_nan_metric_rejected():
    fields = {
        "client_id": "1",
        "round": 0,
        "type": "train",
        "num_examples": 1,
        "metrics": {"loss": math.nan},
        "error": None,
        "records": {},
    }
    data = _container({"kind": "result", "fields": fields, "models": {}})
    with pytest.raises(WireError) as e:
        decode_result(data)
    assert e.value.reason == "bad_value"
    with pytest.raises(WireError) as e:
        encode_result(Result("1", 0, "train", 1, {"loss": math.inf}))
    assert e.value.reason == "bad_value"


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


# ------------------------------------------------------------------------------------------ tensors and records


def _tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "means.class_0": torch.randn(3, 4, generator=g),
        "counts": torch.arange(5, dtype=torch.int64),
        "scale": torch.tensor(2.5),
        "half": torch.randn(3, generator=g).half(),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "route": torch.randn(8, generator=g)[::2],
    }  # a strided view is sent contiguous


def test_tensors_sharing_memory_travel_each_with_their_own_values():
    x = torch.arange(6.0)
    out = decode_task(encode_task(Task("t", 0, tensors={"all": x, "head": x[:2], "tail": x[4:]}))).tensors
    assert out["all"].tolist() == list(range(6)) and out["head"].tolist() == [0, 1] and out["tail"].tolist() == [4, 5]
    again = decode_task(encode_task(Task("t", 0, tensors=out))).tensors  # decoded tensors share one buffer
    _same_tensors(again, out)


RECORDS = {"order": [3, 1, 2], "name": "x", "nested": {"p": 0.25, "ok": True, "none": None}, "n": 7}


def _same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_task_and_result_carry_named_tensors_and_records(weights):
    task = Task("route", 2, {"lr": 0.1}, {"global": weights}, _tensors(), RECORDS)
    out = decode_task(encode_task(task))
    _same_tensors(out.tensors, task.tensors)
    assert out.records == RECORDS and list(out.models) == ["global"]
    _same_state(out.models["global"].state, weights.state)
    result = Result("4", 2, "route", 10, {"loss": 0.1}, {}, None, _tensors(), RECORDS)
    back = decode_result(encode_result(result))
    _same_tensors(back.tensors, result.tensors)
    assert back.records == RECORDS and back.models == {}
    plain = decode_task(encode_task(Task("train", 0)))
    assert (plain.tensors, plain.records) == ({}, {})


def test_decoded_tensors_are_aligned_views_of_a_writable_payload_or_copies_and_never_both(weights):
    payload = encode_result(Result("4", 2, "train", 10, {}, {"local": weights}, None, _tensors(), {}))
    buf = bytearray(payload)
    lo = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    hi = lo + len(buf)
    out = decode_result(buf)
    decoded = [t for t in (*out.tensors.values(), *out.models["local"].state.values()) if t.numel()]
    # every tensor aligned as torch aligns fresh memory (kernels round differently at other alignments, and a
    # received tensor must compute as the sender's did); a blob's tensors all view the payload or are all copied
    # (a view keeps the whole payload alive, so a mix would hold both)
    assert all(t.data_ptr() % tensorblob.ALIGNMENT == 0 for t in decoded)
    assert all(not lo <= t.data_ptr() < hi for t in decoded) or all(lo <= t.data_ptr() < hi for t in decoded)
    out = decode_result(payload)  # bytes are immutable: the tensors get their own writable memory
    out.tensors["means.class_0"].add_(1.0)
    assert decode_result(payload).tensors["means.class_0"].equal(_tensors()["means.class_0"])


def test_an_unaligned_body_still_decodes(weights):
    payload = encode_task(Task("t", 0, {}, {"g": weights}, _tensors()))
    n = int.from_bytes(payload[:8], "little")
    header = payload[8 : 8 + n].rstrip(b" ")
    header += b" " * (1 + len(header) % 2)  # the body now starts at an odd offset
    moved = len(header).to_bytes(8, "little") + header + payload[8 + n :]
    assert (8 + len(header)) % 2
    out = decode_task(moved)
    _same_tensors(out.tensors, _tensors())
    _same_state(out.models["g"].state, weights.state)


@pytest.mark.parametrize(
    "tensors, records, reason, says",
    [
        ({"x": torch.tensor([1.0, math.nan])}, {}, "bad_value", "'x' contains NaN or Inf"),
        ({"x": torch.tensor([math.inf])}, {}, "bad_value", "'x' contains NaN or Inf"),
        ({"": torch.zeros(1)}, {}, "bad_format", "tensor name must be a non-empty string"),
        ({"x": [1.0]}, {}, "bad_format", "must be a torch.Tensor"),
        ({"x": torch.zeros(2, dtype=torch.complex64)}, {}, "bad_format", "must be a torch.Tensor of one of"),
        ([torch.zeros(1)], {}, "bad_format", "named tensors must be a dict"),
        ({}, {"a": [1.0, math.nan]}, "bad_value", "task records.a[1] contains a non-finite number"),
        ({}, {"": 1}, "bad_format", "keyed by non-empty strings"),
        ({}, {"a": object()}, "bad_value", "not JSON"),
        ({}, [1], "bad_format", "records must be a JSON object"),
    ],
)
def test_bad_tensors_and_records_are_refused_when_encoding(tensors, records, reason, says):
    with pytest.raises(WireError) as e:
        encode_task(Task("t", 0, {}, {}, tensors, records))
    assert e.value.reason == reason and says in str(e.value), e.value


def _task_with(
    tensor_blob: bytes | None = None, span=None, records=None, fields=None, models=None, body: bytes = b""
) -> bytes:
    """A task container holding `tensor_blob` as its named tensors (span computed unless given)."""
    if tensor_blob is not None:
        span, body = (span or [len(body), len(tensor_blob)]), body + tensor_blob
    f = fields or {"type": "t", "round": 0, "config": {}, "records": {} if records is None else records}
    return _container({"kind": "task", "fields": f, "models": models or {}, "tensors": span}, body)


def _edited_blob(edit) -> bytes:
    blob = st_save({"a": torch.ones(2, 2), "b": torch.zeros(3, dtype=torch.int64)})
    n = int.from_bytes(blob[:8], "little")
    h = json.loads(blob[8 : 8 + n])
    data = edit(h, blob[8 + n :])
    raw = json.dumps(h).encode()
    return len(raw).to_bytes(8, "little") + raw + (data if data is not None else blob[8 + n :])


@pytest.mark.parametrize(
    "payload, reason, says",
    [
        (_task_with(st_save({"x": torch.tensor([1.0, math.nan])})), "bad_value", "'x' contains NaN or Inf"),
        (_task_with(st_save({"x": torch.tensor([-math.inf])})), "bad_value", "'x' contains NaN or Inf"),
        (_task_with(records={"a": {"b": math.nan}}), "bad_value", "non-finite"),
        (_task_with(records={"": 1}), "bad_format", "keyed by non-empty strings"),
        (_task_with(records=[1]), "bad_format", "records must be a JSON object"),
        (_task_with(fields={"type": "t", "round": 0, "config": {}}), "bad_format", "missing fields ['records']"),
        (
            _task_with(fields={"type": "t", "round": 0, "config": {}, "records": {}, "x": 1}),
            "bad_format",
            "unknown fields ['x']",
        ),
        (
            _container({"kind": "task", "fields": {}, "models": {}, "tensors": None, "more": 1}),
            "bad_format",
            "unknown fields ['more']",
        ),
        (_task_with(st_save({"x": torch.ones(1)}), span=[0, 10**6]), "bad_format", "lies outside"),
        (_task_with(st_save({"x": torch.ones(1)}), span="0"), "bad_format", "span must be [offset, length]"),
        (_task_with(st_save({"x": torch.ones(1)}), span=[0, True]), "bad_format", "span must be [offset, length]"),
        (_task_with(st_save({"x": torch.ones(1)})[:-1]), "bad_format", "tensors blob"),
        (_task_with(st_save({"x": torch.ones(1)}, metadata={"k": "v"})), "bad_format", "carries metadata"),
        (_task_with(_edited_blob(lambda h, d: h["a"].update(dtype="F8"))), "bad_format", "dtype 'F8' is not one of"),
        (_task_with(_edited_blob(lambda h, d: h["a"].update(shape=[2, 3]))), "bad_format", "needs 24 bytes"),
        (_task_with(_edited_blob(lambda h, d: h["a"].update(shape=[2, -2]))), "bad_format", "integers >= 0"),
        (_task_with(_edited_blob(lambda h, d: h["a"].update(data_offsets=[0, 16]))), "bad_format", "invalid offset"),
        (_task_with(_edited_blob(lambda h, d: d + b"\0" * 4)), "bad_format", "file not fully covered"),
        (_task_with(_edited_blob(lambda h, d: h["a"].update(extra=1))), "bad_format", "exactly"),
        (_task_with(_edited_blob(lambda h, d: h.update(__metadata__={"k": 1}))), "bad_format", "strings to strings"),
        (
            _task_with(
                _edited_blob(
                    lambda h, d: (h.update(c={"dtype": "BOOL", "shape": [1], "data_offsets": [40, 41]}), d + b"\x02")[1]
                )
            ),
            "bad_format",
            "bytes other than 0 and 1",
        ),
        (_task_with(pickle.dumps({"x": 1})), "bad_format", "tensors blob"),
    ],
)
def test_bad_tensors_and_records_are_refused_when_decoding(payload, reason, says):
    with pytest.raises(WireError) as e:
        decode_task(payload)
    assert e.value.reason == reason and says in str(e.value), e.value


def test_the_tensors_blob_may_not_overlap_a_model_and_control_payloads_carry_none(weights):
    good = encode_task(Task("t", 0, {}, {"g": weights}))
    n = int.from_bytes(good[:8], "little")
    header, body = json.loads(good[8 : 8 + n]), good[8 + n :]
    with pytest.raises(WireError) as e:
        decode_task(_container({**header, "tensors": [0, 8]}, body))
    assert e.value.reason == "bad_format" and "overlaps" in str(e.value)
    blob = st_save({"x": torch.ones(1)})
    for kind, fields in (("ack", {"ok": True, "error": None}), ("status", {"state": "alive", "session": "ab" * 16})):
        with pytest.raises(WireError) as e:
            (decode_ack if kind == "ack" else decode_status)(
                _container({"kind": kind, "fields": fields, "models": {}, "tensors": [0, len(blob)]}, blob)
            )
        assert e.value.reason == "bad_format" and "carries no models or tensors" in str(e.value)
