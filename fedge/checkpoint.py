"""Checkpoints: a nested JSON-able tree with tensor and Weights leaves, as one safetensors file, never pickle.

The tensors go into the safetensors body; the tree's JSON skeleton (tensors replaced by references), a
format version and a SHA-256 over skeleton and tensor bytes go into its header metadata.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

from fedge import constants as C
from fedge.files import atomic_write
from fedge.model.spec import ModelSpec, SpecError
from fedge.model.weights import WeightsError, check_state
from fedge.wire.messages import Weights

_TREE_KEY, _VERSION_KEY, _HASH_KEY = "fedge.tree", "fedge.tree.version", "fedge.tree.sha256"
# Tags of the skeleton's special leaves; a tree's own dict keys may not start with "$".
_TENSOR, _WEIGHTS, _FLOAT = "$tensor", "$weights", "$float"

Tree = Any  # dict[str, Tree] | list[Tree] | str | int | float | bool | None | torch.Tensor | Weights


class CheckpointError(WeightsError):
    """A checkpoint file is missing, truncated, corrupt or of an unknown version; the message says which."""


def _encode(value: Tree, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON skeleton of `value`; tensors are moved into `tensors` and referenced by name."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT: repr(value)}
    if isinstance(value, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = value.detach().to("cpu").contiguous().clone()  # clone: shared storage cannot be saved
        return {_TENSOR: name}
    if isinstance(value, Weights):
        return {_WEIGHTS: {"spec": value.spec.to_dict(), "state": _encode(dict(value.state), tensors)}}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str) or k.startswith("$")]
        if bad:
            raise TypeError(f"checkpoint dict keys must be strings not starting with '$', got {bad[:3]}")
        return {k: _encode(value[k], tensors) for k in sorted(value)}  # sorted: one encoding per content
    raise TypeError(
        f"cannot checkpoint a {type(value).__name__}; use dict, list, str, int, float, bool, "
        f"None, torch.Tensor or Weights"
    )


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Tree:
    """Inverse of _encode; a dangling tensor reference or a spec that does not fit its tensors raises."""
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if _FLOAT in node:
        return float(node[_FLOAT])
    if _TENSOR in node:
        return tensors[node[_TENSOR]]
    if _WEIGHTS in node:
        spec = ModelSpec.from_dict(node[_WEIGHTS]["spec"])
        state = _decode(node[_WEIGHTS]["state"], tensors)
        check_state(spec, state)
        return Weights(spec, state)
    return {k: _decode(v, tensors) for k, v in node.items()}


def _digest(skeleton: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the skeleton and every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256(skeleton.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def nonfinite(tree: Tree, where: str = "") -> list[str]:
    """Paths of the floating-point tensors in `tree` (also inside Weights) that hold a NaN or an infinity."""
    if isinstance(tree, torch.Tensor):
        return [where or "."] if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else []
    if isinstance(tree, Weights):
        return nonfinite(dict(tree.state), where)
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return [path for key, value in items for path in nonfinite(value, f"{where}/{key}")]


def _flatten(tree: Tree) -> tuple[str, dict[str, torch.Tensor]]:
    """The tree's JSON skeleton and its tensors by reference name (TypeError for what cannot be saved)."""
    tensors: dict[str, torch.Tensor] = {}
    return json.dumps(_encode(tree, tensors), sort_keys=True, allow_nan=False), tensors


def tree_digest(tree: Tree) -> str:
    """SHA-256 of a tree's content (values, tensor dtypes, shapes and bytes, Weights' specs): equal exactly
    when two trees are bitwise equal, whatever the order of their dicts. Unsupported values raise TypeError."""
    return _digest(*_flatten(tree))


def save_tree(path: str | os.PathLike[str], tree: Tree) -> None:
    """Write `tree` atomically as one safetensors file. A leaf of another type, or a dict key that is not
    a string or starts with '$', raises TypeError (a programming error) before anything is written; so does
    a tensor holding NaN or infinity (ValueError): a model that diverged is never made durable."""
    bad = nonfinite(tree)
    if bad:
        raise ValueError(f"refusing to write {path}: non-finite values in {bad[:3]}")
    skeleton, tensors = _flatten(tree)
    metadata = {_TREE_KEY: skeleton, _VERSION_KEY: str(C.CHECKPOINT_VERSION), _HASH_KEY: _digest(skeleton, tensors)}
    atomic_write(path, st_save(tensors, metadata=metadata))


def load_tree(path: str | os.PathLike[str]) -> Tree:
    """Read a file written by save_tree. A missing, truncated or corrupt file, a hash mismatch, an unknown
    version, or Weights that do not match their spec raise CheckpointError naming the file."""
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path} cannot be read (missing, truncated or not safetensors): {e}"
        ) from None
    if metadata.get(_VERSION_KEY) != str(C.CHECKPOINT_VERSION):
        raise CheckpointError(
            f"checkpoint {path} has format version {metadata.get(_VERSION_KEY)!r}; "
            f"this fedge reads version {C.CHECKPOINT_VERSION}"
        )
    skeleton = metadata.get(_TREE_KEY, "")
    if metadata.get(_HASH_KEY) != _digest(skeleton, tensors):
        raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 does not match its contents")
    try:
        return _decode(json.loads(skeleton), tensors)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, SpecError) as e:
        raise CheckpointError(f"checkpoint {path} has a malformed tree: {e}") from None
