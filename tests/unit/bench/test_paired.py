"""bench/paired.py: a direction is claimed only when the per-seed difference keeps one sign in every seed."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/ is scripts, not an installed package

from bench.paired import FAILS, HOLDS, NOISE, paired, verdict  # noqa: E402


def test_one_sign_in_every_seed_is_a_direction_however_small():
    assert paired([80.0, 70.0, 75.0], [79.9, 69.0, 74.5]).sign == 1
    assert paired([60.0, 50.0], [61.0, 50.5]).sign == -1
    line = verdict("A", [80.0, 70.0, 75.0], "B", [79.9, 69.0, 74.5])
    assert line.startswith(f"- {HOLDS}: A > B") and "+0.10, +1.00, +0.50 per seed (mean +0.53)" in line
    assert verdict("A", [60.0, 50.0], "B", [61.0, 50.5]).startswith(f"- {FAILS}")


def test_mixed_signs_a_tie_or_one_seed_are_within_noise_whatever_the_means():
    # means 10 points apart, but one seed goes the other way: no direction
    assert paired([90.0, 90.0, 40.0], [60.0, 60.0, 41.0]).sign == 0
    assert verdict("A", [90.0, 90.0, 40.0], "B", [60.0, 60.0, 41.0]).startswith(f"- {NOISE}")
    assert paired([1.0, 2.0], [1.0, 1.0]).sign == 0
    assert paired([5.0], [1.0]).sign == 0


def test_a_seed_missing_from_either_side_is_left_out_and_unequal_lists_are_refused():
    assert paired([3.0, None, 5.0], [1.0, 2.0, 4.0]).diffs == (2.0, 1.0)
    with pytest.raises(ValueError, match="same seeds"):
        paired([1.0, 2.0], [1.0])
    assert verdict("A", [None], "B", [1.0]).startswith("- n/a")
