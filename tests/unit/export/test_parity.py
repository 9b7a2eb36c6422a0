"""The gradient-parity gate: one step through a training program equals eager PyTorch for every trainable zoo
model in both KL directions, the pool rewrites are exact, and one program serves every λ, T and direction."""

import executorch  # noqa: F401  (a test dependency: missing, this file must fail, not skip)
import pytest
import torch
from torch.nn import functional as F

from export.parity import ExportError, gradient_parity, train_step_pte
from export.training_program import export_training
from fedge.constants import KD_DIRECTIONS
from fedge.distill import kd_loss
from fedge.spec import build
from fedge.zoo import create

from helpers.export_models import POOLS, SHAPE, TRAINABLE, teacher_logits, weights

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", TRAINABLE)
def test_gradient_parity_of_trainable_zoo_models(name, mnist8):
    spec = create(name, SHAPE, 10)
    x, y = mnist8
    program = export_training(spec, weights(spec), batch_size=len(x))
    for direction in KD_DIRECTIONS:
        report = gradient_parity(
            spec, weights(spec), x, y, teacher_logits(len(x)), 0.2, 2.0, program, direction=direction
        )
        print(f"{name} {direction}: loss {report.loss_eager:.6f} vs {report.loss_pte:.6f}, worst {report.worst:.2e}")
        assert report.passed, (direction, report.max_rel_err)
        assert set(report.max_rel_err) == {k for k, _ in build(spec).named_parameters()}


def test_pool_rewrites_give_exact_gradients_through_the_pte():
    x = torch.rand(5, 1, 9, 9, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 3, 5, 7, 9])
    report = gradient_parity(POOLS, weights(POOLS), x, y, teacher_logits(5), kd_lambda=0.5, temperature=1.0)
    assert report.passed, report.max_rel_err


def test_train_step_pte_is_one_sgd_step_at_the_given_parameters(mnist8, pools_program):
    # prepare: the program is exported with weights A, the step runs at weights B
    x, y = mnist8
    t = teacher_logits(len(x))
    program = pools_program
    model = build(POOLS).eval()
    model.load_state_dict(weights(POOLS, seed=7))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    xs = F.adaptive_avg_pool2d(x, 9)  # the 9×9 model on real digits
    # execute
    loss, new, grads = train_step_pte(program, params, xs, y, t, lr=0.1)
    # assert
    ref = kd_loss(model(xs), y, t, 0.2, 1.0)
    ref.backward()
    assert loss == pytest.approx(float(ref), rel=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(new[k], params[k] - 0.1 * grads[k], rtol=0, atol=1e-6)


def test_train_step_pte_rejects_parameters_that_do_not_match(pools_program):
    params = {k: v for k, v in build(POOLS).named_parameters() if not k.endswith("bias")}
    with pytest.raises(ExportError, match=r"missing \['blocks\.0\.0\.bias'"):
        train_step_pte(
            pools_program, params, torch.zeros(8, 1, 9, 9), torch.zeros(8, dtype=torch.long), torch.zeros(8, 10), 0.1
        )


def test_one_program_serves_every_lambda_temperature_and_direction(mnist8, pools_program):
    x, y = mnist8
    xs, t = F.adaptive_avg_pool2d(x, 9), teacher_logits(len(x))
    model = build(POOLS).eval()
    model.load_state_dict(weights(POOLS, seed=2))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    losses = {}
    for lam, temperature, direction in [
        (0.0, 1.0, "teacher_student"),
        (0.7, 3.0, "teacher_student"),
        (0.7, 3.0, "student_teacher"),
        (2.0, 1.0, "student_teacher"),
    ]:
        loss, _, grads = train_step_pte(pools_program, params, xs, y, t, 0.0, lam, temperature, direction)
        model.zero_grad()
        ref = kd_loss(model(xs), y, t, lam, temperature, direction)
        ref.backward()
        assert loss == pytest.approx(float(ref), rel=1e-5)
        for k, p in model.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6)
        losses[lam, temperature, direction] = loss
    assert abs(losses[0.7, 3.0, "teacher_student"] - losses[0.7, 3.0, "student_teacher"]) > 1e-3  # the input acts


def test_train_step_pte_rejects_an_unknown_direction(mnist8, pools_program):
    params = {k: v.detach().clone() for k, v in build(POOLS).named_parameters()}
    with pytest.raises(ExportError, match="kd_direction must be one of teacher_student, student_teacher"):
        train_step_pte(
            pools_program, params, torch.zeros(8, 1, 9, 9), mnist8[1], torch.zeros(8, 10), 0.1, 0.2, 1.0, "x"
        )
