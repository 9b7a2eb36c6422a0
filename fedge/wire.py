"""Transport-neutral wire format: JSON envelopes, a JSON + safetensors payload container, and chunking."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

from fedge.constants import (
    CHUNK_SIZE,
    MAX_CHUNK_BYTES,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_PENDING_MESSAGES,
    MESSAGE_TTL_S,
    SUPPORTED_SCHEMA_VERSIONS,
    WIRE_SCHEMA_VERSION,
)
from fedge.messages import ClientInfo, Result, Task, Weights
from fedge.spec import ModelSpec, SpecError, tensor_shapes
from fedge.weights import WeightsError, from_bytes, to_bytes

MESSAGE_TYPES = ("register", "task", "result", "status", "ack")
REASONS = ("bad_format", "schema_version", "too_large", "hash_mismatch", "bad_chunk", "bad_weights",
           "bad_spec", "bad_value", "spoof", "wrong_run", "expired", "stale_round", "no_open_task", "duplicate")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_LEN_BYTES = 8


class WireError(ValueError):
    """A message, payload or chunk was rejected; `reason` is a short code from REASONS, the text says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------- checks

def _int(d: dict[str, Any], key: str, minimum: int = 0) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise WireError("bad_format", f"field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _str(d: dict[str, Any], key: str, pattern: re.Pattern[str] | None = None) -> str:
    v = d[key]
    if not isinstance(v, str) or not v or (pattern is not None and not pattern.fullmatch(v)):
        raise WireError("bad_format", f"field {key!r} must be a non-empty string"
                        + (f" matching {pattern.pattern}" if pattern else "") + f", got {v!r}")
    return v


def _float(d: dict[str, Any], key: str) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WireError("bad_format", f"field {key!r} must be a finite number, got {v!r}")
    return float(v)


def _exact_keys(d: Any, expected: set[str], what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise WireError("bad_format", f"{what} must be a JSON object, got {type(d).__name__}")
    missing, extra = sorted(expected - set(d)), sorted(set(d) - expected)
    if missing or extra:
        raise WireError("bad_format", f"{what}: missing fields {missing}, unknown fields {extra}")
    return d


def _check_finite_json(v: Any, where: str) -> None:
    """Reject NaN/Inf anywhere inside a JSON value (WireError "bad_value")."""
    if isinstance(v, float) and not math.isfinite(v):
        raise WireError("bad_value", f"{where} contains a non-finite number")
    if isinstance(v, dict):
        for k, x in v.items():
            _check_finite_json(x, f"{where}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_finite_json(x, f"{where}[{i}]")


def _json_loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WireError("bad_format", f"{what} is not UTF-8 JSON: {e}") from None


# ---------------------------------------------------------------------------------------------- envelope

_ENVELOPE_FIELDS = {"schema_version", "run", "round", "type", "msg_id", "reply_to", "sender", "created_at",
                    "ttl_s", "sha256", "size", "chunks"}


@dataclass(frozen=True)
class Envelope:
    """Metadata sent with every message; the payload's bytes are tied to it by `sha256` and `size`."""

    schema_version: int
    run: str
    round: int
    type: str
    msg_id: str
    reply_to: str | None
    sender: str
    created_at: float
    ttl_s: float
    sha256: str
    size: int
    chunks: int

    @classmethod
    def new(cls, run: str, round: int, type: str, sender: str, payload: bytes, reply_to: str | None = None,
            ttl_s: float = MESSAGE_TTL_S, chunk_size: int = CHUNK_SIZE) -> "Envelope":
        """An envelope for `payload` with a fresh msg_id and the current time; bad fields raise WireError."""
        env = cls(WIRE_SCHEMA_VERSION, run, round, type, uuid.uuid4().hex, reply_to, sender, time.time(),
                  float(ttl_s), sha256_hex(payload), len(payload), max(1, math.ceil(len(payload) / chunk_size)))
        return cls.from_dict(env.to_dict())  # validate what we are about to send

    def expired(self, now: float | None = None) -> bool:
        """True once created_at + ttl_s lies in the past."""
        return (time.time() if now is None else now) > self.created_at + self.ttl_s

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in sorted(_ENVELOPE_FIELDS)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, d: Any) -> "Envelope":
        """Validate strictly: unknown schema_version raises WireError "schema_version", a payload size above
        MAX_PAYLOAD_BYTES "too_large", any missing/unknown field or wrong type or value "bad_format"."""
        if not isinstance(d, dict):
            raise WireError("bad_format", f"an envelope must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise WireError("bad_format", f"envelope schema_version must be an integer, got {version!r}")
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise WireError("schema_version", f"envelope schema version {version} is not supported "
                            f"(supported: {list(SUPPORTED_SCHEMA_VERSIONS)}); upgrade this side or the sender")
        _exact_keys(d, _ENVELOPE_FIELDS, "envelope")
        if d["type"] not in MESSAGE_TYPES:
            raise WireError("bad_format", f"envelope type {d['type']!r} is not one of {list(MESSAGE_TYPES)}")
        reply_to = d["reply_to"]
        if reply_to is not None:
            _str(d, "reply_to", _HEX32)
        env = cls(version, _str(d, "run"), _int(d, "round"), d["type"], _str(d, "msg_id", _HEX32), reply_to,
                  _str(d, "sender"), _float(d, "created_at"), _float(d, "ttl_s"), _str(d, "sha256", _HEX64),
                  _int(d, "size"), _int(d, "chunks", minimum=1))
        if env.ttl_s <= 0:
            raise WireError("bad_format", f"envelope ttl_s must be positive, got {env.ttl_s}")
        if env.size > MAX_PAYLOAD_BYTES:
            raise WireError("too_large", f"payload of {env.size} bytes exceeds the cap of {MAX_PAYLOAD_BYTES}")
        return env

    @classmethod
    def from_json(cls, text: str | bytes) -> "Envelope":
        """Parse and validate (see from_dict); text above MAX_HEADER_BYTES raises WireError "too_large"."""
        raw = text.encode("utf-8") if isinstance(text, str) else text
        if len(raw) > MAX_HEADER_BYTES:
            raise WireError("too_large", f"envelope of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
        return cls.from_dict(_json_loads(raw, "envelope"))


# ---------------------------------------------------------------------------------------------- container

def _pack(kind: str, fields: dict[str, Any], models: dict[str, Weights]) -> bytes:
    """8-byte LE header length + JSON header + concatenated safetensors blobs (one per model role)."""
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
    _check_finite_json(fields, kind)
    header = json.dumps({"kind": kind, "fields": fields, "models": index}, sort_keys=True,
                        separators=(",", ":"), allow_nan=False).encode("utf-8")
    out = b"".join([len(header).to_bytes(_LEN_BYTES, "little"), header, *blobs])
    if len(header) > MAX_HEADER_BYTES or len(out) > MAX_PAYLOAD_BYTES:
        raise WireError("too_large", f"{kind} payload header {len(header)} B / total {len(out)} B is over the cap")
    return out


def _read_header(data: bytes, kind: str) -> tuple[dict[str, Any], dict[str, Any], memoryview]:
    """Split and validate the container; returns (fields, models index, body). Never unpickles anything."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("bad_format", f"{kind} payload must be bytes, got {type(data).__name__}")
    data = memoryview(data)
    if len(data) > MAX_PAYLOAD_BYTES:
        raise WireError("too_large", f"{kind} payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    if len(data) < _LEN_BYTES + 2:
        raise WireError("bad_format", f"{kind} payload of {len(data)} bytes is too short for a header")
    n = int.from_bytes(data[:_LEN_BYTES], "little")
    if n > len(data) - _LEN_BYTES:
        raise WireError("bad_format", f"{kind} header length {n} exceeds the payload ({len(data)} bytes); "
                        "truncated, or not a fedge payload")
    if n > MAX_HEADER_BYTES:
        raise WireError("too_large", f"{kind} header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    raw = bytes(data[_LEN_BYTES:_LEN_BYTES + n])
    if not raw.startswith(b"{"):
        raise WireError("bad_format", f"{kind} header is not a JSON object")
    header = _exact_keys(_json_loads(raw, f"{kind} header"), {"kind", "fields", "models"}, f"{kind} header")
    if header["kind"] != kind:
        raise WireError("bad_format", f"expected a {kind} payload, got {header['kind']!r}")
    if not isinstance(header["fields"], dict) or not isinstance(header["models"], dict):
        raise WireError("bad_format", f"{kind} header fields and models must be JSON objects")
    return header["fields"], header["models"], data[_LEN_BYTES + n:]


def _unpack_models(index: dict[str, Any], body: memoryview) -> dict[str, Weights]:
    """Check offsets (in range, non-overlapping, covering the body exactly) and parse each blob with safetensors."""
    spans: list[tuple[int, int, str]] = []
    for role, span in index.items():
        if (not role or not isinstance(span, list) or len(span) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in span)):
            raise WireError("bad_format", f"model {role!r} span must be [offset, length] of integers >= 0")
        if span[0] + span[1] > len(body):
            raise WireError("bad_format", f"model {role!r} span {span} lies outside the {len(body)}-byte body")
        spans.append((span[0], span[1], role))
    spans.sort()
    end = 0
    for start, length, role in spans:
        if start < end:
            raise WireError("bad_format", f"model {role!r} overlaps the previous model's bytes")
        end = start + length
    if sum(s[1] for s in spans) != len(body):
        raise WireError("bad_format", f"model spans cover {sum(s[1] for s in spans)} of {len(body)} body bytes")
    models: dict[str, Weights] = {}
    for start, length, role in spans:
        try:
            spec, state = from_bytes(bytes(body[start:start + length]))
        except (WeightsError, SpecError) as e:
            raise WireError("bad_weights", f"model {role!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - hostile specs still trip the layer code (stride 0, p=-1): reject
            raise WireError("bad_weights", f"model {role!r} is unusable: {type(e).__name__}: {e}") from None
        models[role] = Weights(spec, state)
    return {role: models[role] for role in index}


def _fields(fields: dict[str, Any], expected: set[str], kind: str) -> dict[str, Any]:
    _exact_keys(fields, expected, f"{kind} fields")
    _check_finite_json(fields, kind)
    return fields


def encode_task(task: Task) -> bytes:
    """Task → container bytes; a non-JSON config or NaN raises WireError, bad weights "bad_weights"."""
    try:
        return _pack("task", {"type": task.type, "round": task.round, "config": task.config}, task.models)
    except (TypeError, ValueError) as e:
        if isinstance(e, WireError):
            raise
        raise WireError("bad_value", f"task config is not finite JSON: {e}") from None


def decode_task(data: bytes) -> Task:
    """Container bytes → Task; any malformation raises WireError with a specific reason."""
    f, index, body = _read_header(data, "task")
    f = _fields(f, {"type", "round", "config"}, "task")
    if not isinstance(f["config"], dict):
        raise WireError("bad_format", "task config must be a JSON object")
    return Task(_str(f, "type"), _int(f, "round"), f["config"], _unpack_models(index, body))


def encode_result(result: Result) -> bytes:
    """Result → container bytes; non-finite metrics raise WireError "bad_value"."""
    _metrics(result.metrics)
    fields = {"client_id": result.client_id, "round": result.round, "type": result.type,
              "num_examples": result.num_examples, "metrics": dict(result.metrics)}
    return _pack("result", fields, result.models)


def _metrics(m: Any) -> dict[str, float]:
    if not isinstance(m, dict):
        raise WireError("bad_format", "result metrics must be a JSON object")
    for k, v in m.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise WireError("bad_value", f"metric {k!r} must be a finite number, got {v!r}")
    return {k: float(v) for k, v in m.items()}


def decode_result(data: bytes) -> Result:
    """Container bytes → Result; metrics must be finite numbers ("bad_value"), else see decode_task."""
    f, index, body = _read_header(data, "result")
    _exact_keys(f, {"client_id", "round", "type", "num_examples", "metrics"}, "result fields")
    metrics = _metrics(f["metrics"])
    return Result(_str(f, "client_id"), _int(f, "round"), _str(f, "type"), _int(f, "num_examples"), metrics,
                  _unpack_models(index, body))


def encode_info(info: ClientInfo) -> bytes:
    """ClientInfo → container bytes (no models; the spec travels as JSON)."""
    fields = {"client_id": info.client_id, "spec": info.spec.to_dict(), "profile": info.profile,
              "num_train": info.num_train, "num_test": info.num_test}
    return _pack("info", fields, {})


def decode_info(data: bytes) -> ClientInfo:
    """Container bytes → ClientInfo; an invalid spec raises WireError "bad_spec", else see decode_task."""
    f, index, body = _read_header(data, "info")
    f = _fields(f, {"client_id", "spec", "profile", "num_train", "num_test"}, "info")
    if index or body:
        raise WireError("bad_format", "a client info payload carries no models")
    try:
        spec = ModelSpec.from_dict(f["spec"])
        tensor_shapes(spec)  # builds its layers (on "meta"): a spec the server cannot instantiate is refused here
    except SpecError as e:
        raise WireError("bad_spec", f"client spec: {e}") from None
    except Exception as e:  # noqa: BLE001 - as in _unpack_models: never anything but WireError on network input
        raise WireError("bad_spec", f"client spec is unusable: {type(e).__name__}: {e}") from None
    return ClientInfo(_str(f, "client_id"), spec, _str(f, "profile"), _int(f, "num_train"), _int(f, "num_test"))


STATUS_STATES = ("online", "alive", "offline")


def encode_status(state: str, session: str) -> bytes:
    """A status body: online (just connected), alive (heartbeat) or offline (clean exit, or the will)."""
    if state not in STATUS_STATES:
        raise WireError("bad_format", f"status {state!r} is not one of {list(STATUS_STATES)}")
    return _pack("status", {"state": state, "session": session}, {})


def decode_status(data: bytes) -> tuple[str, str]:
    """(state, session) of a status body."""
    f = _control(data, "status", {"state", "session"})
    if f["state"] not in STATUS_STATES:
        raise WireError("bad_format", f"status {f['state']!r} is not one of {list(STATUS_STATES)}")
    return f["state"], _str(f, "session")


def encode_ack(error: str | None) -> bytes:
    """An acknowledgement body: accepted (error None) or refused with the reason."""
    return _pack("ack", {"ok": error is None, "error": error}, {})


def decode_ack(data: bytes) -> str | None:
    """None when the acknowledged message was accepted, else the server's reason for refusing it."""
    f = _control(data, "ack", {"ok", "error"})
    if f["ok"] is True and f["error"] is None:
        return None
    if f["ok"] is False and isinstance(f["error"], str):
        return f["error"]
    raise WireError("bad_format", f"ack must be ok with no error or not ok with one, got {f}")


def _control(data: bytes, kind: str, expected: set[str]) -> dict[str, Any]:
    f, index, body = _read_header(data, kind)
    if index or body:
        raise WireError("bad_format", f"a {kind} payload carries no models")
    return _fields(f, expected, kind)


# ---------------------------------------------------------------------------------------------- chunking

def split(payload: bytes | memoryview, chunk_size: int = CHUNK_SIZE) -> list[bytes | memoryview]:
    """Cut `payload` into chunks of `chunk_size` bytes (the last may be shorter; b"" gives [b""]).

    A chunk_size below 1 raises WireError "bad_chunk".
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise WireError("bad_chunk", f"chunk_size must be a positive integer, got {chunk_size!r}")
    return [payload[i:i + chunk_size] for i in range(0, len(payload), chunk_size)] or [b""]


@dataclass
class _Partial:
    total: int
    sha256: str
    max_size: int
    parts: dict[int, bytes | memoryview] = field(default_factory=dict)
    size: int = 0
    hasher: Any = field(default_factory=hashlib.sha256)  # the payload's SHA-256, fed in chunk order
    hashed: int = 0  # chunks 0..hashed-1 are in `hasher`

    def feed_hash(self) -> None:
        """Hash the chunks that are next in order, as they arrive, so the check at the end costs nothing."""
        while self.hashed in self.parts:
            self.hasher.update(self.parts[self.hashed])
            self.hashed += 1


class Reassembler:
    """Joins chunks of many messages arriving in any order, with duplicates; memory is bounded.

    At most `max_pending` partial messages are kept (the oldest is evicted, counted in `.evicted`); the ids of
    the last `max_completed` finished messages are remembered so late duplicates are recognised.
    """

    def __init__(self, max_pending: int = MAX_PENDING_MESSAGES, max_completed: int = 16 * MAX_PENDING_MESSAGES):
        self.max_pending = max_pending
        self.max_completed = max_completed
        self.duplicates = 0
        self.evicted = 0
        self._pending: OrderedDict[str, _Partial] = OrderedDict()
        self._done: OrderedDict[str, None] = OrderedDict()

    @property
    def pending(self) -> int:
        """Number of partial messages held."""
        return len(self._pending)

    def _reject(self, msg_id: str, reason: str, message: str) -> WireError:
        self._pending.pop(msg_id, None)
        return WireError(reason, f"message {msg_id}: {message}")

    def repeated(self, msg_id: str) -> bool:
        """True, counted in `duplicates`, when `msg_id` was already joined and returned (a repeat to drop)."""
        if msg_id in self._done:
            self.duplicates += 1
            return True
        return False

    def add(self, msg_id: str, index: int, total: int, data: bytes | memoryview, expected_sha256: str,
            max_size: int = MAX_PAYLOAD_BYTES) -> bytes | None:
        """Store one chunk; return the joined payload when the last one arrives (once), else None.

        Index out of range, a total or hash differing from earlier chunks raise WireError "bad_chunk"; more than
        `max_size` bytes "too_large"; a joined payload whose SHA-256 differs "hash_mismatch". Each rejection
        drops the message's partial state. Repeated chunks and chunks of finished messages count as duplicates.
        """
        if msg_id in self._done:
            self.duplicates += 1
            return None
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise self._reject(msg_id, "bad_chunk", f"chunk total must be a positive integer, got {total!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < total:
            raise self._reject(msg_id, "bad_chunk", f"chunk index {index!r} is outside 0..{total - 1}")
        max_size = min(max_size, MAX_PAYLOAD_BYTES)
        p = self._pending.get(msg_id)
        if p is None:
            while len(self._pending) >= self.max_pending:
                self._pending.popitem(last=False)
                self.evicted += 1
            p = self._pending[msg_id] = _Partial(total, expected_sha256, max_size)
        if p.total != total or p.sha256 != expected_sha256:
            raise self._reject(msg_id, "bad_chunk", f"chunk says total {total} / sha {expected_sha256[:12]}, "
                               f"earlier chunks said {p.total} / {p.sha256[:12]}")
        if index in p.parts:
            self.duplicates += 1
            return None
        p.size += len(data)
        if p.size > max_size:
            raise self._reject(msg_id, "too_large", f"chunks exceed the cap of {max_size} bytes")
        p.parts[index] = data
        p.feed_hash()
        if len(p.parts) < total:
            return None
        payload = b"".join(p.parts[i] for i in range(total))
        del self._pending[msg_id]
        if p.hasher.hexdigest() != expected_sha256:
            raise WireError("hash_mismatch", f"message {msg_id}: SHA-256 of the {len(payload)} joined bytes "
                            "does not match the envelope")
        self._done[msg_id] = None
        while len(self._done) > self.max_completed:
            self._done.popitem(last=False)
        return payload


# ---------------------------------------------------------------------------------------------- frames

_FRAME_LEN_BYTES = 4
_FRAME_FIELDS = {"envelope", "chunk", "chunk_sha256"}


@dataclass(frozen=True)
class Frame:
    """One transport message: the envelope, which chunk of the payload this is, and its bytes."""

    envelope: Envelope
    index: int
    data: memoryview  # a view into the received message: no copy until reassembly joins the chunks


def frames(env: Envelope, payload: bytes, chunk_size: int = CHUNK_SIZE) -> list[bytes]:
    """The transport messages carrying `payload`: 4-byte LE header length, JSON header (envelope, chunk
    index, chunk SHA-256), chunk bytes. `env` must have been made for this payload and chunk size."""
    return list(iter_frames(env, payload, chunk_size))


def iter_frames(env: Envelope, payload: bytes, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """`frames`, one at a time, so the first can be sent while the rest are still being hashed."""
    parts = split(memoryview(payload), chunk_size)
    if len(parts) != env.chunks or env.size != len(payload):
        raise WireError("bad_chunk", f"envelope announces {env.chunks} chunks of {env.size} bytes, payload gives "
                        f"{len(parts)} of {len(payload)}")
    for i, part in enumerate(parts):
        header = json.dumps({"envelope": env.to_dict(), "chunk": i, "chunk_sha256": sha256_hex(part)},
                            sort_keys=True, separators=(",", ":")).encode()
        yield b"".join((len(header).to_bytes(_FRAME_LEN_BYTES, "little"), header, part))


def unframe(data: bytes) -> Frame:
    """Parse and check one transport message: header size, envelope, chunk index within the announced
    count, chunk size cap and chunk SHA-256 (WireError "bad_chunk"); nothing is decoded beyond that."""
    if len(data) < _FRAME_LEN_BYTES:
        raise WireError("bad_format", f"a {len(data)}-byte message is too short to be a fedge frame")
    n = int.from_bytes(data[:_FRAME_LEN_BYTES], "little")
    if n > MAX_HEADER_BYTES or n > len(data) - _FRAME_LEN_BYTES:
        raise WireError("bad_format", f"frame header length {n} is over the cap or beyond the {len(data)}-byte "
                        "message; not a fedge frame")
    header = _exact_keys(_json_loads(data[_FRAME_LEN_BYTES:_FRAME_LEN_BYTES + n], "frame header"), _FRAME_FIELDS,
                         "frame header")
    env = Envelope.from_dict(header["envelope"])
    index = _int(header, "chunk")
    chunk = memoryview(data)[_FRAME_LEN_BYTES + n:]
    if index >= env.chunks:
        raise WireError("bad_chunk", f"chunk {index} of a message announced with {env.chunks} chunks")
    if len(chunk) > MAX_CHUNK_BYTES:
        raise WireError("too_large", f"chunk of {len(chunk)} bytes exceeds {MAX_CHUNK_BYTES}")
    if sha256_hex(chunk) != _str(header, "chunk_sha256", _HEX64):
        raise WireError("bad_chunk", f"chunk {index} of message {env.msg_id}: SHA-256 mismatch (corrupted)")
    return Frame(env, index, chunk)
