"""The run configuration: one frozen dataclass of run-level keys plus the strategy's options, loaded from TOML
plus checked `key=value` overrides.

A key that is not run-level is an option of the run's strategy (`--set eta=0.2`, or a TOML `[options]` table);
the strategy's options dataclass, which only the server side knows (server.strategy.parse_options), checks them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from fedge import constants as C
from fedge.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(UserError, ValueError):
    """A configuration key or value is invalid; the message names it and what is allowed."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; saved in the run folder and printed at start."""

    strategy: str = C.DEFAULT_STRATEGY
    dataset: str = C.DEFAULT_DATASET
    data: str | None = None
    zoo: str = C.DEFAULT_ZOO
    widths: str = C.DEFAULT_WIDTHS  # the zoo's width preset: cpu (shrunk for CPU runs) or paper (fedge/model/zoo.py)
    clients: int = C.DEFAULT_CLIENTS
    active: int = C.DEFAULT_ACTIVE
    rounds: int = C.DEFAULT_ROUNDS
    local_epochs: int = C.DEFAULT_LOCAL_EPOCHS
    batch_size: int = C.DEFAULT_BATCH_SIZE
    lr: float = C.DEFAULT_LR
    sgd_lr: float = C.SGD_LR
    sgd_momentum: float = C.SGD_MOMENTUM
    seed: int = C.DEFAULT_SEED
    partition: str = C.DEFAULT_PARTITION
    classes_per_client: int = C.CLASSES_PER_CLIENT
    alpha: float = C.DIRICHLET_ALPHA
    label_clusters: int = C.LABEL_CLUSTERS  # partition "clustered": FedEM's class groups, each split by Dir(alpha)
    max_samples_per_client: int | None = None
    max_public_samples: int | None = None
    # A device's own data (fedge/data/own_data.py): where each client reads it (a folder of class folders, or an .npz;
    # `{id}` is replaced by the client id), instead of its shard of `dataset`; set, the server takes the sizes
    # clients register. `fedge client --data-dir` sets it per device.
    data_dir: str | None = None
    public_data: str | None = None  # the server's public set from the operator's folder or .npz (else 8 % of dataset)
    # The task own data is read into; each unset key comes from `dataset` (its shape, classes, channel statistics).
    input_shape: tuple[int, ...] | None = None  # C, H, W
    class_names: tuple[str, ...] | None = None  # a label is the position of its class name
    norm_mean: tuple[float, ...] | None = None  # per channel, of pixels scaled to [0, 1]
    norm_std: tuple[float, ...] | None = None
    profiles: tuple[str, ...] = C.DEFAULT_FLEET_PROFILES
    device: str = "auto"
    # torch intra-op threads of the server (0: one under `fedge run`, over either transport, as each client trains;
    # else torch's default)
    server_threads: int = 0
    # the in-process simulation's client worker processes, one torch thread each (launch/workers.py; 0: the
    # machine's cores under `fedge run`, else 1; 1: every client in the server's process, one after another)
    workers: int = 0
    # where those workers run: "processes" of this machine, or "ray": actors of a Ray cluster (the `ray` extra) at
    # ray_address (unset: a local instance; workers 0 there: one per CPU of the cluster); or "batched": in this
    # process, the models of one architecture trained together on client_device (launch/batched.py), `workers` the
    # torch threads of that training
    engine: str = "processes"
    ray_address: str | None = None
    client_device: str = "cpu"  # cpu, cuda or cuda:N: where batched clients train (engine batched only)
    transport: str = C.DEFAULT_TRANSPORT
    run_id: str = C.DEFAULT_RUN_ID
    round_deadline_s: float = C.ROUND_DEADLINE_S
    min_replies: int = C.MIN_REPLIES
    round_retries: int = C.ROUND_RETRIES
    register_timeout_s: float = C.REGISTER_TIMEOUT_S
    heartbeat_s: float = C.HEARTBEAT_S
    keepalive_s: int = C.KEEPALIVE_S
    chunk_size: int = C.CHUNK_SIZE
    # How strategies that average uploads bound and aggregate them (server/bounds.py, server/aggregation.py).
    clip_factor: float = C.CLIP_FACTOR
    aggregator: str = C.DEFAULT_AGGREGATOR
    trim_fraction: float = C.TRIM_FRACTION
    byzantine: int = C.KRUM_BYZANTINE
    export_onnx: bool = True
    out: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the strategy's options, by name

    def __post_init__(self) -> None:
        positive = ("clients", "active", "rounds", "local_epochs", "batch_size", "classes_per_client", "label_clusters")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.active > self.clients:
            raise ConfigError(f"active ({self.active}) cannot exceed clients ({self.clients})")
        if not self.lr > 0 or not self.alpha > 0 or not self.sgd_lr > 0:
            raise ConfigError(
                f"lr, sgd_lr and alpha must be positive, got lr={self.lr}, sgd_lr={self.sgd_lr}, alpha={self.alpha}"
            )
        if not 0 <= self.sgd_momentum < 1:
            raise ConfigError(f"sgd_momentum must be in [0, 1), got {self.sgd_momentum}")
        if not self.profiles:
            raise ConfigError("profiles must name at least one device profile")
        if self.transport not in ("mqtt", "inproc"):
            raise ConfigError(f"transport must be mqtt or inproc, got {self.transport!r}")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.run_id):
            raise ConfigError(
                f"run_id must be 1-64 letters, digits, _ or - (it is an MQTT topic level), got {self.run_id!r}"
            )
        if self.min_replies < 1 or self.round_retries < 0 or not 0 < self.chunk_size <= C.MAX_CHUNK_BYTES:
            raise ConfigError(f"need min_replies >= 1, round_retries >= 0, 0 < chunk_size <= {C.MAX_CHUNK_BYTES}")
        if not (self.round_deadline_s > 0 and self.register_timeout_s > 0 and self.heartbeat_s > 0):
            raise ConfigError("round_deadline_s, register_timeout_s and heartbeat_s must be positive")
        if not 1 <= self.keepalive_s <= 65535:
            raise ConfigError(
                f"keepalive_s must be 1..65535 seconds (MQTT keep-alive; Mosquitto's max_keepalive "
                f"caps it), got {self.keepalive_s}"
            )
        if not isinstance(self.export_onnx, bool):
            raise ConfigError(f"export_onnx must be true or false, got {self.export_onnx!r}")
        if self.widths not in C.WIDTHS:
            raise ConfigError(
                f"widths must be one of {', '.join(C.WIDTHS)} (the zoo's width preset), got {self.widths!r}"
            )
        if self.engine not in ("processes", "ray", "batched"):
            raise ConfigError(f"engine must be processes, ray or batched, got {self.engine!r}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.client_device):
            raise ConfigError(f"client_device must be cpu, cuda or cuda:N, got {self.client_device!r}")
        if self.client_device != "cpu" and (self.engine != "batched" or self.transport != "inproc"):
            raise ConfigError(
                f"client_device {self.client_device} trains the in-process simulation's clients batched: set "
                "transport inproc and engine batched (--transport inproc --engine batched), or client_device cpu"
            )
        if self.workers < 0:
            raise ConfigError(f"workers must be 0 (automatic) or a positive integer, got {self.workers}")
        if self.server_threads < 0:
            raise ConfigError(f"server_threads must be 0 (automatic) or a positive integer, got {self.server_threads}")
        if not (self.clip_factor == 0 or self.clip_factor >= 1):
            raise ConfigError(f"clip_factor must be 0 (no clipping) or >= 1, got {self.clip_factor}")
        check_aggregation(self.aggregator, self.trim_fraction, self.byzantine)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")

    def to_dict(self) -> dict[str, Any]:
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return out | {"options": dict(self.options)}

    def to_json(self) -> str:
        """The whole config as JSON, readable back by load_config (e.g. by client processes)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def check_aggregation(aggregator: str, trim_fraction: float, byzantine: int) -> None:
    """ConfigError unless `aggregator` is one of constants.AGGREGATORS, trim_fraction in [0, 0.5) and byzantine
    (Krum's f) >= 0."""
    if aggregator not in C.AGGREGATORS:
        raise ConfigError(f"aggregator must be one of {', '.join(C.AGGREGATORS)}, got {aggregator!r}")
    if not 0 <= trim_fraction < 0.5:
        raise ConfigError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    if byzantine < 0:
        raise ConfigError(f"byzantine (Krum's f) must be >= 0, got {byzantine}")


def _boolean(value: Any) -> bool:
    """A TOML/JSON bool, or true/false/yes/no/on/off/1/0 from the command line; anything else raises TypeError."""
    if isinstance(value, bool):
        return value
    words = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
    if isinstance(value, str) and value.strip().lower() in words:
        return words[value.strip().lower()]
    raise TypeError


def coerce(name: str, kind: Any, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's declared type (of a run config or a strategy's
    options), or raise ConfigError."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    optional = type(None) in typing.get_args(kind)
    if value is None or (optional and isinstance(value, str) and value.lower() == "none"):
        if optional:
            return None
        raise ConfigError(f"{name} cannot be empty")
    base = args[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) else kind
    try:
        if typing.get_origin(base) is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            item = typing.get_args(base)[0]
            return tuple(item(str(v).strip()) for v in items if str(v).strip())
        if base is bool:
            return _boolean(value)
        if base is int and isinstance(value, float):
            raise ValueError(f"{value} is not an integer")
        return base(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a valid {getattr(base, '__name__', base)}") from None


def run_keys() -> list[str]:
    """The run-level keys, in declaration order (`options` holds the strategy's)."""
    return [f.name for f in fields(RunConfig) if f.name != "options"]


OPTION_PREFIX = "options."  # `--set options.NAME=V`: the strategy's option NAME even where NAME is a run-level key


def config_from(values: Mapping[str, Any], base: RunConfig | None = None) -> RunConfig:
    """Apply `values` over `base` (defaults if None): run-level keys are checked here; an `options` table, keys
    `options.NAME` (an option named as a run-level key: `--set options.alpha=0.5` is FedTrans's α, `--set alpha=`
    the Dirichlet's) and every other key are the strategy's options, added to base's (checked by the server side
    against the strategy)."""
    base = base or RunConfig()
    hints = typing.get_type_hints(RunConfig)
    table = values.get("options", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"options must be a table of the strategy's options (TOML [options]), got {table!r}")
    named = {k.removeprefix(OPTION_PREFIX): v for k, v in values.items() if k.startswith(OPTION_PREFIX)}
    loose = {k: v for k, v in values.items() if k not in hints and not k.startswith(OPTION_PREFIX)}
    options = dict(base.options) | dict(table) | loose | named
    changes = {k: coerce(k, hints[k], v) for k, v in values.items() if k in hints and k != "options"}
    return dataclasses.replace(base, **changes, options=options)


def parse_overrides(pairs: Sequence[str]) -> dict[str, str]:
    """`["rounds=3", "lr=0.01"]` → dict; an item without '=' raises ConfigError."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class PaperFleet:
    """The run-level keys a strategy's paper ran on, where the run's defaults cannot serve the strategy, and why."""

    values: Mapping[str, Any]
    why: str


def paper_fleets() -> dict[str, PaperFleet]:
    """strategy -> the fleet `fedge run --strategy NAME` gets for each key of it the run does not set (a flag, --set
    or the config file wins): the PAPER_FLEETS of every declared method package (fedge.plugins), read from the
    package itself, not its server half: `fedge client` reads a run's TOML the same way and must find the same zoo
    and partition without importing server code."""
    from fedge.plugins import package_attributes

    fleets: dict[str, PaperFleet] = {}
    for declared in package_attributes("PAPER_FLEETS").values():
        fleets |= declared
    return fleets


def paper_fleet(strategy: str, given: Collection[str]) -> dict[str, Any]:
    """The keys of `strategy`'s paper fleet (paper_fleets) that are not among the `given` (set by the user); {} for
    a strategy the run's defaults serve."""
    fleet = paper_fleets().get(strategy)
    return {} if fleet is None else {k: v for k, v in fleet.values.items() if k not in given}


def load_config(path: str | Path | None, overrides: Mapping[str, Any]) -> RunConfig:
    """Defaults, then the keys of the strategy's paper fleet the file and overrides do not set, then the file (if
    any: TOML, or JSON as written by to_json), then overrides; every layer is checked."""
    return load_config_chosen(path, overrides)[0]


def load_config_chosen(path: str | Path | None, overrides: Mapping[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """load_config, and the keys it took from the strategy's paper fleet (what `fedge run` prints)."""
    values: Mapping[str, Any] = {}
    if path is not None:
        json_file = str(path).endswith(".json")
        try:
            text = Path(path).read_text()
            values = json.loads(text) if json_file else tomllib.loads(text)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid {'JSON' if json_file else 'TOML'}: {e}") from None
        if not isinstance(values, Mapping):
            raise ConfigError(f"config file {path} must hold a table of keys, got {type(values).__name__}")
    strategy = str(overrides.get("strategy", values.get("strategy", C.DEFAULT_STRATEGY)))
    chosen = paper_fleet(strategy, set(values) | set(overrides))
    cfg = config_from(values, config_from(chosen))
    return config_from(overrides, cfg), chosen
