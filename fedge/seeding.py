"""Deterministic seeds derived from a run seed and names, so every component draws independently."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part (order matters); equal parts give equal seeds."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
