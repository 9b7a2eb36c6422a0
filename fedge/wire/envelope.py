"""The message envelope, the wire's error type and reasons, strict JSON field checks, and the SHA-256 helpers."""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fedge.constants import (
    CHUNK_SIZE,
    HASH_PARALLEL_MIN_BYTES,
    HASH_THREADS,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_TTL_S,
    MESSAGE_TTL_S,
    SUPPORTED_SCHEMA_VERSIONS,
    WIRE_SCHEMA_VERSION,
)

MESSAGE_TYPES = ("register", "task", "result", "status", "ack")
REASONS = (
    "bad_format",
    "schema_version",
    "too_large",
    "hash_mismatch",
    "bad_chunk",
    "bad_weights",
    "bad_spec",
    "over_memory",
    "bad_value",
    "spoof",
    "wrong_run",
    "expired",
    "stale_round",
    "no_open_task",
    "duplicate",
    "clock_skew",
    "bad_ttl",
)
HEX64 = re.compile(r"[0-9a-f]{64}")
HEX32 = re.compile(r"[0-9a-f]{32}")


class WireError(ValueError):
    """A message, payload or chunk was rejected; `reason` is a short code from REASONS, the text says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


# ---------------------------------------------------------------------------------------------- SHA-256


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """Lowercase hex SHA-256 of `data`."""
    return hashlib.sha256(data).hexdigest()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="fedge-sha256")
        return _pool


def chunk_digests(payload: bytes | bytearray | memoryview, chunk_size: int = CHUNK_SIZE) -> list[bytes]:
    """The SHA-256 digest of each chunk `payload` is cut into (chunks of `chunk_size` bytes, the last shorter; an
    empty payload is one empty chunk). Large payloads are hashed on HASH_THREADS threads (hashlib releases the
    GIL). A chunk_size below 1 raises WireError "bad_chunk"."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise WireError("bad_chunk", f"chunk_size must be a positive integer, got {chunk_size!r}")
    view = memoryview(payload).cast("B")
    parts = [view[i : i + chunk_size] for i in range(0, len(view), chunk_size)] or [view]
    if len(view) < HASH_PARALLEL_MIN_BYTES or len(parts) < 2:
        return [hashlib.sha256(p).digest() for p in parts]
    return list(_hash_pool().map(lambda p: hashlib.sha256(p).digest(), parts))


def root_sha256(digests: list[bytes]) -> str:
    """The message hash an envelope carries: hex SHA-256 over the concatenated 32-byte chunk digests, in order.
    Each chunk is checked against its own digest on arrival, so every byte is hashed once per side."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


# ---------------------------------------------------------------------------------------------- checks


def check_int(d: dict[str, Any], key: str, minimum: int = 0) -> int:
    """d[key] as an integer >= minimum (bools refused); else WireError "bad_format"."""
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise WireError("bad_format", f"field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def check_str(d: dict[str, Any], key: str, pattern: re.Pattern[str] | None = None) -> str:
    """d[key] as a non-empty string (matching `pattern` in full, if given); else WireError "bad_format"."""
    v = d[key]
    if not isinstance(v, str) or not v or (pattern is not None and not pattern.fullmatch(v)):
        raise WireError(
            "bad_format",
            f"field {key!r} must be a non-empty string"
            + (f" matching {pattern.pattern}" if pattern else "")
            + f", got {v!r}",
        )
    return v


def check_float(d: dict[str, Any], key: str) -> float:
    """d[key] as a finite number (bools refused); else WireError "bad_format"."""
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WireError("bad_format", f"field {key!r} must be a finite number, got {v!r}")
    return float(v)


def exact_keys(d: Any, expected: set[str], what: str) -> dict[str, Any]:
    """`d` itself when it is a JSON object with exactly the `expected` keys; else WireError "bad_format"
    naming the missing and unknown ones."""
    if not isinstance(d, dict):
        raise WireError("bad_format", f"{what} must be a JSON object, got {type(d).__name__}")
    missing, extra = sorted(expected - set(d)), sorted(set(d) - expected)
    if missing or extra:
        raise WireError("bad_format", f"{what}: missing fields {missing}, unknown fields {extra}")
    return d


def check_finite_json(v: Any, where: str) -> None:
    """Reject NaN/Inf anywhere inside a JSON value (WireError "bad_value")."""
    if isinstance(v, float) and not math.isfinite(v):
        raise WireError("bad_value", f"{where} contains a non-finite number")
    if isinstance(v, dict):
        for k, x in v.items():
            check_finite_json(x, f"{where}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            check_finite_json(x, f"{where}[{i}]")


def json_loads(data: bytes | bytearray | memoryview, what: str) -> Any:
    """Parse UTF-8 JSON; anything else (bad UTF-8, bad JSON, nesting too deep) is WireError "bad_format"."""
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WireError("bad_format", f"{what} is not UTF-8 JSON: {e}") from None


# ---------------------------------------------------------------------------------------------- envelope

_ENVELOPE_FIELDS = {
    "schema_version",
    "run",
    "round",
    "type",
    "msg_id",
    "reply_to",
    "sender",
    "created_at",
    "ttl_s",
    "sha256",
    "size",
    "chunks",
}


def check_schema_version(version: Any) -> int:
    """`version` when this side speaks it; an integer it does not speak is WireError "schema_version" saying
    which side to upgrade, anything else "bad_format"."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise WireError("bad_format", f"envelope schema_version must be an integer, got {version!r}")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        speaks = " or ".join(str(v) for v in SUPPORTED_SCHEMA_VERSIONS)
        upgrade = "the sender" if version < min(SUPPORTED_SCHEMA_VERSIONS) else "this side"
        raise WireError("schema_version", f"schema version {version}, this side speaks {speaks}; upgrade {upgrade}")
    return version


@dataclass(frozen=True)
class Envelope:
    """Metadata sent with every message. The payload's bytes are tied to it by `size`, `chunks` (the number of
    equal chunks it is cut into, the last shorter) and `sha256`, the root over the chunks' SHA-256 digests
    (see root_sha256). `digests` holds those digests on the side that made the envelope, so that sending
    does not hash again; it never travels."""

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
    digests: tuple[bytes, ...] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def new(
        cls,
        run: str,
        round: int,
        type: str,
        sender: str,
        payload: bytes | bytearray | memoryview,
        reply_to: str | None = None,
        ttl_s: float = MESSAGE_TTL_S,
        chunk_size: int = CHUNK_SIZE,
    ) -> Envelope:
        """An envelope for `payload` cut in `chunk_size` chunks, with a fresh msg_id and the current time; bad
        fields raise WireError."""
        digests = tuple(chunk_digests(payload, chunk_size))
        env = cls.from_dict(
            {
                "schema_version": WIRE_SCHEMA_VERSION,
                "run": run,
                "round": round,
                "type": type,
                "msg_id": uuid.uuid4().hex,
                "reply_to": reply_to,
                "sender": sender,
                "created_at": time.time(),
                "ttl_s": float(ttl_s),
                "sha256": root_sha256(list(digests)),
                "size": len(memoryview(payload).cast("B")),
                "chunks": len(digests),
            }
        )
        return cls(**{**env.to_dict(), "digests": digests})  # validated above: what we are about to send

    def expired(self, now: float | None = None) -> bool:
        """True once created_at + ttl_s lies in the past."""
        return (time.time() if now is None else now) > self.created_at + self.ttl_s

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in sorted(_ENVELOPE_FIELDS)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, d: Any) -> Envelope:
        """Validate strictly: a schema_version this side does not speak raises WireError "schema_version", a
        payload size above MAX_PAYLOAD_BYTES "too_large", any missing/unknown field or wrong type or value
        "bad_format"."""
        if not isinstance(d, dict):
            raise WireError("bad_format", f"an envelope must be a JSON object, got {type(d).__name__}")
        version = check_schema_version(d.get("schema_version"))
        exact_keys(d, _ENVELOPE_FIELDS, "envelope")
        if d["type"] not in MESSAGE_TYPES:
            raise WireError("bad_format", f"envelope type {d['type']!r} is not one of {list(MESSAGE_TYPES)}")
        reply_to = d["reply_to"]
        if reply_to is not None:
            check_str(d, "reply_to", HEX32)
        env = cls(
            version,
            check_str(d, "run"),
            check_int(d, "round"),
            d["type"],
            check_str(d, "msg_id", HEX32),
            reply_to,
            check_str(d, "sender"),
            check_float(d, "created_at"),
            check_float(d, "ttl_s"),
            check_str(d, "sha256", HEX64),
            check_int(d, "size"),
            check_int(d, "chunks", minimum=1),
        )
        if not 0 < env.ttl_s <= MAX_TTL_S:
            raise WireError("bad_ttl", f"envelope ttl_s must lie in (0, {MAX_TTL_S:g}] s, got {env.ttl_s:g}")
        if env.size > MAX_PAYLOAD_BYTES:
            raise WireError("too_large", f"payload of {env.size} bytes exceeds the cap of {MAX_PAYLOAD_BYTES}")
        return env

    @classmethod
    def from_json(cls, text: str | bytes) -> Envelope:
        """Parse and validate (see from_dict); text above MAX_HEADER_BYTES raises WireError "too_large"."""
        raw = text.encode("utf-8") if isinstance(text, str) else text
        if len(raw) > MAX_HEADER_BYTES:
            raise WireError("too_large", f"envelope of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
        return cls.from_dict(json_loads(raw, "envelope"))
