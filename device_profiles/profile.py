"""The DeviceProfile record, its validation, and reading one profile from a TOML file."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from device_profiles.constants import ALLOWED_RUNTIMES, PROFILE_NAME_PATTERN

PathLike = Union[str, Path]

_STR_FIELDS = ("name", "description", "runtime")
_INT_FIELDS = ("memory_bytes", "max_params", "max_macs")
_FLOAT_FIELDS = ("train_macs_per_s", "uplink_bps", "downlink_bps", "rtt_s", "availability")
# Keys a profile file must hold: every field except `source`, which the loader sets.
FILE_KEYS: tuple[str, ...] = _STR_FIELDS + _FLOAT_FIELDS[:1] + _INT_FIELDS + _FLOAT_FIELDS[1:]

_EXAMPLES = {
    "memory_bytes": "1_073_741_824",
    "max_params": "3_000_000",
    "max_macs": "60_000_000",
    "train_macs_per_s": "3.0e9",
    "uplink_bps": "5.0e6",
    "downlink_bps": "50.0e6",
    "rtt_s": "0.028",
}


class ProfileError(ValueError):
    """A device profile is missing, unreadable or invalid.

    `source` is the file (or other origin) concerned and `problems` holds one line per
    problem; the message is those lines joined, each naming the source and the field.
    """

    def __init__(self, source: str, problems: list[str] | tuple[str, ...]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in self.problems))


@dataclass(frozen=True)
class DeviceProfile:
    """What one kind of device can do; all numbers are positive and finite.

    Units: MAC/s, bytes, parameters, forward MACs per sample, bit/s, seconds; availability
    is the probability in (0, 1] that the device is online when selected. Construction
    with an invalid value raises ProfileError naming `source` and the field.
    """

    name: str
    description: str
    runtime: str
    train_macs_per_s: float
    memory_bytes: int
    max_params: int
    max_macs: int
    uplink_bps: float
    downlink_bps: float
    rtt_s: float
    availability: float
    source: str = "<memory>"

    def __post_init__(self) -> None:
        problems = [p for f in FILE_KEYS if (p := field_problem(f, getattr(self, f)))]
        if problems:
            raise ProfileError(self.source, problems)

    def to_dict(self) -> dict[str, Any]:
        """The profile as a plain dict of the file keys (no `source`), e.g. for JSON."""
        return {f: getattr(self, f) for f in FILE_KEYS}


def field_problem(field: str, value: object) -> str | None:
    """One-line description of what is wrong with `value` for `field`, or None if valid.

    An unknown `field` is reported as a problem, never raised.
    """
    if field in _STR_FIELDS:
        return _str_problem(field, value)
    if field in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return f"field {field!r} must be a positive integer (e.g. {_EXAMPLES[field]}), got {value!r}"
        return None
    if field in _FLOAT_FIELDS:
        return _float_problem(field, value)
    return f"unknown field {field!r}; allowed fields: {', '.join(FILE_KEYS)}"


def _str_problem(field: str, value: object) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return f"field {field!r} must be a non-empty string, got {value!r}"
    if field == "runtime" and value not in ALLOWED_RUNTIMES:
        return f"field 'runtime' must be one of {sorted(ALLOWED_RUNTIMES)}, got {value!r}"
    if field == "name" and not re.fullmatch(PROFILE_NAME_PATTERN, value):
        return f"field 'name' must match {PROFILE_NAME_PATTERN} (letters, digits, '-', '_', '.'), got {value!r}"
    return None


def _float_problem(field: str, value: object) -> str | None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if field == "availability":
        if not is_number or not math.isfinite(value) or not 0 < value <= 1:
            return f"field 'availability' must be a probability in (0, 1] (e.g. 0.5), got {value!r}"
        return None
    if not is_number or not math.isfinite(value) or value <= 0:
        return f"field {field!r} must be a positive finite number (e.g. {_EXAMPLES[field]}), got {value!r}"
    return None


def profile_from_mapping(data: Mapping[str, object], source: str, expected_name: str | None = None) -> DeviceProfile:
    """Build a validated DeviceProfile from a flat mapping of the file keys.

    Raises ProfileError listing every problem at once: unknown keys, missing keys, bad
    values, and (if `expected_name` is given) a `name` that differs from it.
    """
    problems: list[str] = []
    for key in data:
        if key == "source":
            problems.append("field 'source' is set by the loader; remove it from the file")
        elif key not in FILE_KEYS:
            problems.append(f"unknown field {key!r}; remove it (allowed fields: {', '.join(FILE_KEYS)})")
    for key in FILE_KEYS:
        if key not in data:
            problems.append(f"missing field {key!r}; add it (e.g. {key} = {_EXAMPLES.get(key, '...')})")
        elif problem := field_problem(key, data[key]):
            problems.append(problem)
    name = data.get("name")
    if expected_name is not None and isinstance(name, str) and name != expected_name:
        problems.append(f"field 'name' is {name!r} but the file is named {expected_name!r}; make them equal")
    if problems:
        raise ProfileError(source, problems)
    values = {k: float(v) if k in _FLOAT_FIELDS else v for k, v in data.items()}
    return DeviceProfile(**values, source=source)  # type: ignore[arg-type]


def load_profile(path: PathLike) -> DeviceProfile:
    """Read and validate one profile file; its `name` must equal the file's stem.

    Raises ProfileError (naming the file) if the file is missing or unreadable, is not
    valid TOML, or fails validation (see profile_from_mapping).
    """
    file = Path(path)
    source = str(file)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(source, ["no such profile file; check the path"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(source, [f"cannot read the file ({exc})"]) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(source, [f"not valid TOML ({exc}); fix the syntax"]) from exc
    return profile_from_mapping(data, source, expected_name=file.stem)
