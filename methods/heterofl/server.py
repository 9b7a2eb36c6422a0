"""`heterofl` (Diao, Ding, Tarokh, ICLR 2021): one global model; each client trains the top-left width slice of it
that its compute capacity allows, and every global weight is averaged over the clients that hold it.

What fedge does as the paper does:
- submodels at model rates r ∈ {1, 1/2, 1/4, 1/8, 1/16} (levels a–e, §3.1): every hidden width times r, rounded
  up (methods/heterofl/widths.scale_width), the weights of the top-left slice of the global model's tensors (Eq. (1));
- each client gets the largest rate whose submodel fits its capacity (the paper fixes a level per client; here
  it follows from the client's capacity: its device profile's max_macs, or a capacity file, server/capacity.py);
- aggregation (Eq. (2)): every element of the global model is the average of the clients whose submodel holds it;
  an element no client of the round holds keeps its value (server/slices.sliced_average);
- the Scaler (§3.1: x / r after each hidden layer while training, identity at inference) as a `scaler` layer in
  the submodel's spec (option `scaler`), but only where no BatchNorm follows the layer (below).

Deviations:
- static BatchNorm (sBN: no running statistics while training, recomputed over the data at evaluation) is not
  used: BatchNorm layers keep running statistics, which are averaged on slices like the weights. For the same
  reason there is no Scaler before a BatchNorm: training-mode BN normalises the 1/r away, and its running
  statistics would be of x / r while inference sees x.
- the paper's masked cross-entropy for non-IID label splits (logits of classes a client lacks are masked out of
  its loss) is not used: clients train with plain cross-entropy.
- the average of Eq. (2) weights each client by its example count (capped at `max_client_share`, as FedAvg), where
  the paper's code takes a plain mean; with equal shards the two agree.
- the global model is a registered spec of the fleet (the largest by MACs, or the one option `model` names), at
  the run's width preset, or the spec in option `model_file` (FedTrans's comparison: the largest model FedTrans
  grew, as its App. A.1 does), from which every submodel is cut: a client whose own registered model is another
  architecture still trains a slice of the global one (the `train_model` task) and is evaluated on it.
- only torch-runtime clients take part: an ExecuTorch client's training program is built for its own model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.config import ConfigError
from fedge.model.spec import ModelSpec, SpecError, build, parameter_names, tensor_shapes, validate
from fedge.seeding import derive_seed
from fedge.wire.messages import ClientInfo, Result, Task, Weights, client_order
from fedge.wire.payloads import Expected
from methods.fedavg.server import checkpoint_global
from methods.heterofl.widths import scale_width, with_scalers
from server.aggregation import capped_shares, combine
from server.capacity import CapacityError, client_capacities, compatible
from server.slices import crop
from server.strategy import Strategy, StrategyError, StrategyOptions, option, register_strategy, torch_profiles

log = logging.getLogger(__name__)


def parse_rates(text: str) -> tuple[float, ...]:
    """The model rates of a comma-separated list ("1,0.5,0.25"); ConfigError unless each is a number in (0, 1],
    they strictly decrease, and the first is 1 (the global model itself)."""
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"rates must be comma-separated numbers such as 1,0.5,0.25, got {text!r}") from None
    if not all(0 < r <= 1 for r in rates):
        raise ConfigError(f"rates must each be in (0, 1], got {text!r}")
    if any(a <= b for a, b in zip(rates, rates[1:])) or rates[0] != 1:
        raise ConfigError(f"rates must start at 1 and strictly decrease (e.g. 1,0.5,0.25), got {text!r}")
    return rates


@dataclass(frozen=True)
class HeteroFLOptions(StrategyOptions):
    """HeteroFL's global model, its model rates, where client capacities come from, and the aggregation cap."""

    model: str = option(
        "",
        "the global model: the name of a model some client registered (at the run's widths); empty: the "
        "registered model with the most MACs",
    )
    model_file: str = option(
        "",
        "a JSON model spec for the global model instead (FedTrans App. A.1 gives HeteroFL the largest model FedTrans "
        "grew: a FedTrans run's summary.json largest_model, written to a file); it must take the fleet's input",
    )
    rates: str = option(
        "1,0.5,0.25,0.125,0.0625",
        "model rates a client may get, comma-separated, from 1 down (HeteroFL's levels a-e); each client gets "
        "the largest whose submodel fits its capacity",
    )
    capacity_file: str = option(
        "",
        "JSON {client: MACs} or CSV client,macs giving each client's capacity; empty: its device profile's max_macs",
    )
    scaler: bool = option(True, "HeteroFL's Scaler: divide hidden activations by the rate while training")
    max_client_share: float = option(
        C.MAX_CLIENT_SHARE,
        "largest share of a round's average one client may get, in (0, 1]; 1 gives plain example weights",
    )

    def __post_init__(self) -> None:
        parse_rates(self.rates)
        if self.model and self.model_file:
            raise ConfigError("heterofl takes its global model from model or from model_file, not both")
        if not 0 < self.max_client_share <= 1:
            raise ConfigError(
                f"max_client_share must be in (0, 1] (1: plain example weights), got {self.max_client_share}"
            )


@register_strategy("heterofl", HeteroFLOptions)
class HeteroFL(Strategy):
    """A global model of which each client trains the width slice its capacity allows."""

    personalized = False  # every client is evaluated on its slice of the one global model
    update_of = {"model": "model"}  # the trained model updates the one sent

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        profiles = torch_profiles(self.name, clients, "trains a slice of the global model on every client")
        try:
            self.capacity = client_capacities(profiles, self.options.capacity_file)
        except CapacityError as e:
            raise StrategyError(str(e)) from None
        spec = self.global_spec(clients)
        specs = {r: self.submodel_spec(spec, r) for r in parse_rates(self.options.rates)}
        self.rate = {cid: self.fitting_rate(cid, specs, profiles[cid]) for cid in clients}
        self.specs = {cid: specs[rate] for cid, rate in self.rate.items()}
        self.shares: dict[str, float] = {}
        torch.manual_seed(derive_seed(self.config.seed, "heterofl-init"))
        self.global_model = Weights(spec, build(spec).state_dict())

    def global_spec(self, clients: Mapping[str, ClientInfo]) -> ModelSpec:
        """The spec in `model_file`, else the registered spec that `model` names (the one with the most MACs if
        several), or the fleet's largest by MACs; StrategyError when the file cannot be read or does not take the
        fleet's input and classes, or listing the fleet's models when no client registered `model`."""
        ordered = sorted(clients.values(), key=lambda info: client_order(info.client_id))
        if self.options.model_file:
            return self.spec_file(ordered[0].spec)
        pool = [info.spec for info in ordered if not self.options.model or info.spec.name == self.options.model]
        if not pool:
            names = sorted({info.spec.name for info in ordered})
            raise StrategyError(
                f"heterofl: no client registered model {self.options.model!r} for the global model; "
                f"this fleet has {names} (leave model empty for the largest)"
            )
        return max(pool, key=lambda spec: spec.macs).with_origin(None)

    def spec_file(self, fleet: ModelSpec) -> ModelSpec:
        """The global model of option `model_file`, checked against a spec of the fleet (input shape, classes)."""
        path = Path(self.options.model_file)
        try:
            spec = ModelSpec.from_json(path.read_text())
            validate(spec)
        except (OSError, SpecError) as e:
            raise StrategyError(f"heterofl: model_file {path}: {e}") from None
        if (spec.input_shape, spec.num_classes) != (fleet.input_shape, fleet.num_classes):
            raise StrategyError(
                f"heterofl: model_file {path} takes input {spec.input_shape} with {spec.num_classes} classes; "
                f"this fleet's models take {fleet.input_shape} with {fleet.num_classes}"
            )
        return spec.with_origin(None)

    def submodel_spec(self, spec: ModelSpec, rate: float) -> ModelSpec:
        """The spec of the submodel at `rate`, with Scaler layers when the option is on."""
        sub = scale_width(spec, rate)
        return with_scalers(sub, rate) if self.options.scaler else sub

    def fitting_rate(self, cid: str, specs: Mapping[float, ModelSpec], profile: Any) -> float:
        """The largest rate whose submodel is compatible with the client's capacity and profile; StrategyError
        naming the client, its capacity and the smallest submodel when none is."""
        for rate, spec in specs.items():
            if compatible(spec, self.capacity[cid], profile):
                return rate
        smallest = specs[min(specs)]
        raise StrategyError(
            f"heterofl: client {cid} (capacity {self.capacity[cid]:,} MACs, profile {profile.name}) fits no "
            f"submodel: the smallest, {smallest.name}, needs {smallest.macs:,} MACs and {smallest.params:,} "
            "parameters. Add a smaller rate, raise its capacity, or choose a smaller global model"
        )

    def submodel(self, cid: str) -> Weights:
        """The client's submodel: the top-left slices of the global model's tensors (Eq. (1)), as fresh tensors."""
        spec = self.specs[cid]
        shapes = tensor_shapes(spec)
        state = self.global_model.state
        return Weights(
            spec, {k: crop(state[k], shapes[k][0]).clone(memory_format=torch.contiguous_format) for k in shapes}
        )

    def submodels(self, clients: Sequence[str]) -> dict[str, Weights]:
        """Each client's submodel, cut once per rate."""
        by_rate: dict[float, Weights] = {}
        for cid in clients:
            if self.rate[cid] not in by_rate:
                by_rate[self.rate[cid]] = self.submodel(cid)
        return {cid: by_rate[self.rate[cid]] for cid in clients}

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        self.shares = {}
        config = self.train_task(upload=True).to_config()
        return {cid: Task("train_model", rnd, config, {"model": w}) for cid, w in self.submodels(active).items()}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """A training reply carries the trained submodel (and may carry the task's `activeness` record); an
        evaluation only metrics."""
        if task.type != "train_model":
            return Expected()
        return Expected(
            models={"model": self.specs[client.client_id]}, records=("activeness",), optional=frozenset({"activeness"})
        )

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        """Eq. (2): each global element becomes the example-weighted average of the replies holding it (or the
        run's robust aggregate over them, server/aggregation.py)."""
        replies = sorted((r for r in results.values() if "model" in r.models), key=lambda r: client_order(r.client_id))
        if not replies:
            return
        shares = capped_shares([r.num_examples for r in replies], self.options.max_client_share)
        if self.config.aggregation.weighted:
            self.shares = {r.client_id: share for r, share in zip(replies, shares)}
        parts = [(r.models["model"].state, share) for r, share in zip(replies, shares)]
        spec = self.global_model.spec
        state = combine(self.global_model.state, parts, self.config.aggregation, parameter_names(spec))
        self.global_model = Weights(spec, state)

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        """Each client evaluates its own submodel of the global model."""
        return {cid: Task("evaluate", rnd, models={"global": w}) for cid, w in self.submodels(clients).items()}

    def record(self, rnd: int, client: str) -> dict[str, Any]:
        """The client's capacity, rate and submodel (name, MACs, parameters), and its share of the round's average."""
        spec = self.specs[client]
        out: dict[str, Any] = {
            "capacity": self.capacity[client],
            "rate": self.rate[client],
            "assigned_model": spec.name,
            "assigned_macs": spec.macs,
            "assigned_params": spec.params,
        }
        return out | ({"aggregation_share": self.shares[client]} if client in self.shares else {})

    def summary(self) -> dict[str, Any]:
        """The global model, and every client's capacity and rate."""
        order = sorted(self.clients, key=client_order)
        return {
            "global_model": self.global_model.spec.name,
            "capacity": {cid: self.capacity[cid] for cid in order},
            "rate": {cid: self.rate[cid] for cid in order},
        }

    def final_models(self) -> dict[str, dict[str, Weights]]:
        """Every client's submodel of the final global model, as role `model`."""
        return {cid: {"model": w} for cid, w in self.submodels(sorted(self.clients, key=client_order)).items()}

    def state(self) -> Tree:
        """The global model."""
        return {"global": self.global_model}

    def load_state(self, state: Tree) -> None:
        """Take the checkpoint's global model; one of another architecture raises StrategyError."""
        self.global_model = checkpoint_global(self.global_model, state)
