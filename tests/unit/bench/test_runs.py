"""bench/runs.py: a kept run is reused, a folder of another config is refused or (benches that name folders without
their scale) replaced, and a folder that is not a run is never deleted."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/ is scripts, not an installed package

from bench.runs import FolderError, guarded, run_kept  # noqa: E402
from fedge.config import config_from  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def tiny(out, **kw):
    base = dict(strategy="local", dataset="digits", zoo="cnn1", clients=2, active=2, rounds=1, local_epochs=1)
    return config_from(base | dict(max_samples_per_client=40, export_onnx=False, out=str(out)) | kw)


def test_a_finished_run_is_reused_and_another_config_refused_or_replaced(tmp_path):
    out = tmp_path / "run"
    assert run_kept(tiny(out)) == "ran" and run_kept(tiny(out)) == "reused"
    with pytest.raises(FolderError, match="another config .*rounds: 1 there, 2 now"):
        run_kept(tiny(out, rounds=2))
    assert json.loads((out / "config.json").read_text())["rounds"] == 1  # refused: nothing touched
    assert run_kept(tiny(out, rounds=2), replace=True) == "ran"
    assert json.loads((out / "config.json").read_text())["rounds"] == 2


def test_a_folder_that_is_not_a_run_is_never_deleted_and_the_error_is_one_line(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FolderError, match="something other than a run"):
        run_kept(tiny(out), replace=True)
    assert (out / "notes.txt").read_text() == "keep me"

    def main() -> int:
        run_kept(tiny(out))
        return 0

    assert guarded(main) == 2
    assert capsys.readouterr().err.startswith(f"error: {out} holds something other than a run")


def test_a_run_is_compared_by_the_server_threads_it_used_and_not_by_its_transport(tmp_path):
    """A config's server_threads 0 means "as they are": the run's summary says what that came to, and that number
    is what a continuation must match (thread counts can change the bits); the transport cannot (the same models
    in process and over MQTT), so a run written by `fedge run --transport inproc` is reused."""
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert run_kept(tiny(out)) == "ran"  # server_threads 0: as they are, one
        assert json.loads((out / "summary.json").read_text())["server_threads"] == 1
        assert run_kept(tiny(out, server_threads=1, transport="inproc")) == "reused"
        with pytest.raises(FolderError, match="another config .*server threads: 1 there, 2 now"):
            run_kept(tiny(out, server_threads=2))
        torch.set_num_threads(2)
        with pytest.raises(FolderError, match="server threads: 1 there, 2 now"):
            run_kept(tiny(out))  # as they are is two threads now
    finally:
        torch.set_num_threads(threads)
