"""Each client's compute capacity (FedTrans Alg. 1's T_c: the most forward MACs per sample a model it trains may
have) from its device profile or from a capacity file, and which models are compatible with it."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from device_profiles import DeviceProfile, fits
from fedge.errors import UserError
from fedge.model.spec import ModelSpec
from fedge.wire.messages import client_order


class CapacityError(UserError, ValueError):
    """A capacity file is unreadable, misses clients or holds a value that is not a positive integer."""


def read_capacity_file(path: str | Path) -> dict[str, int]:
    """Client id → MACs from a JSON object ({"0": 9200000, ...}) or a CSV with the columns `client,macs` (the
    FedTrans authors' realistic.csv has id,macs: `id` is accepted for `client`). CapacityError on anything else."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise CapacityError(f"cannot read capacity file {p}: {e}") from None
    if p.suffix == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise CapacityError(f"capacity file {p} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise CapacityError(f"capacity file {p} must hold a JSON object of client id -> MACs")
        pairs = list(raw.items())
    else:
        rows = list(csv.DictReader(text.splitlines()))
        key = "client" if rows and "client" in rows[0] else "id"
        if not rows or key not in rows[0] or "macs" not in rows[0]:
            raise CapacityError(f"capacity file {p} must be JSON or a CSV with the columns client,macs")
        pairs = [(row[key], row["macs"]) for row in rows]
    out = {}
    for cid, value in pairs:
        try:
            macs = int(float(value)) if not isinstance(value, bool) else -1
        except (TypeError, ValueError):
            macs = -1
        if macs < 1:
            raise CapacityError(f"capacity file {p}: client {cid!r} has capacity {value!r}, not a positive MAC count")
        out[str(cid).strip()] = macs
    return out


def client_capacities(profiles: Mapping[str, DeviceProfile], capacity_file: str | Path | None = None) -> dict[str, int]:
    """T_c for every client: its profile's max_macs, or its row of `capacity_file` (which must list every client;
    CapacityError naming those it lacks)."""
    if not capacity_file:
        return {cid: profile.max_macs for cid, profile in profiles.items()}
    table = read_capacity_file(capacity_file)
    missing = sorted(set(profiles) - set(table), key=client_order)
    if missing:
        raise CapacityError(f"capacity file {capacity_file} has no capacity for clients {missing}")
    return {cid: table[cid] for cid in profiles}


def compatible(spec: ModelSpec, capacity: int, profile: DeviceProfile) -> bool:
    """Whether a client of this capacity and profile can train `spec`: MAC(M) ≤ T_c (FedTrans Alg. 1 line 7) and the
    profile's parameter and memory limits (its max_macs is replaced by T_c, which a capacity file may set)."""
    return fits(spec, replace(profile, max_macs=capacity)).ok
