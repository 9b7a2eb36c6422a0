"""Uploads that parse but whose tensors or counts are wrong (reliability-notes §10: 17–22).

Transport refuses what it can (`bad_weights`, `bad_format` in `fleet.inbox.rejected` and in the
acknowledgement); what passes it is checked by the coordinator (`rejection()` / `Coordinator.accepted`) before
any aggregation. Every test runs on the embedded broker and on Mosquitto.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from device_profiles import get_profile
from fedge.constants import NORM_OUTLIER_FACTOR
from fedge.model import zoo
from fedge.wire.codec import decode_result
from fedge.wire.envelope import Envelope
from fedge.wire.messages import Result, Task, Weights
from fedge.wire.payloads import Expected
from server.coordinator import rejection
from server.fleet import Fleet

from helpers.raw import (  # noqa: F401, F811 (broker, fleet and connect are pytest fixtures)
    CLIENTS,
    NUM_TRAIN,
    RawClient,
    broker,
    connect,
    container,
    coordinator,
    fleet,
    info,
    open_round,
    own,
    refused,
    result_fields,
    safetensors_blob,
    same_weights,
    state_for,
    valid_result,
)

pytestmark = pytest.mark.timeout(90)


def check(res):
    """The coordinator's verdict on a reply to client a's training task of round 1 (fedavg declares its upload)."""
    return rejection(res, Task("train", 1), info("a"), Expected(models={"local": info("a").spec}), get_profile("rpi-4"))


# ------------------------------------------------------------------------------------------------------ 17–20


def _upload(spec, tensors, cid: str = "a", rnd: int = 1) -> bytes:
    """A result whose `local` blob holds these tensors under this spec, written without any check."""
    return container("result", result_fields(cid, rnd), {"local": safetensors_blob(spec, tensors)})


def _result(state, spec=None, cid: str = "a", rnd: int = 1, num_examples=NUM_TRAIN) -> Result:
    """The same upload as an in-memory Result (what the coordinator's checks see, had transport let it pass)."""
    return Result(cid, rnd, "train", num_examples, {"train_loss": 0.5}, {"local": Weights(spec or own(cid), state)})


def _refuse_all(fleet: Fleet, client: RawClient, env: Envelope, cases: dict, reason: str) -> None:
    """Upload each case; each must be refused with `reason` and a message containing its fragment."""
    for name, (payload, fragment) in cases.items():
        error = refused(client, client.answer(env, payload))
        assert error.startswith(f"{reason}:") and fragment in error, f"{name}: {error}"
    assert dict(fleet.inbox.rejected) == {reason: len(cases)}


def _keys_cases() -> dict[str, dict]:
    state = state_for(own("a"))
    missing = {k: v for k, v in state.items() if k != "blocks.3.0.bias"}
    extra = {**state, "head.weight": torch.zeros(10, 128)}
    renamed = {("blocks.3.0.b" if k == "blocks.3.0.bias" else k): v for k, v in state.items()}
    return {"missing key": missing, "extra key": extra, "renamed key": renamed}


def test_a_wrong_key_set_or_model_variant_never_reaches_aggregation(fleet, connect, tmp_path):
    """§10.17: a missing, extra or renamed key is refused by transport (`bad_weights`) and by the coordinator
    (`weights`); tensors of another model variant pass transport and are refused by the coordinator
    (`architecture`). (fedge clients upload the whole model, so there are no personal-head keys to leak.)"""
    cases = _keys_cases()
    for name, state in cases.items():
        assert check(_result(state))[0] == "weights", name
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    _refuse_all(
        fleet,
        a,
        envs["a"],
        {name: (_upload(own("a"), state), "do not match spec") for name, state in cases.items()},
        "bad_weights",
    )

    variant = zoo.create("mobilenet_v1", (1, 28, 28), 10).with_origin("a")  # about cnn1's size: passes the size cap
    assert a.wait_ack(a.answer(envs["a"], _upload(variant, state_for(variant))).msg_id) is None
    coord = coordinator(fleet, tmp_path, ("a",))
    tasks = {"a": Task("train", 1)}
    assert coord.accepted(ex.results(), tasks) == {} and coord.rejected == {"architecture": 1}

    ex, envs = open_round(fleet, [a], 2)
    assert a.wait_ack(a.answer(envs["a"], valid_result("a", 2, own("a"))).msg_id) is None
    assert set(coord.accepted(ex.results(), {"a": Task("train", 2)})) == {"a"}


def test_broadcastable_shapes_are_refused(fleet, connect):
    """§10.18: cnn1 has no (64,) / (64, 64) tensors, so the same holes are probed on its own shapes: (1,) for a
    (16,) bias and (10, 1) for a (10, 128) weight. Both would broadcast; both are refused."""
    state = state_for(own("a"))
    cases = {
        "(1,) for (16,)": {**state, "blocks.0.0.bias": torch.zeros(1)},
        "(10, 1) for (10, 128)": {**state, "blocks.3.0.weight": torch.zeros(10, 1)},
        "(1, 128) for (10, 128)": {**state, "blocks.3.0.weight": torch.zeros(1, 128)},
    }
    for name, bad in cases.items():
        assert check(_result(bad))[0] == "weights", name
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    _refuse_all(fleet, a, envs["a"], {n: (_upload(own("a"), s), "has shape") for n, s in cases.items()}, "bad_weights")
    good = valid_result("a", 1, own("a"))
    assert a.wait_ack(a.answer(envs["a"], good).msg_id) is None
    assert same_weights(ex.results()["a"], decode_result(good))


def test_weights_of_another_dtype_are_refused_not_cast(fleet, connect):
    """§10.19, policy: every tensor must have exactly the dtype its spec gives (float32 throughout cnn1). Nothing is
    cast: float64, int8, bool — and float16, which §6 would allow on the wire — are all refused."""
    state = state_for(own("a"))
    cases = {
        str(dtype): {**state, "blocks.1.0.weight": state["blocks.1.0.weight"].to(dtype)}
        for dtype in (torch.float64, torch.int8, torch.bool, torch.float16)
    }  # (a whole float64 model: too_large)
    for name, bad in cases.items():
        assert check(_result(bad))[0] == "weights", name
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    _refuse_all(fleet, a, envs["a"], {n: (_upload(own("a"), s), "has dtype") for n, s in cases.items()}, "bad_weights")
    assert a.wait_ack(a.answer(envs["a"], valid_result("a", 1, own("a"))).msg_id) is None
    assert ex.results()["a"].models["local"].state["blocks.1.0.weight"].dtype == torch.float32


def test_a_single_non_finite_value_is_refused(fleet, connect):
    """§10.20: one NaN, +Inf or −Inf anywhere in the weights, or a NaN metric, and the upload is refused."""
    state = state_for(own("a"))

    def poisoned(value: float, name: str = "blocks.1.0.weight") -> dict:
        t = state[name].clone()
        t.view(-1)[t.numel() // 2] = value
        return {**state, name: t}

    cases = {"NaN": poisoned(math.nan), "+Inf": poisoned(math.inf, "blocks.3.0.bias"), "-Inf": poisoned(-math.inf)}
    for name, bad in cases.items():
        assert check(_result(bad))[0] == "weights", name
    a = connect("a")
    ex, envs = open_round(fleet, [a], 1)
    _refuse_all(fleet, a, envs["a"], {n: (_upload(own("a"), s), "NaN or Inf") for n, s in cases.items()}, "bad_weights")
    blob = safetensors_blob(own("a"), state)
    nan_metric = container(
        "result",
        None,
        {"local": blob},
        header=json.dumps(  # json writes the NaN token
            {
                "kind": "result",
                "fields": result_fields("a", 1, metrics={"train_loss": math.nan}),
                "models": {"local": [0, len(blob)]},
                "tensors": None,
            }
        ).encode(),
    )
    assert refused(a, a.answer(envs["a"], nan_metric)).startswith("bad_value:")
    assert a.wait_ack(a.answer(envs["a"], valid_result("a", 1, own("a"))).msg_id) is None
    assert set(ex.results()) == {"a"}


# ------------------------------------------------------------------------------------------------------ 21, 22


@pytest.mark.parametrize("outlier, reason", [(1e6, "norm_bound"), (500, "norm_outlier")])
def test_an_update_with_an_outlying_norm_is_rejected(fleet, connect, tmp_path, outlier, reason):
    """§10.21, policy: reject (no clipping). One upload 1e6 x the others' is beyond UPLOAD_NORM_FACTOR x its
    reference (here a fresh initialisation of cnn1): `norm_bound`; one 500 x the others', tiny ones, stays within
    that bound but not within NORM_OUTLIER_FACTOR x the round's median of 3: `norm_outlier`."""
    clients = [connect(cid) for cid in CLIENTS]
    ex, envs = open_round(fleet, clients, 1)
    for c in clients:
        scale = 1e-4 * (outlier if c.cid == "c" else 1.0)
        assert c.wait_ack(c.answer(envs[c.cid], valid_result(c.cid, 1, own(c.cid), scale=scale)).msg_id) is None
    results = ex.results()
    assert set(results) == set(CLIENTS) and outlier > NORM_OUTLIER_FACTOR

    coord = coordinator(fleet, tmp_path, CLIENTS)
    kept = coord.accepted(results, {cid: Task("train", 1) for cid in CLIENTS})
    assert set(kept) == {"a", "b"} and coord.rejected == {reason: 1}


def test_num_examples_abuse_is_rejected(fleet, connect, tmp_path):
    """§10.22: num_examples −5, 3.7, 1e12 written as a float, or true: refused by transport (`bad_format`); 0 and
    10**12 decode, and the coordinator refuses them (`num_examples`: an integer in 1..registered num_train, which
    caps one client's aggregation weight at its registered data size)."""
    a = connect("a")
    blob = safetensors_blob(own("a"), state_for(own("a")))

    def upload(rnd: int, n) -> bytes:
        return container("result", result_fields("a", rnd, num_examples=n), {"local": blob})

    ex, envs = open_round(fleet, [a], 1)
    for n in (-5, 3.7, 1e12, True):
        assert refused(a, a.answer(envs["a"], upload(1, n))).startswith("bad_format:"), n
    coord = coordinator(fleet, tmp_path, ("a",))
    for rnd, n in ((1, 0), (2, 10**12), (3, NUM_TRAIN + 1)):
        if rnd > 1:
            ex, envs = open_round(fleet, [a], rnd)
        assert a.wait_ack(a.answer(envs["a"], upload(rnd, n)).msg_id) is None
        assert coord.accepted(ex.results(), {"a": Task("train", rnd)}) == {}, n
    assert coord.rejected == {"num_examples": 3} and dict(fleet.inbox.rejected) == {"bad_format": 4}
    for n in (3.7, -5):
        assert check(_result(state_for(own("a")), num_examples=n))[0] == "num_examples"

    ex, envs = open_round(fleet, [a], 4)
    assert a.wait_ack(a.answer(envs["a"], upload(4, NUM_TRAIN)).msg_id) is None
    assert set(coord.accepted(ex.results(), {"a": Task("train", 4)})) == {"a"}
