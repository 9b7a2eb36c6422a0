"""Upload bounds by hand: norms over learned parameters only, BatchNorm statistics checked on their own, updates
clipped to a multiple of the round's median (or of the recent history) and outlying updates refused."""

import pytest
import torch

from fedge import constants as C
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import Result, Task, Weights
from server.bounds import UpdateBounds, buffer_rejection, rms, update_pairs, upload_norm, with_tensors

pytestmark = pytest.mark.timeout(60)
CNN4 = create("cnn4", (1, 28, 28), 10)


def test_the_norm_leaves_out_batchnorm_statistics():
    """Issue 28: an honest cnn4's running_var reaches ~384 after 10 epochs; it must not count."""
    state = build(CNN4).state_dict()
    trained = {k: v * 1000 if k.endswith("running_var") else v for k, v in state.items()}
    assert upload_norm(Weights(CNN4, trained)) == upload_norm(Weights(CNN4, state))
    doubled = {k: v * 2 if k.endswith("weight") else v for k, v in state.items()}
    assert upload_norm(Weights(CNN4, doubled)) > upload_norm(Weights(CNN4, state))


def test_batchnorm_statistics_are_checked_on_their_own():
    state = build(CNN4).state_dict()
    assert buffer_rejection(state, "model") is None
    assert buffer_rejection(state | {"blocks.0.1.running_var": torch.full((16,), 383.6)}, "model") is None
    for name, value in (("running_var", -1.0), ("running_var", 1e13), ("running_mean", -2e6)):
        key = f"blocks.0.1.{name}"
        bad = state | {key: torch.full_like(state[key], value)}
        assert key in buffer_rejection(bad, "model")


def pair(up: float, sent: float = 0.0, n: int = 4):
    return (torch.full((n,), up), torch.full((n,), sent))


PARAMS = {"local": frozenset({"w"})}


def test_an_update_beyond_the_clip_factor_x_the_round_median_is_scaled_to_it():
    bounds = UpdateBounds(3.0)
    pairs = {cid: {"local/w": pair(u)} for cid, u in zip("abcd", (1.0, 1.2, 0.8, 5.0))}
    refused, clipped = bounds.apply(pairs, dict.fromkeys("abcd", PARAMS))
    assert refused == {} and list(clipped) == ["d"]
    assert rms(clipped["d"]["local/w"]) == pytest.approx(3 * 1.1)  # median of 1, 1.2, 0.8, 5
    assert bounds.clipped == {"d": 1}
    assert bounds.history["local/w"] == pytest.approx([1.0, 1.2, 0.8, 3.3])


def test_an_outlying_update_is_refused_and_kept_out_of_the_history():
    bounds = UpdateBounds(3.0)
    outlier = 1.0 * C.UPDATE_OUTLIER_FACTOR * 1.5
    pairs = {cid: {"local/w": pair(u)} for cid, u in zip("abcd", (1.0, 1.0, 1.0, outlier))}
    refused, clipped = bounds.apply(pairs, dict.fromkeys("abcd", PARAMS))
    assert list(refused) == ["d"] and "RMS 15" in refused["d"] and clipped == {}
    assert bounds.history["local/w"] == [1.0, 1.0, 1.0] and bounds.history["#local"] == [1.0, 1.0, 1.0]


def test_with_fewer_than_three_updates_the_recent_history_is_the_reference_and_no_liar_grows_it():
    bounds = UpdateBounds(3.0)
    first = {"a": {"local/w": pair(9.0)}, "b": {"local/w": pair(1.0)}}
    assert bounds.apply(first, dict.fromkeys("ab", PARAMS)) == ({}, {})  # nothing to compare with yet ...
    assert bounds.history == {}  # ... and a round of two seeds no history a liar could have set
    bounds.history = {"local/w": [1.0, 1.0, 2.0], "#local": [1.0, 1.0, 2.0]}
    refused, clipped = bounds.apply({"a": {"local/w": pair(5.0)}}, {"a": PARAMS})
    assert refused == {} and rms(clipped["a"]["local/w"]) == pytest.approx(3.0)
    assert bounds.history["#local"] == [1.0, 1.0, 2.0, 1.0]  # a round without a quorum adds at most its reference
    assert bounds.history["local/w"] == [1.0, 1.0, 2.0, 1.0]
    refused, _ = bounds.apply({"a": {"local/w": pair(16.0)}}, {"a": PARAMS})
    assert "RMS 16, over 10 x the recent median 1" in refused["a"]


def test_updates_of_zero_are_neither_a_reference_nor_history():
    """FedMN's router comes back unchanged from a client that learns no routing: those zeros must not pull the
    median down and clip the clients that did learn."""
    bounds = UpdateBounds(3.0)
    pairs = {cid: {"t": pair(u)} for cid, u in zip("abcdef", (0.0, 0.0, 0.0, 1.0, 1.2, 3.5))}
    refused, clipped = bounds.apply(pairs, dict.fromkeys("abcdef", {"tensors": frozenset({"t"})}))
    assert refused == {} and clipped == {}  # 3.5 <= 3 x median(1, 1.2, 3.5) = 3.6
    assert bounds.history["t"] == pytest.approx([1.0, 1.2, 3.5])


def test_the_history_does_not_depend_on_the_order_replies_arrived_in():
    """Over MQTT replies arrive in any order; the history (and so later rounds' bounds) must be the in-process run's."""
    values = dict(zip(["10", "2", "1", "3"], (4.0, 3.0, 2.0, 1.0)))
    histories = []
    for order in (["10", "2", "1", "3"], ["1", "2", "3", "10"]):
        bounds = UpdateBounds(3.0)
        bounds.apply({cid: {"local/w": pair(values[cid])} for cid in order}, dict.fromkeys(order, PARAMS))
        histories.append(bounds.history)
    assert histories[0] == histories[1] and histories[0]["local/w"] == [2.0, 3.0, 1.0, 4.0]


def test_no_clipping_at_clip_factor_zero_but_outliers_are_still_refused():
    bounds = UpdateBounds(0.0)
    pairs = {cid: {"local/w": pair(u)} for cid, u in zip("abcd", (1.0, 1.0, 1.0, 5.0))}
    assert bounds.apply(pairs, dict.fromkeys("abcd", PARAMS)) == ({}, {})


def test_buffers_are_clipped_but_do_not_decide_an_outlier():
    """A BatchNorm running_var update (not a learned parameter) is clipped on its own and never refuses a reply."""
    bounds = UpdateBounds(3.0)
    pairs = {cid: {"local/w": pair(1.0), "local/bn.running_var": pair(v)} for cid, v in zip("abc", (1, 1, 500))}
    refused, clipped = bounds.apply(pairs, dict.fromkeys("abc", PARAMS))
    assert refused == {} and list(clipped) == ["c"] and rms(clipped["c"]["local/bn.running_var"]) == pytest.approx(3)


def test_update_pairs_and_with_tensors_follow_the_declared_roles():
    spec = create("cnn1", (1, 8, 8), 10)
    sent = build(spec).state_dict()
    up = {k: v + 1 for k, v in sent.items()}
    task = Task("train", 0, models={"global": Weights(spec, sent)}, tensors={"t": torch.zeros(3)})
    res = Result("a", 0, "train", 5, models={"local": Weights(spec, up)}, tensors={"t": torch.ones(3)})
    pairs = update_pairs(task, res, {"local": "global"}, tensor_updates=True)
    assert set(pairs) == {f"local/{k}" for k in sent} | {"t"}
    assert update_pairs(task, res, {}, tensor_updates=False) == {}
    new = with_tensors(res, {"local/blocks.0.0.bias": torch.zeros(16), "t": torch.full((3,), 2.0)})
    assert torch.equal(new.models["local"].state["blocks.0.0.bias"], torch.zeros(16))
    assert torch.equal(new.tensors["t"], torch.full((3,), 2.0)) and torch.equal(res.tensors["t"], torch.ones(3))
