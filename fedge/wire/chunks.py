"""Chunking a payload into transport frames and joining arriving frames back into whole payloads, in bounded memory."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

from fedge.constants import (
    CHUNK_SIZE,
    MAX_CHUNK_BYTES,
    MAX_COMPLETED_IDS,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    PENDING_CHUNK_OVERHEAD_BYTES,
    PENDING_MESSAGE_OVERHEAD_BYTES,
    PENDING_SENDER_BYTES,
    PENDING_TOTAL_BYTES,
)
from fedge.wire.envelope import (
    HEX64,
    Envelope,
    WireError,
    check_int,
    check_str,
    chunk_digests,
    exact_keys,
    json_loads,
    root_sha256,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- chunking


def split(payload: bytes | memoryview, chunk_size: int = CHUNK_SIZE) -> list[bytes | memoryview]:
    """Cut `payload` into chunks of `chunk_size` bytes (the last may be shorter; b"" gives [b""]).

    A chunk_size below 1 raises WireError "bad_chunk".
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise WireError("bad_chunk", f"chunk_size must be a positive integer, got {chunk_size!r}")
    return [payload[i : i + chunk_size] for i in range(0, len(payload), chunk_size)] or [b""]


@dataclass
class _Partial:
    """A message whose chunks are arriving: what its first frame announced, the chunks so far, their cost."""

    sender: str
    total: int
    sha256: str
    size: int
    stride: int  # the uniform chunk length its frames imply (see unframe)
    joined: bytearray = field(default_factory=bytearray)  # chunks 0..done-1, copied out of their frames in order
    done: int = 0
    parts: dict[int, memoryview] = field(default_factory=dict)  # chunks that came early: views into their frames
    digests: dict[int, bytes] = field(default_factory=dict)  # each kept chunk's SHA-256, checked by unframe
    cost: int = 0  # bytes charged: whole frames as received, plus bookkeeping (see ChunkJoiner)

    def has(self, index: int) -> bool:
        """Whether chunk `index` is already kept (joined or held)."""
        return index < self.done or index in self.parts

    def keep(self, index: int, data: memoryview, digest: bytes) -> None:
        """Append the chunk to the joined bytes if it is the next one, with the early ones it unblocks (so the
        copy happens while the rest arrive, and its frame is released); else hold it as it came."""
        self.digests[index] = digest
        self.parts[index] = data
        while self.done in self.parts:
            self.joined += self.parts.pop(self.done)
            self.done += 1


class ChunkJoiner:
    """Joins chunks of many messages arriving in any order, with duplicates, in bounded memory.

    What a partial message holds is counted as its frames' whole bytes as received plus
    PENDING_CHUNK_OVERHEAD_BYTES per chunk and PENDING_MESSAGE_OVERHEAD_BYTES per message: exact for a chunk
    that came early (a view into its frame, so the header stays alive with it), an upper bound for chunks
    joined in order (copied onto the message's bytes as they arrive, their frames released). A sender may
    hold `sender_budget` bytes, or twice the size limit of the message being joined if that is more; all
    senders together `total_budget`. Over a budget, the oldest partial of that sender (or, over the total, of
    the sender holding most) is evicted, counted per sender in `evicted` and logged at the 1st, 2nd, 4th, 8th,
    ... eviction of each sender. The ids of the last `max_completed` finished messages are remembered so late
    duplicates are recognised.
    """

    def __init__(
        self,
        sender_budget: int = PENDING_SENDER_BYTES,
        total_budget: int = PENDING_TOTAL_BYTES,
        max_completed: int = MAX_COMPLETED_IDS,
    ):
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
            log.warning(
                "evicted partial message %s from %s (%d of %d chunks, %d bytes held): %s; %d eviction(s) "
                "from this sender so far",
                key[1],
                p.sender,
                len(p.digests),
                p.total,
                p.cost,
                why,
                n,
            )

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

    def add(self, sender: str, frame: Frame, max_size: int = MAX_PAYLOAD_BYTES) -> bytearray | None:
        """Keep one frame's chunk; return the joined payload when the last one arrives (once), else None.

        A frame whose envelope disagrees with earlier frames of its message (count, hash, size, chunk length)
        raises WireError "bad_chunk"; an announced size above `max_size` "too_large", as does a message whose
        frames alone exceed its sender's budget; chunk digests whose root (root_sha256) differs from the
        envelope's "hash_mismatch". Each rejection drops the message's partial state. Repeated chunks and chunks
        of finished messages count as duplicates. The payload is a new bytearray (writable: decoded tensors
        view it in place).
        """
        env, key = frame.envelope, (sender, frame.envelope.msg_id)
        if key in self._done:
            self.duplicates += 1
            return None
        if env.size > min(max_size, MAX_PAYLOAD_BYTES):
            raise self._reject(key, "too_large", f"{env.size} bytes exceed the cap of {max_size}")
        p = self._pending.get(sender, {}).get(env.msg_id)
        if p is not None and (p.total, p.sha256, p.size, p.stride) != (env.chunks, env.sha256, env.size, frame.stride):
            raise self._reject(
                key,
                "bad_chunk",
                f"chunk {frame.index} says {env.chunks} chunks of {frame.stride} "
                f"bytes, {env.size} bytes, sha {env.sha256[:12]}; earlier chunks said {p.total} of "
                f"{p.stride}, {p.size}, {p.sha256[:12]}",
            )
        if p is not None and p.has(frame.index):
            self.duplicates += 1
            return None
        cost = frame.cost + PENDING_CHUNK_OVERHEAD_BYTES + (PENDING_MESSAGE_OVERHEAD_BYTES if p is None else 0)
        self._make_room(key, cost, max(self.sender_budget, 2 * max_size + PENDING_MESSAGE_OVERHEAD_BYTES))
        if p is None:
            p = _Partial(sender, env.chunks, env.sha256, env.size, frame.stride)
            self._pending.setdefault(sender, OrderedDict())[env.msg_id] = p
        p.keep(frame.index, frame.data, frame.digest)
        p.cost += cost
        self.held[sender] += cost
        if p.done < p.total:
            return None
        self._drop(key)
        if root_sha256([p.digests[i] for i in range(p.total)]) != p.sha256:
            raise WireError(
                "hash_mismatch",
                f"message {key[1]}: the root SHA-256 over its {p.total} chunk digests does not match the envelope",
            )
        payload = p.joined
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
                raise self._reject(
                    key,
                    "too_large",
                    f"its frames hold {self.held[sender] + cost} bytes, over the "
                    f"{sender_budget}-byte budget of sender {sender} (headers far larger than chunks?)",
                )
            self._evict(older, f"sender {sender} holds over its budget of {sender_budget} bytes")
        while self.held_total + cost > self.total_budget:
            candidates = [s for s in self.held if self._oldest_other(s, key) is not None]
            if not candidates:
                raise self._reject(
                    key, "too_large", f"{cost} more bytes do not fit the total budget of {self.total_budget} bytes"
                )
            biggest = max(candidates, key=lambda s: self.held[s])
            self._evict(
                self._oldest_other(biggest, key), f"partial messages of all senders hold over {self.total_budget} bytes"
            )


# ---------------------------------------------------------------------------------------------- frames

_FRAME_LEN_BYTES = 4
_FRAME_FIELDS = {"envelope", "chunk", "chunk_sha256"}


@dataclass(frozen=True)
class Frame:
    """One transport message: the envelope, which chunk of the payload this is, and its bytes."""

    envelope: Envelope
    index: int
    data: memoryview  # a view into the received message: no copy until the joiner joins the chunks
    stride: int  # the uniform chunk length of the message this chunk implies
    cost: int  # bytes of the whole received message (header and chunk), which `data` keeps alive
    digest: bytes  # SHA-256 of `data`, as the frame announced it and as checked


def frames(env: Envelope, payload: bytes | bytearray, chunk_size: int = CHUNK_SIZE) -> list[bytes]:
    """The transport messages carrying `payload`: 4-byte LE header length, JSON header (envelope, chunk
    index, chunk SHA-256), chunk bytes. `env` must have been made for this payload and chunk size (WireError
    "bad_chunk" when its size, chunk count or root hash say otherwise)."""
    return list(iter_frames(env, payload, chunk_size))


def iter_frames(env: Envelope, payload: bytes | bytearray, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """`frames`, one at a time. The chunk digests are those the envelope was made with (Envelope.new keeps
    them), else they are computed here."""
    view = memoryview(payload).cast("B")
    parts = split(view, chunk_size)
    digests = list(env.digests) if env.digests is not None else chunk_digests(view, chunk_size)
    if (len(parts), len(view), len(digests), root_sha256(digests)) != (env.chunks, env.size, env.chunks, env.sha256):
        raise WireError(
            "bad_chunk",
            f"envelope announces {env.chunks} chunks of {env.size} bytes, sha "
            f"{env.sha256[:12]}; the payload gives {len(parts)} of {len(view)}, sha "
            f"{root_sha256(digests)[:12]}",
        )
    head = json.dumps(env.to_dict(), sort_keys=True, separators=(",", ":"))
    for i, (part, digest) in enumerate(zip(parts, digests)):
        header = f'{{"chunk":{i},"chunk_sha256":"{digest.hex()}","envelope":{head}}}'.encode()
        yield b"".join((len(header).to_bytes(_FRAME_LEN_BYTES, "little"), header, part))


def unframe(data: bytes) -> Frame:
    """Parse and check one transport message: header size, envelope, chunk index within the announced
    count, chunk size cap and chunk SHA-256 (WireError "bad_chunk"); nothing is decoded beyond that."""
    if len(data) < _FRAME_LEN_BYTES:
        raise WireError("bad_format", f"a {len(data)}-byte message is too short to be a fedge frame")
    n = int.from_bytes(data[:_FRAME_LEN_BYTES], "little")
    if n > MAX_HEADER_BYTES or n > len(data) - _FRAME_LEN_BYTES:
        raise WireError(
            "bad_format",
            f"frame header length {n} is over the cap or beyond the {len(data)}-byte message; not a fedge frame",
        )
    header = exact_keys(
        json_loads(data[_FRAME_LEN_BYTES : _FRAME_LEN_BYTES + n], "frame header"), _FRAME_FIELDS, "frame header"
    )
    env = Envelope.from_dict(header["envelope"])
    index = check_int(header, "chunk")
    chunk = memoryview(data)[_FRAME_LEN_BYTES + n :]
    if index >= env.chunks:
        raise WireError("bad_chunk", f"chunk {index} of a message announced with {env.chunks} chunks")
    if len(chunk) > MAX_CHUNK_BYTES:
        raise WireError("too_large", f"chunk of {len(chunk)} bytes exceeds {MAX_CHUNK_BYTES}")
    stride = chunk_stride(env.size, env.chunks, index, len(chunk))
    announced = check_str(header, "chunk_sha256", HEX64)
    digest = hashlib.sha256(chunk).digest()
    if digest.hex() != announced:
        raise WireError("bad_chunk", f"chunk {index} of message {env.msg_id}: SHA-256 mismatch (corrupted)")
    return Frame(env, index, chunk, stride, len(data), digest)


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
        raise WireError(
            "bad_chunk", f"chunk {index} of {length} bytes cannot belong to {size} bytes cut into {chunks} equal chunks"
        )
    return stride
