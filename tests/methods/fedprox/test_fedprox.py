"""FedProx: μ = 0 is FedAvg bit for bit, the client's gradient is Eq. (2)'s, a larger μ keeps the client nearer w^t,
and bad settings are refused."""

import json

import pytest
import torch
from torch.nn import functional as F

from fedge.config import ConfigError, config_from
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.tasks import TaskConfigError
from launch.simulation import run_simulation
from methods.fedprox.client import proximal_objective, proximal_term
from methods.fedprox.server import FedProxOptions
from methods.fedprox.tasks import ProxTrainTask

pytestmark = pytest.mark.timeout(120)


def run(out, strategy, **options):
    settings = dict(strategy=strategy, dataset="digits", zoo="cnn1", clients=3, active=3, rounds=2, local_epochs=2)
    cfg = config_from(settings | options | {"seed": 4, "transport": "inproc", "out": str(out), "export_onnx": False})
    summary = run_simulation(cfg, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, [{k: r.get(k) for k in ("round", "client", "train_loss", "accuracy")} for r in rows]


def test_mu_zero_is_fedavg_bit_for_bit_and_a_positive_mu_changes_the_run(tmp_path):
    fedavg, fedavg_rows = run(tmp_path / "fedavg", "fedavg")
    zero, zero_rows = run(tmp_path / "zero", "fedprox", mu=0.0)
    prox, prox_rows = run(tmp_path / "prox", "fedprox", mu=1.0)
    assert zero_rows == fedavg_rows and zero["final_accuracy"] == fedavg["final_accuracy"]
    assert prox_rows != fedavg_rows  # the proximal term is in the loss the clients report and optimise
    assert prox["final_accuracy"]["mean"] > 0.3  # ten classes: it still learns


def test_the_gradient_is_eq_2s_ce_gradient_plus_mu_times_the_distance_to_the_global_model():
    torch.manual_seed(0)
    model = build(create("cnn1", (1, 8, 8), 10)).double().eval()  # no dropout: both passes see one function
    x, y = torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.arange(6) % 10
    objective = proximal_objective(model, x, y, mu=0.3)  # w^t: the model now
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loss, ce, prox = objective(torch.arange(6))
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad + 0.3 * (p.detach() - anchor[n]), rtol=1e-10, atol=1e-12)
    assert float(prox) == pytest.approx(float(proximal_term(model, anchor))) and float(prox) > 0
    assert float(loss) == pytest.approx(float(ce) + 0.15 * float(prox))


def test_a_larger_mu_keeps_the_trained_model_nearer_the_global_one():
    from edge_client.training import TrainConfig, fit

    x, y = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(64) % 10
    distances = []
    for mu in (0.0, 10.0):
        torch.manual_seed(0)
        model = build(create("cnn1", (1, 8, 8), 10))
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        cfg = TrainConfig(epochs=3, batch_size=16, lr=1e-2, seed=0)
        fit(model, x, y, cfg, objective=proximal_objective(model, x, y, mu))
        distances.append(float(proximal_term(model, start)))
    assert distances[1] < 0.5 * distances[0]


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="mu must be a finite number >= 0"):
        FedProxOptions(mu=-0.1)
    base = dict(epochs=1, batch_size=8, lr=1e-3, seed=0, upload=True)
    with pytest.raises(TaskConfigError, match="mu must be"):
        ProxTrainTask(**base, mu=float("nan"))
    assert ProxTrainTask.from_config(ProxTrainTask(**base, mu=0.5).to_config()).mu == 0.5
