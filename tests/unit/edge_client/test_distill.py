"""The kd_train task: CE + λ·KL (pFedClub Eq. 5; KL(teacher ‖ student) by default, KL(student ‖ teacher) when the
task asks for the literal reading), CE alone before the first teacher."""

import math

import pytest
import torch

import edge_client  # noqa: F401  (registers the task handlers)
from edge_client.agent import TASKS, ClientAgent, ClientData, TaskError
from edge_client.training import Distillation, TrainConfig, fit
from fedge.distill import kd_kl
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import build, make_spec
from fedge.wire.messages import Task, Weights

pytestmark = pytest.mark.timeout(120)

IN = (1, 4, 4)
STUDENT = make_spec("student", IN, 3, [("fc", [L("flatten"), L("linear", {"out_features": 3})])])
TEACHER = make_spec(
    "teacher",
    IN,
    3,
    [
        ("fc1", [L("flatten"), L("linear", {"out_features": 8}), L("relu"), L("dropout", {"p": 0.5})]),
        ("fc2", [L("linear", {"out_features": 3})]),
    ],
)
BASE = {"epochs": 2, "batch_size": 5, "lr": 1e-2, "seed": 7, "upload": True}


def data(n: int = 12) -> ClientData:
    gen = torch.Generator().manual_seed(0)
    return ClientData(
        torch.randn(n, *IN, generator=gen),
        torch.randint(0, 3, (n,), generator=gen),
        torch.randn(4, *IN, generator=gen),
        torch.randint(0, 3, (4,), generator=gen),
    )


def agent(n: int = 12) -> ClientAgent:
    return ClientAgent("c1", STUDENT, data(n), "rpi-4", seed=0)


def teacher(seed: int = 5) -> Weights:
    torch.manual_seed(seed)
    return Weights(TEACHER, {k: v.detach().clone() for k, v in build(TEACHER).state_dict().items()})


def same_weights(a: ClientAgent, b: ClientAgent) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def test_kd_train_is_registered():
    assert "kd_train" in TASKS


def test_lambda_zero_with_teacher_equals_plain_train_bit_for_bit():
    plain, kd = agent(), agent()
    r_plain = plain.handle(Task("train", 3, dict(BASE)))
    r_kd = kd.handle(Task("kd_train", 3, {**BASE, "kd_lambda": 0.0}, {"teacher": teacher()}))
    assert same_weights(plain, kd)
    assert r_kd.metrics["train_loss"] == r_plain.metrics["train_loss"]
    assert r_kd.metrics["kd_loss"] > 0  # measured, not optimised


def test_first_participation_without_teacher_is_plain_ce_training():
    plain, first = agent(), agent()
    r_plain = plain.handle(Task("train", 1, dict(BASE)))
    result = first.handle(Task("kd_train", 1, dict(BASE)))
    assert same_weights(plain, first)
    assert result.metrics["kd_loss"] == 0.0
    assert result.metrics["train_loss"] == r_plain.metrics["train_loss"]
    assert result.metrics["train_seconds"] > 0
    assert result.num_examples == 12 and result.type == "kd_train"
    local = result.models["local"]
    assert all(torch.equal(local.state[k], v) for k, v in first.model.state_dict().items())
    assert "local" not in agent().handle(Task("kd_train", 1, {**BASE, "upload": False})).models


@pytest.mark.parametrize("direction", [None, "teacher_student", "student_teacher"])
def test_loss_on_one_batch_is_ce_plus_lambda_kl_by_hand(direction):
    client = agent(8)
    student0 = build(client.spec)
    student0.load_state_dict(client.model.state_dict())
    t = teacher()
    t_module = build(TEACHER)
    t_module.load_state_dict(t.state)
    x, y = client.data.x_train, client.data.y_train
    with torch.no_grad():
        s = student0(x)
        p = torch.softmax(t_module.eval()(x), 1)  # teacher in eval mode: dropout off
    q = torch.softmax(s, 1)
    ce = -sum(math.log(float(q[i, y[i]])) for i in range(8)) / 8
    a, b = (q, p) if direction == "student_teacher" else (p, q)  # KL(a ‖ b); no direction: the default
    kl = sum(float(a[i, c]) * math.log(float(a[i, c]) / float(b[i, c])) for i in range(8) for c in range(3)) / 8
    cfg = {**BASE, "epochs": 1, "batch_size": 8, "kd_lambda": 0.2} | ({"kd_direction": direction} if direction else {})
    result = client.handle(Task("kd_train", 2, cfg, {"teacher": t}))
    assert result.metrics["kd_loss"] == pytest.approx(kl, rel=1e-5)
    assert result.metrics["train_loss"] == pytest.approx(ce + 0.2 * kl, rel=1e-5)
    assert kl > 0.01


def test_distillation_pulls_the_student_towards_the_teacher():
    t = teacher()
    t_module = build(TEACHER)
    t_module.load_state_dict(t.state)
    cfg = {**BASE, "epochs": 30}
    results = {}
    for lam in (0.0, 2.0):
        client = agent()
        client.handle(Task("kd_train", 2, {**cfg, "kd_lambda": lam}, {"teacher": t}))
        with torch.no_grad():
            results[lam] = float(kd_kl(client.model.eval()(client.data.x_train), t_module.eval()(client.data.x_train)))
    assert results[2.0] < 0.5 * results[0.0]


def test_temperature_is_read_and_changes_the_update():
    runs = []
    for temperature in (1.0, 4.0):
        client = agent()
        client.handle(Task("kd_train", 2, {**BASE, "temperature": temperature}, {"teacher": teacher()}))
        runs.append(client)
    assert not same_weights(*runs)


@pytest.mark.parametrize(
    "bad",
    [
        {"kd_lambda": -0.1},
        {"kd_lambda": "much"},
        {"kd_lambda": float("nan")},
        {"temperature": 0.0},
        {"temperature": None},
        {"kd_direction": "reverse"},
        {"epochs": 0},
    ],
)
def test_bad_config_raises_task_error(bad):
    with pytest.raises(TaskError):
        agent().handle(Task("kd_train", 2, {**BASE, **bad}, {"teacher": teacher()}))


def test_teacher_that_does_not_fit_raises_task_error():
    wrong_classes = make_spec("t5", IN, 5, [("fc", [L("flatten"), L("linear", {"out_features": 5})])])
    five = Weights(wrong_classes, build(wrong_classes).state_dict())
    with pytest.raises(TaskError, match="classes"):
        agent().handle(Task("kd_train", 2, dict(BASE), {"teacher": five}))
    broken = teacher()
    broken.state["blocks.1.0.weight"] = torch.full((3, 8), float("nan"))
    with pytest.raises(TaskError, match="rejected"):
        agent().handle(Task("kd_train", 2, dict(BASE), {"teacher": broken}))


def test_fit_rejects_teacher_logits_that_do_not_match_the_data():
    client = agent()
    cfg = TrainConfig(epochs=1, batch_size=4, lr=1e-3, seed=0)
    with pytest.raises(ValueError, match="teacher logits"):
        fit(client.model, client.data.x_train, client.data.y_train, cfg, Distillation(torch.zeros(5, 3)))
    with pytest.raises(ValueError, match="shape"):
        fit(client.model, client.data.x_train, client.data.y_train, cfg, Distillation(torch.zeros(12, 4)))
    stats = fit(client.model, client.data.x_train, client.data.y_train, cfg, Distillation(torch.zeros(12, 3), 0.5))
    assert stats.loss == pytest.approx(stats.ce + 0.5 * stats.kd, rel=1e-5)
