"""What a reply to a task may carry, as its strategy declares it, and the check of a reply against that
declaration: models by role (of a fixed or any architecture), named tensors (shape, dtype, finite values) and JSON
records. The coordinator runs the check before `aggregate` sees a reply; the transport sizes a reply by it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from device_profiles import DeviceProfile, fits
from fedge import constants as C
from fedge.model.spec import ModelSpec, tensor_shapes
from fedge.model.weights import WeightsError, check_state
from fedge.wire.messages import ClientInfo, Result

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


@dataclass(frozen=True)
class TensorSlot:
    """A named tensor a reply carries: its exact shape and dtype (a name from DTYPES)."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.shape):
            raise ValueError(f"tensor shape {self.shape} must be non-negative integers")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Expected:
    """What a reply to one task may carry. `models`: role -> the architecture it must have (compared without the
    blocks' origins), or None for any architecture with the client's input shape and classes that fits its device
    profile (a model that grows); `tensors`: name -> slot; `records`: names of JSON records; `optional`: names
    (of any kind) that may be absent. Anything not declared is refused."""

    models: Mapping[str, ModelSpec | None] = field(default_factory=dict)
    tensors: Mapping[str, TensorSlot] = field(default_factory=dict)
    records: tuple[str, ...] = ()
    optional: frozenset[str] = frozenset()

    def reply_bytes(self, profile: DeviceProfile) -> int:
        """The largest reply payload this allows: the tensor bytes of every declared model (for any architecture,
        ANY_MODEL_BYTES_PER_PARAM bytes per parameter the profile allows) and tensor, plus REPLY_SLACK_BYTES for
        headers, specs and records."""
        models = sum(
            C.ANY_MODEL_BYTES_PER_PARAM * profile.max_params if spec is None else model_bytes(spec)
            for spec in self.models.values()
        )
        return models + sum(slot.nbytes for slot in self.tensors.values()) + C.REPLY_SLACK_BYTES


def model_bytes(spec: ModelSpec) -> int:
    """Bytes of every tensor in a model of this architecture (parameters and buffers)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in tensor_shapes(spec).values())


def _missing_or_extra(kind: str, have: set[str], declared: set[str], optional: frozenset[str]) -> str | None:
    extra, missing = sorted(have - declared), sorted(declared - have - optional)
    if extra:
        return f"{kind} {extra} that the task does not expect (expected: {sorted(declared) or 'none'})"
    if missing:
        return f"no {kind} {missing}, which the task expects"
    return None


def payload_rejection(
    res: Result, expected: Expected, client: ClientInfo, profile: DeviceProfile
) -> tuple[str, str] | None:
    """(reason code, message) when a reply's models, tensors or records differ from `expected`, else None.

    Codes: "payload" (a name not declared, or a declared one missing), "architecture" (a model of another
    architecture than declared, or one that does not fit the client's data or device profile), "weights" (tensors
    that do not match their model's spec, or non-finite), "tensors" (a named tensor of another shape or dtype, or
    with non-finite values), "records" (a record that is not finite JSON)."""
    for kind, have, declared in (
        ("models", res.models, expected.models),
        ("tensors", res.tensors, expected.tensors),
        ("records", res.records, expected.records),
    ):
        problem = _missing_or_extra(kind, set(have), set(declared), expected.optional)
        if problem:
            return "payload", problem
    for role, weights in res.models.items():
        problem = _architecture_problem(weights.spec, expected.models[role], client, profile)
        if problem:
            return "architecture", f"model {role!r}: {problem}"
        try:
            check_state(weights.spec, weights.state)
        except WeightsError as e:
            return "weights", f"model {role!r}: {e}"
    for name, tensor in res.tensors.items():
        slot = expected.tensors[name]
        if (
            not isinstance(tensor, torch.Tensor)
            or tuple(tensor.shape) != slot.shape
            or tensor.dtype != DTYPES[slot.dtype]
        ):
            got = (tuple(tensor.shape), str(tensor.dtype)) if isinstance(tensor, torch.Tensor) else type(tensor)
            return "tensors", f"tensor {name!r} is {got}, expected {slot.shape} of {slot.dtype}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return "tensors", f"tensor {name!r} has non-finite values"
    for name, value in res.records.items():
        if not _finite_json(value):
            return "records", f"record {name!r} is not finite JSON (numbers, strings, booleans, null, lists, objects)"
    return None


def _architecture_problem(
    spec: ModelSpec, declared: ModelSpec | None, client: ClientInfo, profile: DeviceProfile
) -> str | None:
    if declared is not None:
        if spec.with_origin(None) != declared.with_origin(None):
            return f"{spec.name!r} is not the architecture the task expects ({declared.name!r})"
        return None
    if spec.input_shape != client.spec.input_shape or spec.num_classes != client.spec.num_classes:
        return (
            f"{spec.name!r} takes {list(spec.input_shape)} and gives {spec.num_classes} classes; client "
            f"{client.client_id}'s data need {list(client.spec.input_shape)} and {client.spec.num_classes}"
        )
    verdict = fits(spec, profile)
    if not verdict.ok:
        return f"{spec.name!r} does not fit device profile {profile.name}: {'; '.join(verdict.failures)}"
    return None


def _finite_json(value: Any, depth: int = 0) -> bool:
    if depth > C.MAX_RECORD_DEPTH:
        return False
    if value is None or isinstance(value, (bool, str, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite_json(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite_json(v, depth + 1) for k, v in value.items())
    return False
