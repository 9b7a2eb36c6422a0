"""Weights: exact key/shape/dtype/finiteness checks, safetensors only, atomic writes."""

import pickle

import pytest
import torch

from fedge.spec import build
from fedge.weights import WeightsError, check_state, from_bytes, load_model, save_model, to_bytes
from fedge.zoo import create

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


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(1), r"shape \[1\], spec says \[16\]"),          # broadcastable, still rejected
    (torch.zeros(16, dtype=torch.float64), "dtype torch.float64"),
    (torch.tensor([float("nan")] + [0.0] * 15), "NaN or Inf"),
])
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


@pytest.mark.parametrize("blob, message", [
    (b"abc", "shorter than a safetensors header"),
    ((10**9).to_bytes(8, "little") + b"{}", "exceeds the blob"),
    ((2).to_bytes(8, "little") + b"{}", "no 'fedge.spec' metadata"),
])
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
