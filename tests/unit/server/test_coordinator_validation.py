"""Every reply is checked before it touches server state; bad ones are rejected with a reason code."""

import pytest
import torch

from device_profiles import get_profile
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result, Task, Weights
from fedge.wire.payloads import Expected
from server.bounds import norm_outliers, upload_norm
from server.coordinator import rejection

pytestmark = pytest.mark.timeout(60)
SPEC = create("cnn1", (1, 8, 8), 10).with_origin("0")
INFO = ClientInfo("0", SPEC, "rpi-4", num_train=20, num_test=5)
TRAIN = Task("train", 3)
STATE = build(SPEC).state_dict()
UPLOAD = Expected(models={"local": SPEC})  # what a training task of a fixed-architecture strategy declares


def check(res, task, expected=UPLOAD):
    return rejection(res, task, INFO, expected, get_profile("rpi-4"))


def reply(**kw):
    base = dict(
        client_id="0",
        round=3,
        type="train",
        num_examples=20,
        metrics={"train_loss": 0.5},
        models={"local": Weights(SPEC, STATE)},
    )
    return Result(**(base | kw))


def test_a_good_reply_passes():
    assert check(reply(), TRAIN) is None


@pytest.mark.parametrize(
    "kw, task, code",
    [
        ({"round": 2}, TRAIN, "no_open_task"),  # stale round
        ({"type": "evaluate"}, TRAIN, "no_open_task"),
        ({}, None, "no_open_task"),
        ({"num_examples": 0}, TRAIN, "num_examples"),
        ({"num_examples": -5}, TRAIN, "num_examples"),
        ({"num_examples": 3.7}, TRAIN, "num_examples"),
        ({"num_examples": 10**12}, TRAIN, "num_examples"),
        ({"metrics": {"train_loss": float("nan")}}, TRAIN, "metrics"),
        ({"metrics": {"train_loss": "low"}}, TRAIN, "metrics"),
        (
            {
                "models": {
                    "local": Weights(create("cnn2", (1, 8, 8), 10), build(create("cnn2", (1, 8, 8), 10)).state_dict())
                }
            },
            TRAIN,
            "architecture",
        ),
        (
            {"models": {"local": Weights(SPEC, STATE | {"blocks.0.0.bias": torch.full((16,), float("inf"))})}},
            TRAIN,
            "weights",
        ),
        ({"type": "evaluate", "num_examples": 5, "metrics": {"loss": 0.1}}, Task("evaluate", 3), "metrics"),
        ({"models": {"local": Weights(SPEC, STATE), "extra": Weights(SPEC, STATE)}}, TRAIN, "payload"),
        ({"models": {}}, TRAIN, "payload"),  # the declared upload is missing
        ({"tensors": {"x": torch.zeros(2)}}, TRAIN, "payload"),  # a tensor nobody asked for
    ],
)
def test_bad_replies_are_rejected_with_a_reason(kw, task, code):
    assert check(reply(**kw), task)[0] == code


def upload(cid, scale):
    return Result(cid, 3, "train", 20, {}, {"local": Weights(SPEC, {k: v * scale for k, v in STATE.items()})})


def test_norm_outliers_against_the_median_of_the_round():
    three = {"0": upload("0", 1.0), "1": upload("1", 2.0), "2": upload("2", 3.0)}
    assert norm_outliers(three) == {}
    # norms 1, 2, 3, 500 x n: median 2.5 n, limit 100 x 2.5 n = 250 n
    flagged = norm_outliers(three | {"3": upload("3", 500.0)})
    norm = upload_norm(upload("3", 500.0).models["local"])
    assert list(flagged) == ["3"] and f"norm {norm:.4g}" in flagged["3"]
    assert norm_outliers({"0": upload("0", 1.0), "3": upload("3", 1e6)}) == {}  # too few uploads for a median
    assert norm_outliers(three | {"4": reply(models={})}) == {}  # a reply without a model is not counted
