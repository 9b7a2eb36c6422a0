"""bench/floor.py: FLOPs of stitch fine-tuning and matching counted by hand on tiny specs, zero-padding taps left
out of the floor's count, a measured machine rate that is a positive number, and the report lines' format."""

import math
import re
import sys
from pathlib import Path

import pytest

from fedge.model.layers import LayerSpec
from fedge.model.spec import make_spec
from methods.reassembly.assemble import candidate_spec

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # bench/ is scripts, not an installed package

from bench import floor  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def linear(n):
    return [LayerSpec("linear", {"out_features": n})]


def tiny(name="tiny"):
    """4 -> 8 -> 6 -> 2, Linear only: MACs per sample 32, 48 and 12."""
    return make_spec(name, (4,), 2, [("a", linear(8)), ("b", linear(6)), ("c", linear(2))])


def test_the_spec_macs_are_the_hand_counted_ones():
    assert floor.block_macs(tiny()) == (32, 48, 12) == floor.block_macs(tiny(), count_padding=True)


def test_a_stitch_at_block_zero_trains_it_and_backpropagates_through_the_rest():
    # per sample: forward 2*(32+48+12) = 184, backward to the input of b and c 2*(48+12) = 120 (block 0's input
    # is data), weight gradient of a 2*32 = 64: 368, on 3 steps of 10 samples; no prefix, so public is unused
    assert floor.finetune_flops(tiny(), (0,), 10, 3, 20) == 368 * 30
    # a second stitch adds only its weight gradient, 2*12
    assert floor.finetune_flops(tiny(), (2, 0), 10, 3, 20) == (368 + 24) * 30


def test_the_prefix_before_the_first_stitch_runs_forward_once_over_the_public_set():
    # prefix a: 2*32 per public sample; then forward b, c 120, backward to c's input 24, b's weights 96
    assert floor.finetune_flops(tiny(), (1,), 10, 3, 20) == 2 * 32 * 20 + 240 * 30
    more_public = floor.finetune_flops(tiny(), (1,), 10, 3, 40) - floor.finetune_flops(tiny(), (1,), 10, 3, 20)
    assert more_public == 2 * 32 * 20  # only the prefix grows with the public set, and once, not per epoch
    assert floor.finetune_flops(tiny(), (1,), 10, 3, 20, sharing=2) == 32 * 20 + 240 * 30


def test_the_per_block_counts_are_the_totals_split_by_block():
    # stitch at 1: a forward once over 20 public samples; b forward, backward-to-input skipped (its input is the
    # cache), weight gradient; c forward and backward to its input; matching: every block over 20 samples
    assert floor.finetune_block_flops(tiny(), (1,), 10, 3, 20) == [2 * 32 * 20, 2 * 2 * 48 * 30, 2 * 2 * 12 * 30]
    assert floor.matching_block_flops(tiny(), (1,), 20, sharing=4) == [2 * 32 * 20 / 4, 2 * 48 * 20, 2 * 12 * 20]


def test_moving_the_first_stitch_later_lowers_the_flops():
    flops = [floor.finetune_flops(tiny(), (s,), 64, 21, 400) for s in range(3)]
    assert flops[0] > flops[1] > flops[2]


def test_no_stitches_means_no_fine_tuning_and_the_matching_forward_is_the_whole_model():
    assert floor.finetune_flops(tiny(), (), 64, 21, 400) == 0.0
    assert floor.matching_flops(tiny(), (), 400) == 2 * 92 * 400
    assert floor.matching_flops(tiny(), (1,), 400, sharing=4) == (2 * 32 / 4 + 2 * 60) * 400


def test_a_candidate_from_two_models_counts_its_stitch():
    first, second = tiny("m1"), tiny("m2")
    spec, stitches = candidate_spec("cand", [first.blocks[0], *second.blocks[1:]], (4,), 2)
    assert stitches == (1,) and [b.name for b in spec.blocks] == ["a", "stitch0", "b", "c"]
    # a 8 -> 8 stitch: 64 MACs; prefix a on 400 public; per sample forward 2*(64+48+12), backward to the inputs
    # of b and c 2*(48+12), the stitch's weights 2*64
    per_sample = 248 + 120 + 128
    assert floor.finetune_flops(spec, stitches, 400, 3, 400) == 2 * 32 * 400 + per_sample * 1200
    matching = 2 * (32 + 124) * 400
    assert floor.candidate_flops(spec, stitches, 400, 3) == 2 * 32 * 400 + per_sample * 1200 + matching
    # unlabeled: two views per sample, and the prefix on every batch's views
    assert floor.candidate_flops(spec, stitches, 400, 3, labeled=False) == (2 * 32 + per_sample) * 2400 + matching


def test_the_floor_leaves_out_taps_on_zero_padding():
    conv = [LayerSpec("conv2d", {"out_channels": 2, "kernel_size": 3, "padding": 1})]
    spec = make_spec("conv", (1, 3, 3), 2, [("conv", conv), ("head", [LayerSpec("flatten"), *linear(2)])])
    # 3x3 map, 3x3 kernel, padding 1: valid taps per row of outputs 2 + 3 + 2 = 7, so 7*7 of 81 per channel
    assert floor.block_macs(spec, count_padding=True) == (2 * 81, 18 * 2)
    assert floor.block_macs(spec) == (2 * 49, 18 * 2)
    assert floor.finetune_flops(spec, (0,), 1, 1, 1) < floor.finetune_flops(spec, (0,), 1, 1, 1, count_padding=True)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        floor.finetune_flops(tiny(), (3,), 64, 21, 400)
    with pytest.raises(ValueError, match="finite"):
        floor.finetune_flops(tiny(), (0,), -1, 21, 400)
    with pytest.raises(ValueError, match="sharing"):
        floor.matching_flops(tiny(), (0,), 400, sharing=0)
    with pytest.raises(ValueError, match="threads"):
        floor.machine_rate(threads=0)


def test_the_machine_rate_is_a_positive_number():
    rate = floor.machine_rate(threads=1, repeats=1)
    assert math.isfinite(rate) and rate > 0


def test_block_rates_time_every_block():
    rates = floor.block_rates(tiny(), batch=4, repeats=1)
    assert [(r.index, r.name) for r in rates] == [(0, "a"), (1, "b"), (2, "c")]
    assert [r.flops for r in rates] == [2 * 2 * m * 4 for m in (32, 48, 12)]
    assert all(r.seconds > 0 and math.isfinite(r.rate) for r in rates)


def test_block_rates_time_folded_channels_last_blocks_as_candidates_run_them():
    conv = [LayerSpec("conv2d", {"out_channels": 4, "kernel_size": 3, "padding": 1}), LayerSpec("bn2d")]
    spec = make_spec("conv", (2, 6, 6), 2, [("conv", conv), ("head", [LayerSpec("flatten"), *linear(2)])])
    plain, folded = (floor.block_rates(spec, batch=4, repeats=1, fold=f) for f in (False, True))
    assert [r.flops for r in plain] == [r.flops for r in folded] and all(r.seconds > 0 for r in folded)


def test_the_report_lines_give_the_floor_inputs_then_one_ratio_per_strategy():
    lines = floor.floor_lines(
        {"pfedclub": (2.41, 1.0), "pfedhr": (0.5, 0.25), "none": (math.nan, 1.0)},
        {"pfedclub": 125e9, "pfedhr": 30e9, "none": 0.0},
        95e9,
    )
    assert "95.0 GFLOP/s" in lines[0] and "1 torch thread" in lines[0] and "pfedclub 125.0 GFLOP" in lines[0]
    assert lines[1:] == [
        "pfedclub per candidate / floor: 2.41x",
        "pfedhr per candidate / floor: 2.00x",
        "none per candidate / floor: n/a",
    ]
    assert all(re.fullmatch(r"^\S+ per candidate / floor: \d+\.\d\dx$", line) for line in lines[1:3])
    with pytest.raises(ValueError, match="floor seconds"):
        floor.floor_lines({"pfedclub": (1.0, 0.0)}, {"pfedclub": 1.0}, 95e9)
    own = floor.floor_lines({"pfedclub": (2.41, 1.0)}, {"pfedclub": 125e9}, 95e9, own_rate={"pfedclub": 2.0})
    assert own[1:] == [
        "pfedclub per candidate / floor: 2.41x",
        "pfedclub per candidate / blocks' own rates: 1.21x (2.000 s)",
    ]
