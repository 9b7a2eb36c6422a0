"""tools/arm64-check.sh (run by hand: ~20-30 min, root, network) parses, and refuses bad usage before touching
anything: exit 2 with one line, no work folder made."""

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "arm64-check.sh"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.parametrize("argv, says", [(["--pi", "3"], "--pi takes 4 or 5"), (["--nope"], "unknown argument --nope")])
def test_bad_usage_exits_2_before_doing_anything(tmp_path, argv, says):
    before = set(Path("/tmp").glob("fedge-arm64.*"))
    done = subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True)
    assert done.returncode == 2 and says in done.stderr
    assert set(Path("/tmp").glob("fedge-arm64.*")) == before
