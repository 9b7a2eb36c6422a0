"""`fedtrans` (Zhu, Liu, Chowdhury, Lai, MLSys 2024, Algorithm 1): one small model grows, by function-preserving
widening and deepening of its most active cells, into a chain of models; each client trains a model its capacity
allows, sampled by its utilities (Eqs. 2-4); models share weights softly, small to large (Eq. 5).

Our choices where the paper is open (docs/deviations.md): sim(M_i, M_j) is the mean of the cells' matching degrees
(fedtrans_math.model_similarity); t in Eq. (5)'s η^t counts the rounds since M_j was made; Eq. (5)'s weights are
normalised to sum to one; DoC is taken on the newest model's median training loss of the rounds it was trained; a
model that trained no client this round is left as it is unless a smaller model shares into it.

Growth needs a quorum (docs/deviations.md): a point of the newest model's loss curve (Eq. 1) and of its cell
activeness is the median over at least `growth_quorum` distinct clients' reports, so one liar moves a point only
between the honest reports beside it: it cannot force, stall or steer growth beyond the spread of the honest
clients' own reports (with 1-2 reporters it sets the point). A round with fewer reporters adds theirs (each
client's latest) to a pool that carries over to the next rounds until the quorum is met; Eq. (1)'s γ and δ then
count points, not rounds. A chain whose newest model fewer than `growth_quorum` clients ever train stops growing.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fedge import constants as C
from fedge.checkpoint import Tree
from fedge.config import ConfigError
from fedge.model.spec import ModelSpec, build, parameter_names, tensor_shapes
from fedge.model.weights import State
from fedge.seeding import derive_seed
from fedge.tasks import is_cell_weight
from fedge.wire.messages import ClientInfo, Result, Task, Weights, client_order
from fedge.wire.payloads import Expected
from methods.fedtrans.maths import (
    degree_of_convergence,
    lineage_map,
    model_similarity,
    sample_model,
    soft_weights,
    standardized,
    update_utilities,
)
from methods.fedtrans.transforms import TransformError, can_deepen, can_widen, cells, deepen, widen
from server.aggregation import capped_shares, combine
from server.capacity import client_capacities, compatible
from server.slices import crop, sliced_average
from server.strategy import Strategy, StrategyError, StrategyOptions, option, register_strategy, torch_profiles

log = logging.getLogger(__name__)
SELECTIONS = ("gradient", "random")


@dataclass(frozen=True)
class FedTransOptions(StrategyOptions):
    """Algorithm 1's parameters (α, β; γ, δ of Eq. (1); η of Eq. (5)), where capacities come from, and the
    switches of the paper's ablations."""

    alpha: float = option(0.9, "cell selection threshold α: transform cells with activeness > α x the largest (§4.1)")
    beta: float = option(0.003, "DoC threshold β: transform when DoC <= β (§5.1's 0.003)")
    gamma: int = option(10, "γ: loss slopes averaged by the degree of convergence, Eq. (1) (§5.1's 10)")
    delta: int = option(20, "δ: rounds between the two losses of one slope in Eq. (1) (the authors' CIFAR-10 20)")
    eta: float = option(0.9, "η of Eq. (5): another model's share decays as η^t, t = the target model's age in rounds")
    gradient_rounds: int = option(5, "T: rounds of cell activeness averaged for selection (the authors' CIFAR-10 5)")
    initial_model: str = option("", "the model the chain starts from: a registered model's name; '' = the cheapest")
    capacity_file: str = option("", "client id -> MAC capacity (JSON or CSV client,macs); '' = profiles' max_macs")
    max_models: int = option(8, "most models the chain may hold (bounds server memory)")
    layer_selection: str = option("gradient", "gradient (§4.1) or random (Table 3's FedTrans-l ablation)")
    soft_aggregation: bool = option(True, "Eq. (5) sharing between models; false: each model averages its own")
    large_to_small: bool = option(False, "also share large models into small ones (Table 1's ablation)")
    max_client_share: float = option(C.MAX_CLIENT_SHARE, "largest share of a model's average one client may get")
    growth_quorum: int = option(
        C.MIN_GROWTH_REPORTERS,
        "distinct clients whose reports make one point of DoC (Eq. 1) and activeness; below 3 one liar steers growth",
    )

    def __post_init__(self) -> None:
        checks = {
            "alpha": 0 <= self.alpha <= 1,
            "beta": math.isfinite(self.beta),
            "gamma": self.gamma >= 1,
            "delta": self.delta >= 1,
            "eta": 0 < self.eta <= 1,
            "gradient_rounds": self.gradient_rounds >= 1,
            "max_models": self.max_models >= 1,
            "layer_selection": self.layer_selection in SELECTIONS,
            "max_client_share": 0 < self.max_client_share <= 1,
            "growth_quorum": self.growth_quorum >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(
                f"fedtrans options {bad} out of range: alpha in [0, 1], beta finite, gamma, delta, gradient_rounds, "
                f"max_models and growth_quorum >= 1, eta in (0, 1], layer_selection one of {SELECTIONS}, "
                "max_client_share in (0, 1]"
            )


def weight_cells(spec: ModelSpec) -> dict[str, int]:
    """Every conv and linear weight of a model (its cells for similarity, §4.2) → its parameter count."""
    return {n: math.prod(shape) for n, (shape, _) in tensor_shapes(spec).items() if is_cell_weight(n, shape)}


@register_strategy("fedtrans", FedTransOptions)
class FedTrans(Strategy):
    """Algorithm 1: assign (lines 6-10), update utilities (11), aggregate softly (13), grow the chain (15-22)."""

    personalized = False  # every client is evaluated on its best compatible model, trained or not
    update_of = {"model": "model"}  # the trained model updates the one sent

    def setup(self, clients: Mapping[str, ClientInfo]) -> None:
        super().setup(clients)
        self.profiles = torch_profiles(
            self.name, clients, "sends each client a model of the server's choosing to train"
        )
        self.capacity = client_capacities(self.profiles, self.options.capacity_file or None)
        initial = self.initial_spec(clients)
        misfits = sorted(
            (cid for cid in clients if not compatible(initial, self.capacity[cid], self.profiles[cid])),
            key=client_order,
        )
        if misfits:
            raise StrategyError(
                f"fedtrans's initial model {initial.name!r} ({initial.macs:,} MACs, {initial.params:,} params) is "
                f"beyond clients {misfits} (capacity {self.capacity[misfits[0]]:,} MACs, profile "
                f"{self.profiles[misfits[0]].name}); pick a smaller initial_model"
            )
        torch.manual_seed(derive_seed(self.config.seed, "fedtrans-init"))
        state = build(initial).state_dict()
        self.models: list[Weights] = [Weights(initial, state)]
        self.lineages: list[dict[str, str | None]] = [{n: n for n in state}]
        self.created: list[int] = [0]
        self.ops: list[dict[str, str]] = [{}]  # per model: cell → the last transformation applied to it
        self.utilities: dict[str, list[float]] = {cid: [0.0] for cid in clients}  # Alg. 1 line 2
        self.losses: list[float] = []  # the newest model's median training loss per point (a quorum's reports)
        self.activeness: list[dict[str, float]] = []  # the newest model's median cell activeness, last T points
        # The newest model's reports waiting for a quorum: client -> its latest training loss / activeness.
        self.pending: dict[str, dict[str, Any]] = {"train_loss": {}, "activeness": {}}
        self.quorum_reports: dict[str, int] = {}  # reports pooled across rounds, and set aside, by kind
        self.similarity: list[list[float]] = [[1.0]]
        self.transforms: list[dict[str, Any]] = []
        self.growth_stopped = ""
        self.ignored: dict[str, int] = {}  # reports left out (a client may lie), by what they reported
        self.assigned: dict[str, int] = {}
        self.doc: float | None = None

    def initial_spec(self, clients: Mapping[str, ClientInfo]) -> ModelSpec:
        """M_0: the fleet's registered model named by `initial_model`, else its cheapest (fewest MACs)."""
        specs = {info.spec.name: info.spec.with_origin(None) for info in clients.values()}
        if self.options.initial_model:
            if self.options.initial_model not in specs:
                raise StrategyError(
                    f"initial_model {self.options.initial_model!r} is none of the fleet's models {sorted(specs)}"
                )
            return specs[self.options.initial_model]
        return min(specs.values(), key=lambda s: (s.macs, s.params, s.name))

    def compatible(self, cid: str) -> list[int]:
        """Alg. 1 line 7: the models client `cid` can train (MACs within its capacity, within its profile)."""
        return [k for k, m in enumerate(self.models) if compatible(m.spec, self.capacity[cid], self.profiles[cid])]

    def plan(self, rnd: int, active: Sequence[str]) -> dict[str, Task]:
        """Lines 6-10: each client trains a model sampled from its utilities over its compatible ones (Eqs. 2-3)."""
        self.assigned = {}
        for cid in active:
            rng = np.random.default_rng(derive_seed(self.config.seed, "fedtrans-assign", rnd, cid))
            self.assigned[cid] = sample_model(self.utilities[cid], self.compatible(cid), rng)
        config = self.train_task(upload=True).to_config()
        return {cid: Task("train_model", rnd, config, {"model": self.models[k]}) for cid, k in self.assigned.items()}

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        if task.type != "train_model":
            return Expected()
        return Expected(
            models={"model": task.models["model"].spec}, records=("activeness",), optional=frozenset({"activeness"})
        )

    def aggregate(self, rnd: int, results: Mapping[str, Result]) -> None:
        replies = {cid: r for cid, r in results.items() if cid in self.assigned and "model" in r.models}
        if not replies:
            return
        losses = self.reported_losses(replies)
        z = standardized(losses)
        trained = {cid: self.assigned[cid] for cid in replies}
        self.utilities = update_utilities(  # line 11, Eq. (4)
            self.utilities, trained, z, self.similarity, {cid: self.compatible(cid) for cid in trained}
        )
        self.update_weights(rnd, replies)  # line 13, Eq. (5)
        newest = len(self.models) - 1
        mine = sorted((cid for cid in replies if self.assigned[cid] == newest), key=client_order)
        point = self.quorum("train_loss", {cid: losses[cid] for cid in mine if cid in losses})
        if point is not None:
            self.losses.append(statistics.median(point))
            self.losses = self.losses[-(self.options.gamma + self.options.delta) :]
        reports = self.quorum("activeness", self.activeness_reports({c: replies[c] for c in mine}))
        if reports is not None:
            names = sorted(reports[0])
            median = {n: float(statistics.median(a[n] for a in reports)) for n in names}
            self.activeness = (self.activeness + [median])[-self.options.gradient_rounds :]
        self.doc = degree_of_convergence(self.losses, self.options.gamma, self.options.delta)  # line 15, Eq. (1)
        if self.doc is not None and self.doc <= self.options.beta and not self.growth_stopped:  # line 16
            self.grow(rnd)

    def quorum(self, kind: str, reports: Mapping[str, Any]) -> list[Any] | None:
        """The reports (of `kind`: train_loss or activeness) of one point of the newest model's curve, or None
        while fewer than `growth_quorum` distinct clients have reported: this round's `reports` (client -> report)
        when they are enough alone, the pool of earlier ones set aside; else they join the pool (a client's later
        report replaces its earlier one, set aside), which makes the point once it is large enough. Counted in
        summary.json's `quorum_reports`."""
        pool = self.pending[kind]
        need = self.options.growth_quorum
        if len(reports) >= need:
            self.count(f"{kind}_set_aside", len(pool))
            pool.clear()
            return [reports[cid] for cid in sorted(reports, key=client_order)]
        self.count(f"{kind}_pooled", len(reports))
        self.count(f"{kind}_set_aside", len(set(reports) & set(pool)))
        pool.update(reports)
        if len(pool) < need:
            return None
        out = [pool[cid] for cid in sorted(pool, key=client_order)]
        pool.clear()
        return out

    def count(self, key: str, n: int) -> None:
        """Add n to the `quorum_reports` counter `key` (kept absent while 0)."""
        if n:
            self.quorum_reports[key] = self.quorum_reports.get(key, 0) + n

    def reported_losses(self, replies: Mapping[str, Result]) -> dict[str, float]:
        """The replies' training losses that are numbers in [0, MAX_REPORTED_LOSS]; a missing or absurd one (a
        client may lie) is left out of Eqs. (1) and (4) and counted."""
        out = {}
        for cid in sorted(replies, key=client_order):
            value = replies[cid].metrics.get("train_loss")
            if isinstance(value, (int, float)) and 0 <= value <= C.MAX_REPORTED_LOSS:
                out[cid] = float(value)
            else:
                self.ignored["train_loss"] = self.ignored.get("train_loss", 0) + 1
        return out

    def model_averages(self, replies: Mapping[str, Result]) -> dict[int, State]:
        """Each trained model's average over its clients' replies (example-weighted, shares capped; or the run's
        robust aggregate, server/aggregation.py), from the model they were sent."""
        out = {}
        for k in sorted(set(self.assigned[cid] for cid in replies)):
            mine = sorted((cid for cid in replies if self.assigned[cid] == k), key=client_order)
            shares = capped_shares([replies[cid].num_examples for cid in mine], self.options.max_client_share)
            parts = [(replies[cid].models["model"].state, share) for cid, share in zip(mine, shares)]
            out[k] = combine(self.models[k].state, parts, self.config.aggregation, parameter_names(self.models[k].spec))
        return out

    def update_weights(self, rnd: int, replies: Mapping[str, Result]) -> None:
        """Eq. (5): each model j becomes the weighted average, element by element on top-left slices along the
        lineage, of its own w_j (its clients' fresh average, else its current weights: i = j is always in the sum)
        and the fresh averages w_i of the other models trained this round (i < j, or any i with large_to_small),
        weighted η^{1(i≠j)·t}·sim(M_i, M_j). A model no client trained is not pulled again by models that were not
        trained either: they bring no new information."""
        averages = self.model_averages(replies)
        new = []
        for j, model in enumerate(self.models):
            own = averages.get(j, model.state)
            if self.options.soft_aggregation:
                others = [i for i in averages if i != j]
                weights = soft_weights(
                    j,
                    others + [j],
                    self.similarity,
                    self.options.eta,
                    rnd - self.created[j],
                    self.options.large_to_small,
                )
            else:
                weights = {j: 1.0}
            parts = [(own if i == j else self.carried(averages[i], i, j), w) for i, w in sorted(weights.items())]
            new.append(Weights(model.spec, sliced_average(model.state, parts)))
        self.models = new

    def carried(self, state: State, source: int, target: int) -> State:
        """Model `source`'s tensors named as model `target`'s, along the lineage; a larger source's are cropped
        to the target's shapes."""
        shapes = {n: t.shape for n, t in self.models[target].state.items()}
        if source <= target:
            names = lineage_map(self.lineages, target, source)
            return {n: state[p] for n, p in names.items() if p is not None}
        names = lineage_map(self.lineages, source, target)
        return {p: crop(state[n], shapes[p]) for n, p in names.items() if p is not None}

    def activeness_reports(self, replies: Mapping[str, Result]) -> dict[str, dict[str, float]]:
        """The newest model's cell activeness this round, by client: the replies whose `activeness` record is
        well-formed (a value in [0, MAX_REPORTED_ACTIVENESS] for every conv/linear weight; others are left out and
        counted). A point of activeness is their median per weight (`quorum`): one client cannot pick the cell."""
        names = set(weight_cells(self.models[-1].spec))
        reports = {}
        for cid in sorted(replies, key=client_order):
            act = replies[cid].records.get("activeness")
            if (
                isinstance(act, dict)
                and set(act) == names
                and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= C.MAX_REPORTED_ACTIVENESS
                    for v in act.values()
                )
            ):
                reports[cid] = {n: float(v) for n, v in act.items()}
            elif act is not None:
                self.ignored["activeness"] = self.ignored.get("activeness", 0) + 1
        return reports

    def select_cells(self, rnd: int) -> list[Any]:
        """Lines 19-21: the cells of the newest model whose activeness, averaged over the last T rounds, exceeds α
        times the largest (all of them if every one is 0); with layer_selection=random, as many cells drawn at
        random (the paper's FedTrans-l ablation), and also when no client reported activeness."""
        spec = self.models[-1].spec
        candidates = cells(spec)
        rounds = [a for a in self.activeness if a]
        scores = {c: statistics.fmean(a[f"{c.name}.weight"] for a in rounds) for c in candidates} if rounds else {}
        chosen = []
        if scores:
            top = max(scores.values())
            chosen = [c for c in candidates if scores[c] >= self.options.alpha * top]  # the largest always "exceeds"
        if self.options.layer_selection == "random" or not chosen:
            rng = np.random.default_rng(derive_seed(self.config.seed, "fedtrans-cells", rnd))
            picks = rng.choice(len(candidates), size=min(len(candidates), max(1, len(chosen))), replace=False)
            chosen = [candidates[i] for i in sorted(picks)]
        return chosen

    def grow(self, rnd: int) -> None:
        """Lines 16-22: a new model M* from the newest one, each selected cell widened ×2 or deepened by one
        identity cell, alternating per cell (the first time widened, then deepened, then widened...), weights
        inherited function-preservingly; a transformation that would leave no client able to train the model
        (beyond the fleet's largest capacity) is skipped. When none of the selected cells can grow, the others are
        tried, most active first, until one does; when none can, the chain stops growing. M* starts with its
        parent's utilities (line 18)."""
        if len(self.models) >= self.options.max_models:
            self.growth_stopped = f"the chain holds max_models={self.options.max_models} models"
            return
        rng = torch.Generator().manual_seed(derive_seed(self.config.seed, "fedtrans-widen", rnd))
        selected = self.select_cells(rnd)
        spec, state, lineage, ops, applied = self.transform(selected, rng)
        for cell in self.by_activeness([c for c in cells(self.models[-1].spec) if c not in selected]):
            if applied:
                break
            spec, state, lineage, ops, applied = self.transform([cell], rng)
        if not applied:
            self.growth_stopped = "no cell can be transformed within the fleet's largest capacity"
            log.info("fedtrans round %d: %s; the chain stops growing", rnd, self.growth_stopped)
            return
        parent = len(self.models) - 1
        spec = ModelSpec(f"{self.models[0].spec.name}-t{parent + 1}", spec.input_shape, spec.num_classes, spec.blocks)
        self.models.append(Weights(spec, state))
        self.lineages.append(lineage)
        self.created.append(rnd + 1)
        self.ops.append(ops)
        self.utilities = {cid: u + [u[parent]] for cid, u in self.utilities.items()}
        self.similarity = self.similarities()
        self.losses, self.activeness = [], []
        for kind, pool in self.pending.items():  # reports of the parent, which is no longer the newest model
            self.count(f"{kind}_set_aside", len(pool))
            pool.clear()
        self.transforms.append(
            {
                "round": rnd,
                "model": spec.name,
                "parent": self.models[parent].spec.name,
                "ops": applied,
                "doc": self.doc,
                "macs": spec.macs,
                "params": spec.params,
            }
        )
        log.info(
            "fedtrans round %d: made %s (%s MACs) from %s: %s",
            rnd,
            spec.name,
            f"{spec.macs:,}",
            self.models[parent].spec.name,
            applied,
        )

    def by_activeness(self, candidates: Sequence[Any]) -> list[Any]:
        """`candidates` (cells of the newest model), most active first over the last T rounds, then by position."""
        rounds = [a for a in self.activeness if a]

        def score(c: Any) -> float:
            return statistics.fmean(a[f"{c.name}.weight"] for a in rounds) if rounds else 0.0

        return sorted(candidates, key=lambda c: (-score(c), c.block, c.layer))

    def transform(self, chosen: Sequence[Any], rng: torch.Generator) -> tuple[ModelSpec, State, dict, dict, list]:
        """The newest model with each `chosen` cell transformed (widen or deepen, alternating per cell; the other
        when the first cannot apply), last cell first so that a deepening does not rename a cell still to come:
        (spec, state, lineage to the newest model's tensors, last operation per cell, what was applied)."""
        spec, state = self.models[-1].spec, self.models[-1].state
        lineage: dict[str, str | None] = {n: n for n in state}
        ops = dict(self.ops[-1])
        applied = []
        for cell in sorted(chosen, key=lambda c: (c.block, c.layer), reverse=True):
            first, second = ("deepen", "widen") if ops.get(cell.name) == "widen" else ("widen", "deepen")
            for op in (first, second):
                possible = can_widen(spec, cell) if op == "widen" else can_deepen(spec, cell)
                if not possible:
                    continue
                try:
                    out = widen(spec, state, cell, rng) if op == "widen" else deepen(spec, state, cell)
                except TransformError as e:
                    log.warning("fedtrans: cannot %s cell %s: %s", op, cell.name, e)
                    continue
                if not any(compatible(out.spec, self.capacity[c], self.profiles[c]) for c in self.clients):
                    continue  # never a model larger than the largest capacity in the fleet
                ops = {
                    c.name: ops[p[: -len(".weight")]]
                    for c in cells(out.spec)
                    if (p := out.lineage.get(f"{c.name}.weight")) and p[: -len(".weight")] in ops
                }
                ops[cell.name] = op
                lineage = {n: None if p is None else lineage[p] for n, p in out.lineage.items()}
                spec, state = out.spec, out.state
                applied.append({"cell": cell.name, "op": op})
                break
        return spec, state, lineage, ops, applied

    def similarities(self) -> list[list[float]]:
        """sim(M_i, M_j) for every pair of the chain (§4.2), symmetric, 1 on the diagonal."""
        n = len(self.models)
        sim = [[1.0] * n for _ in range(n)]
        for j in range(n):
            sizes = weight_cells(self.models[j].spec)
            for i in range(j):
                names = lineage_map(self.lineages, j, i)
                ancestors = {c: None if names[c] is None else self.models[i].state[names[c]].numel() for c in sizes}
                sim[i][j] = sim[j][i] = model_similarity(sizes, ancestors)
        return sim

    def best(self, cid: str) -> int:
        """The compatible model of highest utility for client `cid` (the paper's evaluation pick, §5.1; the first
        on ties)."""
        options = self.compatible(cid)
        return max(options, key=lambda k: (self.utilities[cid][k], -k))

    def evaluation(self, rnd: int, clients: Sequence[str]) -> dict[str, Task]:
        return {cid: Task("evaluate", rnd, models={"global": self.models[self.best(cid)]}) for cid in clients}

    def record(self, rnd: int, client: str) -> dict[str, Any]:
        """The client's capacity, the model it trained (if any) and the one it is evaluated on, the chain's length
        and the newest model's DoC."""
        row: dict[str, Any] = {
            "capacity": self.capacity[client],
            "eval_model": self.models[self.best(client)].spec.name,
            "models": len(self.models),
            "doc": self.doc,
        }
        if client in self.assigned:
            spec = self.models[self.assigned[client]].spec
            row.update(assigned_model=spec.name, assigned_macs=spec.macs, assigned_params=spec.params)
        return row

    def summary(self) -> dict[str, Any]:
        return {
            "capacities": {cid: self.capacity[cid] for cid in sorted(self.capacity, key=client_order)},
            "chain": [
                {"name": m.spec.name, "macs": m.spec.macs, "params": m.spec.params, "created_round": c}
                for m, c in zip(self.models, self.created)
            ],
            "largest_model": max((m.spec for m in self.models), key=lambda spec: spec.macs).to_dict(),
            "transforms": list(self.transforms),
            "growth_stopped": self.growth_stopped,
            "ignored_reports": dict(self.ignored),
            "quorum_reports": dict(self.quorum_reports),
            "eval_models": {
                cid: self.models[self.best(cid)].spec.name for cid in sorted(self.clients, key=client_order)
            },
        }

    def final_models(self) -> dict[str, dict[str, Weights]]:
        """Each client's model: its compatible model of highest utility."""
        return {cid: {"model": self.models[self.best(cid)]} for cid in self.clients}

    def state(self) -> Tree:
        """The chain (models, lineages, birth rounds, last transformation per cell), utilities, the newest model's
        loss curve and activeness, similarities and the transformation log."""
        return {
            "models": list(self.models),
            "lineages": [dict(x) for x in self.lineages],
            "created": list(self.created),
            "ops": [dict(x) for x in self.ops],
            "utilities": {cid: list(u) for cid, u in self.utilities.items()},
            "losses": list(self.losses),
            "activeness": [dict(a) for a in self.activeness],
            "similarity": [list(r) for r in self.similarity],
            "transforms": list(self.transforms),
            "growth_stopped": self.growth_stopped,
            "doc": self.doc,
            "ignored": dict(self.ignored),
            "pending": {kind: dict(pool) for kind, pool in self.pending.items()},
            "quorum_reports": dict(self.quorum_reports),
        }

    def load_state(self, state: Tree) -> None:
        """Take the checkpoint's chain; one of another initial model or fleet raises StrategyError."""
        if state["models"][0].spec != self.models[0].spec:
            raise StrategyError(
                f"checkpoint's chain starts from {state['models'][0].spec.name!r}, this run from "
                f"{self.models[0].spec.name!r}"
            )
        if set(state["utilities"]) != set(self.clients):
            raise StrategyError("checkpoint's utilities are for another fleet")
        self.models = list(state["models"])
        self.lineages = [dict(x) for x in state["lineages"]]
        self.created, self.ops = list(state["created"]), [dict(x) for x in state["ops"]]
        self.utilities = {cid: list(u) for cid, u in state["utilities"].items()}
        self.losses, self.activeness = list(state["losses"]), [dict(a) for a in state["activeness"]]
        # absent from checkpoints written before the growth quorum: nothing pending, nothing counted
        pending = state.get("pending", {})
        self.pending = {kind: dict(pending.get(kind, {})) for kind in self.pending}
        self.ignored, self.quorum_reports = dict(state.get("ignored", {})), dict(state.get("quorum_reports", {}))
        self.similarity = [list(r) for r in state["similarity"]]
        self.transforms, self.growth_stopped, self.doc = (
            list(state["transforms"]),
            state["growth_stopped"],
            state["doc"],
        )
