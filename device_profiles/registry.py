"""Finding device profiles by name: bundled files, user directories, FEDGE_PROFILE_PATH.

Search order, highest priority first: the `extra_dirs` argument (in order), then the
directories in the FEDGE_PROFILE_PATH environment variable (os.pathsep separated, in
order), then the profiles bundled in device_profiles/profiles/. A file <name>.toml in a
higher-priority directory overrides every lower one with the same name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from device_profiles.constants import PROFILE_PATH_ENV, PROFILE_SUFFIX
from device_profiles.profile import DeviceProfile, PathLike, ProfileError, load_profile

BUNDLED_DIR = Path(__file__).resolve().parent / "profiles"


def search_dirs(extra_dirs: Iterable[PathLike] = ()) -> list[Path]:
    """Profile directories, highest priority first (bundled directory last).

    Raises TypeError if `extra_dirs` is a single string or path instead of a collection,
    and ProfileError if a named directory does not exist. Empty FEDGE_PROFILE_PATH
    entries (e.g. a trailing separator) are ignored.
    """
    if isinstance(extra_dirs, (str, Path)):
        raise TypeError(
            f"extra_dirs must be a collection of directories, e.g. [{str(extra_dirs)!r}], not a single path"
        )
    user = [(Path(d), "extra_dirs") for d in extra_dirs]
    env_value = os.environ.get(PROFILE_PATH_ENV, "")
    user += [(Path(d), PROFILE_PATH_ENV) for d in env_value.split(os.pathsep) if d]
    for directory, origin in user:
        if not directory.is_dir():
            raise ProfileError(
                str(directory),
                [
                    f"profile directory (from {origin}) does not exist or is not a "
                    f"directory; create it or remove it from {origin}"
                ],
            )
    return [d for d, _ in user] + [BUNDLED_DIR]


def profile_files(extra_dirs: Iterable[PathLike] = ()) -> dict[str, Path]:
    """Map each visible profile name to the file that wins for it (see module docstring).

    Raises like search_dirs. Files are not parsed here, so a broken file is only
    reported when it is loaded.
    """
    found: dict[str, Path] = {}
    for directory in reversed(search_dirs(extra_dirs)):
        for file in sorted(directory.glob(f"*{PROFILE_SUFFIX}")):
            found[file.stem] = file
    return found


def _looks_like_path(name_or_path: PathLike) -> bool:
    if isinstance(name_or_path, Path):
        return True
    seps = [s for s in (os.sep, os.altsep, "/") if s]
    return name_or_path.endswith(PROFILE_SUFFIX) or any(s in name_or_path for s in seps)


def get_profile(name_or_path: PathLike, extra_dirs: Iterable[PathLike] = ()) -> DeviceProfile:
    """A profile by name (bundled or from a user directory), or from a .toml file path.

    A Path, or a string ending in .toml or containing a path separator, is read as a
    file. Raises ProfileError for an unknown name (the message lists the available
    names) and for any invalid or unreadable file (naming the file and field).
    """
    if _looks_like_path(name_or_path):
        return load_profile(name_or_path)
    files = profile_files(extra_dirs)
    if name_or_path not in files:
        raise ProfileError(
            str(name_or_path),
            [
                f"unknown device profile; available: {', '.join(sorted(files))}. "
                f"Pass a path to a {PROFILE_SUFFIX} file, or add its directory to "
                f"{PROFILE_PATH_ENV}"
            ],
        )
    return load_profile(files[name_or_path])


def list_profiles(extra_dirs: Iterable[PathLike] = ()) -> list[DeviceProfile]:
    """Every visible profile (after overrides), sorted by name.

    Raises ProfileError if any visible file is invalid: a broken user file is an error,
    not something to skip silently.
    """
    return [load_profile(path) for _, path in sorted(profile_files(extra_dirs).items())]


def validate_profile_file(path: PathLike) -> DeviceProfile:
    """Check one profile file and return the profile it defines.

    Raises ProfileError listing every problem (one line each, naming file and field):
    unreadable file, TOML syntax, missing or unknown keys, bad values, name != stem.
    """
    return load_profile(path)
