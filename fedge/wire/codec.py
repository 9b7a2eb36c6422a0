"""The payload container, JSON header plus safetensors blobs (never pickle): encoding and strict decoding of tasks,
results, client info (registration), status and acknowledgements."""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from safetensors.torch import save as st_save

from fedge.constants import MAX_ERROR_CHARS, MAX_HEADER_BYTES, MAX_PAYLOAD_BYTES
from fedge.model.spec import ModelSpec, SpecError, tensor_shapes
from fedge.model.weights import WeightsError, all_finite, from_bytes, to_bytes
from fedge.wire import tensorblob
from fedge.wire.envelope import HEX32, WireError, check_finite_json, check_int, check_str, exact_keys, json_loads
from fedge.wire.messages import ClientInfo, Records, Result, Task, Tensors, Weights

_LEN_BYTES = 8
_ALIGN = 8  # the body starts at a multiple of this (tensorblob.parse views tensors that land 64-byte aligned)
_HEADER_FIELDS = {"kind", "fields", "models", "tensors"}
_TASK_FIELDS = {"type", "round", "config", "records"}
_RESULT_FIELDS = {"client_id", "round", "type", "num_examples", "metrics", "error", "records"}
_INFO_FIELDS = {"client_id", "spec", "profile", "num_train", "num_test"}
STATUS_STATES = ("online", "alive", "offline")
Buffer = bytes | bytearray | memoryview


# ---------------------------------------------------------------------------------------------- container


def _tensor_blob(tensors: Tensors) -> bytes:
    """One safetensors blob of named tensors, no metadata; WireError "bad_format" for a bad name or a
    non-tensor, "bad_value" for NaN/Inf."""
    out = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise WireError("bad_format", f"tensor name must be a non-empty string, got {name!r}")
        if not isinstance(t, torch.Tensor) or t.dtype not in tensorblob.DTYPES.values():
            raise WireError(
                "bad_format",
                f"tensor {name!r} must be a torch.Tensor of one of "
                f"{sorted(tensorblob.DTYPES)}, got {getattr(t, 'dtype', type(t).__name__)}",
            )
        if t.is_floating_point() and not all_finite(t):
            raise WireError("bad_value", f"tensor {name!r} contains NaN or Inf")
        out[name] = t.detach().to("cpu").contiguous()
    try:
        return st_save(out)
    except RuntimeError:  # safetensors refuses tensors whose memory overlaps (e.g. x and x[:2]): give each its own
        return st_save({name: t.clone() for name, t in out.items()})


def _pack(kind: str, fields: dict[str, Any], models: dict[str, Weights], tensors: Tensors | None = None) -> bytes:
    """8-byte LE header length + JSON header (padded with spaces so the body is aligned) + the models'
    safetensors blobs, one per role, then one blob of the named tensors if there are any (the header's
    "tensors" span is null when there are none)."""
    blobs: list[bytes] = []
    index: dict[str, list[int]] = {}
    offset = 0
    for role, w in models.items():
        if not isinstance(role, str) or not role:
            raise WireError("bad_format", f"model role must be a non-empty string, got {role!r}")
        try:
            blob = to_bytes(w.spec, w.state)
        except (WeightsError, SpecError) as e:
            raise WireError("bad_weights", f"model {role!r}: {e}") from None
        index[role] = [offset, len(blob)]
        blobs.append(blob)
        offset += len(blob)
    if tensors is not None and not isinstance(tensors, dict):
        raise WireError("bad_format", f"named tensors must be a dict, got {type(tensors).__name__}")
    span = None
    if tensors:
        blobs.append(_tensor_blob(tensors))
        span = [offset, len(blobs[-1])]
    check_finite_json(fields, kind)
    try:
        header = json.dumps(
            {"kind": kind, "fields": fields, "models": index, "tensors": span},
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        ).encode("utf-8")
    except (TypeError, ValueError) as e:  # a value JSON cannot carry (an object, a non-string key)
        raise WireError("bad_value", f"{kind} fields are not JSON: {e}") from None
    header += b" " * (-(_LEN_BYTES + len(header)) % _ALIGN)
    size = _LEN_BYTES + len(header) + sum(len(b) for b in blobs)
    if len(header) > MAX_HEADER_BYTES or size > MAX_PAYLOAD_BYTES:
        raise WireError("too_large", f"{kind} payload header {len(header)} B / total {size} B is over the cap")
    return b"".join([len(header).to_bytes(_LEN_BYTES, "little"), header, *blobs])


def _read_header(data: Buffer, kind: str) -> tuple[dict[str, Any], dict[str, Any], Any, memoryview]:
    """Split and validate the container; returns (fields, models index, tensors span, body). Never unpickles."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("bad_format", f"{kind} payload must be bytes, got {type(data).__name__}")
    data = memoryview(data).cast("B")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise WireError("too_large", f"{kind} payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    if len(data) < _LEN_BYTES + 2:
        raise WireError("bad_format", f"{kind} payload of {len(data)} bytes is too short for a header")
    n = int.from_bytes(data[:_LEN_BYTES], "little")
    if n > len(data) - _LEN_BYTES:
        raise WireError(
            "bad_format",
            f"{kind} header length {n} exceeds the payload ({len(data)} bytes); truncated, or not a fedge payload",
        )
    if n > MAX_HEADER_BYTES:
        raise WireError("too_large", f"{kind} header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    raw = bytes(data[_LEN_BYTES : _LEN_BYTES + n])
    if not raw.startswith(b"{"):
        raise WireError("bad_format", f"{kind} header is not a JSON object")
    header = exact_keys(json_loads(raw, f"{kind} header"), _HEADER_FIELDS, f"{kind} header")
    if header["kind"] != kind:
        raise WireError("bad_format", f"expected a {kind} payload, got {header['kind']!r}")
    if not isinstance(header["fields"], dict) or not isinstance(header["models"], dict):
        raise WireError("bad_format", f"{kind} header fields and models must be JSON objects")
    return header["fields"], header["models"], header["tensors"], data[_LEN_BYTES + n :]


def _spans(index: dict[str, Any], tensors: Any, body: memoryview) -> dict[str | None, tuple[int, int]]:
    """Each blob's (start, length) by model role (None for the named tensors): in range, non-overlapping,
    covering the body exactly; else WireError "bad_format"."""
    named = [(role, f"model {role!r}", span) for role, span in index.items()]
    if tensors is not None:
        named.append((None, "the tensors blob", tensors))
    spans: list[tuple[int, int, str | None, str]] = []
    for role, what, span in named:
        if (
            role == ""
            or not isinstance(span, list)
            or len(span) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in span)
        ):
            raise WireError("bad_format", f"{what} span must be [offset, length] of integers >= 0")
        if span[0] + span[1] > len(body):
            raise WireError("bad_format", f"{what} span {span} lies outside the {len(body)}-byte body")
        spans.append((span[0], span[1], role, what))
    spans.sort(key=lambda s: s[:2])
    end, previous = 0, None
    for start, length, role, what in spans:
        if start < end:
            raise WireError(
                "bad_format", f"{what} overlaps the previous {'tensors blob' if previous is None else 'model'}'s bytes"
            )
        end, previous = start + length, role
    if sum(s[1] for s in spans) != len(body):
        raise WireError("bad_format", f"blob spans cover {sum(s[1] for s in spans)} of {len(body)} body bytes")
    return {role: (start, length) for start, length, role, _ in spans}


def _unpack_models(
    index: dict[str, Any], spans: dict[str | None, tuple[int, int]], body: memoryview
) -> dict[str, Weights]:
    """Parse each model's blob in place (fedge.model.weights.from_bytes: spec, keys, shapes, dtypes, finite values)."""
    models: dict[str, Weights] = {}
    for role in index:
        start, length = spans[role]
        try:
            spec, state = from_bytes(body[start : start + length])
        except (WeightsError, SpecError) as e:
            raise WireError("bad_weights", f"model {role!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - hostile specs still trip the layer code (stride 0, p=-1): reject
            raise WireError("bad_weights", f"model {role!r} is unusable: {type(e).__name__}: {e}") from None
        models[role] = Weights(spec, state)
    return models


def _unpack_tensors(spans: dict[str | None, tuple[int, int]], body: memoryview) -> Tensors:
    """The named tensors' blob parsed in place: a malformed blob is WireError "bad_format", metadata too (the
    blob has none), NaN/Inf "bad_value"."""
    start, length = spans[None]
    try:
        meta, tensors = tensorblob.parse(body[start : start + length])
    except tensorblob.BlobError as e:
        raise WireError("bad_format", f"tensors blob: {e}") from None
    if meta:
        raise WireError("bad_format", f"tensors blob carries metadata {sorted(meta)[:5]}; it has none")
    for name, t in tensors.items():
        if t.is_floating_point() and not all_finite(t):
            raise WireError("bad_value", f"tensor {name!r} contains NaN or Inf")
    return tensors


def _unpack(data: Buffer, kind: str, expected: set[str]) -> tuple[dict[str, Any], dict[str, Weights], Tensors]:
    """Fields (exactly `expected`, finite), models and named tensors of a task or result payload."""
    f, index, tensors, body = _read_header(data, kind)
    exact_keys(f, expected, f"{kind} fields")
    spans = _spans(index, tensors, body)
    return f, _unpack_models(index, spans, body), _unpack_tensors(spans, body) if tensors is not None else {}


def _records(records: Any, kind: str) -> Records:
    """Records as sent: a JSON object whose names are non-empty strings ("bad_format") and whose values hold
    finite numbers only ("bad_value")."""
    if not isinstance(records, dict) or not all(isinstance(k, str) and k for k in records):
        raise WireError("bad_format", f"{kind} records must be a JSON object keyed by non-empty strings")
    check_finite_json(records, f"{kind} records")
    return records


# ---------------------------------------------------------------------------------------------- messages


def encode_task(task: Task) -> bytes:
    """Task → container bytes; a non-JSON or non-finite config or record raises WireError "bad_value", a bad
    tensor name "bad_format", a non-finite tensor "bad_value", bad weights "bad_weights"."""
    fields = {"type": task.type, "round": task.round, "config": task.config, "records": _records(task.records, "task")}
    return _pack("task", fields, task.models, task.tensors)


def decode_task(data: Buffer) -> Task:
    """Container bytes → Task; any malformation raises WireError with a specific reason."""
    f, models, tensors = _unpack(data, "task", _TASK_FIELDS)
    check_finite_json(f, "task")
    if not isinstance(f["config"], dict):
        raise WireError("bad_format", "task config must be a JSON object")
    return Task(
        check_str(f, "type"), check_int(f, "round"), f["config"], models, tensors, _records(f["records"], "task")
    )


def _metrics(m: Any) -> dict[str, float]:
    if not isinstance(m, dict):
        raise WireError("bad_format", "result metrics must be a JSON object")
    for k, v in m.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise WireError("bad_value", f"metric {k!r} must be a finite number, got {v!r}")
    return {k: float(v) for k, v in m.items()}


def encode_result(result: Result) -> bytes:
    """Result → container bytes; non-finite metrics, records or tensors raise WireError "bad_value"."""
    _metrics(result.metrics)
    records = _records(result.records, "result")
    fields = {
        "client_id": result.client_id,
        "round": result.round,
        "type": result.type,
        "num_examples": result.num_examples,
        "metrics": dict(result.metrics),
        "error": result.error,
        "records": records,
    }
    return _pack("result", fields, result.models, result.tensors)


def decode_result(data: Buffer) -> Result:
    """Container bytes → Result; metrics must be finite numbers ("bad_value"), else see decode_task."""
    f, models, tensors = _unpack(data, "result", _RESULT_FIELDS)
    metrics = _metrics(f["metrics"])
    records = _records(f["records"], "result")
    error = f["error"]
    if error is not None and not (isinstance(error, str) and len(error) <= MAX_ERROR_CHARS):
        raise WireError("bad_format", f"result error must be null or a string of at most {MAX_ERROR_CHARS} characters")
    return Result(
        check_str(f, "client_id"),
        check_int(f, "round"),
        check_str(f, "type"),
        check_int(f, "num_examples"),
        metrics,
        models,
        error,
        tensors,
        records,
    )


def encode_info(info: ClientInfo) -> bytes:
    """ClientInfo → container bytes (no models; the spec travels as JSON)."""
    fields = {
        "client_id": info.client_id,
        "spec": info.spec.to_dict(),
        "profile": info.profile,
        "num_train": info.num_train,
        "num_test": info.num_test,
    }
    return _pack("info", fields, {})


def decode_info(data: Buffer) -> ClientInfo:
    """Container bytes → ClientInfo; an invalid spec raises WireError "bad_spec", else see decode_task."""
    f = _control(data, "info", _INFO_FIELDS)
    try:
        spec = ModelSpec.from_dict(f["spec"])
        tensor_shapes(spec)  # builds its layers (on "meta"): a spec the server cannot instantiate is refused here
    except SpecError as e:
        raise WireError("bad_spec", f"client spec: {e}") from None
    except Exception as e:  # noqa: BLE001 - as in _unpack_models: never anything but WireError on network input
        raise WireError("bad_spec", f"client spec is unusable: {type(e).__name__}: {e}") from None
    return ClientInfo(
        check_str(f, "client_id"), spec, check_str(f, "profile"), check_int(f, "num_train"), check_int(f, "num_test")
    )


def encode_status(state: str, session: str) -> bytes:
    """A status body: online (just connected), alive (heartbeat) or offline (clean exit, or the will)."""
    if state not in STATUS_STATES:
        raise WireError("bad_format", f"status {state!r} is not one of {list(STATUS_STATES)}")
    return _pack("status", {"state": state, "session": session}, {})


def decode_status(data: Buffer) -> tuple[str, str]:
    """(state, session) of a status body."""
    f = _control(data, "status", {"state", "session"})
    if f["state"] not in STATUS_STATES:
        raise WireError("bad_format", f"status {f['state']!r} is not one of {list(STATUS_STATES)}")
    return f["state"], check_str(f, "session", HEX32)


def encode_ack(error: str | None) -> bytes:
    """An acknowledgement body: accepted (error None) or refused with the reason."""
    return _pack("ack", {"ok": error is None, "error": error}, {})


def decode_ack(data: Buffer) -> str | None:
    """None when the acknowledged message was accepted, else the server's reason for refusing it."""
    f = _control(data, "ack", {"ok", "error"})
    if f["ok"] is True and f["error"] is None:
        return None
    if f["ok"] is False and isinstance(f["error"], str):
        return f["error"]
    raise WireError("bad_format", f"ack must be ok with no error or not ok with one, got {f}")


def _control(data: Buffer, kind: str, expected: set[str]) -> dict[str, Any]:
    """The fields of a payload that carries JSON only (info, status, ack): no models, no tensors blob."""
    f, index, tensors, body = _read_header(data, kind)
    if index or tensors is not None or body:
        raise WireError("bad_format", f"a {kind} payload carries no models or tensors")
    exact_keys(f, expected, f"{kind} fields")
    check_finite_json(f, kind)
    return f
