"""Payloads that are not what they claim: pickles, malformed containers and safetensors, fuzzing
(reliability-notes §10: 15, 16).

Over a real broker (both kinds) a raw client uploads each case as a correctly framed and hashed result;
the server must refuse it with its reason and keep serving. The fuzz loop and the hostile-blob cases call
fedge.wire.codec and fedge.brokers.mqtt.Inbox directly: nothing but WireError may come out of them.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import random
from collections import Counter

import pytest
import torch

from device_profiles import get_profile
from fedge.brokers.mqtt import Inbox
from fedge.constants import MAX_HEADER_BYTES, REPLY_SLACK_BYTES, SPEC_METADATA_KEY
from fedge.model.weights import check_state
from fedge.wire.chunks import frames
from fedge.wire.codec import decode_result
from fedge.wire.envelope import Envelope, WireError
from fedge.wire.messages import Result, Task
from fedge.wire.payloads import Expected
from server.coordinator import rejection

from helpers.raw import (  # noqa: F401, F811 (broker, fleet and connect are pytest fixtures)
    NUM_TEST,
    NUM_TRAIN,
    ONE_FRAME,
    PROFILE,
    RUN,
    SPEC,
    broker,
    connect,
    container,
    fleet,
    info,
    join_blob,
    open_round,
    own,
    refused,
    rejected_only,
    result_fields,
    safetensors_blob,
    same_weights,
    split_blob,
    split_container,
    state_for,
    tensor_bytes,
    valid_result,
)

pytestmark = pytest.mark.timeout(90)


# ------------------------------------------------------------------------------------------------------ 15


class _Bomb:
    """Unpickling this opens `path` for writing, i.e. creates it: a stand-in for any code an attacker picks."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _bombs(path) -> tuple[bytes, bytes]:
    """The bomb as a plain pickle and as a torch.save archive of a would-be state dict."""
    buf = io.BytesIO()
    torch.save({"blocks.0.0.weight": _Bomb(path)}, buf)
    return pickle.dumps(_Bomb(path)), buf.getvalue()


def test_the_bombs_are_live(tmp_path):
    """The premise of the pickle test: these bytes, unpickled, do create their marker file."""
    pickle.loads(_bombs(tmp_path / "by-pickle")[0])
    torch.load(io.BytesIO(_bombs(tmp_path / "by-torch")[1]), weights_only=False)
    assert (tmp_path / "by-pickle").exists() and (tmp_path / "by-torch").exists()


def test_a_pickle_upload_is_refused_and_never_run(fleet, connect, tmp_path):
    """§10.15: pickle and torch.save blobs are refused, `bad_format` (in the model slot: `bad_weights`), never run."""
    marker = tmp_path / "pwned"
    pick, archive = _bombs(marker)
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)

    a.publish(a.topic("result"), pick)  # the MQTT message itself: not even a frame
    a.publish(a.topic("result"), archive)
    rejected_only(fleet, bad_format=2)
    for payload in (pick, archive):  # correctly framed and hashed; the payload is the bomb
        assert refused(a, a.answer(envs["a"], payload)).startswith("bad_format:")
    blob_slot = container("result", result_fields("a", 1), {"local": archive})  # the bomb where safetensors go
    assert refused(a, a.answer(envs["a"], blob_slot)).startswith("bad_weights:")

    good = valid_result("a", 1, own("a"))
    assert a.wait_ack(a.answer(envs["a"], good).msg_id) is None
    assert same_weights(ex.results()["a"], decode_result(good))
    assert dict(fleet.inbox.rejected) == {"bad_format": 4, "bad_weights": 1}
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------------ 16


def _blob_edited(good: bytes, edit) -> bytes:
    """`good` with its safetensors header changed by `edit(header)` (the data bytes unchanged)."""
    header, body = split_container(good)
    blob_header, data = split_blob(body)
    edit(blob_header)
    return container("result", header["fields"], {"local": join_blob(blob_header, data)})


def _overlap(h: dict) -> None:
    """The second tensor's bytes start where the first one's do."""
    (_, t1), (_, t2) = sorted(
        ((k, v) for k, v in h.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
    )[:2]
    t2["data_offsets"] = [t1["data_offsets"][0], t1["data_offsets"][0] + t2["data_offsets"][1] - t2["data_offsets"][0]]


def _beyond(h: dict) -> None:
    """The last tensor grows by one row, its shape and offsets consistent, its end past the data."""
    last = max((v for k, v in h.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][1])
    row = math.prod(last["shape"][1:]) * 4
    last["shape"] = [last["shape"][0] + 1, *last["shape"][1:]]
    last["data_offsets"] = [last["data_offsets"][0], last["data_offsets"][1] + row]


def _malformed(good: bytes) -> dict[str, tuple[bytes, str, str]]:
    """Case → (payload, reason code, what the refusal says); the container first, then the safetensors inside."""
    header, body = split_container(good)
    fields, n = header["fields"], int.from_bytes(good[:8], "little")
    return {
        "truncated length field": (good[:5], "bad_format", "too short for a header"),
        "truncated header": (
            (n // 2).to_bytes(8, "little") + good[8 : 8 + n // 2] + body,
            "bad_format",
            "header is not UTF-8 JSON",
        ),
        "header length > payload": (len(good).to_bytes(8, "little") + good[8:], "bad_format", "exceeds the payload"),
        "overlapping spans": (
            container(
                "result", fields, {"local": body}, index={"local": [0, len(body)], "teacher": [len(body) - 8, 8]}
            ),
            "bad_format",
            "overlaps the previous model",
        ),
        "out-of-range span": (
            container("result", fields, {"local": body}, index={"local": [0, len(body) + 8]}),
            "bad_format",
            "lies outside",
        ),
        "header above the cap": (
            (MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{" + b" " * MAX_HEADER_BYTES,
            "too_large",
            f"exceeds {MAX_HEADER_BYTES}",
        ),
        "safetensors truncated header": (
            container("result", fields, {"local": body[:6]}),
            "bad_weights",
            "shorter than a safetensors header",
        ),
        "safetensors header length > blob": (
            container("result", fields, {"local": len(body).to_bytes(8, "little") + body[8:]}),
            "bad_weights",
            "exceeds the blob",
        ),
        "safetensors overlapping offsets": (_blob_edited(good, _overlap), "bad_weights", "invalid offset for tensor"),
        "safetensors out-of-range offsets": (_blob_edited(good, _beyond), "bad_weights", "file not fully covered"),
    }


def test_malformed_payloads_each_get_their_own_reason(fleet, connect):
    """§10.16: each malformation is refused with its reason code and a message naming the defect.

    Several share the code `bad_format` (container) or `bad_weights` (the safetensors inside): the
    codes come from fedge.wire.envelope.REASONS, the refusal's text tells the cases apart.
    """
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    good = valid_result("a", 1, own("a"))
    cases = _malformed(good)
    said = {}
    for name, (payload, reason, fragment) in cases.items():
        said[name] = refused(a, a.answer(envs["a"], payload))
        assert said[name].startswith(f"{reason}:") and fragment in said[name], f"{name}: {said[name]}"
    assert a.wait_ack(a.answer(envs["a"], good).msg_id) is None  # the server still serves
    assert same_weights(ex.results()["a"], decode_result(good))
    assert fleet.inbox.rejected == Counter(reason for _, reason, _ in cases.values())
    for name, (_, _, fragment) in cases.items():  # each description fits its own case only
        assert [other for other, text in said.items() if fragment in text] == [name]


def test_a_header_over_the_cap_is_refused_before_parsing():
    """The container's header cap holds for any header, however the payload is delivered."""
    payload = (MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"[" * (MAX_HEADER_BYTES + 1)  # would recurse if parsed
    with pytest.raises(WireError) as e:
        decode_result(payload)
    assert e.value.reason == "too_large"


JUNK = [
    None,
    True,
    False,
    -1,
    0,
    1,
    3.7,
    2**31,
    2**64,
    -(2**63),
    1e308,
    "",
    "x",
    "F64",
    "BOOL",
    [],
    {},
    [1, 2],
    [-1, 10**12],
    {"a": 1},
    ["x"],
    "[" * 50,
    json.loads("[" * 200 + "]" * 200),
]


def _leaves(x, path=()):
    """Every path into a JSON value (objects and lists included), for structure-aware mutation."""
    yield path
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, (*path, i))


def _edit(rng: random.Random, value):
    """A copy of a JSON value with one node replaced by junk or deleted."""
    value = json.loads(json.dumps(value))
    path = rng.choice(list(_leaves(value))[1:])
    parent = value
    for p in path[:-1]:
        parent = parent[p]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(JUNK)
    return value


def _mutate(rng: random.Random, good: bytes) -> tuple[str, bytes]:
    """One random mutation of a valid result payload: bytes, length fields, or one JSON node of the container
    header, the safetensors header, or the model spec in its metadata."""
    header, body = split_container(good)
    blob_header, data = split_blob(body)
    front = len(good) - len(data)  # container header + safetensors header: where parsing happens
    kind = rng.choice(
        [
            "flip",
            "overwrite",
            "truncate",
            "insert",
            "delete",
            "length",
            "blob_length",
            "container_json",
            "safetensors_json",
            "spec_json",
        ]
    )
    b = bytearray(good)
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(front + 64)
            b[i] ^= 1 << rng.randrange(8)
    elif kind == "overwrite":
        i = rng.randrange(front)
        b[i : i + rng.randint(1, 16)] = rng.randbytes(rng.randint(1, 16))
    elif kind == "truncate":
        del b[rng.randrange(len(b)) :]
    elif kind == "insert":
        i = rng.randrange(front)
        b[i:i] = rng.randbytes(rng.randint(1, 64))
    elif kind == "delete":
        i = rng.randrange(front)
        del b[i : i + rng.randint(1, 64)]
    elif kind == "length":
        n = int.from_bytes(good[:8], "little")
        b[:8] = rng.choice([n + rng.randint(-64, 64), rng.randrange(2**64)]).to_bytes(8, "little")
    elif kind == "blob_length":
        at = len(good) - len(body)
        b[at : at + 8] = rng.choice(
            [rng.randrange(2**64), int.from_bytes(body[:8], "little") + rng.randint(-64, 64)]
        ).to_bytes(8, "little")
    elif kind == "container_json":
        h = _edit(rng, header)
        return kind, container("result", None, {"local": body}, header=json.dumps(h).encode())
    elif kind == "safetensors_json":
        h = json.loads(json.dumps(blob_header))
        h = {k: (_edit(rng, v) if k != "__metadata__" and rng.random() < 0.3 else v) for k, v in h.items()}
        if rng.random() < 0.3:
            h = _edit(rng, h)
        return kind, container("result", header["fields"], {"local": join_blob(h, data)})
    else:
        meta = dict(blob_header["__metadata__"])
        meta[SPEC_METADATA_KEY] = json.dumps(_edit(rng, json.loads(meta[SPEC_METADATA_KEY])))
        return kind, container(
            "result", header["fields"], {"local": join_blob({**blob_header, "__metadata__": meta}, data)}
        )
    return kind, bytes(b)


def _mutate_frame(rng: random.Random, frame: bytes) -> tuple[str, bytes]:
    """One random mutation of a transport frame: its bytes, its length field, or one node of its JSON header."""
    n = int.from_bytes(frame[:4], "little")
    kind = rng.choice(["flip", "truncate", "insert", "length", "json", "json"])
    b = bytearray(frame)
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(4 + n + 64)
            b[i] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del b[rng.randrange(len(b)) :]
    elif kind == "insert":
        i = rng.randrange(4 + n)
        b[i:i] = rng.randbytes(rng.randint(1, 32))
    elif kind == "length":
        b[:4] = rng.choice([n + rng.randint(-16, 16), rng.randrange(2**32)]).to_bytes(4, "little")
    else:
        header = _edit(rng, json.loads(frame[4 : 4 + n]))
        raw = json.dumps(header).encode()
        return kind, len(raw).to_bytes(4, "little") + raw + frame[4 + n :]
    return kind, bytes(b)


def _on_spec(res: Result) -> bool:
    """What an accepted reply must be: one `local` model of exactly the registered spec and its tensors."""
    if set(res.models) != {"local"} or res.models["local"].spec.with_origin("a") != own("a"):
        return False
    check_state(own("a"), res.models["local"].state)
    return True


def test_fuzzed_payloads_never_crash_and_never_pass_off_spec():
    """§10.16 fuzz (seeded, 300 mutations each): decode_result and Inbox.check raise nothing but WireError, and
    nothing that gets past them and the coordinator's checks differs from the registered spec."""
    rng = random.Random(20240611)
    good = valid_result("a", 1, own("a"))
    task = Task("train", 1)
    crashes, outcome = [], Counter()
    for i in range(300):
        kind, bad = _mutate(rng, good)
        try:
            res = decode_result(bad)
        except WireError as e:
            outcome[e.reason] += 1
            continue
        except Exception as e:  # noqa: BLE001 (what this test hunts for)
            crashes.append(f"decode #{i} ({kind}): {type(e).__name__}: {e}"[:300])
            continue
        verdict = rejection(res, task, info("a"), Expected(models={"local": info("a").spec}), get_profile("rpi-4"))
        outcome[verdict[0] if verdict else "accepted"] += 1
        if verdict is None and not _on_spec(res):
            crashes.append(f"decode #{i} ({kind}): accepted off-spec models {sorted(res.models)}")

    env = Envelope.new(RUN, 1, "result", "a", good, reply_to="1" * 32, chunk_size=ONE_FRAME)
    [frame] = frames(env, good, ONE_FRAME)
    limit = tensor_bytes(own("a")) + REPLY_SLACK_BYTES
    for i in range(300):
        inbox = Inbox(RUN, lambda kind, client, env: limit)
        kind, bad = _mutate_frame(rng, frame)
        try:
            delivery = inbox.check(f"fedge/{RUN}/result/a", bad)
        except WireError as e:
            outcome[f"frame:{e.reason}"] += 1
            continue
        except Exception as e:  # noqa: BLE001
            crashes.append(f"frame #{i} ({kind}): {type(e).__name__}: {e}"[:300])
            continue
        outcome["frame:delivered"] += 1
        if delivery is not None and bytes(delivery.payload) != good:
            crashes.append(f"frame #{i} ({kind}): delivered {len(delivery.payload)} bytes that are not the upload")
    assert not crashes, "\n".join(crashes)
    payload_reasons = {k for k in outcome if not k.startswith("frame:")} - {"accepted"}
    frame_reasons = {k for k in outcome if k.startswith("frame:")} - {"frame:delivered"}
    assert outcome["accepted"] < 30 and len(payload_reasons) >= 3 and len(frame_reasons) >= 3, outcome  # it bites


def _spec_edit(edit) -> str:
    d = own("a").to_dict()
    edit(d)
    return json.dumps(d)


def _layer_args(block: int, layer: int, **args):
    return lambda d: d["blocks"][block]["layers"][layer]["args"].update(args)


HOSTILE_SPECS = {  # each one escaped decode_result as a non-WireError before the codec caught every parser failure
    "conv stride 0": _layer_args(0, 0, stride=0),  # ZeroDivisionError in the shape arithmetic
    "dropout p = -1": _layer_args(2, 3, p=-1),  # ValueError from torch when the layer is built
    "dropout p a string": _layer_args(2, 3, p="x"),  # TypeError from torch
    "conv kernel_size 3.7": _layer_args(0, 0, kernel_size=3.7),  # TypeError from torch when the layer is built
    "maxpool kernel_size 0": _layer_args(0, 2, kernel_size=0),  # ZeroDivisionError
}


@pytest.mark.parametrize(
    "case", ["spec metadata not a string", "metadata a list", "deeply nested header", *HOSTILE_SPECS]
)
def test_hostile_blobs_are_refused_as_bad_weights(case):
    """Regression cases the fuzz loop found: a hostile blob header or spec is `bad_weights`, never a crash."""
    header, data = split_blob(safetensors_blob(own("a"), state_for(own("a"))))
    if case == "spec metadata not a string":
        blob = join_blob({**header, "__metadata__": {SPEC_METADATA_KEY: 5}}, data)
    elif case == "metadata a list":
        blob = join_blob({**header, "__metadata__": [SPEC_METADATA_KEY]}, data)
    elif case == "deeply nested header":
        raw = b"[" * 100_000 + b"]" * 100_000
        blob = len(raw).to_bytes(8, "little") + raw + data
    else:
        blob = join_blob({**header, "__metadata__": {SPEC_METADATA_KEY: _spec_edit(HOSTILE_SPECS[case])}}, data)
    with pytest.raises(WireError) as e:
        decode_result(container("result", result_fields("a", 1), {"local": blob}))
    assert e.value.reason == "bad_weights"


def test_a_registration_whose_spec_cannot_be_built_is_refused(fleet, connect):
    """A registration passing shape validation but whose layers cannot be built is `bad_spec`, acknowledged as such,
    and the client is not registered; a valid registration afterwards is."""
    b = connect("b", register=False)
    spec = json.loads(_spec_edit(_layer_args(2, 3, p=-1)))
    payload = container(
        "info", {"client_id": "b", "spec": spec, "profile": PROFILE, "num_train": NUM_TRAIN, "num_test": NUM_TEST}
    )
    assert refused(b, b.send("register", "register", 0, payload)).startswith("bad_spec:")
    assert "b" not in fleet.clients and dict(fleet.inbox.rejected) == {"bad_spec": 1}
    assert b.register(SPEC) is None and "b" in fleet.clients
