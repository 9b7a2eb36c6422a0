"""`fedge doctor`: what this machine can host as a fedge client, checked before it joins a fleet.

It measures in a fresh interpreter what `import torch` and a few training steps cost here (fedge.torch_build),
reads the machine's memory and disk, and lists per zoo model whether the device profile admits it and whether its
training footprint fits beside the measured runtime in the memory available now. Problems (a CUDA build of torch
without a GPU, too little memory for any model) are listed with their fix; the exit status is 1 when there is one.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from device_profiles import DeviceProfile, fits, training_fits, training_footprint_bytes
from device_profiles.constants import RUNTIME_OPTIMIZER
from fedge.errors import UserError
from fedge.model.zoo import MODELS, create
from fedge.torch_build import TorchBuild

MB = 1e6
PROBE_TIMEOUT_S = 600.0  # `import torch` from an SD card under emulation can take minutes


class ProbeFailed(UserError):
    """The fresh interpreter that measures torch did not finish; the message has its exit status and stderr."""


def _fresh(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m fedge.torch_build ARGS` in a fresh interpreter of this Python (nothing imported here counts)."""
    root = str(Path(__file__).resolve().parents[1])  # the folder holding the packages, installed or checked out
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        return subprocess.run(
            [sys.executable, "-m", "fedge.torch_build", *args], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"importing torch and training did not finish in {timeout:.0f} s") from None


def probe_runtime(timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """fedge.torch_build's measurements. A probe killed by a signal (SIGILL: an instruction this CPU lacks) is
    reported with what the build's own check finds, without training."""
    done = _fresh([], timeout)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    died = f"exit {done.returncode}"
    if done.returncode < 0:
        try:
            died = f"killed by {signal.Signals(-done.returncode).name}"
        except ValueError:  # a signal Python has no name for
            died = f"killed by signal {-done.returncode}"
    checked = _fresh(["--problems"], timeout)
    causes = json.loads(checked.stdout.strip().splitlines()[-1]) if checked.returncode == 0 else []
    why = "; ".join(causes) or done.stderr.strip()[-2000:]
    raise ProbeFailed(f"training a few steps in a fresh interpreter failed ({died}): {why}")


def meminfo(text: str | None = None) -> dict[str, int]:
    """MemTotal and MemAvailable in bytes from /proc/meminfo (empty where there is none)."""
    if text is None:
        try:
            text = Path("/proc/meminfo").read_text()
        except OSError:
            return {}
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable") and rest.split():
            values[key] = int(rest.split()[0]) * 1024
    return values


def machine() -> dict[str, Any]:
    """Architecture, OS, Python, cores, memory and the free disk where this Python installs packages."""
    memory = meminfo()
    return {
        "arch": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "memory_total": memory.get("MemTotal"),
        "memory_available": memory.get("MemAvailable"),
        "disk_free": shutil.disk_usage(sys.prefix).free,
        "prefix": sys.prefix,
    }


def model_rows(
    profile: DeviceProfile | None,
    input_shape: tuple[int, int, int],
    classes: int,
    batch_size: int,
    widths: str,
    runtime_rss: int,
    available: int | None,
) -> list[dict[str, Any]]:
    """Per zoo model: its size, whether `profile` admits it (params, MACs and training memory, as `fedge client`
    checks; None without a profile) and whether the measured runtime plus its training footprint fits the memory
    available now (None where the machine does not say)."""
    optimizer = RUNTIME_OPTIMIZER[profile.runtime if profile else "torch"]
    rows = []
    for name in MODELS:
        spec = create(name, input_shape, classes, widths)
        footprint = training_footprint_bytes(spec, batch_size, optimizer)
        admits = None if profile is None else fits(spec, profile).ok and training_fits(spec, profile, batch_size).ok
        needs = runtime_rss + footprint.total
        rows.append(
            {
                "model": name,
                "params": spec.params,
                "macs": spec.macs,
                "footprint_mb": round(footprint.total / MB, 1),
                "needs_mb": round(needs / MB, 1),
                "profile_admits": admits,
                "fits_memory_now": None if available is None else needs <= available,
            }
        )
    return rows


def problems(runtime: dict[str, Any], rows: list[dict[str, Any]], here: dict[str, Any]) -> list[str]:
    """What stands between this machine and a client, each with what to do: the build's (the probe's
    build_problems) and memory."""
    found = list(runtime["build_problems"])
    if here["memory_available"] is not None and not any(r["fits_memory_now"] for r in rows):
        found.append(
            f"{here['memory_available'] / MB:.0f} MB of memory available is not enough for the runtime "
            f"({runtime['rss_after_training'] / MB:.0f} MB measured) and any zoo model's training at this batch "
            f"size: free memory, lower --batch-size, or use a device with more memory"
        )
    return found


def report(
    profile: DeviceProfile | None, input_shape: tuple[int, int, int], classes: int, batch_size: int, widths: str
) -> dict[str, Any]:
    """Everything `fedge doctor` prints, as one JSON-able dict."""
    runtime, here = probe_runtime(), machine()
    build = TorchBuild(**runtime["build"])
    rows = model_rows(
        profile, input_shape, classes, batch_size, widths, runtime["rss_after_training"], here["memory_available"]
    )
    return {
        "machine": here,
        "torch": runtime | {"kind": build.kind},
        "profile": profile.name if profile else None,
        "batch_size": batch_size,
        "models": rows,
        "problems": problems(runtime, rows, here),
    }


def text(r: dict[str, Any]) -> str:
    """The report as a few lines and a table."""
    m, t = r["machine"], r["torch"]
    memory = "memory unknown" if not m["memory_total"] else f"memory {m['memory_total'] / MB:.0f} MB"
    if m["memory_total"] and m["memory_available"] is not None:
        memory += f" ({m['memory_available'] / MB:.0f} MB available)"
    libraries = t["cuda_libraries"]
    lines = [
        f"machine: {m['arch']}, {m['system']}, Python {m['python']}, {m['cores']} cores, {memory}, "
        f"{m['disk_free'] / MB:.0f} MB free at {m['prefix']}",
        f"torch {t['build']['version']}: {t['kind']}{', GPU usable' if t['build']['gpu'] else ''}; import "
        f"{t['import_seconds']:.2f} s, RSS {t['rss_after_import'] / MB:.0f} MB after import, "
        f"{t['rss_after_training'] / MB:.0f} MB after a few training steps",
        "CUDA libraries mapped: "
        + (f"{len(libraries)}, {sum(libraries.values()) / MB:.0f} MB resident" if libraries else "none"),
        "",
        f"zoo models at batch {r['batch_size']} (needs: the measured runtime plus the model's training footprint)"
        + (f", against profile {r['profile']}" if r["profile"] else "")
        + ":",
    ]
    yes = {True: "yes", False: "no", None: "-"}
    lines.append(f"  {'model':14s} {'params':>9s} {'MACs':>11s} {'needs MB':>9s} {'profile':>8s} {'fits now':>9s}")
    for row in r["models"]:
        lines.append(
            f"  {row['model']:14s} {row['params']:>9,d} {row['macs']:>11,d} {row['needs_mb']:>9.1f} "
            f"{yes[row['profile_admits']]:>8s} {yes[row['fits_memory_now']]:>9s}"
        )
    lines.append("")
    lines += [f"problem: {p}" for p in r["problems"]] or ["no problems found"]
    return "\n".join(lines)
