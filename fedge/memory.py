"""The client process's resident memory (current and peak RSS), for the metrics every task reply carries."""

from __future__ import annotations

import os
import resource
import sys

from fedge.constants import MEMORY_METRICS

_STATM = "/proc/self/statm"


def _statm_rss() -> int | None:
    """Current RSS in bytes from /proc/self/statm, or None where there is none (macOS) or it cannot be read."""
    try:
        with open(_STATM, encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes: ru_maxrss (KiB on Linux, bytes on macOS), or the
    current RSS where the kernel's peak lags behind it (it is updated at its own accounting points)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = int(peak) if sys.platform == "darwin" else int(peak) * 1024
    return max(peak, _statm_rss() or 0)


def rss_bytes() -> int:
    """The process's current resident set size in bytes (/proc/self/statm); without it (macOS), the peak."""
    current = _statm_rss()
    return peak_rss_bytes() if current is None else current


def memory_metrics() -> dict[str, float]:
    """MEMORY_METRICS (`rss_bytes`, `peak_rss_bytes`) of this process now, as task-reply metrics (finite numbers)."""
    current = rss_bytes()
    return dict(zip(MEMORY_METRICS, (float(current), float(max(current, peak_rss_bytes())))))
