"""Weights: exact key/shape/dtype/finiteness checks, safetensors only, atomic writes."""

import math
import pickle

import pytest
import torch

from fedge.model.spec import build
from fedge.model.weights import WeightsError, all_finite, check_state, from_bytes, load_model, save_model, to_bytes
from fedge.model.zoo import create

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def model():
    spec = create("cnn1", (1, 28, 28), 10)
    return spec, build(spec).state_dict()


def test_missing_and_extra_keys(model):
    spec, state = model
    state = dict(state)
    state.pop("blocks.0.0.weight")
    state["intruder"] = torch.zeros(1)
    with pytest.raises(WeightsError, match=r"missing \['blocks.0.0.weight'\], unexpected \['intruder'\]"):
        check_state(spec, state)


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.zeros(1), r"shape \[1\], spec says \[16\]"),  # broadcastable, still rejected
        (torch.zeros(16, dtype=torch.float64), "dtype torch.float64"),
        (torch.tensor([float("nan")] + [0.0] * 15), "NaN or Inf"),
    ],
)
def test_bad_tensor(model, bad, message):
    spec, state = model
    state = dict(state) | {"blocks.0.0.bias": bad}
    with pytest.raises(WeightsError, match=message):
        check_state(spec, state)


def test_pickle_is_never_accepted(model, tmp_path):
    marker = tmp_path / "pwned"

    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(WeightsError):
        from_bytes(pickle.dumps(Bomb()))
    assert not marker.exists()


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"abc", "shorter than a safetensors header"),
        ((10**9).to_bytes(8, "little") + b"{}", "exceeds the blob"),
        ((2).to_bytes(8, "little") + b"{}", "no 'fedge.spec' metadata"),
    ],
)
def test_malformed_blobs(blob, message):
    with pytest.raises(WeightsError, match=message):
        from_bytes(blob)


def test_truncated_payload_is_rejected(model):
    spec, state = model
    blob = to_bytes(spec, state)
    with pytest.raises(WeightsError):
        from_bytes(blob[:-100])


def test_atomic_save_leaves_no_temp_files(model, tmp_path):
    spec, state = model
    path = tmp_path / "sub" / "m.safetensors"
    save_model(path, spec, state)
    save_model(path, spec, state)
    assert [p.name for p in path.parent.iterdir()] == ["m.safetensors"]
    assert load_model(path)[0] == spec
    with pytest.raises(WeightsError, match="cannot read weights file"):
        load_model(tmp_path / "absent.safetensors")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_finds_one_bad_value_and_survives_an_overflowing_sum(dtype):
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.zeros(3, 400, dtype=dtype)
        t[1, 123] = bad
        assert not all_finite(t) and not all_finite(t.t()) and not all_finite(t[:, 100:200])
    huge = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)  # finite values whose sum overflows
    assert all_finite(huge) and all_finite(-huge) and all_finite(torch.zeros(0, dtype=dtype))
    assert all_finite(torch.ones(5, dtype=dtype, requires_grad=True))
