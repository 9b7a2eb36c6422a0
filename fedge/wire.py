"""Transport-neutral wire format: JSON envelopes, a JSON + safetensors payload container, and chunking."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

from fedge.constants import (
    CHUNK_SIZE,
    MAX_CHUNK_BYTES,
    MAX_COMPLETED_IDS,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_TTL_S,
    MESSAGE_TTL_S,
    PENDING_CHUNK_OVERHEAD_BYTES,
    PENDING_MESSAGE_OVERHEAD_BYTES,
    PENDING_SENDER_BYTES,
    PENDING_TOTAL_BYTES,
    SUPPORTED_SCHEMA_VERSIONS,
    WIRE_SCHEMA_VERSION,
)
from fedge.messages import ClientInfo, Result, Task, Weights
from fedge.spec import ModelSpec, SpecError, tensor_shapes
from fedge.weights import WeightsError, from_bytes, to_bytes

MESSAGE_TYPES = ("register", "task", "result", "status", "ack")
REASONS = ("bad_format", "schema_version", "too_large", "hash_mismatch", "bad_chunk", "bad_weights",
           "bad_spec", "bad_value", "spoof", "wrong_run", "expired", "stale_round", "no_open_task", "duplicate",
           "clock_skew", "bad_ttl")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_LEN_BYTES = 8
MAX_ERROR_CHARS = 1000  # a client's report of why it could not execute a task
log = logging.getLogger(__name__)


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
        if not 0 < env.ttl_s <= MAX_TTL_S:
            raise WireError("bad_ttl", f"envelope ttl_s must lie in (0, {MAX_TTL_S:g}] s, got {env.ttl_s:g}")
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
              "num_examples": result.num_examples, "metrics": dict(result.metrics), "error": result.error}
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
    _exact_keys(f, {"client_id", "round", "type", "num_examples", "metrics", "error"}, "result fields")
    metrics = _metrics(f["metrics"])
    error = f["error"]
    if error is not None and not (isinstance(error, str) and len(error) <= MAX_ERROR_CHARS):
        raise WireError("bad_format", f"result error must be null or a string of at most {MAX_ERROR_CHARS} "
                        "characters")
    return Result(_str(f, "client_id"), _int(f, "round"), _str(f, "type"), _int(f, "num_examples"), metrics,
                  _unpack_models(index, body), error)


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
    return f["state"], _str(f, "session", _HEX32)


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
    """A message whose chunks are arriving: what its first frame announced, the chunks so far, their cost."""

    sender: str
    total: int
    sha256: str
    size: int
    stride: int  # the uniform chunk length its frames imply (see unframe)
    parts: dict[int, memoryview] = field(default_factory=dict)
    cost: int = 0  # bytes held: whole frames as received, plus bookkeeping
    hasher: Any = field(default_factory=hashlib.sha256)  # the payload's SHA-256, fed in chunk order
    hashed: int = 0  # chunks 0..hashed-1 are in `hasher`

    def feed_hash(self) -> None:
        """Hash the chunks that are next in order, as they arrive, so the check at the end costs nothing."""
        while self.hashed in self.parts:
            self.hasher.update(self.parts[self.hashed])
            self.hashed += 1


class Reassembler:
    """Joins chunks of many messages arriving in any order, with duplicates, in bounded memory.

    What a partial message holds is counted as its frames' whole bytes as received (a chunk is a view into its
    frame, so the header stays alive with it) plus PENDING_CHUNK_OVERHEAD_BYTES per chunk and
    PENDING_MESSAGE_OVERHEAD_BYTES per message. A sender may hold `sender_budget` bytes, or twice the size
    limit of the message being joined if that is more; all senders together `total_budget`. Over a budget, the
    oldest partial of that sender (or, over the total, of the sender holding most) is evicted, counted per
    sender in `evicted` and logged at the 1st, 2nd, 4th, 8th, ... eviction of each sender. The ids of the last
    `max_completed` finished messages are remembered so late duplicates are recognised.
    """

    def __init__(self, sender_budget: int = PENDING_SENDER_BYTES, total_budget: int = PENDING_TOTAL_BYTES,
                 max_completed: int = MAX_COMPLETED_IDS):
        self.sender_budget, self.total_budget, self.max_completed = sender_budget, total_budget, max_completed
        self.duplicates = 0
        self.evicted: Counter[str] = Counter()
        self.held: Counter[str] = Counter()  # bytes held per sender
        self._pending: dict[str, OrderedDict[str, _Partial]] = {}  # sender -> msg_id -> partial, oldest first
        self._done: OrderedDict[tuple[str, str], None] = OrderedDict()

    @property
    def pending(self) -> int:
        """Number of partial messages held."""
        return sum(len(messages) for messages in self._pending.values())

    @property
    def held_total(self) -> int:
        """Bytes held for partial messages, by the count above."""
        return sum(self.held.values())

    def _drop(self, key: tuple[str, str]) -> _Partial:
        sender, msg_id = key
        p = self._pending[sender].pop(msg_id)
        if not self._pending[sender]:
            del self._pending[sender]
        self.held[sender] -= p.cost
        if not self.held[sender]:
            del self.held[sender]
        return p

    def _oldest_other(self, sender: str, key: tuple[str, str]) -> tuple[str, str] | None:
        """The oldest partial message of `sender` other than `key`, if any."""
        return next(((sender, m) for m in self._pending.get(sender, ()) if (sender, m) != key), None)

    def _evict(self, key: tuple[str, str], why: str) -> None:
        p = self._drop(key)
        self.evicted[p.sender] += 1
        n = self.evicted[p.sender]
        if n & (n - 1) == 0:
            log.warning("evicted partial message %s from %s (%d of %d chunks, %d bytes held): %s; %d eviction(s) "
                        "from this sender so far", key[1], p.sender, len(p.parts), p.total, p.cost, why, n)

    def _reject(self, key: tuple[str, str], reason: str, message: str) -> WireError:
        if key[1] in self._pending.get(key[0], ()):
            self._drop(key)
        return WireError(reason, f"message {key[1]}: {message}")

    def repeated(self, sender: str, msg_id: str) -> bool:
        """True, counted in `duplicates`, when this message was already joined and returned (a repeat to drop)."""
        if (sender, msg_id) in self._done:
            self.duplicates += 1
            return True
        return False

    def add(self, sender: str, frame: "Frame", max_size: int = MAX_PAYLOAD_BYTES) -> bytes | None:
        """Keep one frame's chunk; return the joined payload when the last one arrives (once), else None.

        A frame whose envelope disagrees with earlier frames of its message (count, hash, size, chunk length)
        raises WireError "bad_chunk"; an announced size above `max_size` "too_large", as does a message whose
        frames alone exceed its sender's budget; a joined payload whose SHA-256 differs "hash_mismatch". Each
        rejection drops the message's partial state. Repeated chunks and chunks of finished messages count as
        duplicates.
        """
        env, key = frame.envelope, (sender, frame.envelope.msg_id)
        if key in self._done:
            self.duplicates += 1
            return None
        if env.size > min(max_size, MAX_PAYLOAD_BYTES):
            raise self._reject(key, "too_large", f"{env.size} bytes exceed the cap of {max_size}")
        p = self._pending.get(sender, {}).get(env.msg_id)
        if p is not None and (p.total, p.sha256, p.size, p.stride) != (env.chunks, env.sha256, env.size, frame.stride):
            raise self._reject(key, "bad_chunk", f"chunk {frame.index} says {env.chunks} chunks of {frame.stride} "
                               f"bytes, {env.size} bytes, sha {env.sha256[:12]}; earlier chunks said {p.total} of "
                               f"{p.stride}, {p.size}, {p.sha256[:12]}")
        if p is not None and frame.index in p.parts:
            self.duplicates += 1
            return None
        cost = frame.cost + PENDING_CHUNK_OVERHEAD_BYTES + (PENDING_MESSAGE_OVERHEAD_BYTES if p is None else 0)
        self._make_room(key, cost, max(self.sender_budget, 2 * max_size + PENDING_MESSAGE_OVERHEAD_BYTES))
        if p is None:
            p = _Partial(sender, env.chunks, env.sha256, env.size, frame.stride)
            self._pending.setdefault(sender, OrderedDict())[env.msg_id] = p
        p.parts[frame.index] = frame.data
        p.cost += cost
        self.held[sender] += cost
        p.feed_hash()
        if len(p.parts) < p.total:
            return None
        payload = b"".join(p.parts[i] for i in range(p.total))
        self._drop(key)
        if p.hasher.hexdigest() != p.sha256:
            raise WireError("hash_mismatch", f"message {key[1]}: SHA-256 of the {len(payload)} joined bytes "
                            "does not match the envelope")
        self._done[key] = None
        while len(self._done) > self.max_completed:
            self._done.popitem(last=False)
        return payload

    def _make_room(self, key: tuple[str, str], cost: int, sender_budget: int) -> None:
        """Evict older partials until `cost` more bytes for message `key` fit both budgets; WireError
        "too_large" (the message dropped) when the message's own frames do not fit its sender's budget."""
        sender = key[0]
        while self.held[sender] + cost > sender_budget:
            older = self._oldest_other(sender, key)
            if older is None:
                raise self._reject(key, "too_large", f"its frames hold {self.held[sender] + cost} bytes, over the "
                                   f"{sender_budget}-byte budget of sender {sender} (headers far larger than chunks?)")
            self._evict(older, f"sender {sender} holds over its budget of {sender_budget} bytes")
        while self.held_total + cost > self.total_budget:
            candidates = [s for s in self.held if self._oldest_other(s, key) is not None]
            if not candidates:
                raise self._reject(key, "too_large", f"{cost} more bytes do not fit the total budget of "
                                   f"{self.total_budget} bytes")
            biggest = max(candidates, key=lambda s: self.held[s])
            self._evict(self._oldest_other(biggest, key),
                        f"partial messages of all senders hold over {self.total_budget} bytes")


# ---------------------------------------------------------------------------------------------- frames

_FRAME_LEN_BYTES = 4
_FRAME_FIELDS = {"envelope", "chunk", "chunk_sha256"}


@dataclass(frozen=True)
class Frame:
    """One transport message: the envelope, which chunk of the payload this is, and its bytes."""

    envelope: Envelope
    index: int
    data: memoryview  # a view into the received message: no copy until reassembly joins the chunks
    stride: int  # the uniform chunk length of the message this chunk implies
    cost: int  # bytes of the whole received message (header and chunk), which `data` keeps alive


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
    stride = chunk_stride(env.size, env.chunks, index, len(chunk))
    if sha256_hex(chunk) != _str(header, "chunk_sha256", _HEX64):
        raise WireError("bad_chunk", f"chunk {index} of message {env.msg_id}: SHA-256 mismatch (corrupted)")
    return Frame(env, index, chunk, stride, len(data))


def chunk_stride(size: int, chunks: int, index: int, length: int) -> int:
    """The chunk length c with which `split` cuts `size` bytes into `chunks` chunks, as implied by chunk
    `index` having `length` bytes: every chunk but the last has c bytes, the last 1..c (WireError "bad_chunk"
    when no such c exists, e.g. more chunks than a payload of that size can need, or empty chunks)."""
    last = index == chunks - 1
    if chunks == 1:
        ok, stride = length == size, size
    elif not last:
        ok, stride = length >= 1 and -(-size // length) == chunks, length
    else:
        rest = size - length
        stride = rest // (chunks - 1) if length >= 1 and rest > 0 else 0
        ok = length >= 1 and stride >= length and stride * (chunks - 1) == rest
    if not ok:
        raise WireError("bad_chunk", f"chunk {index} of {length} bytes cannot belong to {size} bytes cut into "
                        f"{chunks} equal chunks")
    return stride
