"""fedge.tasks: the one typed definition of a training task's config, written by the server, read by the client."""

import pytest

from fedge import constants as C
from fedge.tasks import TaskConfigError, TrainTask

pytestmark = pytest.mark.timeout(30)
TASK = TrainTask(epochs=2, batch_size=16, lr=1e-3, seed=5, upload=True)


def test_round_trip_and_defaults():
    config = TASK.to_config()
    assert config == {
        "epochs": 2,
        "batch_size": 16,
        "lr": 1e-3,
        "seed": 5,
        "upload": True,
        "sgd_lr": C.SGD_LR,
        "sgd_momentum": C.SGD_MOMENTUM,
        "kd_lambda": C.KD_LAMBDA,
        "temperature": C.KD_TEMPERATURE,
        "kd_direction": "teacher_student",
    }
    assert TrainTask.from_config(config) == TASK
    minimal = {"epochs": 2, "batch_size": 16, "lr": 1e-3, "seed": 5, "upload": True}
    assert TrainTask.from_config(minimal) == TASK
    assert TrainTask.from_config(minimal | {"lr": 1}).lr == 1.0  # a JSON integer is a valid float


@pytest.mark.parametrize(
    "change, match",
    [
        ({"epochs": None}, "lacks 'epochs'"),
        ({"epochs": 2.5}, "epochs=2.5 is not a valid int"),
        ({"epochs": True}, "epochs=True is not a valid int"),
        ({"upload": 1}, "upload=1 is not a valid bool"),
        ({"lr": "0.1"}, "lr='0.1' is not a valid float"),
        ({"lr": float("nan")}, "lr=nan is not a valid float"),
        ({"epochs": 0}, "must be positive"),
        ({"sgd_momentum": 1.0}, "sgd_momentum in"),
        ({"kd_direction": "reverse"}, "kd_direction must be one of teacher_student, student_teacher, got 'reverse'"),
        ({"kd_direction": 1}, "kd_direction=1 is not a valid str"),
        ({"bogus": 1}, r"unknown task config key\(s\) \['bogus'\]"),
    ],
)
def test_a_bad_config_names_the_key(change, match):
    config = TASK.to_config() | change
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(TaskConfigError, match=match):
        TrainTask.from_config(config)


def test_the_kl_direction_round_trips():
    literal = TrainTask(epochs=2, batch_size=16, lr=1e-3, seed=5, upload=True, kd_direction="student_teacher")
    assert literal.to_config()["kd_direction"] == "student_teacher"
    assert TrainTask.from_config(literal.to_config()) == literal
    with pytest.raises(TaskConfigError, match="teacher_student, student_teacher"):
        TrainTask(epochs=2, batch_size=16, lr=1e-3, seed=5, upload=True, kd_direction="literal")


def test_a_config_that_is_not_an_object_is_refused():
    with pytest.raises(TaskConfigError, match="JSON object"):
        TrainTask.from_config([1, 2])
