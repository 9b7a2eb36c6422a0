"""training_footprint_bytes and memory_fits: parts by hand, optimisers, the refusal stating both numbers."""

from dataclasses import dataclass, replace

import pytest

from device_profiles import get_profile, memory_fits, training_fits, training_footprint_bytes


@dataclass(frozen=True)
class Model:
    params: int
    activations: int


def test_footprint_parts_by_hand_for_adam_and_sgd() -> None:
    f = training_footprint_bytes(Model(params=51, activations=35), batch_size=4)
    assert (f.weights, f.gradients, f.optimizer_state, f.activations) == (204, 204, 408, 35 * 4 * 4)
    assert f.total == 204 + 204 + 408 + 560
    assert training_footprint_bytes(Model(51, 35), 4, "sgd_momentum").optimizer_state == 204
    assert training_footprint_bytes(Model(51, 35), 4, "sgd").optimizer_state == 0


@pytest.mark.parametrize("batch, optimizer", [(0, "adam"), (4, "lbfgs")])
def test_footprint_rejects_a_bad_batch_or_optimizer(batch: int, optimizer: str) -> None:
    with pytest.raises(ValueError):
        training_footprint_bytes(Model(51, 35), batch, optimizer)


def test_a_footprint_over_memory_bytes_fails_with_both_numbers() -> None:
    profile = replace(get_profile("rpi-zero-2w"), memory_bytes=1_000_000)
    big = Model(params=10_000, activations=100_000)  # 0.16 MB of state + 0.4 MB of activations per sample
    assert training_fits(big, profile, 1).ok
    verdict = training_fits(big, profile, 16)
    assert not verdict.ok and memory_fits(training_footprint_bytes(big, 16), profile) == verdict
    (failure,) = verdict.failures
    assert "training footprint 6.6 MB" in failure and "activations 6.4 MB at batch 16" in failure
    assert "> memory_bytes 1.0 MB of profile rpi-zero-2w" in failure
