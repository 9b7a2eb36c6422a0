"""fedge.distill: the KL directions of pFedClub Eq. (5) (default KL(teacher ‖ student), the literal reading as an
option), CE + λ·KL with float or tensor λ, T and direction, the λ/T/direction check."""

import math

import pytest
import torch
from torch.nn import functional as F

from fedge import constants as C
from fedge.distill import check_kd_settings, direction_weight, kd_kl, kd_loss, kd_terms

pytestmark = pytest.mark.timeout(30)


STUDENT = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, -1.0]])
TEACHER = torch.tensor([[math.log(4.0), math.log(2.0), 0.0], [0.0, 2.0, 0.0]])


def softmax_rows(logits: torch.Tensor, temperature: float) -> list[list[float]]:
    rows = [[math.exp(v / temperature) for v in row] for row in logits.tolist()]
    return [[v / sum(row) for v in row] for row in rows]


def kl_by_hand(a: list[list[float]], b: list[list[float]]) -> float:
    """Batch mean of Σ_c a·log(a/b) = KL(a ‖ b), with explicit sums."""
    return sum(ai * math.log(ai / bi) for ra, rb in zip(a, b) for ai, bi in zip(ra, rb)) / len(a)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_default_kl_is_teacher_to_student(temperature):
    """KL(p_teacher ‖ q_student), the teacher as target (Deep Mutual Learning, the authors' code), times T²."""
    p, q = softmax_rows(TEACHER, temperature), softmax_rows(STUDENT, temperature)
    want = temperature**2 * kl_by_hand(p, q)
    assert C.KD_DIRECTION == "teacher_student"
    assert float(kd_kl(STUDENT, TEACHER, temperature)) == pytest.approx(want, abs=1e-6)
    assert float(kd_kl(STUDENT, TEACHER, temperature, "teacher_student")) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_literal_reading_of_eq5_is_student_to_teacher(temperature):
    p, q = softmax_rows(TEACHER, temperature), softmax_rows(STUDENT, temperature)
    want = temperature**2 * kl_by_hand(q, p)
    assert float(kd_kl(STUDENT, TEACHER, temperature, "student_teacher")) == pytest.approx(want, abs=1e-6)


def test_the_two_directions_differ_on_asymmetric_distributions():
    # q = (1/2, 1/2), p = (3/4, 1/4): KL(p ‖ q) ≈ 0.1308, KL(q ‖ p) ≈ 0.1438
    student, teacher = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
    kl_p_q = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    kl_q_p = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert float(kd_kl(student, teacher)) == pytest.approx(kl_p_q, abs=1e-6)
    assert float(kd_kl(student, teacher, direction="student_teacher")) == pytest.approx(kl_q_p, abs=1e-6)
    assert abs(kl_p_q - kl_q_p) > 0.01


def test_the_programs_tensor_weight_gives_each_direction():
    """The training program passes the direction as a 0-dim weight w: 1 = teacher_student, 0 = student_teacher."""
    for direction in C.KD_DIRECTIONS:
        w = torch.tensor(direction_weight(direction))
        got, want = kd_kl(STUDENT, TEACHER, torch.tensor(2.0), w), kd_kl(STUDENT, TEACHER, 2.0, direction)
        assert torch.equal(got, want), direction  # w·a + (1 − w)·b with w ∈ {0, 1} is a or b exactly
    assert [direction_weight(d) for d in ("teacher_student", "student_teacher")] == [1.0, 0.0]


def test_bad_shapes_and_an_unknown_direction_raise_value_error():
    with pytest.raises(ValueError, match="shape"):
        kd_kl(STUDENT, torch.zeros(2, 4))
    message = "kd_direction must be one of teacher_student, student_teacher, got 'forward'"
    for call in (lambda: kd_kl(STUDENT, TEACHER, 1.0, "forward"), lambda: direction_weight("forward")):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == message


@pytest.mark.parametrize("direction", C.KD_DIRECTIONS)
@pytest.mark.parametrize("lam,temperature", [(0.0, 1.0), (0.2, 1.0), (1.0, 2.5)])
def test_kd_loss_is_ce_plus_lambda_times_kd_kl(lam, temperature, direction):
    # prepare
    gen = torch.Generator().manual_seed(3)
    z, t, y = torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen), torch.arange(6)
    # execute
    got = kd_loss(z, y, t, lam, temperature, direction)
    # assert
    want = F.cross_entropy(z, y) + lam * kd_kl(z, t, temperature, direction)
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


def test_an_unknown_direction_is_refused_by_the_check():
    check_kd_settings(0.2, 1.0, "student_teacher")
    with pytest.raises(ValueError, match="kd_direction must be one of teacher_student, student_teacher"):
        check_kd_settings(0.2, 1.0, "reverse")


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
