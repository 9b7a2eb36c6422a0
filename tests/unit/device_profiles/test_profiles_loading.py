"""Tests for reading, validating and finding device profiles (bundled, user dirs, env var)."""

from __future__ import annotations

import ast
import math
import os
import re
import sys
from pathlib import Path

import pytest

import device_profiles
from device_profiles import (
    BUNDLED_DIR,
    DeviceProfile,
    ProfileError,
    get_profile,
    list_profiles,
    load_profile,
    profile_from_mapping,
    validate_profile_file,
)

pytestmark = pytest.mark.timeout(60)

BUNDLED_NAMES = [
    "android-flagship",
    "android-low-end",
    "android-mid-range",
    "gpu-server",
    "jetson-orin-nano",
    "rpi-4",
    "rpi-5",
    "rpi-zero-2w",
]
NUMERIC_KEYS = [
    "train_macs_per_s",
    "memory_bytes",
    "max_params",
    "max_macs",
    "uplink_bps",
    "downlink_bps",
    "rtt_s",
    "availability",
]

VALID_LINES = {
    "name": 'name = "dev"',
    "description": 'description = "a test device"',
    "runtime": 'runtime = "torch"',
    "train_macs_per_s": "train_macs_per_s = 3.0e9",
    "memory_bytes": "memory_bytes = 1_073_741_824",
    "max_params": "max_params = 3_000_000",
    "max_macs": "max_macs = 60_000_000",
    "uplink_bps": "uplink_bps = 5e6",
    "downlink_bps": "downlink_bps = 50_000_000",
    "rtt_s": "rtt_s = 0.028",
    "availability": "availability = 0.5",
}


def write_profile(directory: Path, stem: str = "dev", **overrides: str | None) -> Path:
    """Write <stem>.toml from VALID_LINES; an override of None drops that key."""
    lines = dict(VALID_LINES)
    for key, line in overrides.items():
        if line is None:
            lines.pop(key)
        else:
            lines[key] = line
    path = directory / f"{stem}.toml"
    path.write_text("\n".join(lines.values()) + "\n", encoding="utf-8")
    return path


# --- bundled profiles -------------------------------------------------------------------


@pytest.mark.parametrize("name", BUNDLED_NAMES)
def test_every_bundled_profile_loads_and_validates(name: str) -> None:
    profile = get_profile(name)
    assert profile.name == name
    assert validate_profile_file(BUNDLED_DIR / f"{name}.toml") == profile
    assert Path(profile.source) == BUNDLED_DIR / f"{name}.toml"
    expected_runtime = "executorch" if name.startswith("android-") else "torch"
    assert profile.runtime == expected_runtime
    assert 0 < profile.availability <= 1


def test_list_profiles_is_sorted_and_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDGE_PROFILE_PATH", raising=False)
    names = [p.name for p in list_profiles()]
    assert names == BUNDLED_NAMES


@pytest.mark.parametrize("name", BUNDLED_NAMES)
def test_every_bundled_number_cites_a_source_or_estimate(name: str) -> None:
    lines = (BUNDLED_DIR / f"{name}.toml").read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        key = line.split("=")[0].strip()
        if key not in NUMERIC_KEYS:
            continue
        comments = [line.partition("#")[2]]
        above = index - 1
        while above >= 0 and lines[above].lstrip().startswith("#"):
            comments.append(lines[above])
            above -= 1
        text = " ".join(comments)
        assert re.search(r"\[[A-Z]+\d*\]|estimate", text), f"{name}.toml: {key} is unsourced"


def test_training_memory_of_max_params_fits_each_bundled_device() -> None:
    for profile in list_profiles():
        assert profile.max_params * 16 <= profile.memory_bytes, profile.name


# --- bad files --------------------------------------------------------------------------

BAD_CASES = {
    "missing field": ({"max_macs": None}, ["missing field 'max_macs'"]),
    "unknown field": ({"gpu": "gpu_count = 1"}, ["unknown field 'gpu_count'", "remove it"]),
    "negative number": ({"max_macs": "max_macs = -3"}, ["field 'max_macs' must be a positive integer", "got -3"]),
    "nan": ({"rtt_s": "rtt_s = nan"}, ["field 'rtt_s' must be a positive finite number", "got nan"]),
    "infinity": ({"uplink_bps": "uplink_bps = inf"}, ["field 'uplink_bps'", "got inf"]),
    "bad runtime": (
        {"runtime": 'runtime = "tflite"'},
        ["field 'runtime' must be one of ['executorch', 'torch']", "'tflite'"],
    ),
    "name differs from stem": ({"name": 'name = "other"'}, ["field 'name' is 'other'", "named 'dev'"]),
    "toml syntax error": ({"max_params": "max_params = = 3"}, ["not valid TOML", "fix"]),
    "float for integer": (
        {"memory_bytes": "memory_bytes = 1.5e9"},
        ["field 'memory_bytes' must be a positive integer", "got 1500000000.0"],
    ),
    "bool for integer": (
        {"max_params": "max_params = true"},
        ["field 'max_params' must be a positive integer", "got True"],
    ),
    "availability above 1": (
        {"availability": "availability = 1.5"},
        ["field 'availability' must be a probability in (0, 1]", "got 1.5"],
    ),
    "availability zero": ({"availability": "availability = 0"}, ["field 'availability'", "got 0"]),
    "string for number": (
        {"train_macs_per_s": 'train_macs_per_s = "fast"'},
        ["field 'train_macs_per_s'", "got 'fast'"],
    ),
    "empty description": ({"description": 'description = ""'}, ["field 'description' must be a non-empty string"]),
    "source key": ({"source": 'source = "x"'}, ["field 'source' is set by the loader"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_file_names_file_and_field(case: str, tmp_path: Path) -> None:
    overrides, expected = BAD_CASES[case]
    path = write_profile(tmp_path, **overrides)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert str(path) in message and "dev.toml" in message
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert isinstance(info.value, ValueError)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write_profile(tmp_path, max_macs="max_macs = -3", rtt_s=None, extra="colour = 'red'")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert len(info.value.problems) == 3
    assert all(line.startswith(f"{path}: ") for line in str(info.value).splitlines())


def test_missing_file_is_a_profile_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "nope.toml")


def test_valid_file_gives_exact_values(tmp_path: Path) -> None:
    profile = load_profile(write_profile(tmp_path))
    assert profile == DeviceProfile(
        name="dev",
        description="a test device",
        runtime="torch",
        train_macs_per_s=3.0e9,
        memory_bytes=1_073_741_824,
        max_params=3_000_000,
        max_macs=60_000_000,
        uplink_bps=5e6,
        downlink_bps=50e6,
        rtt_s=0.028,
        availability=0.5,
        source=str(tmp_path / "dev.toml"),
    )
    assert isinstance(profile.downlink_bps, float)


def test_direct_construction_is_validated() -> None:
    good = get_profile("rpi-4").to_dict()
    with pytest.raises(ProfileError, match=r"<wire>: field 'rtt_s'.*got -1"):
        DeviceProfile(**{**good, "rtt_s": -1.0}, source="<wire>")
    with pytest.raises(ProfileError, match="availability"):
        DeviceProfile(**{**good, "availability": math.nan})


def test_to_dict_round_trips_through_profile_from_mapping() -> None:
    profile = get_profile("android-mid-range")
    again = profile_from_mapping(profile.to_dict(), source=profile.source)
    assert again == profile
    assert "source" not in profile.to_dict()


# --- lookup, user directories, overrides ------------------------------------------------


def test_unknown_name_lists_available_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDGE_PROFILE_PATH", raising=False)
    with pytest.raises(ProfileError) as info:
        get_profile("rpi4")
    message = str(info.value)
    assert message.startswith("rpi4: unknown device profile")
    assert ", ".join(BUNDLED_NAMES) in message
    assert "FEDGE_PROFILE_PATH" in message


def test_get_profile_by_path(tmp_path: Path) -> None:
    path = write_profile(tmp_path)
    assert get_profile(str(path)).name == "dev"
    assert get_profile(path).source == str(path)


def test_extra_dirs_override_bundled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDGE_PROFILE_PATH", raising=False)
    write_profile(tmp_path, stem="rpi-4", name='name = "rpi-4"', description='description = "my overclocked pi"')
    write_profile(tmp_path, stem="zz-custom", name='name = "zz-custom"')
    assert get_profile("rpi-4", extra_dirs=[tmp_path]).description == "my overclocked pi"
    assert get_profile("rpi-4").description != "my overclocked pi"
    listed = list_profiles(extra_dirs=[tmp_path])
    assert [p.name for p in listed] == BUNDLED_NAMES + ["zz-custom"]
    assert next(p for p in listed if p.name == "rpi-4").source == str(tmp_path / "rpi-4.toml")


def test_env_var_overrides_bundled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    write_profile(first, stem="rpi-5", name='name = "rpi-5"', description='description = "A"')
    write_profile(second, stem="rpi-5", name='name = "rpi-5"', description='description = "B"')
    monkeypatch.setenv("FEDGE_PROFILE_PATH", os.pathsep.join([str(first), str(second), ""]))
    assert get_profile("rpi-5").description == "A"  # earlier entry wins, like PATH
    assert get_profile("rpi-5", extra_dirs=[second]).description == "B"  # argument beats env


def test_missing_user_dir_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDGE_PROFILE_PATH", raising=False)
    with pytest.raises(ProfileError, match="does not exist"):
        get_profile("rpi-4", extra_dirs=[tmp_path / "missing"])
    monkeypatch.setenv("FEDGE_PROFILE_PATH", str(tmp_path / "gone"))
    with pytest.raises(ProfileError, match="FEDGE_PROFILE_PATH"):
        list_profiles()


def test_single_string_extra_dirs_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="collection"):
        get_profile("rpi-4", extra_dirs=str(tmp_path))  # type: ignore[arg-type]


def test_broken_user_file_is_not_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDGE_PROFILE_PATH", raising=False)
    write_profile(tmp_path, stem="rpi-4", name='name = "rpi-4"', max_macs="max_macs = 0")
    with pytest.raises(ProfileError, match=r"rpi-4\.toml: field 'max_macs'"):
        list_profiles(extra_dirs=[tmp_path])


# --- package rule -----------------------------------------------------------------------


def test_package_imports_only_stdlib() -> None:
    allowed = set(sys.stdlib_module_names) | {"device_profiles", "tomllib", "tomli", "__future__"}
    for file in Path(device_profiles.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            assert set(roots) <= allowed, f"{file.name} imports {roots}"
