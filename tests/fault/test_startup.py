"""reliability-notes §10 test 8: a server started with fewer clients than the run needs waits at most the
registration timeout, then exits with a clear one-line status (no unbounded wait, no traceback)."""

import time

import pytest

from helpers.federation import Federation, make_config

pytestmark = pytest.mark.timeout(120)


def test_server_gives_up_on_a_missing_fleet_with_a_clear_error(tmp_path):
    cfg = make_config(tmp_path / "run", clients=3, register_timeout_s=4.0)
    with Federation(tmp_path / "fed", cfg) as fed:
        fed.start_clients(["0"])  # one of the three
        start = time.monotonic()
        server = fed.start_server_process("--out", str(tmp_path / "run"))
        assert server.wait(60) == 2
        waited = time.monotonic() - start
        log = server.log()
    assert "fedge: error: only" in log and "of 3 clients registered within 4 s" in log, log
    assert "Traceback" not in log
    assert waited < 4.0 + 20  # the timeout plus start-up (imports, broker connection), never unbounded
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing written for a run that never started
