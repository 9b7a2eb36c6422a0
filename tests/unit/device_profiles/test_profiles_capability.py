"""Tests for capability checks: fits, pFedClub+ eta bound, FedTrans matching, simulated clock."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from device_profiles import (
    DeviceProfile,
    SizedModel,
    Verdict,
    compatible_models,
    fits,
    get_profile,
    train_seconds,
    training_memory_bytes,
    transfer_seconds,
    within_size_bound,
)

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Model:
    params: int
    macs: int


def make_profile(**changes: object) -> DeviceProfile:
    values: dict[str, object] = dict(
        name="t",
        description="test",
        runtime="torch",
        train_macs_per_s=3e9,
        memory_bytes=100_000_000,
        max_params=1_000_000,
        max_macs=60_000_000,
        uplink_bps=5e6,
        downlink_bps=50e6,
        rtt_s=0.028,
        availability=1.0,
    )
    values.update(changes)
    return DeviceProfile(**values)  # type: ignore[arg-type]


# --- fits --------------------------------------------------------------------------------


def test_model_at_every_limit_fits() -> None:
    profile = make_profile(memory_bytes=16_000_000)
    verdict = fits(Model(params=1_000_000, macs=60_000_000), profile)
    assert verdict == Verdict(ok=True, failures=())
    assert bool(verdict) is True


def test_failures_say_which_limit_and_by_how_much() -> None:
    profile = make_profile(memory_bytes=10_000_000)
    verdict = fits(Model(params=3_200_000, macs=70_000_000), profile)
    assert not verdict
    assert verdict.failures == (
        "params 3,200,000 > max_params 1,000,000 (3.20x the limit)",
        "macs 70,000,000 > max_macs 60,000,000 (1.17x the limit)",
        "training memory estimate (params x 16 B) 51,200,000 > memory_bytes 10,000,000 (5.12x the limit)",
    )


def test_one_over_each_limit_fails_only_that_limit() -> None:
    profile = make_profile(memory_bytes=16_000_000)
    assert (
        fits(Model(1_000_001, 60_000_000), profile)
        .failures[0]
        .startswith("params 1,000,001 > max_params 1,000,000 (1.00x")
    )
    assert len(fits(Model(1_000_001, 60_000_000), profile).failures) == 2  # memory too
    assert fits(Model(1_000_000, 60_000_001), profile).failures == (
        "macs 60,000,001 > max_macs 60,000,000 (1.00x the limit)",
    )


def test_memory_alone_can_fail() -> None:
    profile = make_profile(max_params=10_000_000, memory_bytes=15_999_999)
    verdict = fits(Model(1_000_000, 1), profile)
    assert verdict.failures == (
        "training memory estimate (params x 16 B) 16,000,000 > memory_bytes 15,999,999 (1.00x the limit)",
    )
    assert training_memory_bytes(1_000_000) == 16_000_000


@pytest.mark.parametrize(
    "params,macs,error",
    [
        (-1, 10, ValueError),
        (10, -1, ValueError),
        (1.5, 10, TypeError),
        (True, 10, TypeError),
    ],
)
def test_fits_rejects_bad_model_numbers(params: object, macs: object, error: type) -> None:
    with pytest.raises(error):
        fits(Model(params, macs), make_profile())  # type: ignore[arg-type]


def test_model_protocol_is_duck_typed() -> None:
    class Spec:
        @property
        def params(self) -> int:
            return 5

        @property
        def macs(self) -> int:
            return 7

    assert isinstance(Spec(), SizedModel)
    assert isinstance(Model(1, 2), SizedModel)
    assert fits(Spec(), make_profile()).ok


# --- the model zoo against the bundled fleet ----------------------------------------------

BIG = Model(params=3_000_000, macs=60_000_000)  # top of the zoo at 32x32
SMALL = Model(params=100_000, macs=1_000_000)  # bottom of the zoo


@pytest.mark.parametrize(
    "name", ["rpi-4", "rpi-5", "jetson-orin-nano", "android-mid-range", "android-flagship", "gpu-server"]
)
def test_capable_devices_fit_the_whole_zoo(name: str) -> None:
    assert fits(BIG, get_profile(name)).ok
    assert fits(SMALL, get_profile(name)).ok


@pytest.mark.parametrize("name", ["rpi-zero-2w", "android-low-end"])
def test_weak_devices_fit_only_small_models(name: str) -> None:
    profile = get_profile(name)
    assert fits(SMALL, profile).ok
    assert fits(Model(params=500_000, macs=5_000_000), profile).ok
    verdict = fits(BIG, profile)
    assert not verdict.ok
    assert any(f.startswith("params 3,000,000 > max_params") for f in verdict.failures)
    assert any(f.startswith("macs 60,000,000 > max_macs") for f in verdict.failures)


# --- pFedClub+ eta bound -----------------------------------------------------------------


@pytest.mark.parametrize(
    "candidate,client,eta,expected",
    [
        (1100, 1000, 0.1, True),  # exactly (1 + eta)|w|
        (1101, 1000, 0.1, False),  # one over
        (1300, 1000, 0.3, True),  # 0.3 is not exact in binary; read as the decimal 3/10
        (1301, 1000, 0.3, False),
        (115, 100, 0.15, True),  # float (1 + 0.15) * 100 = 114.99999999999999
        (1000, 1000, 0.0, True),
        (1001, 1000, 0.0, False),
        (500, 1000, -0.5, True),  # the paper allows -1 < eta < 0 (smaller teachers)
        (501, 1000, -0.5, False),
        (0, 1000, 0.1, True),
        (3000, 1000, 2, True),  # integer eta
    ],
)
def test_size_bound(candidate: int, client: int, eta: float, expected: bool) -> None:
    assert within_size_bound(candidate, client, eta) is expected


@pytest.mark.parametrize("eta", [-1, -1.0, -2.5, math.nan, math.inf, -math.inf])
def test_size_bound_rejects_eta_out_of_range(eta: float) -> None:
    with pytest.raises(ValueError, match="eta must be a finite number > -1"):
        within_size_bound(10, 10, eta)


@pytest.mark.parametrize(
    "candidate,client,error",
    [
        (-1, 10, ValueError),
        (10, 0, ValueError),
        (10.0, 10, TypeError),
        (10, "10", TypeError),
    ],
)
def test_size_bound_rejects_bad_sizes(candidate: object, client: object, error: type) -> None:
    with pytest.raises(error):
        within_size_bound(candidate, client, 0.1)  # type: ignore[arg-type]


def test_size_bound_rejects_non_numeric_eta() -> None:
    with pytest.raises(TypeError):
        within_size_bound(10, 10, "0.1")  # type: ignore[arg-type]


# --- FedTrans compatible models ----------------------------------------------------------


def test_compatible_models_sorted_by_macs_then_name() -> None:
    models = {
        "a": Model(1, 50_000_000),
        "e": Model(1, 1_000_000),
        "c": Model(1, 60_000_000),
        "d": Model(1, 60_000_001),
        "b": Model(1, 1_000_000),
        "f": Model(1, 10_000_000),
    }
    assert compatible_models(models, make_profile()) == ["b", "e", "f", "a", "c"]


def test_compatible_models_ignores_params_and_can_be_empty() -> None:
    profile = make_profile(max_macs=100)
    assert compatible_models({"huge_params": Model(10**9, 100)}, profile) == ["huge_params"]
    assert compatible_models({"x": Model(1, 101)}, profile) == []
    assert compatible_models({}, profile) == []


def test_compatible_models_on_bundled_low_end_phone() -> None:
    models = {
        "tiny": Model(50_000, 900_000),
        "cnn": Model(400_000, 9_900_000),
        "mobilenet": Model(2_200_000, 12_000_000),
    }
    assert compatible_models(models, get_profile("android-low-end")) == ["tiny", "cnn"]


# --- simulated clock ---------------------------------------------------------------------


def test_train_seconds_hand_computed() -> None:
    profile = make_profile(train_macs_per_s=3e9)
    # 3 x 10M MACs x 500 samples x 2 epochs = 30e9 MACs of work at 3e9 MAC/s
    assert train_seconds(10_000_000, 500, 2, profile) == pytest.approx(10.0)
    assert train_seconds(10_000_000, 0, 2, profile) == 0.0


def test_train_seconds_on_bundled_rpi4() -> None:
    # 3 x 60M x 1000 x 1 / 2.975e9
    assert train_seconds(60_000_000, 1000, 1, get_profile("rpi-4")) == pytest.approx(180e9 / 2.975e9)


@pytest.mark.parametrize("args", [(-1, 1, 1), (1, -1, 1), (1, 1, -1), (1.5, 1, 1)])
def test_train_seconds_rejects_bad_input(args: tuple[object, object, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        train_seconds(*args, make_profile())  # type: ignore[arg-type]


def test_transfer_seconds_hand_computed() -> None:
    profile = make_profile(uplink_bps=5e6, downlink_bps=50e6, rtt_s=0.028)
    assert transfer_seconds(1_000_000, profile, "up") == pytest.approx(0.028 + 1.6)
    assert transfer_seconds(1_000_000, profile, "down") == pytest.approx(0.028 + 0.16)
    assert transfer_seconds(0, profile, "down") == pytest.approx(0.028)


@pytest.mark.parametrize("direction", ["UP", "upload", "", "sideways"])
def test_transfer_seconds_rejects_bad_direction(direction: str) -> None:
    with pytest.raises(ValueError, match="direction must be 'up' or 'down'"):
        transfer_seconds(10, make_profile(), direction)


def test_transfer_seconds_rejects_negative_bytes() -> None:
    with pytest.raises(ValueError):
        transfer_seconds(-1, make_profile(), "up")
