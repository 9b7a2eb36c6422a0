"""fedge.files.atomic_write: permission bits from the first byte, and no torn file under the final name."""

import os
import stat

import pytest

from fedge.files import atomic_write

pytestmark = pytest.mark.timeout(30)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_the_bytes_private_by_default_and_with_the_given_mode(tmp_path):
    atomic_write(tmp_path / "a" / "secret", b"pw")  # the parent folder is created
    atomic_write(tmp_path / "public", b"x", mode=0o644)
    assert (tmp_path / "a" / "secret").read_bytes() == b"pw" and mode(tmp_path / "a" / "secret") == 0o600
    assert mode(tmp_path / "public") == 0o644


def test_the_mode_is_set_before_the_first_byte(tmp_path, monkeypatch):
    # prepare: watch every write into the temp file and record the file's mode at that moment
    seen = []
    real_fdopen = os.fdopen

    class Spy:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def write(self, data):
            seen.append(stat.S_IMODE(os.fstat(self.f.fileno()).st_mode))
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Spy(real_fdopen(fd, *a, **k)))
    # execute
    atomic_write(tmp_path / "passwd", b"alice:hash\n", mode=0o640)
    # assert
    assert seen == [0o640]
    assert mode(tmp_path / "passwd") == 0o640


def test_a_failing_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    # prepare: an existing file, and an fsync that fails after the new bytes went into the temp file
    path = tmp_path / "state.json"
    atomic_write(path, b"old")

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    # execute
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, b"new, never complete")
    # assert: the old content under the final name, nothing else in the folder
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failing_first_write_leaves_no_file_under_the_final_name(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        atomic_write(tmp_path / "new.bin", b"data")
    assert not list(tmp_path.iterdir())
