"""FedMN's client (Wang et al., ICDM 2022, Algorithm 1 lines 6-13): the `modular_train` and `modular_evaluate`
tasks on a client whose own model is a modular network (methods/fedmn/modular.py).

`modular_train`, one round:
- take the router and the blocks the task's route reaches from the server (line 9, §II-E): only those arrive;
- the route V is the one this client sampled at the end of its previous round (lines 6-7, Eqs. 5, 10), which the
  server learnt from its reply and sent back with its blocks; it is fixed for the round (§II-B);
- train the route's blocks with the objective (Eqs. 4, 6, line 11) on V as a straight-through hard decision:
  forward runs V exactly (an inactive block gets no input), backward differentiates a relaxed sample σ((L + G)/τ) of
  Eq. (5) with respect to G, the argument of σ in Eq. (10), at the router just received. Its logistic noise L is
  drawn conditioned on V (L + G > 0 exactly on V's paths), so the relaxed sample is one whose hard decision is V;
- G depends on the router θ_h through the mean over the whole local dataset (Eq. 9). Algorithm 1 computes Π once per
  round (line 6), so every batch's router gradient is J^T ∂L_b/∂G with the one Jacobian J = ∂G/∂θ_h of line 6. We
  sum ∂L_b/∂G over the batches (of every epoch) and take J^T of the sum in one more pass over the data, then one SGD
  step at `router_lr`: the sum of the per-batch SGD steps of Algorithm 1 (line 19) with Π as line 6 computed it;
- sample the next round's route with the trained router (lines 6-7 of the next round: nothing changes the local
  router in between), and the most likely route (evaluation), each with a forced path to the output if it has none;
- upload the router and the blocks the route used (line 13), and the three routes.

Our choices where the paper is silent (docs/deviations.md): blocks train with the run's optimizer (Adam at `lr`, as
every fedge strategy), the router with SGD at the task's `router_lr`; the router's passes run in eval mode (no
dropout), so Π is one deterministic function of the data; a router with BatchNorm (a MobileNet φx) first re-estimates
its running statistics over the data (one pass in training mode, cumulative averages).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch.nn import functional as F

from edge_client.agent import ClientAgent, TaskError, register_task
from edge_client.tasks import train_config, train_settings, training_result
from edge_client.training import Objective, evaluate, fit
from fedge.model.layers import SpecError
from fedge.model.spec import SpecModel
from fedge.seeding import derive_seed
from fedge.wire.messages import Result, Task
from methods.fedmn.modular import (
    NEXT_ROUTE,
    ROUTE,
    ROUTING,
    Layout,
    ModularNet,
    Router,
    block_names,
    downloaded,
    has_path,
    net_of,
    uploaded,
    with_path,
)
from methods.fedmn.tasks import ModularTrainTask


def logistic_noise(paths: int, gen: torch.Generator) -> torch.Tensor:
    """log ε − log(1 − ε), ε ~ Uniform(0, 1), per path (Eq. 5's noise)."""
    return _logit(torch.rand(paths, generator=gen, dtype=torch.float64)).float()


def _logit(eps: torch.Tensor) -> torch.Tensor:
    eps = eps.clamp(1e-12, 1 - 1e-12)
    return eps.log() - torch.log1p(-eps)


def noise_given(route: torch.Tensor, logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Eq. (5)'s noise L conditioned on the hard decision: L + G > 0 exactly where `route` is on (ε uniform on
    (σ(−G), 1) for a path that is on, on (0, σ(−G)) for one that is off), so σ((L + G)/τ) is a relaxed sample whose
    decision is `route`."""
    eps = torch.rand(len(route), generator=gen, dtype=torch.float64)
    cut = torch.sigmoid(-logits.detach().double())
    return _logit(torch.where(route, cut + eps * (1 - cut), eps * cut)).to(logits.dtype)


def relaxed_bernoulli(logits: torch.Tensor, noise: torch.Tensor, temperature: float) -> torch.Tensor:
    """Eq. (5): σ((log ε − log(1 − ε) + log(π / (1 − π))) / τ) with π = σ(logits), so log(π / (1 − π)) = logits."""
    return torch.sigmoid((noise + logits) / temperature)


def straight_through(route: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """Gates whose forward values are exactly the hard route (0 or 1) and whose gradient is the relaxed sample's."""
    return route.to(soft.dtype) + (soft - soft.detach())


def path_logits(router: Router, x: torch.Tensor, y: torch.Tensor, batch: int) -> torch.Tensor:
    """G of Eqs. (9)-(10): the mean of h([φx(x_i), φy(y_i)]) over the whole dataset, so Π = σ(G); in batches
    (summed in float64), eval mode, without autograd; in x's dtype."""
    router.eval()
    with torch.no_grad():
        total = sum(router(xb, yb).double().sum(0) for xb, yb in zip(x.split(batch), y.split(batch)))
    return (total / len(x)).to(x.dtype)


def router_backward(router: Router, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor, batch: int) -> None:
    """Accumulate J^T `grad` into the router's .grad, J = ∂G/∂θ_h (G as path_logits computes it), one batch at a
    time: G is a mean over samples, so J^T g = Σ_batches ∂(g · Σ_{i∈batch} h_i / n)/∂θ_h."""
    router.eval()
    for xb, yb in zip(x.split(batch), y.split(batch)):
        (router(xb, yb).sum(0) @ grad / len(x)).backward()


def refresh_batchnorm(router: Router, x: torch.Tensor, y: torch.Tensor, batch: int) -> None:
    """Re-estimate the running statistics of the router's BatchNorm layers over the data (training mode, cumulative
    averages, no autograd), so that eval-mode passes normalise with this data's statistics."""
    norms = [m for m in router.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    router.train()
    with torch.no_grad():
        for xb, yb in zip(x.split(batch), y.split(batch)):
            router(xb, yb)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    router.eval()


def sgd_step(router: Router, lr: float) -> None:
    """θ_h ← θ_h − lr · ∂/∂θ_h, and clear the gradients."""
    with torch.no_grad():
        for p in router.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    router.zero_grad(set_to_none=True)


def routed_objective(
    model: SpecModel,
    net: ModularNet,
    x: torch.Tensor,
    y: torch.Tensor,
    route: torch.Tensor,
    gates: Callable[[], torch.Tensor],
) -> Objective:
    """Cross-entropy of the network on `route`, with fresh gates (a small graph from G) for every batch."""
    hard = tuple(bool(v) for v in route.tolist())

    def terms(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        net.gates = (hard, gates())
        ce = F.cross_entropy(model(x[idx]), y[idx])
        return ce, ce, torch.zeros(())

    return terms


def modular(agent: ClientAgent, task: Task) -> ModularNet:
    """The client's ModularNet; TaskError when its model is not modular or its runtime is not torch."""
    if agent.trainer.runtime != "torch":
        raise TaskError(f"client {agent.client_id}: the {agent.trainer.runtime} runtime cannot train {task.type}")
    try:
        return net_of(agent.model)
    except SpecError as e:
        raise TaskError(f"client {agent.client_id}: {e}") from None


def task_route(task: Task, name: str, layout: Layout) -> torch.Tensor:
    """The route the task carries under `name`: (E,) bool with a path from the input to the output; TaskError
    otherwise."""
    route = task.tensors.get(name)
    if (
        not isinstance(route, torch.Tensor)
        or route.dtype != torch.bool
        or tuple(route.shape) != (layout.paths,)
        or not has_path(layout, route.tolist())
    ):
        raise TaskError(f"task {task.type} of round {task.round} carries no {name!r}: a ({layout.paths},) bool route")
    return route


def put_blocks(model: SpecModel, task: Task, names: Sequence[str], route_name: str) -> None:
    """Load the task's tensors `names` into `model` (what the server sent of the route: §II-E's copy); TaskError
    unless the task carries exactly those (and the route), each of the model's shape and dtype."""
    state = model.state_dict()
    sent = set(task.tensors) - {route_name}
    if sent != set(names):
        missing, extra = sorted(set(names) - sent), sorted(sent - set(names))
        raise TaskError(f"task {task.type} of round {task.round}: its route needs {missing} too; it has extra {extra}")
    for name in names:
        t = task.tensors[name]
        if tuple(t.shape) != tuple(state[name].shape) or t.dtype != state[name].dtype:
            raise TaskError(
                f"task {task.type}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, expected {state[name].shape}"
            )
    model.load_state_dict({name: task.tensors[name] for name in names}, strict=False)


@register_task("modular_train")
def modular_train_task(agent: ClientAgent, task: Task) -> Result:
    """One round of Algorithm 1 for this client (module docstring); replies with the router's and the used blocks'
    tensors under their state names, and `route`, `next_route`, `routing` (its most likely route, which the client
    also keeps as its model's `routing`)."""
    settings = train_settings(task, ModularTrainTask)
    net = modular(agent, task)
    layout = net.layout
    route = task_route(task, ROUTE, layout)
    names = list(agent.model.state_dict())
    put_blocks(agent.model, task, downloaded(names, layout, route.tolist()), ROUTE)
    x, y, batch = agent.data.x_train, agent.data.y_train, settings.batch_size
    gen = torch.Generator().manual_seed(derive_seed(settings.seed, "route", agent.client_id, task.round))
    start = time.perf_counter()
    refresh_batchnorm(net.router, x, y, batch)
    logits = path_logits(net.router, x, y, batch).requires_grad_() if settings.learn_routing else None
    noise = noise_given(route, logits, gen) if logits is not None else None

    def gates() -> torch.Tensor:
        if logits is None or noise is None:  # every path on, the router untouched
            return route.float()
        return straight_through(route, relaxed_bernoulli(logits, noise, settings.route_temperature))

    try:
        objective = routed_objective(agent.model, net, x, y, route, gates)
        stats = fit(agent.model, x, y, train_config(agent, task, settings), objective=objective)
    finally:
        net.gates = None
    if logits is not None and logits.grad is not None:
        router_backward(net.router, x, y, logits.grad, batch)
        sgd_step(net.router, settings.router_lr)
    decided = path_logits(net.router, x, y, batch)
    next_route = with_path(layout, logistic_noise(layout.paths, gen) + decided > 0, decided)
    routing = with_path(layout, decided > 0, decided)
    net.set_routing(routing)
    seconds = time.perf_counter() - start
    state = agent.model.state_dict()
    sent = uploaded(names, layout, route.tolist())
    tensors = {n: state[n].detach().clone() for n in sent} | {ROUTE: route, NEXT_ROUTE: next_route, ROUTING: routing}
    probabilities = torch.sigmoid(decided)
    metrics = {"path_certainty": float((2 * probabilities - 1).abs().mean())}
    return training_result(agent, task, stats.loss, seconds, {}, tensors, metrics)


@register_task("modular_evaluate", mutates=False)
def modular_evaluate_task(agent: ClientAgent, task: Task) -> Result:
    """Accuracy and loss on the test set of the client's model with the sent global blocks of its `routing` (the
    most likely route of its router, which the server sends back) put in: the global pool personalised by the
    client's routing. The client's own model is left as it is."""
    net = modular(agent, task)
    routing = task_route(task, ROUTING, net.layout)
    model = agent.module_for(agent.weights())
    put_blocks(model, task, block_names(list(model.state_dict()), net.layout, routing.tolist()), ROUTING)
    net_of(model).set_routing(routing)
    accuracy, loss = evaluate(model, agent.data.x_test, agent.data.y_test)
    return Result(agent.client_id, task.round, task.type, len(agent.data.y_test), {"accuracy": accuracy, "loss": loss})
