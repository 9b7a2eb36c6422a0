"""fedge.wire.payloads: a reply is checked against what its task declared; reply sizes follow from the declaration."""

import dataclasses
import math

import pytest
import torch

from device_profiles import get_profile
from fedge import constants as C
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result, Weights
from fedge.wire.payloads import Expected, TensorSlot, model_bytes, payload_rejection

pytestmark = pytest.mark.timeout(60)
PROFILE = get_profile("rpi-4")
SPEC = create("cnn1", (1, 8, 8), 10)
CLIENT = ClientInfo("7", SPEC.with_origin("7"), "rpi-4", 20, 5)


def weights(spec):
    return Weights(spec, build(spec).state_dict())


def reply(**kw):
    return Result("7", 0, "t", 5, **kw)


def code(res, expected):
    verdict = payload_rejection(res, expected, CLIENT, PROFILE)
    return None if verdict is None else verdict[0]


def test_a_reply_with_exactly_what_was_declared_passes():
    expected = Expected(
        models={"local": SPEC}, tensors={"m": TensorSlot((2, 3)), "n": TensorSlot((4,), "int64")}, records=("r",)
    )
    ok = reply(
        models={"local": weights(SPEC.with_origin("7"))},
        tensors={"m": torch.ones(2, 3), "n": torch.arange(4)},
        records={"r": {"a": [1, 2.5, None, "x"]}},
    )
    assert code(ok, expected) is None


@pytest.mark.parametrize(
    "res, why",
    [
        (reply(tensors={"m": torch.ones(2, 3), "x": torch.ones(1)}), "payload"),  # undeclared tensor
        (reply(), "payload"),  # declared tensor missing
        (reply(tensors={"m": torch.ones(3, 2)}), "tensors"),  # shape
        (reply(tensors={"m": torch.ones(2, 3, dtype=torch.float64)}), "tensors"),  # dtype
        (reply(tensors={"m": torch.full((2, 3), math.nan)}), "tensors"),  # non-finite
        (reply(tensors={"m": torch.ones(2, 3)}, records={"x": 1}), "payload"),  # undeclared record
        (reply(tensors={"m": torch.ones(2, 3)}, models={"local": weights(SPEC)}), "payload"),  # undeclared model
    ],
)
def test_anything_else_is_refused_with_its_reason(res, why):
    assert code(res, Expected(tensors={"m": TensorSlot((2, 3))})) == why


def test_optional_names_may_be_absent_and_records_must_be_finite_json():
    expected = Expected(tensors={"m": TensorSlot((1,))}, records=("r",), optional=frozenset({"m", "r"}))
    assert code(reply(), expected) is None
    assert code(reply(records={"r": [1.0, math.inf]}), expected) == "records"
    assert code(reply(records={"r": {1: 2}}), expected) == "records"  # JSON object keys are strings
    deep = 0
    for _ in range(C.MAX_RECORD_DEPTH + 2):
        deep = [deep]
    assert code(reply(records={"r": deep}), expected) == "records"


def test_a_declared_architecture_is_enforced_and_any_architecture_must_fit_the_client():
    other = create("cnn2", (1, 8, 8), 10)
    assert code(reply(models={"local": weights(other)}), Expected(models={"local": SPEC})) == "architecture"
    assert code(reply(models={"local": weights(other)}), Expected(models={"local": None})) is None
    wrong_classes = create("cnn1", (1, 8, 8), 3)
    assert code(reply(models={"local": weights(wrong_classes)}), Expected(models={"local": None})) == "architecture"
    tiny = dataclasses.replace(PROFILE, max_params=SPEC.params - 1)
    verdict = payload_rejection(reply(models={"g": weights(SPEC)}), Expected(models={"g": None}), CLIENT, tiny)
    assert verdict[0] == "architecture" and "does not fit" in verdict[1]


def test_weights_that_do_not_match_their_spec_are_refused():
    state = build(SPEC).state_dict()
    state["blocks.0.0.weight"] = torch.full_like(state["blocks.0.0.weight"], math.nan)
    assert code(reply(models={"local": Weights(SPEC, state)}), Expected(models={"local": SPEC})) == "weights"


def test_reply_bytes_by_hand():
    expected = Expected(
        models={"a": SPEC, "b": None}, tensors={"m": TensorSlot((2, 3)), "n": TensorSlot((4,), "int64")}
    )
    by_hand = model_bytes(SPEC) + C.ANY_MODEL_BYTES_PER_PARAM * PROFILE.max_params + 2 * 3 * 4 + 4 * 8
    assert expected.reply_bytes(PROFILE) == by_hand + C.REPLY_SLACK_BYTES
    assert model_bytes(SPEC) == sum(t.numel() * t.element_size() for t in build(SPEC).state_dict().values())


def test_a_slot_with_an_unknown_dtype_or_negative_size_is_a_programming_error():
    with pytest.raises(ValueError, match="dtype"):
        TensorSlot((1,), "complex64")
    with pytest.raises(ValueError, match="shape"):
        TensorSlot((-1,))
