"""What an image or .npz file declares, read from its headers before anything is decoded: PNG integrity, .npy
member shapes, dtypes and sizes."""

from __future__ import annotations

import math
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from numpy.lib import format as npy_format

# What a zip member, the zlib stream of a PNG, may raise when it is corrupt.
ZIP_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, NotImplementedError, RuntimeError, zlib.error)

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type: gray, RGB, palette, gray + alpha, RGBA
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


# ------------------------------------------------------------------------------------------------ PNG


def png_problem(path: Path) -> str | None:
    """What is missing from the PNG at `path` (e.g. "it ends before its IEND chunk"), or None when it is whole:
    every chunk complete with its CRC, an IEND, and image data that decompress to every row its header declares.
    Reads the file once, a block at a time, decompressing at most the bytes its IHDR declares. A file that cannot
    be opened or read raises OSError."""
    try:
        with open(path, "rb") as f:
            return _stream_problem(f)
    except zlib.error as e:
        return f"its image data do not decompress: {' '.join(str(e).split())}"


def _stream_problem(f: BinaryIO) -> str | None:
    """What is missing from the PNG stream `f`, or None; corrupt image data raise zlib.error."""
    if f.read(8) != _PNG_SIGNATURE:
        return "no PNG signature"
    inflate, produced, expected = zlib.decompressobj(), 0, -1
    while True:
        head = f.read(8)
        if len(head) < 8:
            return "it ends before its IEND chunk"
        left, kind = struct.unpack(">I4s", head)
        crc = zlib.crc32(kind)
        while left:
            block = f.read(min(left, 1 << 16))
            if not block:
                return f"its {repr(kind)[2:-1]} chunk is cut short"
            crc, left = zlib.crc32(block, crc), left - len(block)
            if kind == b"IHDR" and len(block) == 13 and expected < 0:
                expected = _png_stream_bytes(*struct.unpack(">IIBBBBB", block))
            while kind == b"IDAT" and block and 0 <= produced <= expected:
                produced += len(inflate.decompress(block, 1 << 16))
                block = inflate.unconsumed_tail
        if f.read(4) != struct.pack(">I", crc):
            return f"its {repr(kind)[2:-1]} chunk is cut short or its CRC is wrong"
        if kind == b"IEND":
            break
    if produced < expected:
        return f"its image data hold {produced:,} of the {expected:,} bytes its header declares"
    return None


def _png_stream_bytes(width: int, height: int, depth: int, colour: int, *rest: int) -> int:
    """The bytes a PNG's image data decompress to: a filter byte and the packed pixels of each row, of each Adam7
    pass when interlaced (`rest`: compression, filter, interlace method)."""
    bits = depth * _PNG_CHANNELS.get(colour, 4)
    total = 0
    for x0, y0, dx, dy in _ADAM7 if rest[2] else ((0, 0, 1, 1),):
        pw, ph = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if pw > 0 and ph > 0:
            total += ph * (1 + -(-pw * bits // 8))
    return total


# ------------------------------------------------------------------------------------------------ .npz


class BadMember(ValueError):
    """An .npz member whose .npy header declares what is never read: Python objects, or more bytes than the member
    holds. The message names the member (not the file) and what was wrong."""


@dataclass(frozen=True)
class Member:
    """One array of an .npz as its .npy header declares it (nothing read beyond the header)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


def npz_members(zf: zipfile.ZipFile) -> dict[str, Member]:
    """Each .npy member's declared array, by key (its name without .npy); other members are skipped. A member
    declaring Python objects, or more bytes than the zip says it holds, raises BadMember; a bad .npy header raises
    ValueError; a corrupt zip raises one of ZIP_ERRORS."""
    members = {}
    for info in zf.infolist():
        if not info.filename.endswith(".npy"):
            continue
        key = info.filename[: -len(".npy")]
        with zf.open(info) as f:
            version = npy_format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"{key}: .npy format version {version} (numpy.savez writes 1.0 or 2.0)")
            read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
            shape, _, dtype = read_header(f)
            held = info.file_size - f.tell()
        if dtype.hasobject:
            raise BadMember(
                "cannot read it as an .npz of arrays (corrupt, or holds pickled objects): "
                f"{key} holds Python objects ({dtype}), which are never unpickled"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > held:
            raise BadMember(
                f"{key} declares a {shape} {dtype} array of {nbytes:,} bytes but holds {max(held, 0):,}; "
                "the file is corrupt or was not written by numpy.savez"
            )
        members[key] = Member(info.filename, tuple(shape), dtype, nbytes)
    return members


def load_member(zf: zipfile.ZipFile, m: Member) -> np.ndarray:
    """Member `m`'s array (its size already checked by npz_members); a body shorter than its header says raises
    ValueError, a corrupt zip one of ZIP_ERRORS. Never unpickles."""
    with zf.open(m.name) as f:
        # allow_pickle=False: a device's file is data, never code to unpickle.
        return npy_format.read_array(f, allow_pickle=False)
