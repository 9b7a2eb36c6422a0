"""pFedClub's server half: teachers kept between selections, pFedClub+ bound and fallback, ablations."""

import logging

import pytest
import torch

from fedge.config import ConfigError
from fedge.messages import ClientInfo, Result, Weights
from fedge.spec import build
from fedge.tasks import TrainTask
from fedge.zoo import create
from server.strategy import PublicData, StrategyConfig, StrategyError, create_strategy

pytestmark = pytest.mark.timeout(120)
MODELS = {"0": "cnn1", "1": "cnn2", "2": "cnn1", "3": "mobilenet_v1"}
PUBLIC = PublicData(torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 10)


CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)


def spec(cid):
    return create(MODELS[cid], (1, 8, 8), 10).with_origin(cid)


def make(name, **options):
    s = create_strategy(name, CONFIG, PUBLIC, {"finetune_epochs": 1, "max_candidates": 2} | options)
    s.setup({cid: ClientInfo(cid, spec(cid), "rpi-4", 20, 5) for cid in MODELS})
    return s


def uploads(rnd, cids):
    out = {}
    for cid in cids:
        torch.manual_seed(int(cid))
        out[cid] = Result(cid, rnd, "kd_train", 20, {}, {"local": Weights(spec(cid), build(spec(cid)).state_dict())})
    return out


def test_first_participation_has_no_teacher_and_teachers_are_kept_until_next_selection():
    s = make("pfedclub")
    assert all(not t.models for t in s.plan(0, ["0", "1", "3"]).values())
    s.aggregate(0, uploads(0, ["0", "1", "3"]))
    teacher = s.teachers["0"]
    s.plan(1, ["2", "3"])
    s.aggregate(1, uploads(1, ["2", "3"]))  # rounds pass without client 0
    s.plan(2, ["1"])
    s.aggregate(2, {})  # client 1 was sent its teacher but did not reply
    task = s.plan(3, ["0", "2"])["0"]
    assert task.type == "kd_train" and task.models["teacher"] is teacher
    assert task.config["kd_lambda"] == pytest.approx(0.2)
    assert "1" not in s.teachers


@pytest.mark.parametrize("name", ["pfedclub", "pfedhr"])
def test_the_kd_train_task_carries_the_kl_direction_option(name):
    default = make(name).plan(0, ["0"])["0"]
    literal = make(name, kd_direction="student_teacher").plan(0, ["0"])["0"]
    assert default.config["kd_direction"] == "teacher_student"
    assert literal.config["kd_direction"] == "student_teacher"
    assert TrainTask.from_config(literal.config).kd_direction == "student_teacher"
    with pytest.raises(ConfigError, match="kd_direction must be one of teacher_student, student_teacher"):
        make(name, kd_direction="reverse")


def test_pfedclub_plus_teachers_respect_eta_and_profile():
    s = make("pfedclub+", eta=0.0)
    s.aggregate(0, uploads(0, list(MODELS)))
    for cid, teacher in s.teachers.items():
        assert teacher.spec.params <= spec(cid).params


def test_negative_eta_without_any_candidate_falls_back_to_no_teacher(caplog):
    s = make("pfedclub+", eta=-0.9)
    with caplog.at_level(logging.WARNING):
        s.aggregate(0, uploads(0, ["0", "1"]))
    assert s.teachers == {}
    assert "no teacher" in caplog.text
    record = s.record(0, "0")
    assert record["teacher_fallback"] is True and record["teacher_params"] is None


@pytest.mark.parametrize(
    "ablation, index", [("max", "raw"), ("min", "raw"), ("noc", "raw"), ("nbc", "raw"), ("none", "relative")]
)
def test_ablations_and_index_modes_run(ablation, index):
    s = make("pfedclub", ablation=ablation, cmsr_index=index)
    s.aggregate(0, uploads(0, ["0", "1", "3"]))
    assert set(s.teachers) == {"0", "1", "3"}


def test_unknown_ablation_and_missing_public_data_are_refused():
    with pytest.raises(ConfigError, match="ablation"):
        make("pfedclub", ablation="bogus")
    with pytest.raises(ConfigError, match="index"):
        make("pfedclub", cmsr_index="bogus")
    with pytest.raises(ConfigError, match="has no option.*'eta'"):
        make("pfedclub", eta=0.1)  # only pFedClub+ has the size bound
    s = create_strategy("pfedclub", CONFIG)
    with pytest.raises(StrategyError, match="public samples"):
        s.setup({"0": ClientInfo("0", spec("0"), "rpi-4", 20, 5)})
