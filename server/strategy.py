"""The server half of a strategy (plan, aggregate and the replies it expects), its options, and the strategy
registry."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from device_profiles import DeviceProfile, get_profile
from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.config import ConfigError, coerce
from fedge.errors import UserError
from fedge.model.spec import ModelSpec
from fedge.plugins import load_methods
from fedge.registry import Registry
from fedge.tasks import TrainTask
from fedge.wire.messages import ClientInfo, Result, Task, Weights, client_order
from fedge.wire.payloads import Expected
from server.aggregation import Aggregation

T = TypeVar("T", bound=TrainTask)


class StrategyError(UserError, ValueError):
    """A strategy cannot run on this fleet or configuration; the message says what to change."""


@dataclass(frozen=True)
class StrategyConfig:
    """What every strategy gets from the run's run-level keys: local training, the seed, the server's device, and
    how a strategy that averages uploads aggregates them (server/aggregation.py)."""

    local_epochs: int
    batch_size: int
    lr: float
    seed: int
    device: str = "cpu"
    sgd_lr: float = C.SGD_LR
    sgd_momentum: float = C.SGD_MOMENTUM
    aggregation: Aggregation = Aggregation()


def option(default: Any, help: str) -> Any:
    """A field of a strategy's options dataclass: its default and the one line `fedge strategies` shows."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class StrategyOptions:
    """A strategy's own settings (none here). Subclasses are frozen dataclasses whose fields are made with
    `option(...)` and checked in __post_init__ (ConfigError naming the option and what is allowed)."""

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, str]]:
        """(name, type, default, help) of every option, in declaration order."""
        hints = typing.get_type_hints(cls)
        return [
            (f.name, getattr(hints[f.name], "__name__", str(hints[f.name])), f.default, f.metadata.get("help", ""))
            for f in dataclasses.fields(cls)
        ]


@dataclass(frozen=True)
class PublicData:
    """The server's public set (pFedClub: 8 % of the data); labels are None for the unlabeled setting."""

    x: torch.Tensor
    y: torch.Tensor | None


def torch_profiles(name: str, clients: Mapping[str, ClientInfo], why: str) -> dict[str, DeviceProfile]:
    """Every client's device profile; StrategyError naming the clients on another runtime, for a strategy whose
    clients train what only the torch runtime can (an ExecuTorch training program is built for the client's own
    model and plain cross-entropy): `why` says what, e.g. "trains a slice of the global model on every client"."""
    profiles = {cid: get_profile(info.profile) for cid, info in clients.items()}
    others = sorted((cid for cid, p in profiles.items() if p.runtime != "torch"), key=client_order)
    if others:
        raise StrategyError(
            f"{name} {why}, which only the torch runtime can: clients {others} run "
            f"{sorted({profiles[c].runtime for c in others})}. Use torch device profiles (--set profiles=...)"
        )
    return profiles


class Strategy:
    """Hooks the round loop calls. Strategies never loop over rounds and never touch the transport."""

    name = "base"
    options_type: type[StrategyOptions] = StrategyOptions  # set by register_strategy
    # A personalized strategy's final accuracy covers only clients that trained at least once
    # (a never-selected client has no personalized model); a global-model strategy covers all.
    personalized = True
    # Reply model roles that are the client's update of a model its task sent (reply role -> task role; FedAvg:
    # {"local": "global"}), and whether named tensors the task also sent are updated ones (FedMN's blocks): the
    # coordinator bounds and clips their difference from what was sent against the round (server/bounds.py).
    update_of: Mapping[str, str] = {}
    tensor_updates = False

    def outlier_exempt(self) -> frozenset[str]:
        """Named tensors whose honest updates are too heavy-tailed across clients to refuse a reply by (FedMN's
        router): left out of the whole-update outlier check, still clipped tensor by tensor. None by default."""
        return frozenset()

    def __init__(
        self, config: StrategyConfig, public: PublicData | None = None, options: StrategyOptions | None = None
    ) -> None:
        self.config = config
        self.public = public
        self.options: Any = self.options_type() if options is None else options
        if not isinstance(self.options, self.options_type):
            raise StrategyError(f"{self.name} takes {self.options_type.__name__}, got {type(self.options).__name__}")
        self.clients: dict[str, ClientInfo] = {}

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        """Called once with the registered fleet; raise StrategyError if the fleet does not fit."""
        self.clients = dict(clients)

    def train_task(self, upload: bool, kind: type[T] = TrainTask, **extra: Any) -> T:
        """The settings of a local-training task from the run's keys (epochs, batch, Adam's lr, the executorch
        runtime's SGD lr and momentum, seed) and whether to upload the model, as `kind` (TrainTask or a method's
        subclass) with its own fields in `extra` (λ/T/KL direction for a kd_train task, FedProx's μ, ...)."""
        c = self.config
        return kind(
            epochs=c.local_epochs,
            batch_size=c.batch_size,
            lr=c.lr,
            seed=c.seed,
            upload=upload,
            sgd_lr=c.sgd_lr,
            sgd_momentum=c.sgd_momentum,
            **extra,
        )

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        """The task for each active client this round. A failed round is planned again, so planning must not
        change anything `state()` returns."""
        raise NotImplementedError

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        """Fold the replies that arrived (possibly none) into the server state."""
        raise NotImplementedError

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """What a reply to `task` (one this strategy planned, or an evaluation) may carry; the coordinator refuses
        a reply with anything else, and the transport sizes replies by it. By default: metrics only."""
        return Expected()

    def reply_rejection(self, task: Task, client: ClientInfo, result: Result) -> tuple[str, str] | None:
        """The strategy's own check of a reply that already carries what `expects` declares (shapes, dtypes, finite
        values): (reason code, message) to refuse it before `aggregate` sees it, counted in summary.json like
        the coordinator's refusals; None (the default) to accept it."""
        return None

    def round_rejections(self, tasks: Mapping[str, Task], results: Mapping[str, Result]) -> dict[str, tuple[str, str]]:
        """The strategy's check of a round's replies together (a bound relative to the round, such as a median over
        its replies), given those that passed every check of one reply, `reply_rejection` included, and the tasks
        they answer (training or evaluation): client → (reason code, message) for each reply to refuse before
        `aggregate` sees it, counted in summary.json like the others; {} (the default) to accept them all."""
        return {}

    def trained_spec(self, task: Task, client: ClientInfo) -> ModelSpec:
        """The architecture `client` trains for `task` (one this strategy planned), which the simulated clock
        charges (server/clock.py): by default the model the task sends under role "model" (a strategy that
        hands out the model to train), else the client's registered model (FedAvg's "global" has its
        architecture; pFedClub/pFedHR train the client's own model, the teacher is charged separately)."""
        sent = task.models.get(C.TRAINED_MODEL_ROLE)
        return sent.spec if sent is not None else client.spec

    def other_macs(self, task: Task, client: ClientInfo) -> int:
        """MACs per training sample that `task` costs `client` once, besides training `trained_spec` and a teacher's
        forward pass (the clock adds both itself); 0 by default."""
        return 0

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        """Evaluation tasks; by default each client evaluates its own current model."""
        return {cid: Task("evaluate", rnd) for cid in clients}

    def record(self, rnd: int, client: str) -> dict[str, Any]:
        """Extra per-client fields for metrics.jsonl (e.g. teacher size); none by default."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Extra fields for summary.json; none by default."""
        return {}

    def final_models(self) -> dict[str, dict[str, Weights]]:
        """The server-side models a finished run leaves per client, by role (e.g. {"3": {"teacher": ...}});
        written to the run folder and exported after the last round. None by default."""
        return {}

    def state(self) -> Tree:
        """Everything later rounds and the summary need, as a checkpoint tree (fedge.checkpoint); by default
        nothing. A run resumed from it must continue bit-identically."""
        return {}

    def load_state(self, state: Tree) -> None:
        """Restore what `state()` returned, after `setup` with the same fleet; by default there is nothing to
        restore. A tree that does not fit this strategy and fleet raises StrategyError."""


# filled by the server halves of the `fedge.methods` entry points (fedge.plugins) when first read
STRATEGIES: Registry[type[Strategy]] = Registry("strategy", StrategyError, partial(load_methods, "server"))


def register_strategy(
    name: str, options: type[StrategyOptions] = StrategyOptions
) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator adding a strategy under `name` (which becomes its `name` attribute) with its options
    dataclass."""
    if not (dataclasses.is_dataclass(options) and issubclass(options, StrategyOptions)):
        raise TypeError(f"strategy {name!r}: options must be a StrategyOptions dataclass, got {options!r}")

    def add(cls: type[Strategy]) -> type[Strategy]:
        cls.name, cls.options_type = name, options
        return STRATEGIES.add(name, cls)

    return add


def parse_options(name: str, values: Mapping[str, Any]) -> StrategyOptions:
    """The options of strategy `name` from `values` (strings from --set, or TOML/JSON values), over its defaults.
    An unknown strategy raises StrategyError; an unknown option, or a bad value, ConfigError listing the
    strategy's options."""
    options_type = STRATEGIES.get(name).options_type
    known = {f.name: f for f in dataclasses.fields(options_type)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        listing = ", ".join(known) or "none"
        raise ConfigError(
            f"strategy {name!r} has no option(s) {unknown}; its options: {listing} "
            f"(`fedge strategies` describes them; run-level keys are listed by `fedge run --help`)"
        )
    hints = typing.get_type_hints(options_type)
    return options_type(**{k: coerce(k, hints[k], v) for k, v in values.items()})


def create_strategy(
    name: str,
    config: StrategyConfig,
    public: PublicData | None = None,
    options: StrategyOptions | Mapping[str, Any] | None = None,
) -> Strategy:
    """Instantiate a registered strategy with its options (a dataclass, or values for parse_options; None: the
    defaults); an unknown name raises StrategyError listing the known ones."""
    if options is None or isinstance(options, Mapping):
        options = parse_options(name, options or {})
    return STRATEGIES.get(name)(config, public, options)
