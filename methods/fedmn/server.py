"""`fedmn` (Wang et al., ICDM 2022, Algorithm 1): a shared pool of modular blocks and a routing hypernetwork; each
client trains the blocks on its own route, and the server averages every block over the clients that used it.

What fedge does as the paper does (the client half is methods/fedmn/client.py):
- the global modular pool and router (line 3), one modular architecture for the fleet (methods/fedmn/modular.py; the
  zoo's fedmn_<units>_<encoder>, e.g. fedmn_2x2x2_mobilenet_v2 for the paper's CIFAR-10 [2×2×2]);
- every round (lines 4-15): a client gets the router and the global values of the blocks its route uses (line 9,
  §II-E), trains, and uploads the router and those blocks (line 13); the upload is refused unless it holds exactly
  them, in their shapes, for the route it was sent;
- aggregation (§II-E): every block becomes the example-weighted average over the clients that used it, normalised by
  the weights present (the paper's Σ_m |D_m|/|D| a_i^m θ_i^m, which without normalising would shrink a block toward 0
  by the share of clients that skipped it); a block no reply used keeps its value; the router is averaged over all
  replies;
- the relaxed Bernoulli's temperature anneals exponentially from `temperature` to `min_temperature` (§IV-B: 1.0 to
  0.1), by `temperature_decay` per routed round;
- the encoder warm-up (§IV-B pretrains the encoders with FedAvg): `warmup_rounds` rounds with every path on, the
  router untouched, i.e. FedAvg of the whole pool.

Where fedge departs or chooses (docs/deviations.md):
- a client's route for round t is the one it sampled at the end of its previous task, with its router as local
  training left it: Algorithm 1 samples it at the start of round t (lines 6-7) with the same local router, before
  copying from the server (line 9); sampling it a task earlier is what lets the server send only that route's
  blocks. A client whose route the server does not know yet trains with every path on, like the warm-up;
- a block is active when it lies on a path from the input to the output (methods/fedmn/modular.py);
- a client is evaluated, as the authors' code does, on the global pool with its own most likely route (the model
  `final_models` leaves per client and the run exports);
- the shares are capped at `max_client_share` (an example count is a client's word), as FedAvg's.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.config import ConfigError
from fedge.model.spec import build, parameter_names, tensor_shapes
from fedge.seeding import derive_seed
from fedge.wire.messages import ClientInfo, Result, Task, Weights, client_order
from fedge.wire.payloads import Expected, TensorSlot
from methods.fedavg.server import checkpoint_global
from methods.fedmn.modular import (
    NEXT_ROUTE,
    ROUTE,
    ROUTER,
    ROUTING,
    Layout,
    block_names,
    block_of,
    downloaded,
    elements,
    has_path,
    is_modular,
    layout_of,
    route_text,
    router_has_batchnorm,
    router_macs,
    uploaded,
    used_blocks,
)
from methods.fedmn.tasks import ModularTrainTask
from server.aggregation import capped_shares, combine
from server.bounds import tensors_norm
from server.strategy import Strategy, StrategyError, StrategyOptions, option, register_strategy, torch_profiles

ROUTER_PASSES = 5  # router forward passes per sample per routed task: Π, its gradient pass (~3), the next decision


def part_name(part: Any) -> str:
    return ROUTER if part == ROUTER else f"block {part[1]} of layer {part[0]}"


@dataclass(frozen=True)
class FedMNOptions(StrategyOptions):
    """The warm-up, the temperature schedule of Eq. (5), the router's learning rate and the aggregation cap."""

    warmup_rounds: int = option(0, "rounds with every path on and the router untouched (FedAvg of the whole pool)")
    temperature: float = option(1.0, "τ of Eq. (5) in the first routed round (paper: 1.0)")
    min_temperature: float = option(0.1, "the smallest τ the annealing reaches (paper: 0.1)")
    temperature_decay: float = option(0.1, "r of τ_t = max(min_temperature, temperature · e^(-r t)), t routed rounds")
    router_lr: float = option(
        C.ROUTER_LR,
        "the routing hypernetwork's SGD step on its gradient summed over a task's batches (ours: the paper's grid "
        "0.001-0.05 is its per-batch local solver's; at 0.05 routes stay near coin flips for 30 rounds)",
    )
    max_client_share: float = option(
        C.MAX_CLIENT_SHARE, "largest share of a round's average one client may get, in (0, 1]; 1: example weights"
    )

    def __post_init__(self) -> None:
        if self.warmup_rounds < 0:
            raise ConfigError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if not (0 < self.min_temperature <= self.temperature and math.isfinite(self.temperature)):
            raise ConfigError(
                f"temperatures must satisfy 0 < min_temperature <= temperature, got {self.min_temperature} and "
                f"{self.temperature}"
            )
        if not (self.temperature_decay >= 0 and math.isfinite(self.temperature_decay)):
            raise ConfigError(f"temperature_decay must be a finite number >= 0, got {self.temperature_decay}")
        if not (self.router_lr > 0 and math.isfinite(self.router_lr)):
            raise ConfigError(f"router_lr must be a finite number > 0, got {self.router_lr}")
        if not 0 < self.max_client_share <= 1:
            raise ConfigError(f"max_client_share must be in (0, 1], got {self.max_client_share}")


@register_strategy("fedmn", FedMNOptions)
class FedMN(Strategy):
    """Algorithm 1 with block-wise exchange (§II-E); module docstring."""

    tensor_updates = True  # the uploaded blocks and router update what the task sent (server/bounds.py clips them)

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        torch_profiles(self.name, clients, "trains a modular network and its router (the modular_train task)")
        specs = {info.spec.with_origin(None).to_json() for info in clients.values()}  # a spec is not hashable
        spec = next(iter(clients.values())).spec.with_origin(None)
        if len(specs) > 1 or not is_modular(spec):
            names = sorted({info.spec.name for info in clients.values()})
            raise StrategyError(
                f"fedmn needs every client on one modular network, but this fleet has {names}; use a FedMN pool "
                "from the zoo, e.g. --zoo fedmn_2x2x2_cnn1"
            )
        self.layout: Layout = layout_of(spec)
        self.shapes = tensor_shapes(spec)
        torch.manual_seed(derive_seed(self.config.seed, "fedmn-init"))
        self.global_model = Weights(spec, build(spec).state_dict())
        self.routes: dict[str, torch.Tensor] = {}  # client -> the route it sampled for its next round
        self.routings: dict[str, torch.Tensor] = {}  # client -> its most likely route (evaluation)
        self.parts: dict[Any, list[str]] = {}  # block (layer, index) or ROUTER -> its state tensors
        for name in self.shapes:
            if (part := block_of(name)) is not None:
                self.parts.setdefault(part, []).append(name)
        self.learned = parameter_names(spec)  # the norm bound leaves out buffers (BatchNorm's running statistics)
        self.router_macs = router_macs(spec)  # forward MACs per sample of the router, which every client holds
        self.batchnorm = int(router_has_batchnorm(spec))  # a pass re-estimating its BatchNorm statistics
        self.shares: dict[str, float] = {}  # client -> its share of the router's average, this round
        self.down: dict[str, int] = {}  # client -> numbers sent to it this round (§IV-D's transmitted parameters)
        self.up: dict[str, int] = {}  # client -> numbers it uploaded this round

    def all_on(self) -> torch.Tensor:
        return torch.ones(self.layout.paths, dtype=torch.bool)

    def temperature(self, rnd: int) -> float:
        """τ of the round: temperature · e^(-decay · t), t = rnd - warmup_rounds, not below min_temperature."""
        o = self.options
        t = max(rnd - o.warmup_rounds, 0)
        return max(o.min_temperature, o.temperature * math.exp(-o.temperature_decay * t))

    def route_for(self, rnd: int, cid: str) -> torch.Tensor | None:
        """The route the client trains in round `rnd`: the one it sampled last, or None (every path on: the
        warm-up, or no route known yet)."""
        return self.routes.get(cid) if rnd >= self.options.warmup_rounds else None

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        self.shares, self.down, self.up = {}, {}, {}
        state, names, tasks = self.global_model.state, list(self.shapes), {}
        for cid in active:
            route = self.route_for(rnd, cid)
            config = self.train_task(
                True,
                ModularTrainTask,
                route_temperature=self.temperature(rnd),
                router_lr=self.options.router_lr,
                learn_routing=route is not None,
            ).to_config()
            route = self.all_on() if route is None else route
            tensors = {n: state[n] for n in downloaded(names, self.layout, route.tolist())}
            self.down[cid] = elements(self.shapes, list(tensors))
            tasks[cid] = Task("modular_train", rnd, config, tensors=tensors | {ROUTE: route})
        return tasks

    def outlier_exempt(self) -> frozenset[str]:
        """The router: its SGD step on a task's summed gradient varies across honest clients by over 10 x the
        round's median (bench/robust.py); it is clipped, and in a task that learns no routing must come back as
        sent (reply_rejection)."""
        return frozenset(self.parts[ROUTER])

    def route_slots(self, *names: str) -> dict[str, TensorSlot]:
        return {name: TensorSlot((self.layout.paths,), "bool") for name in names}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        """A modular_train reply carries the router's and the task's route's used blocks' tensors (each of its shape
        and dtype) and the three routes; an evaluation only metrics."""
        if task.type != "modular_train":
            return Expected()
        slots = {
            name: TensorSlot(self.shapes[name][0], str(self.shapes[name][1]).removeprefix("torch."))
            for name in uploaded(list(self.shapes), self.layout, task.tensors[ROUTE].tolist())
        }
        return Expected(tensors=slots | self.route_slots(ROUTE, NEXT_ROUTE, ROUTING))

    def reply_rejection(self, task: Task, client: ClientInfo, result: Result) -> tuple[str, str] | None:
        """Code "route": a reply for another route than the task's, router parameters other than those sent in a
        task that learns no routing (the warm-up: the router is untouched), or a next or most likely route without a
        path from the input to the output. Code "norm_bound" (the coordinator's bound on uploaded models, which named
        tensors do not pass through): a block or the router whose parameters' L2 norm exceeds UPLOAD_NORM_FACTOR
        times that of what the task sent of it."""
        if task.type != "modular_train":
            return None
        if not torch.equal(result.tensors[ROUTE], task.tensors[ROUTE]):
            return "route", "the reply's route is not the one its task was sent with"
        if not task.config.get("learn_routing") and any(
            not torch.equal(result.tensors[n], task.tensors[n]) for n in self.parts[ROUTER] if n in self.learned
        ):
            return "route", "it changed the router in a task that learns no routing (every path on)"
        for name in (NEXT_ROUTE, ROUTING):
            if not has_path(self.layout, result.tensors[name].tolist()):
                return "route", f"its {name} connects no encoder to the output"
        sent, got = self.part_norms(task.tensors), self.part_norms(result.tensors)
        for part, norm in got.items():
            if norm > C.UPLOAD_NORM_FACTOR * sent[part]:
                return "norm_bound", (
                    f"{part_name(part)} has norm {norm:.4g}, over {C.UPLOAD_NORM_FACTOR:g} x the {sent[part]:.4g} "
                    "it was sent"
                )
        return None

    def part_norms(self, tensors: Mapping[str, torch.Tensor]) -> dict[Any, float]:
        """The L2 norm of the learned parameters of each block (and of the router) that `tensors` holds."""
        return {
            part: tensors_norm(tensors[n] for n in names if n in self.learned)
            for part, names in self.parts.items()
            if names[0] in tensors
        }

    def other_macs(self, task: Task, client: ClientInfo) -> int:
        """The router's passes over the client's data: Π, the gradient pass and the next decision on a routed task
        (ROUTER_PASSES forward-equivalents), the decision alone in the warm-up; one more when the router re-estimates
        its BatchNorm statistics."""
        if task.type != "modular_train":
            return 0
        passes = ROUTER_PASSES if task.config.get("learn_routing") else 1
        return (passes + self.batchnorm) * self.router_macs

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        """§II-E: each block the example-weighted average of the replies that used it, the router that of all
        replies; the weights are normalised, and capped at max_client_share, among the replies holding the part
        (so a client claiming many examples cannot outweigh the others on the blocks it shares with few). A block no
        reply used keeps its value. The replies' next and most likely routes are kept."""
        replies = sorted(
            (r for r in results.values() if r.type == "modular_train"), key=lambda r: client_order(r.client_id)
        )
        if not replies:
            return
        state = dict(self.global_model.state)
        for part, names in self.parts.items():
            users = [r for r in replies if names[0] in r.tensors]  # a reply holds all of a part or none (expects)
            if not users:
                continue
            shares = capped_shares([r.num_examples for r in users], self.options.max_client_share)
            parts = [({n: r.tensors[n] for n in names}, share) for r, share in zip(users, shares)]
            state |= combine({n: state[n] for n in names}, parts, self.config.aggregation, self.learned)
            if part == ROUTER and self.config.aggregation.weighted:
                self.shares = {r.client_id: share for r, share in zip(users, shares)}
        self.global_model = Weights(self.global_model.spec, state)
        for r in replies:
            self.routes[r.client_id] = r.tensors[NEXT_ROUTE].clone()
            self.routings[r.client_id] = r.tensors[ROUTING].clone()
            self.up[r.client_id] = elements(self.shapes, [n for n in r.tensors if block_of(n) is not None])

    def routing(self, cid: str) -> torch.Tensor:
        return self.routings.get(cid, self.all_on())

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        """Each client evaluates the global blocks of its most likely route (every path on before it has one)."""
        state, names, tasks = self.global_model.state, list(self.shapes), {}
        for cid in clients:
            routing = self.routing(cid)
            tensors = {n: state[n] for n in block_names(names, self.layout, routing.tolist())}
            tasks[cid] = Task("modular_evaluate", rnd, tensors=tensors | {ROUTING: routing})
        return tasks

    def record(self, rnd: int, client: str) -> dict[str, Any]:
        """The client's most likely route, how many blocks it uses, the numbers it downloaded and uploaded this
        round (§IV-D's transmitted parameters) and its aggregation share."""
        out: dict[str, Any] = {}
        if client in self.routings:
            routing = self.routings[client].tolist()
            out["routing"] = route_text(routing)
            out["blocks_used"] = len(used_blocks(self.layout, routing))
        if client in self.down:
            out["params_down"] = self.down[client]
        if client in self.up:
            out["params_up"] = self.up[client]
        if client in self.shares:
            out["aggregation_share"] = self.shares[client]
        return out

    def summary(self) -> dict[str, Any]:
        """Every client's most likely route, and how many distinct routes the fleet settled on."""
        order = sorted(self.routings, key=client_order)
        routes = {cid: route_text(self.routings[cid].tolist()) for cid in order}
        return {
            "pool": list(self.layout.units),
            "paths": self.layout.paths,
            "routing": routes,
            "distinct_routes": len(set(routes.values())),
            "route_counts": dict(Counter(routes.values()).most_common()),
        }

    def final_models(self) -> dict[str, dict[str, Weights]]:
        """Every client's personalised model: the global pool with its most likely route as `routing`."""
        out = {}
        for cid in sorted(self.clients, key=client_order):
            state = dict(self.global_model.state)
            name = next(n for n in state if n.endswith(".routing"))
            state[name] = self.routing(cid).clone()
            out[cid] = {"model": Weights(self.global_model.spec, state)}
        return out

    def state(self) -> Tree:
        """The global pool and router, and every client's next and most likely route."""
        return {"global": self.global_model, "routes": dict(self.routes), "routings": dict(self.routings)}

    def load_state(self, state: Tree) -> None:
        """Take the checkpoint's pool and routes; another architecture, or routes that are not this fleet's clients'
        (bool, one per path, each connecting the input to the output), raise StrategyError."""
        self.global_model = checkpoint_global(self.global_model, state)
        for key in ("routes", "routings"):
            routes = state.get(key)
            if (
                not isinstance(routes, dict)
                or set(routes) - set(self.clients)
                or not all(
                    isinstance(t, torch.Tensor)
                    and t.dtype == torch.bool
                    and tuple(t.shape) == (self.layout.paths,)
                    and has_path(self.layout, t.tolist())
                    for t in routes.values()
                )
            ):
                raise StrategyError(
                    f"checkpoint {key} are not routes of this fleet's clients over {self.layout.paths} paths"
                )
        self.routes, self.routings = dict(state["routes"]), dict(state["routings"])
