"""safetensors blobs parsed in place: the header checked as strictly as safetensors does, tensors that view the
caller's buffer instead of copying it."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from fedge.constants import MAX_HEADER_BYTES

_LEN_BYTES = 8
ALIGNMENT = 64  # bytes: what torch's CPU allocator aligns fresh tensors to (c10's gAlignment)
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}
Buffer = bytes | bytearray | memoryview


class BlobError(ValueError):
    """A safetensors blob is malformed; the message names the defect."""


def _header(view: memoryview) -> dict[str, Any]:
    if len(view) < _LEN_BYTES:
        raise BlobError("weights blob is shorter than a safetensors header")
    n = int.from_bytes(view[:_LEN_BYTES], "little")
    if n > len(view) - _LEN_BYTES:
        raise BlobError(f"safetensors header length {n} exceeds the blob ({len(view)} bytes)")
    if n > MAX_HEADER_BYTES:
        raise BlobError(f"safetensors header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    raw = bytes(view[_LEN_BYTES : _LEN_BYTES + n])
    try:
        header = json.loads(raw.decode("utf-8")) if raw.startswith(b"{") else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BlobError(f"safetensors header is not a JSON object: {e}") from None
    if not isinstance(header, dict):
        raise BlobError("safetensors header is not a JSON object")
    return header


def metadata(data: Buffer) -> dict[str, str]:
    """The blob's `__metadata__` (empty if absent); it must map strings to strings. Raises BlobError."""
    meta = _header(memoryview(data).cast("B")).get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise BlobError("safetensors __metadata__ must map strings to strings")
    return meta


def _entry(name: str, info: Any) -> tuple[int, int, str, torch.dtype, tuple[int, ...]]:
    """(start, end, name, dtype, shape) of one header entry, its types checked."""
    if not name:
        raise BlobError("a tensor name must be a non-empty string")
    if not isinstance(info, dict) or set(info) != _ENTRY_FIELDS:
        raise BlobError(f"tensor {name!r}: an entry must be an object of exactly {sorted(_ENTRY_FIELDS)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BlobError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in shape):
        raise BlobError(f"tensor {name!r}: shape must be a list of integers >= 0, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in offsets)
        or offsets[0] > offsets[1]
    ):
        raise BlobError(f"tensor {name!r}: data_offsets must be [start, end] with 0 <= start <= end")
    return offsets[0], offsets[1], name, DTYPES[dtype], tuple(shape)


def parse(data: Buffer) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors by name) of a safetensors blob, in header order.

    The checks are safetensors' own: the header a JSON object within the blob and below MAX_HEADER_BYTES,
    metadata strings to strings, known dtypes, integer shapes, each tensor's bytes exactly its shape times its
    item size, tensors back to back from the data's start ("invalid offset") and covering it to its end ("file
    not fully covered"), BOOL bytes 0 or 1. Any defect raises BlobError.

    Every tensor comes back aligned as torch aligns fresh memory (ALIGNMENT): CPU kernels (MKL, oneDNN) round
    differently at other alignments, and a tensor received over MQTT must compute as the sender's own does in an
    in-process run (tests/integration/test_transports_agree.py). When `data` is writable and every tensor in it
    already sits at such an address, the tensors view it (no copy; they keep all of it alive); otherwise, and always
    for read-only data (bytes: tensors must not write to immutable memory), all of them are copied once into one
    fresh buffer, each at an ALIGNMENT boundary, and `data` is not held.
    """
    view = memoryview(data).cast("B")
    header = _header(view)
    meta = metadata(view)
    entries = sorted(_entry(name, info) for name, info in header.items() if name != "__metadata__")
    base = _LEN_BYTES + int.from_bytes(view[:_LEN_BYTES], "little")
    end = 0
    for start, stop, name, dtype, shape in entries:
        if start != end:
            raise BlobError(
                f"invalid offset for tensor `{name}`: it starts at byte {start}, the previous ends at {end}"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if stop - start != nbytes:
            raise BlobError(
                f"tensor `{name}`: shape {list(shape)} of {dtype} needs {nbytes} bytes, its offsets give {stop - start}"
            )
        end = stop
    if base + end != len(view):
        raise BlobError(
            f"incomplete metadata, file not fully covered: tensors cover {end} of {len(view) - base} data bytes"
        )
    src = np.frombuffer(view, dtype=np.uint8)
    for start, stop, name, dtype, _ in entries:
        if dtype == torch.bool and bool((src[base + start : base + stop] > 1).any()):
            raise BlobError(f"tensor `{name}` of dtype BOOL holds bytes other than 0 and 1")
    tensors = _views(view, base, entries) if not view.readonly else None
    tensors = tensors if tensors is not None else _packed(src, base, entries)
    return meta, {name: tensors[name] for name in header if name != "__metadata__"}


def _views(view: memoryview, base: int, entries: list[Any]) -> dict[str, torch.Tensor] | None:
    """The tensors as views of writable `view` if every one starts at an ALIGNMENT boundary, else None."""
    address = torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0
    if any((address + base + start) % ALIGNMENT for start, stop, *_ in entries if stop > start):
        return None
    tensors = {}
    for start, stop, name, dtype, shape in entries:
        count = (stop - start) // dtype.itemsize
        flat = torch.frombuffer(view, dtype=dtype, count=count, offset=base + start) if count else torch.empty(0)
        tensors[name] = flat.to(dtype).view(shape)
    return tensors


def _packed(src: np.ndarray, base: int, entries: list[Any]) -> dict[str, torch.Tensor]:
    """The tensors copied into one fresh buffer, each at an ALIGNMENT boundary (fresh torch memory is aligned)."""
    offsets, size = [], 0
    for start, stop, *_ in entries:
        offsets.append(size)
        size += -(-(stop - start) // ALIGNMENT) * ALIGNMENT
    packed = torch.empty(size, dtype=torch.uint8)
    out = packed.numpy()
    tensors = {}
    for at, (start, stop, name, dtype, shape) in zip(offsets, entries):
        out[at : at + stop - start] = src[base + start : base + stop]
        tensors[name] = packed[at : at + stop - start].view(dtype).view(shape)
    return tensors
