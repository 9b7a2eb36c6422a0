"""The task configurations both halves of a strategy share: one typed definition the server writes into a Task's
JSON config and the client reads back, instead of two spellings of the same dict keys."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Self, Sequence

from fedge import constants as C


class TaskConfigError(ValueError):
    """A task's config lacks a key, has one of the wrong type, or a value out of range; the message names it."""


@dataclass(frozen=True)
class TrainTask:
    """Settings of local training (the `train` and `kd_train` tasks): epochs, batch size, Adam's lr (torch
    runtime), SGD's lr and momentum (executorch runtime), the run seed, whether to upload the trained model, and,
    for distillation, λ, T and the KL's direction of pFedClub Eq. (5) (fedge.distill.kd_kl)."""

    epochs: int
    batch_size: int
    lr: float
    seed: int
    upload: bool
    sgd_lr: float = C.SGD_LR
    sgd_momentum: float = C.SGD_MOMENTUM
    kd_lambda: float = C.KD_LAMBDA
    temperature: float = C.KD_TEMPERATURE
    kd_direction: str = C.KD_DIRECTION

    def __post_init__(self) -> None:
        if (
            self.epochs < 1
            or self.batch_size < 1
            or not self.lr > 0
            or not self.sgd_lr > 0
            or not 0 <= self.sgd_momentum < 1
        ):
            raise TaskConfigError(
                f"epochs, batch_size, lr and sgd_lr must be positive and sgd_momentum in [0, 1), got {self}"
            )
        if self.kd_direction not in C.KD_DIRECTIONS:
            raise TaskConfigError(
                f"kd_direction must be one of {', '.join(C.KD_DIRECTIONS)}, got {self.kd_direction!r}"
            )

    def to_config(self) -> dict[str, Any]:
        """The JSON config a Task carries."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        """Read a Task's config; a missing required key, an unknown key, a value of the wrong type or out of range
        raises TaskConfigError naming it."""
        return read_config(cls, config)


def is_cell_weight(name: str, shape: Sequence[int]) -> bool:
    """Whether a state tensor is a conv or linear weight: a FedTrans cell, whose ‖mean gradient‖/‖W‖ a `train_model`
    reply reports under its name in the `activeness` record (both halves use this one rule)."""
    return name.endswith(".weight") and len(shape) >= 2


def read_config(cls: Any, config: Mapping[str, Any]) -> Any:
    """An instance of the frozen dataclass `cls` from a task's JSON config, each value checked against the field's
    type (int, float, bool; an int is a valid float, a bool is neither); TaskConfigError on a missing, unknown or
    ill-typed key, or a non-finite number."""
    if not isinstance(config, Mapping):
        raise TaskConfigError(f"a task config must be a JSON object, got {type(config).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise TaskConfigError(f"unknown task config key(s) {unknown}; {cls.__name__} has {sorted(fields)}")
    values = {}
    for name, f in fields.items():
        if name not in config:
            if f.default is dataclasses.MISSING:
                raise TaskConfigError(f"task config lacks {name!r}")
            continue
        values[name] = _typed(name, hints[name], config[name])
    return cls(**values)


def _typed(name: str, kind: Any, value: Any) -> Any:
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise TaskConfigError(f"task config {name}={value!r} is not a valid {getattr(kind, '__name__', kind)}")
    return value
