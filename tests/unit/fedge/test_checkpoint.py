"""Checkpoint trees: exact round trips, and a typed error (never a partial state) for torn, truncated,
tampered or unknown-version files (reliability notes §10 test 10)."""

import math
import os

import pytest
import torch

from fedge import checkpoint
from fedge.checkpoint import CheckpointError, load_tree, save_tree, tree_digest
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import Weights

pytestmark = pytest.mark.timeout(60)
SPEC = create("cnn1", (1, 8, 8), 10).with_origin("3")


def tree():
    torch.manual_seed(0)
    shared = torch.randn(2, 3)
    return {
        "round": 4,
        "loss": 0.1 + 0.2,
        "nan": math.nan,
        "inf": -math.inf,
        "flags": [True, False, None],
        "name": "pfedclub",
        "empty": {},
        "nested": {"a": [1, [2.5, "x"]]},
        "t": shared,
        "again": shared,
        "view": shared[:, 1],
        "half": torch.ones(3, dtype=torch.bfloat16),
        "counter": torch.tensor(7),
        "mask": torch.tensor([True, False]),
        "model": Weights(SPEC, build(SPEC).state_dict()),
    }


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Weights):
        return a.spec == b.spec and same(a.state, b.state)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def test_round_trip_is_exact(tmp_path):
    save_tree(tmp_path / "c.safetensors", tree())
    assert same(load_tree(tmp_path / "c.safetensors"), tree())


@pytest.mark.parametrize("bad", [{"k": (1, 2)}, {1: "int key"}, {"$tensor": "0"}, {"k": {1, 2}}, [object()]])
def test_unsupported_values_raise_type_error_and_write_nothing(tmp_path, bad):
    with pytest.raises(TypeError):
        save_tree(tmp_path / "c.safetensors", bad)
    assert not (tmp_path / "c.safetensors").exists()


def test_truncated_file_raises_checkpoint_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_tree(path, tree())
    blob = path.read_bytes()
    for size in (0, 5, 200, len(blob) - 1):
        path.write_bytes(blob[:size])
        with pytest.raises(CheckpointError, match="cannot be read"):
            load_tree(path)


def test_flipped_byte_fails_the_hash(tmp_path):
    path = tmp_path / "c.safetensors"
    save_tree(path, tree())
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_tree(path)


def test_unknown_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint.C, "CHECKPOINT_VERSION", 99)
    save_tree(tmp_path / "c.safetensors", {"a": 1})
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="version '99'"):
        load_tree(tmp_path / "c.safetensors")


def test_missing_file_and_foreign_safetensors_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_tree(tmp_path / "none.safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="version"):
        load_tree(tmp_path / "other.safetensors")


def test_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_tree(path, {"round": 1})

    def crash(src, dst):
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        save_tree(path, {"round": 2})
    monkeypatch.undo()
    assert load_tree(path) == {"round": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left behind


def test_digest_sees_content_not_dict_order():
    a = {"x": 1, "y": torch.zeros(2)}
    assert tree_digest(a) == tree_digest({"y": torch.zeros(2), "x": 1})
    assert tree_digest(a) != tree_digest({"x": 1.0, "y": torch.zeros(2)})  # an int is not a float
    assert tree_digest(a) != tree_digest({"x": 1, "y": torch.tensor([0.0, -0.0])})  # one bit differs
    assert tree_digest(a) != tree_digest({"x": 1, "y": torch.zeros(2, dtype=torch.float64)})
