"""Per-FedAvg (FO): one meta step is Algorithm 1's w − β∇f(w − α∇f(w, D), D') by hand, the evaluation is one SGD
step of size α, a client with fewer than two examples is refused, and bad step sizes are refused."""

import pytest
import torch
from torch.func import functional_call, grad
from torch.nn import functional as F

from edge_client.agent import ClientAgent, ClientData, TaskError
from fedge.config import ConfigError
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import Task, Weights
from methods.perfedavg.client import meta_evaluate_task, meta_step, meta_train_task
from methods.perfedavg.server import PerFedAvgOptions
from methods.perfedavg.tasks import MetaTask

pytestmark = pytest.mark.timeout(120)
SPEC = create("cnn1", (1, 8, 8), 10)


def test_a_meta_step_is_algorithm_1s_first_order_step_by_hand():
    torch.manual_seed(0)
    model = build(SPEC).double().eval()  # no dropout: the function of w alone
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 8, 8, generator=gen, dtype=torch.float64), torch.arange(8) % 10
    w = {n: p.detach().clone() for n, p in model.named_parameters()}

    def f(params, xs, ys):
        return F.cross_entropy(functional_call(model, params, (xs,)), ys)

    inner = grad(f)(w, x[:4], y[:4])
    w_tilde = {n: w[n] - 0.05 * inner[n] for n in w}
    outer = grad(f)(w_tilde, x[4:], y[4:])
    want = {n: w[n] - 0.3 * outer[n] for n in w}
    loss = meta_step(model, (x[:4], y[:4]), (x[4:], y[4:]), alpha=0.05, beta=0.3)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-10, atol=1e-12)
    assert loss == pytest.approx(float(f(w_tilde, x[4:], y[4:])))


def agent(n=16):
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 4
    data = ClientData(torch.randn(n, 1, 8, 8, generator=gen), y, torch.randn(8, 1, 8, 8, generator=gen), y[:8] % 4)
    return ClientAgent("c", SPEC, data, "rpi-4", seed=0)


def sent():
    torch.manual_seed(3)
    return Weights(SPEC, build(SPEC).state_dict())


def config(upload=True, **kw):
    return MetaTask(epochs=1, batch_size=4, lr=1e-3, seed=2, upload=upload, **kw).to_config()


def test_meta_training_moves_the_model_and_evaluation_leaves_it():
    a, w = agent(), sent()
    res = meta_train_task(a, Task("meta_train", 0, config(alpha=0.05, beta=0.05), {"global": w}))
    moved = res.models["local"].state
    assert any(not torch.equal(moved[k], w.state[k]) for k in w.state)
    before = {k: v.clone() for k, v in a.model.state_dict().items()}
    out = meta_evaluate_task(a, Task("meta_evaluate", 0, config(upload=False), {"global": w}))
    assert 0 <= out.metrics["accuracy"] <= 1 and out.num_examples == 8
    assert all(torch.equal(v, before[k]) for k, v in a.model.state_dict().items())


def test_a_client_with_one_example_and_bad_steps_are_refused():
    with pytest.raises(TaskError, match="needs two batches"):
        meta_train_task(agent(1), Task("meta_train", 0, config(), {"global": sent()}))
    with pytest.raises(ConfigError, match="inner_lr and outer_lr"):
        PerFedAvgOptions(outer_lr=0.0)
