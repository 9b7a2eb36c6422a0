"""Capability checks against a DeviceProfile: fit, pFedClub+ size bound, FedTrans match, clock."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, runtime_checkable

from device_profiles.constants import (
    BYTES_PER_ACTIVATION,
    BYTES_PER_PARAM,
    DIRECTION_DOWN,
    DIRECTION_UP,
    OPTIMIZER_STATES,
    RUNTIME_OPTIMIZER,
    TRAIN_COST_FACTOR,
    TRAINING_COPIES,
)
from device_profiles.profile import DeviceProfile


@runtime_checkable
class SizedModel(Protocol):
    """Anything that knows its parameter count and forward MACs per sample."""

    @property
    def params(self) -> int:
        """Number of trainable parameters."""
        ...

    @property
    def macs(self) -> int:
        """Forward multiply-accumulates for one input sample."""
        ...


@runtime_checkable
class TrainableModel(Protocol):
    """Anything that knows its parameter count and the activation elements per sample training keeps."""

    @property
    def params(self) -> int:
        """Number of trainable parameters."""
        ...

    @property
    def activations(self) -> int:
        """Elements per sample kept for backward (fedge's ModelSpec: the input and every layer's output once)."""
        ...


@dataclass(frozen=True)
class Verdict:
    """Whether a model fits a device; `failures` says which limits fail and by how much."""

    ok: bool
    failures: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok


def checked_count(value: object, what: str, minimum: int = 0) -> int:
    """`value` as an int >= minimum; TypeError for non-ints (bools too), else ValueError."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    return number


def training_memory_bytes(params: int) -> int:
    """Estimated bytes to train a model of `params` parameters with Adam.

    Estimate: fp32 weights, gradients and Adam's two moments = params * 4 B * 4.
    Activations and runtime overhead are not counted. Raises TypeError/ValueError for a
    non-integer or negative `params`.
    """
    return checked_count(params, "params") * BYTES_PER_PARAM * TRAINING_COPIES


MB = 1e6  # the unit of Footprint.describe


@dataclass(frozen=True)
class Footprint:
    """Estimated bytes one training step holds, by part (training_footprint_bytes says what is left out)."""

    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    batch_size: int
    optimizer: str

    @property
    def total(self) -> int:
        """Weights + gradients + optimiser state + activations."""
        return self.weights + self.gradients + self.optimizer_state + self.activations

    def describe(self) -> str:
        """E.g. "training footprint 412.3 MB (weights 0.9, gradients 0.9, adam 1.7, activations 408.8 MB at
        batch 16)"."""
        return (
            f"training footprint {self.total / MB:.1f} MB (weights {self.weights / MB:.1f}, gradients "
            f"{self.gradients / MB:.1f}, {self.optimizer} {self.optimizer_state / MB:.1f}, activations "
            f"{self.activations / MB:.1f} MB at batch {self.batch_size})"
        )


def training_footprint_bytes(model: TrainableModel, batch_size: int, optimizer: str = "adam") -> Footprint:
    """Estimated memory of training `model` at `batch_size` with `optimizer` ("adam", "sgd_momentum", "sgd").

    fp32 weights, gradients (one copy each), optimiser state (Adam: 2 moments, SGD with momentum: 1, plain SGD:
    none) and activations saved for backward: model.activations elements per sample (the input and every layer's
    output, each once) x batch x 4 B. Left out: the runtime itself (Python + torch, measured in
    bench/client_memory.py; the profiles' memory_bytes are what is left after OS and runtime), the client's data
    shard, the autograd temporaries of one layer's backward, allocator slack, and the no-grad evaluation batch.
    Raises AttributeError if `model` lacks `params`/`activations`, TypeError/ValueError for non-integer or
    negative counts, a batch_size < 1 or an unknown optimizer.
    """
    params = checked_count(model.params, "model.params")
    elements = checked_count(model.activations, "model.activations")
    batch = checked_count(batch_size, "batch_size", minimum=1)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    weights = params * BYTES_PER_PARAM
    return Footprint(
        weights=weights,
        gradients=weights,
        optimizer_state=weights * OPTIMIZER_STATES[optimizer],
        activations=elements * batch * BYTES_PER_ACTIVATION,
        batch_size=batch,
        optimizer=optimizer,
    )


def memory_fits(footprint: Footprint, profile: DeviceProfile) -> Verdict:
    """Whether a training footprint fits the profile's memory_bytes; the failure states both numbers."""
    if footprint.total <= profile.memory_bytes:
        return Verdict(ok=True)
    limit = f"memory_bytes {profile.memory_bytes / MB:.1f} MB of profile {profile.name}"
    return Verdict(ok=False, failures=(f"{footprint.describe()} > {limit}",))


def training_fits(model: TrainableModel, profile: DeviceProfile, batch_size: int) -> Verdict:
    """Whether training `model` at `batch_size` with the optimiser of the profile's runtime (RUNTIME_OPTIMIZER)
    fits the profile's memory_bytes; the failure states the footprint by part and the limit. Raises like
    training_footprint_bytes."""
    return memory_fits(training_footprint_bytes(model, batch_size, RUNTIME_OPTIMIZER[profile.runtime]), profile)


def _over(what: str, value: int, limit_name: str, limit: int) -> str:
    return f"{what} {value:,} > {limit_name} {limit:,} ({value / limit:.2f}x the limit)"


def fits(model: SizedModel, profile: DeviceProfile) -> Verdict:
    """Check a model against the profile's max_params, max_macs and memory_bytes.

    Memory uses training_memory_bytes (an estimate). Raises AttributeError if `model`
    lacks `params`/`macs`, and TypeError/ValueError if they are not non-negative ints.
    """
    params = checked_count(model.params, "model.params")
    macs = checked_count(model.macs, "model.macs")
    failures = []
    if params > profile.max_params:
        failures.append(_over("params", params, "max_params", profile.max_params))
    if macs > profile.max_macs:
        failures.append(_over("macs", macs, "max_macs", profile.max_macs))
    memory = training_memory_bytes(params)
    if memory > profile.memory_bytes:
        label = f"training memory estimate (params x {BYTES_PER_PARAM * TRAINING_COPIES} B)"
        failures.append(_over(label, memory, "memory_bytes", profile.memory_bytes))
    return Verdict(ok=not failures, failures=tuple(failures))


def within_size_bound(candidate_params: int, client_params: int, eta: float) -> bool:
    """pFedClub+ size constraint |w*_m| <= (1 + eta)|w_m| (pFedClub, NeurIPS 2024, §4.4).

    The paper adds this constraint to the candidate search of §3.2.2 Step 2 and allows
    any eta > -1 (eta < 0 demands smaller teachers); it uses eta = 0.1. The comparison is
    exact with eta read as the decimal it prints as (0.1 means 1/10), so a candidate of
    exactly (1 + eta)|w| parameters passes. Raises ValueError for eta <= -1 or not
    finite, for negative candidate_params or client_params < 1; TypeError for non-ints.
    """
    candidate = checked_count(candidate_params, "candidate_params")
    client = checked_count(client_params, "client_params", minimum=1)
    if isinstance(eta, bool) or not isinstance(eta, (int, float)):
        raise TypeError(f"eta must be a number, got {eta!r}")
    if not math.isfinite(eta) or eta <= -1:
        raise ValueError(f"eta must be a finite number > -1 (pFedClub §4.4), got {eta!r}")
    return candidate <= (1 + Fraction(repr(float(eta)))) * client


def compatible_models(models: Mapping[str, SizedModel], profile: DeviceProfile) -> list[str]:
    """Names of the models with MAC(M) <= T_c, cheapest first (FedTrans, MLSys 2024, §4.2).

    FedTrans Alg. 1 line 7 counts the "compatible models" {M | MAC(M) <= T_c}; here
    T_c = profile.max_macs. Ties in MACs are ordered by name. An empty list means no
    model fits; the caller decides the fallback (the authors' code falls back to
    model 0). Raises like fits() for a model without valid `macs`.
    """
    macs = {name: checked_count(m.macs, f"models[{name!r}].macs") for name, m in models.items()}
    ok = [name for name, m in macs.items() if m <= profile.max_macs]
    return sorted(ok, key=lambda name: (macs[name], name))


def train_seconds(forward_macs_per_sample: int, samples: int, epochs: int, profile: DeviceProfile) -> float:
    """Simulated local-training time: 3 x forward MACs x samples x epochs / train_macs_per_s.

    The factor 3 is FedScale's rule (backward ~ 2x forward; fedscale/cloud/internal/
    client_metadata.py). train_macs_per_s is the device's MAC rate while training, so the
    3x is applied here only once. Raises TypeError/ValueError for negative or
    non-integer inputs.
    """
    work = (
        TRAIN_COST_FACTOR
        * checked_count(forward_macs_per_sample, "forward_macs_per_sample")
        * checked_count(samples, "samples")
        * checked_count(epochs, "epochs")
    )
    return work / profile.train_macs_per_s


def transfer_seconds(num_bytes: int, profile: DeviceProfile, direction: str) -> float:
    """Simulated time to move `num_bytes`: rtt_s + num_bytes * 8 / bandwidth.

    `direction` is "up" (device to server, uplink_bps) or "down" (downlink_bps). Raises
    ValueError for another direction or negative num_bytes, TypeError for non-ints.
    """
    size = checked_count(num_bytes, "num_bytes")
    if direction == DIRECTION_UP:
        bandwidth = profile.uplink_bps
    elif direction == DIRECTION_DOWN:
        bandwidth = profile.downlink_bps
    else:
        raise ValueError(f"direction must be {DIRECTION_UP!r} or {DIRECTION_DOWN!r}, got {direction!r}")
    return profile.rtt_s + size * 8 / bandwidth
