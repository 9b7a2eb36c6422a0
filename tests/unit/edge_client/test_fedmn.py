"""FedMN's client (methods/fedmn/client.py): relaxed Bernoulli samples (Eq. 5) average to the path probabilities, the
router's gradient through Π (Eqs. 9-10) reaches every router parameter and matches autograd through the whole graph
and finite differences, and the modular_train / modular_evaluate tasks on an agent: only the route's blocks come
and go, blocks off the route stay as they were, the router learns only when asked, malformed tasks are refused and a
re-sent task replies alike."""

import pytest
import torch
from torch.nn import functional as F

import edge_client  # noqa: F401  (registers the task handlers)
from edge_client.agent import ClientAgent, ClientData, TaskError
from edge_client.training import evaluate
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import Task
from methods.fedmn.client import (
    logistic_noise,
    noise_given,
    path_logits,
    refresh_batchnorm,
    relaxed_bernoulli,
    router_backward,
    straight_through,
)
from methods.fedmn.modular import (
    NEXT_ROUTE,
    ROUTE,
    ROUTING,
    block_names,
    block_of,
    downloaded,
    has_path,
    layout_of,
    net_of,
    uploaded,
)
from methods.fedmn.tasks import ModularTrainTask

pytestmark = pytest.mark.timeout(120)
SPEC = create("fedmn_2x2x2_fc", (1, 4, 4), 10)
LAYOUT = layout_of(SPEC)
N = 12


def data() -> ClientData:
    gen = torch.Generator().manual_seed(0)
    y = torch.tensor([0, 1, 2, 3] * 3)
    return ClientData(torch.randn(N, 1, 4, 4, generator=gen), y, torch.randn(6, 1, 4, 4, generator=gen), y[:6])


def chain_route(encoder=0, middle=1, out=0) -> torch.Tensor:
    r = torch.zeros(LAYOUT.paths, dtype=torch.bool)
    r[[LAYOUT.path(2, middle, encoder), LAYOUT.path(3, out, middle), LAYOUT.output_path(out)]] = True
    return r


def global_state(seed=5):
    torch.manual_seed(seed)
    return build(SPEC).state_dict()


def train_task(route, learn=True, lr=1e-2, rnd=1, state=None, **config) -> Task:
    state = global_state() if state is None else state
    names = downloaded(list(state), LAYOUT, route.tolist())
    settings = ModularTrainTask(
        epochs=1, batch_size=4, lr=lr, seed=7, upload=True, route_temperature=0.5, router_lr=0.5, learn_routing=learn
    )
    return Task(
        "modular_train", rnd, settings.to_config() | config, tensors={n: state[n] for n in names} | {ROUTE: route}
    )


def test_relaxed_samples_at_a_small_temperature_average_to_the_path_probabilities():
    logits = torch.tensor([-3.0, -1.0, 0.0, 0.4, 2.5])
    gen = torch.Generator().manual_seed(0)
    samples = torch.stack([relaxed_bernoulli(logits, logistic_noise(5, gen), 0.01) for _ in range(40_000)])
    assert torch.allclose(samples.mean(0), torch.sigmoid(logits), atol=0.01)
    assert ((samples < 0.01) | (samples > 0.99)).float().mean() > 0.97  # nearly binary at τ = 0.01
    assert torch.allclose(relaxed_bernoulli(logits, torch.zeros(5), 1.0), torch.sigmoid(logits))  # ε = 1/2


def relaxed_loss(model, x, y, logits, noise, tau=0.7):
    """Eq. (6) with the continuous relaxation in the forward (every path at its relaxed value)."""
    net = net_of(model)
    gates = relaxed_bernoulli(logits, noise, tau)
    net.gates = ((True,) * LAYOUT.paths, gates)
    loss = sum(F.cross_entropy(model(xb), yb) for xb, yb in zip(x.split(5), y.split(5)))
    net.gates = None
    return loss


def test_the_router_gradient_is_autograd_through_pi_and_matches_finite_differences():
    torch.manual_seed(0)
    model = build(SPEC).double().train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    router = net_of(model).router
    d = data()
    x, y = d.x_train.double(), d.y_train
    noise = logistic_noise(LAYOUT.paths, torch.Generator().manual_seed(1)).double()

    # the client's way: G without a graph, ∂L/∂G from training, then J^T ∂L/∂G in a second pass (3 batches)
    logits = path_logits(router, x, y, batch=5).requires_grad_()
    relaxed_loss(model, x, y, logits, noise).backward()
    router.zero_grad()
    router_backward(router, x, y, logits.grad, batch=5)
    two_pass = {n: p.grad.clone() for n, p in router.named_parameters()}
    assert all(g.abs().sum() > 0 for g in two_pass.values()), "every router parameter gets a gradient"

    # autograd through the whole graph: G computed with its graph over all the data at once
    router.zero_grad()
    model.zero_grad()
    router.eval()
    direct_logits = router(x, y).mean(0)
    relaxed_loss(model, x, y, direct_logits, noise).backward()
    for name, p in router.named_parameters():
        assert torch.allclose(p.grad, two_pass[name], rtol=1e-9, atol=1e-12), name

    # finite differences on a few entries of every router tensor
    def loss_at() -> float:
        with torch.no_grad():
            return float(relaxed_loss(model, x, y, path_logits(router, x, y, batch=5), noise))

    h = 1e-6
    for name, p in router.named_parameters():
        flat = p.data.view(-1)
        for i in torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(2))[:3].tolist():
            old = float(flat[i])
            flat[i] = old + h
            up = loss_at()
            flat[i] = old - h
            down = loss_at()
            flat[i] = old
            assert (up - down) / (2 * h) == pytest.approx(float(two_pass[name].view(-1)[i]), rel=1e-4, abs=1e-8), name


def test_straight_through_gates_carry_the_hard_route_forward():
    soft = torch.tensor([0.9, 0.2, 0.6], requires_grad=True)
    gates = straight_through(torch.tensor([False, True, True]), soft)
    assert gates.tolist() == [0.0, 1.0, 1.0]
    gates.sum().backward()
    assert soft.grad.tolist() == [1.0, 1.0, 1.0]


def agent() -> ClientAgent:
    return ClientAgent("c1", SPEC, data(), "rpi-4", seed=0)


def test_a_task_brings_what_its_route_reaches_returns_what_it_used_and_leaves_the_others_alone():
    a, route = agent(), chain_route(encoder=1, middle=0, out=1)
    before = {k: v.clone() for k, v in a.model.state_dict().items()}
    sent = global_state()
    reply = a.handle(train_task(route, lr=1e-12, state=sent))  # Adam at 1e-12: the blocks stay the sent ones
    down, up = downloaded(list(sent), LAYOUT, route.tolist()), uploaded(list(sent), LAYOUT, route.tolist())
    assert set(reply.tensors) == set(up) | {ROUTE, NEXT_ROUTE, ROUTING}
    assert {block_of(n) for n in set(down) - set(up)} == {(1, 0)}  # encoder 0 runs (off paths' gradients) only
    assert torch.equal(reply.tensors[ROUTE], route)
    after = a.model.state_dict()
    for name in up:
        if block_of(name) != "router":
            assert torch.allclose(reply.tensors[name], sent[name], atol=1e-9), name  # the sent value was used
            assert not torch.equal(reply.tensors[name], before[name]), name
    for name in before:
        if block_of(name) == (1, 0):
            assert torch.equal(after[name], sent[name]), name  # downloaded, run without gradient
        elif block_of(name) not in (None, "router") and name not in down:
            assert torch.equal(after[name], before[name]), name  # neither sent nor trained: as the client had it
    for name in (NEXT_ROUTE, ROUTING):
        assert has_path(LAYOUT, reply.tensors[name].tolist())
    assert torch.equal(net_of(a.model).routing, reply.tensors[ROUTING])
    assert 0 <= reply.metrics["path_certainty"] <= 1


def test_the_noise_is_drawn_given_the_route():
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):
        logits = 3 * torch.randn(LAYOUT.paths, generator=gen)
        route = torch.rand(LAYOUT.paths, generator=gen) < 0.5
        noise = noise_given(route, logits, gen)
        assert torch.equal(noise + logits > 0, route)
        assert torch.equal(relaxed_bernoulli(logits, noise, 0.3) > 0.5, route)


def test_a_router_with_batchnorm_re_estimates_its_statistics_over_the_data():
    spec = create("fedmn_1x2x2_mobilenet_v2", (3, 8, 8), 10)
    router = net_of(build(spec)).router
    x, y = torch.randn(10, 3, 8, 8), torch.arange(10) % 10
    norms = [m for m in router.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(float(m.running_mean.abs().sum()) == 0 for m in norms)
    refresh_batchnorm(router, x, y, batch=4)
    assert not router.training
    assert all(int(m.num_batches_tracked) == 3 and float(m.running_mean.abs().sum()) > 0 for m in norms)
    assert all(m.momentum == 0.1 for m in norms)  # put back
    first = norms[0]
    with torch.no_grad():  # cumulative averages: the mean of the three batches' channel means
        z = router.phi_x[0](x)
        means = [z[i : i + 4].mean(dim=(0, 2, 3)) for i in (0, 4, 8)]
    assert torch.allclose(first.running_mean, sum(means) / 3, atol=1e-5)


def test_the_router_learns_only_when_the_task_says_so():
    sent = global_state()
    router = [n for n in sent if block_of(n) == "router"]
    learnt = agent().handle(train_task(chain_route(), learn=True, state=sent))
    assert all(not torch.equal(learnt.tensors[n], sent[n]) for n in router)
    every = torch.ones(LAYOUT.paths, dtype=torch.bool)
    frozen = agent().handle(train_task(every, learn=False, state=sent))
    assert all(torch.equal(frozen.tensors[n], sent[n]) for n in router)
    assert set(frozen.tensors) == set(uploaded(list(sent), LAYOUT, every.tolist())) | {ROUTE, NEXT_ROUTE, ROUTING}


def test_a_resent_task_replies_alike():
    a, task = agent(), train_task(chain_route())
    first, again = a.handle(task), a.handle(task)
    assert first.tensors.keys() == again.tensors.keys()
    assert all(torch.equal(first.tensors[k], again.tensors[k]) for k in first.tensors)


@pytest.mark.parametrize("fault", ["extra", "missing", "shape", "no path", "not bool"])
def test_a_malformed_task_is_refused(fault):
    route = chain_route()
    task = train_task(route)
    tensors = dict(task.tensors)
    block = next(n for n in tensors if block_of(n) not in ("router", None))
    if fault == "extra":
        state = global_state()
        unreached = next(n for n in state if block_of(n) == (2, 0))  # the route reaches block 2.1 only
        tensors[unreached] = state[unreached]
    elif fault == "missing":
        del tensors[block]
    elif fault == "shape":
        tensors[block] = torch.zeros(3)
    elif fault == "no path":
        tensors[ROUTE] = torch.zeros(LAYOUT.paths, dtype=torch.bool)
    else:
        tensors[ROUTE] = route.float()
    with pytest.raises(TaskError):
        agent().handle(Task(task.type, task.round, task.config, tensors=tensors))


def test_evaluation_puts_the_sent_blocks_of_the_routing_into_a_copy():
    a = agent()
    own = {k: v.clone() for k, v in a.model.state_dict().items()}
    routing, sent = chain_route(encoder=1, middle=1, out=0), global_state(9)
    names = block_names(list(sent), LAYOUT, routing.tolist())
    reply = a.handle(Task("modular_evaluate", 2, tensors={n: sent[n] for n in names} | {ROUTING: routing}))
    expected = build(SPEC)
    expected.load_state_dict(own)
    expected.load_state_dict({n: sent[n] for n in names}, strict=False)
    net_of(expected).set_routing(routing)
    accuracy, loss = evaluate(expected, a.data.x_test, a.data.y_test)
    assert reply.metrics["accuracy"] == accuracy and reply.metrics["loss"] == pytest.approx(loss)
    assert all(torch.equal(a.model.state_dict()[k], own[k]) for k in own)
