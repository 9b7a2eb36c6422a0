"""The `dc_train` task: L_kd of Eq. (3) by hand, Eq. (4) with λ = 0 is plain CE training, L_kd trains the extractor
only, and the task end to end on an agent (the sent head goes in before training, the reply's statistics are
those of the trained model's features)."""

import copy

import pytest
import torch

import edge_client  # noqa: F401  (registers the task handlers)
from edge_client.agent import ClientAgent, ClientData, TaskError
from edge_client.tasks import train_config
from edge_client.training import TrainConfig, fit
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import Task, Weights
from methods.dcpfl.class_stats import COUNTS, COVARIANCES, GLOBAL_MEANS, KNOWN_CLASSES, MEANS, class_statistics
from methods.dcpfl.client import anchored_objective, aux_loss
from methods.dcpfl.heads import extract, head_spec, head_state, put_head
from methods.dcpfl.tasks import DCTrainTask

pytestmark = pytest.mark.timeout(120)

SPEC = create("cnn1", (1, 8, 8), 10)  # 128-d representation (after fc1's ReLU and dropout), fc2 the head
D, N = 128, 24
CFG = TrainConfig(epochs=2, batch_size=8, lr=1e-2, seed=7)


def data() -> ClientData:
    gen = torch.Generator().manual_seed(0)
    y = torch.tensor([0, 1, 2, 3, 4, 7] * 4)  # classes 5, 6, 8, 9 absent
    return ClientData(torch.randn(N, 1, 8, 8, generator=gen), y, torch.randn(4, 1, 8, 8, generator=gen), y[:4])


def agent() -> ClientAgent:
    return ClientAgent("c1", SPEC, data(), "rpi-4", seed=0)


def model(seed=0):
    torch.manual_seed(seed)
    return build(SPEC)


def sent_head(seed=5, scale=1.0) -> Weights:
    """A global head other than any client's: seeded random, times `scale`."""
    torch.manual_seed(seed)
    state = {k: v * scale for k, v in head_state(SPEC, build(SPEC).state_dict()).items()}
    return Weights(head_spec(SPEC), state)


def global_means(known=(0, 1, 2, 7)):
    means = torch.randn(10, D, generator=torch.Generator().manual_seed(9)).abs()
    mask = torch.zeros(10, dtype=torch.bool)
    mask[list(known)] = True
    return means, mask


def task(rnd=0, covariance=True, lam=0.1, lr=1e-2, tensors=None, head=None) -> Task:
    config = DCTrainTask(
        epochs=2, batch_size=8, lr=lr, seed=7, upload=False, aux_lambda=lam, covariance=covariance
    ).to_config()
    return Task("dc_train", rnd, config, {"head": head or sent_head()}, tensors or {})


def test_aux_loss_is_the_mean_unsquared_distance_and_unknown_classes_add_zero():
    z = torch.tensor([[3.0, 4.0], [0.0, 0.0], [5.0, 5.0], [1.0, 1.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2, 0])
    means = torch.tensor([[0.0, 0.0], [0.0, 1.0], [9.0, 9.0]])
    known = torch.tensor([True, True, False])
    loss = aux_loss(z, y, means, known)
    assert float(loss.detach()) == pytest.approx((5.0 + 1.0 + 0.0 + 2**0.5) / 4)  # sample 2's class unknown: 0, counted
    loss.backward()
    assert not z.grad[2].any() and z.grad[0].tolist() == pytest.approx([0.6 / 4, 0.8 / 4])
    none_known = aux_loss(z, y, means, torch.zeros(3, dtype=torch.bool))
    assert float(none_known.detach()) == 0 and none_known.requires_grad


def test_with_lambda_zero_training_is_bit_identical_to_plain_cross_entropy():
    x, y = data().x_train, data().y_train
    means, known = global_means()
    plain, anchored, pulled = model(), model(), model()
    fit(plain, x, y, CFG)
    stats = fit(anchored, x, y, CFG, objective=anchored_objective(anchored, x, y, means, known, lam=0.0))
    assert stats.kd > 0  # L_kd measured, not optimised
    assert all(torch.equal(v, anchored.state_dict()[k]) for k, v in plain.state_dict().items())
    fit(pulled, x, y, CFG, objective=anchored_objective(pulled, x, y, means, known, lam=0.5))
    assert any(not torch.equal(v, pulled.state_dict()[k]) for k, v in plain.state_dict().items())


def test_l_kd_gives_the_head_no_gradient_and_the_extractor_some():
    m = model().train()
    x, y = data().x_train, data().y_train
    means, known = global_means()
    torch.manual_seed(0)
    aux_loss(extract(m, x), y, means, known).backward()
    head = list(m.blocks[-1].parameters())
    assert head and all(p.grad is None or not p.grad.any() for p in head)
    extractor = [p for b in m.blocks[:-1] for p in b.parameters()]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in extractor)
    # in Eq. (4), the head's gradient is CE's alone
    idx = torch.arange(N)
    grads = []
    for lam in (0.0, 3.0):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout mask
        anchored_objective(m, x, y, means, known, lam)(idx)[0].backward()
        grads.append([p.grad.clone() for p in head])
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(*grads))


def test_the_task_trains_the_model_with_the_sent_head_on_eq_4_and_uploads_its_features_statistics():
    means, known = global_means()
    a = agent()
    start = copy.deepcopy(a.model)
    t = task(rnd=1, tensors={GLOBAL_MEANS: means, KNOWN_CLASSES: known})
    result = a.handle(t)
    # the reference: the agent's model before the task, with the sent head put in, trained on Eq. (4)
    put_head(start, t.models["head"].state)
    x, y = a.data.x_train, a.data.y_train
    cfg = train_config(a, t, DCTrainTask.from_config(t.config))
    fit(start, x, y, cfg, objective=anchored_objective(start, x, y, means, known, 0.1))
    assert all(torch.equal(v, start.state_dict()[k]) for k, v in a.model.state_dict().items())
    trained = head_state(SPEC, a.model.state_dict())["blocks.0.0.weight"]
    assert not torch.equal(trained, t.models["head"].state["blocks.0.0.weight"])  # the head trained too
    assert result.type == "dc_train" and result.num_examples == N and not result.models
    assert result.metrics["aux_loss"] > 0 and result.metrics["train_loss"] > 0
    t_ = result.tensors
    assert set(t_) == {MEANS, COUNTS, COVARIANCES}
    assert t_[MEANS].shape == (10, D) and t_[MEANS].dtype == torch.float32
    assert t_[COVARIANCES].shape == (10, D, D) and t_[COVARIANCES].dtype == torch.float32
    assert t_[COUNTS].dtype == torch.int64 and int(t_[COUNTS].sum()) == N
    assert t_[COUNTS].tolist() == [4, 4, 4, 4, 4, 0, 0, 4, 0, 0]
    with torch.no_grad():
        z = extract(a.model.eval(), x)  # the trained model's features, dropout off
    want = class_statistics(z, y, 10)
    assert torch.equal(t_[MEANS], want.means.float()) and torch.equal(t_[COVARIANCES], want.covariances.float())


def test_with_a_tiny_learning_rate_the_model_keeps_the_sent_head():
    a = agent()
    sent = sent_head(scale=3.0)
    a.handle(task(lr=1e-9, head=sent))
    own = head_state(SPEC, a.model.state_dict())
    assert all(torch.allclose(own[k], sent.state[k], rtol=0, atol=1e-6) for k in sent.state)


def test_without_covariances_the_reply_has_none():
    result = agent().handle(task(covariance=False))
    assert set(result.tensors) == {MEANS, COUNTS}


def test_a_first_round_without_global_means_trains_on_cross_entropy_alone():
    a = agent()
    start = copy.deepcopy(a.model)
    t = task(rnd=0, lam=0.5)
    result = a.handle(t)
    assert result.metrics["aux_loss"] == 0
    put_head(start, t.models["head"].state)
    fit(start, a.data.x_train, a.data.y_train, train_config(a, t, DCTrainTask.from_config(t.config)))
    assert all(torch.equal(v, start.state_dict()[k]) for k, v in a.model.state_dict().items())


def test_a_head_of_another_shape_or_none_or_bad_global_means_are_refused():
    other = create("fedgh_cnn1", (1, 28, 28), 10)
    torch.manual_seed(0)
    head = Weights(head_spec(other), head_state(other, build(other).state_dict()))
    a = agent()
    with pytest.raises(TaskError, match="carries no head of the shape of 'cnn1'"):
        a.handle(task(head=head))
    with pytest.raises(TaskError, match="carries no head"):
        a.handle(Task("dc_train", 0, task().config))
    means, known = global_means()
    with pytest.raises(TaskError, match=r"global means must be \(10, 128\)"):
        a.handle(task(tensors={GLOBAL_MEANS: means[:, :64], KNOWN_CLASSES: known}))
    with pytest.raises(TaskError, match="global means"):
        a.handle(task(tensors={GLOBAL_MEANS: means}))
    with pytest.raises(TaskError, match="aux_lambda must be >= 0"):
        a.handle(Task("dc_train", 0, task().config | {"aux_lambda": -1.0}, {"head": sent_head()}))


def test_the_executorch_runtime_is_refused():
    class ExecuTorch:
        runtime = "executorch"

    a = agent()
    a.trainer = ExecuTorch()
    with pytest.raises(TaskError, match="executorch runtime cannot train dc_train"):
        a.handle(task())
