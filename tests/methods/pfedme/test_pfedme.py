"""pFedMe: one batch is Eqs. (7)-(8) by hand, the client keeps θ and uploads w, the server's β mixes as line 10,
and bad settings are refused."""

import pytest
import torch
from torch.func import functional_call, grad
from torch.nn import functional as F

from edge_client.agent import ClientAgent, ClientData
from fedge.config import ConfigError
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result, Task, Weights
from methods.pfedme.client import moreau_step, pfedme_train_task
from methods.pfedme.server import PFedMe, PFedMeOptions
from methods.pfedme.tasks import MoreauTask
from server.strategy import StrategyConfig

pytestmark = pytest.mark.timeout(120)
SPEC = create("cnn1", (1, 8, 8), 10)
SETTINGS = dict(epochs=1, batch_size=8, lr=1e-3, seed=2, upload=True)


def test_one_batch_is_eqs_7_and_8_by_hand():
    torch.manual_seed(0)
    model = build(SPEC).double().eval()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 1, 8, 8, generator=gen, dtype=torch.float64), torch.arange(6) % 10
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = MoreauTask(**SETTINGS, lamda=2.0, inner_steps=3, personal_lr=0.1, eta=0.05)

    def h(theta):
        moreau = sum(((theta[n] - w[n]) ** 2).sum() for n in w)
        return F.cross_entropy(functional_call(model, theta, (x,)), y) + s.lamda / 2 * moreau

    theta = dict(w)
    for _ in range(s.inner_steps):
        g = grad(h)(theta)
        theta = {n: theta[n] - s.personal_lr * g[n] for n in theta}
    local = [p.detach().clone() for p in model.parameters()]
    moreau_step(model, local, x, y, s)
    for (n, p), new_w in zip(model.named_parameters(), local):
        torch.testing.assert_close(p.detach(), theta[n], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(new_w, w[n] - s.eta * s.lamda * (w[n] - theta[n]), rtol=1e-10, atol=1e-12)


def test_the_client_keeps_theta_and_uploads_w():
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(16) % 4
    data = ClientData(torch.randn(16, 1, 8, 8, generator=gen), y, torch.randn(4, 1, 8, 8, generator=gen), y[:4])
    agent = ClientAgent("c", SPEC, data, "rpi-4", seed=0)
    torch.manual_seed(3)
    sent = Weights(SPEC, build(SPEC).state_dict())
    config = MoreauTask(**SETTINGS, lamda=15.0, inner_steps=2, personal_lr=0.05, eta=0.01).to_config()
    res = pfedme_train_task(agent, Task("pfedme_train", 0, config, {"global": sent}))
    w, theta = res.models["local"].state, agent.model.state_dict()
    for name, _ in agent.model.named_parameters():
        step_w, gap = (w[name] - sent.state[name]).norm(), (theta[name] - w[name]).norm()
        assert step_w > 0 and gap > 0  # w moved toward θ, and θ is not w
        assert (theta[name] - sent.state[name]).norm() > step_w  # θ goes further than w (η·λ < 1)


def info(cid):
    return ClientInfo(cid, SPEC.with_origin(cid), "rpi-4", 20, 5)


def test_the_server_mixes_beta_of_the_mean_into_the_global_model():
    strategy = PFedMe(StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0), options=PFedMeOptions(beta=0.25))
    strategy.setup({c: info(c) for c in "01"})
    old = {k: v.clone() for k, v in strategy.global_model.state.items()}
    ones = {k: torch.ones_like(v) if v.is_floating_point() else v for k, v in old.items()}
    replies = {c: Result(c, 0, "pfedme_train", 10, models={"local": Weights(SPEC, ones)}) for c in "01"}
    strategy.aggregate(0, replies)
    for k, v in strategy.global_model.state.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, 0.75 * old[k] + 0.25 * torch.ones_like(v))
    with pytest.raises(ConfigError, match="beta"):
        PFedMeOptions(beta=1.5)
    with pytest.raises(ConfigError, match="inner_steps"):
        PFedMeOptions(inner_steps=0)
