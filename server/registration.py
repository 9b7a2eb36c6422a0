"""What the server requires of a registering client before it joins the fleet."""

from __future__ import annotations

from typing import Callable, Mapping

from device_profiles import ProfileError, fits, get_profile, training_fits
from fedge import constants as C
from fedge.model.spec import ModelSpec
from fedge.wire.messages import ClientInfo

# Why a model cannot train on a device runtime (e.g. export.training_program.check_trainable for "executorch": a layer
# without an exact ExecuTorch training form), raised as ValueError; the launcher supplies one per runtime.
RuntimeCheck = Callable[[ModelSpec], None]


# A registration check's answer: None to accept, else (reason code of fedge.wire.envelope.REASONS, message).
Refusal = tuple[str, str]


def registration_check(
    shard_sizes: Mapping[str, tuple[int, int]] | None = None,
    runtime_checks: Mapping[str, RuntimeCheck] | None = None,
    batch_size: int = C.DEFAULT_BATCH_SIZE,
) -> Callable[[ClientInfo], Refusal | None]:
    """What the server requires of a registering client: a known profile its model fits (and passes the check of
    its profile's runtime in `runtime_checks`, if any: for executorch, an ExecuTorch training form; the full
    gradient-parity gate runs on the client), a training footprint at the run's `batch_size` within the profile's
    memory_bytes ("over_memory", stating both numbers), some data, and, where the server made the clients' shards
    (`shard_sizes`: client id -> (train, test) examples), exactly the data sizes of its shard: a client's word on
    its size sets its weight in FedAvg. Other refusals are "bad_spec"."""
    checks = dict(runtime_checks or {})

    def check(info: ClientInfo) -> Refusal | None:
        problem = spec_problem(info)
        if problem is not None:
            return "bad_spec", problem
        memory = training_fits(info.spec, get_profile(info.profile), min(batch_size, info.num_train))
        if not memory.ok:
            return "over_memory", f"model {info.spec.name} on device profile {info.profile}: {memory.failures[0]}"
        return None

    def spec_problem(info: ClientInfo) -> str | None:
        try:
            profile = get_profile(info.profile)
        except ProfileError as e:
            return f"unknown device profile: {e}"
        verdict = fits(info.spec, profile)
        if not verdict.ok:
            return f"model {info.spec.name} does not fit device profile {info.profile}: {'; '.join(verdict.failures)}"
        if profile.runtime in checks:
            try:
                checks[profile.runtime](info.spec)
            except ValueError as e:
                return (
                    f"model {info.spec.name} cannot train on device profile {info.profile} "
                    f"(runtime {profile.runtime}): {e}"
                )
        if info.num_train < 1 or info.num_test < 1:
            return f"client {info.client_id} has no training or test data"
        if shard_sizes is not None:
            if info.client_id not in shard_sizes:
                return (
                    f"client id {info.client_id!r} is not a shard of this run's partition (0..{len(shard_sizes) - 1})"
                )
            if (info.num_train, info.num_test) != shard_sizes[info.client_id]:
                train, test = shard_sizes[info.client_id]
                return (
                    f"client {info.client_id} claims {info.num_train} training and {info.num_test} test examples;"
                    f" its shard of the run's partition has {train} and {test} (clients reading their own data need"
                    " data_dir set in the server's run config too)"
                )
        return None

    return check
