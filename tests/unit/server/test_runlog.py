"""The run folder on resume: the checkpoint must be there, and metrics of rounds after it are dropped."""

import pytest

from server.runlog import CHECKPOINT_FILE, RunLog

pytestmark = pytest.mark.timeout(60)


def test_resume_keeps_the_lines_of_checkpointed_rounds_only(tmp_path):
    log = RunLog(tmp_path, {"seed": 1})
    log.append_rows([{"round": r, "client": c} for r in range(3) for c in ("0", "1")])
    log.write_checkpoint({"next_round": 2})
    with log.metrics_path.open("a") as f:
        f.write('{"round": 3, "cli')  # torn by the crash
    resumed = RunLog(tmp_path, {"seed": 1}, resume=True)
    resumed.keep_rounds_before(resumed.read_checkpoint()["next_round"])
    assert [(r["round"], r["client"]) for r in resumed.rows()] == [(0, "0"), (0, "1"), (1, "0"), (1, "1")]
    resumed.append_rows([{"round": 2, "client": "0"}])
    assert resumed.rows()[-1] == {"round": 2, "client": "0"}


def test_a_new_run_refuses_a_used_folder_and_resume_needs_a_checkpoint(tmp_path):
    RunLog(tmp_path / "a", {})
    with pytest.raises(FileExistsError, match="already holds a run"):
        RunLog(tmp_path / "a", {})
    with pytest.raises(FileNotFoundError, match=CHECKPOINT_FILE):
        RunLog(tmp_path / "a", {}, resume=True)
