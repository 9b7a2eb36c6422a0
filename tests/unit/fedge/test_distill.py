"""fedge.distill: the KL direction of pFedClub Eq. (5), CE + λ·KL with float or tensor λ and T, the λ/T check."""

import math

import pytest
import torch
from torch.nn import functional as F

from fedge.distill import check_kd_settings, kd_kl, kd_loss, kd_terms

pytestmark = pytest.mark.timeout(30)


def test_kl_is_student_to_teacher_as_eq5_is_written():
    student = torch.tensor([[0.0, 0.0]])  # q = (1/2, 1/2)
    teacher_logits = torch.tensor([[math.log(3.0), 0.0]])  # p = (3/4, 1/4)
    kl_p_q = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    kl_q_p = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert float(kd_kl(student, teacher_logits)) == pytest.approx(kl_q_p, abs=1e-6)
    assert abs(kl_p_q - kl_q_p) > 0.01  # the direction matters for this example
    # T = 2: softmax of logits / 2, times T² = 4
    p = torch.softmax(teacher_logits / 2, 1)[0].tolist()
    assert float(kd_kl(student, teacher_logits, 2.0)) == pytest.approx(
        4 * sum(0.5 * math.log(0.5 / pi) for pi in p), abs=1e-6
    )
    with pytest.raises(ValueError, match="shape"):
        kd_kl(student, torch.zeros(1, 3))


@pytest.mark.parametrize("lam,temperature", [(0.0, 1.0), (0.2, 1.0), (1.0, 2.5)])
def test_kd_loss_is_ce_plus_lambda_times_kd_kl(lam, temperature):
    # prepare
    gen = torch.Generator().manual_seed(3)
    z, t, y = torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen), torch.arange(6)
    # execute
    got = kd_loss(z, y, t, lam, temperature)
    # assert
    want = F.cross_entropy(z, y) + lam * kd_kl(z, t, temperature)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_tensor_lambda_and_temperature_give_the_same_bits_as_floats():
    """The training program takes λ and T as 0-dim tensors; the eager client passes floats."""
    gen = torch.Generator().manual_seed(4)
    z, t, y = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen), torch.arange(5)
    floats = kd_terms(z, y, t, 0.3, 2.0)
    tensors = kd_terms(z, y, t, torch.tensor(0.3), torch.tensor(2.0))
    for a, b in zip(floats, tensors):
        assert torch.equal(a, b)
    assert torch.equal(floats[1], F.cross_entropy(z, y)) and torch.equal(floats[2], kd_kl(z, t, 2.0))


@pytest.mark.parametrize("lam, temperature", [(0.0, 1.0), (0.2, 0.5), (3.0, 10.0)])
def test_valid_settings_pass(lam, temperature):
    check_kd_settings(lam, temperature)


@pytest.mark.parametrize(
    "lam, temperature, message",
    [
        (-0.1, 1.0, "kd_lambda must be a finite number >= 0, got -0.1"),
        (math.nan, 1.0, "kd_lambda must be a finite number >= 0, got nan"),
        (math.inf, 1.0, "kd_lambda must be a finite number >= 0, got inf"),
        (0.2, 0.0, "temperature must be a finite number > 0, got 0.0"),
        (0.2, -1.0, "temperature must be a finite number > 0, got -1.0"),
        (0.2, math.inf, "temperature must be a finite number > 0, got inf"),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_setting(lam, temperature, message):
    with pytest.raises(ValueError) as e:
        check_kd_settings(lam, temperature)
    assert str(e.value) == message
