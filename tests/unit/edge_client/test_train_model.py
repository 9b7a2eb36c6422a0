"""The `train_model` task: the client trains the model the server sent (another architecture than its own), returns
it with ‖mean gradient‖/‖W‖ per conv/linear weight, leaves its own model alone; only the torch runtime runs it."""

import pytest
import torch

import edge_client  # noqa: F401  (registers the task handlers)
from edge_client.agent import ClientAgent, ClientData, TaskError
from edge_client.tasks import GradientMeans
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import build, make_spec
from fedge.wire.messages import Task, Weights

pytestmark = pytest.mark.timeout(60)

IN = (1, 4, 4)
OWN = make_spec("own", IN, 3, [("fc", [L("flatten"), L("linear", {"out_features": 3})])])
SENT = make_spec(
    "sent",
    IN,
    3,
    [
        ("conv", [L("conv2d", {"out_channels": 2, "kernel_size": 3, "padding": 1}), L("relu")]),
        ("fc", [L("flatten"), L("linear", {"out_features": 5}), L("relu"), L("linear", {"out_features": 3})]),
    ],
)
TRAIN = {"epochs": 2, "batch_size": 4, "lr": 1e-2, "seed": 7, "upload": True}


def agent() -> ClientAgent:
    gen = torch.Generator().manual_seed(0)
    data = ClientData(
        torch.randn(12, *IN, generator=gen),
        torch.randint(0, 3, (12,), generator=gen),
        torch.randn(4, *IN, generator=gen),
        torch.randint(0, 3, (4,), generator=gen),
    )
    return ClientAgent("c1", OWN, data, "rpi-4", seed=0)


def sent() -> Weights:
    torch.manual_seed(3)
    return Weights(SENT, build(SENT).state_dict())


def test_the_sent_model_is_trained_and_returned_and_the_own_model_untouched():
    a = agent()
    own = {k: v.clone() for k, v in a.model.state_dict().items()}
    model = sent()
    result = a.handle(Task("train_model", 0, dict(TRAIN), {"model": model}))
    back = result.models["model"]
    assert back.spec == SENT and back.state.keys() == model.state.keys()
    assert any(not torch.equal(back.state[k], model.state[k]) for k in model.state)  # it trained
    assert all(torch.equal(v, own[k]) for k, v in a.model.state_dict().items())
    assert result.num_examples == 12 and result.metrics["train_loss"] > 0
    act = result.records["activeness"]
    assert set(act) == {"blocks.0.0.weight", "blocks.1.1.weight", "blocks.1.3.weight"}
    assert all(v > 0 for v in act.values())
    again = agent().handle(Task("train_model", 0, dict(TRAIN), {"model": sent()}))
    assert all(torch.equal(again.models["model"].state[k], back.state[k]) for k in back.state)  # deterministic


def test_activeness_is_the_norm_of_the_mean_gradient_over_the_weights_norm():
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.0, 4.0]]))  # ‖W‖ = 5
    means = GradientMeans(torch.nn.Sequential(layer))
    for grad in ([1.0, 0.0], [0.0, 2.0]):  # mean gradient (0.5, 1): norm √1.25
        layer.weight.grad = torch.tensor([grad])
        means()
    assert means.activeness() == {"0.weight": pytest.approx(1.25**0.5 / 5)}


def test_a_task_without_a_model_or_on_another_runtime_is_refused():
    a = agent()
    with pytest.raises(TaskError, match="carries no model"):
        a.handle(Task("train_model", 0, dict(TRAIN)))

    class Other:
        runtime = "executorch"

    a.trainer = Other()
    with pytest.raises(TaskError, match="executorch runtime trains only its own"):
        a.handle(Task("train_model", 0, dict(TRAIN), {"model": sent()}))
