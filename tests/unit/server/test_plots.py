"""time_to_accuracy.png: its points per round and its units, and the file it draws."""

import pytest

from server.plots import MACS_UNITS, SECONDS_UNITS, _unit, plot_time_to_accuracy, time_to_accuracy_points

pytestmark = pytest.mark.timeout(60)


def row(rnd, client, accuracy, seconds, macs):
    return {
        "round": rnd,
        "client": client,
        "accuracy": accuracy,
        "cumulative_sim_seconds": seconds,
        "cumulative_train_macs": macs,
    }


ROWS = [
    row(0, "0", 0.5, 10.0, 100),
    row(0, "1", 0.7, 10.0, 100),
    row(1, "0", None, 25.0, 300),  # trained, not evaluated
    row(1, "1", 0.9, 25.0, 300),
    {"round": 2, "client": "0", "accuracy": 0.4},  # a row from before the clock
]


def test_one_point_per_evaluated_round_with_the_clock():
    assert time_to_accuracy_points(ROWS) == [(10.0, 100, pytest.approx(0.6)), (25.0, 300, 0.9)]


def test_units_are_the_largest_the_run_reaches_twice():
    assert _unit(7200.0, SECONDS_UNITS) == (3600.0, "h")
    assert _unit(7199.0, SECONDS_UNITS) == (60.0, "min")
    assert _unit(0.5, SECONDS_UNITS) == (1.0, "s")
    assert _unit(3e15, MACS_UNITS) == (1e15, "PMACs")
    assert _unit(1.9e9, MACS_UNITS) == (1e6, "MMACs")


def test_the_plot_is_a_png(tmp_path):
    path = tmp_path / "time_to_accuracy.png"
    plot_time_to_accuracy({"fedavg": ROWS, "local": ROWS[:2], "old": ROWS[4:]}, path, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
