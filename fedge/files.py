"""Writing state to disk: the one atomic write (temp file, fsync, rename) every file of fedge goes through."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Write `data` to `path` so that a crash or an error leaves either the old file or the new one under that
    name, never a torn one; creates missing parent folders.

    The temp file gets permission bits `mode` before its first byte is written (so 0o600, the default, keeps
    secrets private from the start); the file then replaces `path` with those bits. A failing write removes
    the temp file and raises the OSError.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
