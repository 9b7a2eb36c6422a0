"""Teacher programs for executorch clients: exported on the server once per distinct teacher, shipped in the
kd_train task in place of the teacher's weights (tensor teacher_pte, records teacher_pte_sha256 and teacher_spec);
torch clients still get the weights; a teacher that cannot be exported goes with the reason instead."""

import pytest
import torch

from device_profiles import get_profile
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.teacher_program import (
    TEACHER_PROGRAM_ERROR,
    TEACHER_PTE,
    TEACHER_PTE_SHA256,
    TEACHER_SPEC,
    sha256_hex,
    shipped_program,
    weights_digest,
)
from fedge.wire.codec import decode_task, encode_task
from fedge.wire.messages import ClientInfo, Result, Task, Weights
from methods.reassembly.teacher_programs import TeacherPrograms
from server.clock import client_clock
from server.strategy import PublicData, StrategyConfig, create_strategy

pytestmark = pytest.mark.timeout(120)
PUBLIC = PublicData(torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 10)
CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)
PROFILES = {"0": "android-mid-range", "1": "android-flagship", "2": "rpi-4", "3": "android-mid-range"}


def weights(model: str, seed: int) -> Weights:
    spec = create(model, (1, 8, 8), 10)
    torch.manual_seed(seed)
    return Weights(spec, build(spec).state_dict())


class FakeExporter:
    """Stands in for export.pte.teacher_program: bytes that name the teacher, a count of calls."""

    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = 0, fail

    def __call__(self, teacher: Weights) -> bytes:
        self.calls += 1
        if self.fail:
            raise ValueError("ExecuTorch output differs from eager")
        return b"PTE:" + weights_digest(teacher).encode()


def strategy(name: str, exporter: FakeExporter | None):
    cap = {"max_candidates": 2} if name.startswith("pfedclub") else {}
    s = create_strategy(name, CONFIG, PUBLIC, {"finetune_epochs": 1, "finetune_min_steps": 0} | cap)
    s.program_for = exporter
    s.setup({cid: ClientInfo(cid, create("cnn1", (1, 8, 8), 10), p, 20, 5) for cid, p in PROFILES.items()})
    return s


@pytest.mark.parametrize("name", ["pfedclub", "pfedhr"])
def test_executorch_clients_get_the_program_not_the_weights_and_torch_clients_the_weights(name):
    exporter = FakeExporter()
    s = strategy(name, exporter)
    shared, other = weights("cnn2", 1), weights("cnn3", 2)
    s.teachers = {"0": shared, "1": shared, "2": shared, "3": other}
    tasks = s.plan(1, list(PROFILES))
    # executorch clients: no teacher weights, the program as uint8 bytes with its hash and the teacher's spec
    for cid, teacher in (("0", shared), ("1", shared), ("3", other)):
        task = tasks[cid]
        assert not task.models and task.tensors[TEACHER_PTE].dtype == torch.uint8
        data, spec = shipped_program(task)
        assert data == exporter(teacher) and task.records[TEACHER_PTE_SHA256] == sha256_hex(data)
        assert spec == teacher.spec and task.records[TEACHER_SPEC] == teacher.spec.to_dict()
    # the torch client: unchanged, spec + weights
    assert tasks["2"].models["teacher"] is shared and not tasks["2"].tensors and not tasks["2"].records
    # two distinct teachers, exported once each (the test's own calls above added three)
    assert exporter.calls - 3 == 2 and s.programs.exports == 2 and s.programs.hits == 1
    s.plan(2, list(PROFILES))  # the same teachers next time: no export
    assert s.programs.exports == 2 and s.programs.hits == 4
    assert s.summary()["teacher_programs_exported"] == 2


def test_without_an_exporter_executorch_clients_get_the_weights():
    s = strategy("pfedclub", None)
    s.teachers = {"0": weights("cnn2", 1)}
    assert s.plan(0, ["0"])["0"].models["teacher"] is s.teachers["0"]
    assert "teacher_programs_exported" not in s.summary()


def test_a_teacher_that_cannot_be_exported_goes_without_a_teacher_and_says_why():
    exporter = FakeExporter(fail=True)
    s = strategy("pfedclub", exporter)
    s.teachers = {"0": weights("cnn2", 1), "3": weights("cnn2", 1)}
    tasks = s.plan(4, ["0", "3"])
    for task in tasks.values():
        assert not task.models and not task.tensors
        assert "differs from eager" in task.records[TEACHER_PROGRAM_ERROR]
    assert exporter.calls == 1  # the failure is kept, not retried for the same teacher
    assert "differs from eager" in s.record(4, "0")[TEACHER_PROGRAM_ERROR]


def test_the_cache_keeps_only_the_kept_teachers_programs():
    programs = TeacherPrograms(FakeExporter())
    a, b = weights("cnn1", 1), weights("cnn1", 2)
    programs.program(a), programs.program(b)
    programs.keep_only([b])
    assert len(programs.programs) == 1 and programs.program(b) and programs.exports == 2


def test_the_shipped_program_survives_the_codec_and_its_reply_may_carry_the_hash():
    s = strategy("pfedclub", FakeExporter())
    s.teachers = {"0": weights("cnn2", 1)}
    task = s.plan(0, ["0"])["0"]
    back = decode_task(encode_task(task))
    assert shipped_program(back) == shipped_program(task)
    expected = s.expects(task, s.clients["0"])
    assert TEACHER_PTE_SHA256 in expected.records and TEACHER_PTE_SHA256 in expected.optional


def test_the_clock_charges_a_shipped_teacher_like_a_sent_one():
    teacher = weights("cnn2", 1)
    s = strategy("pfedclub", FakeExporter())
    s.teachers = {"0": teacher}
    shipped = s.plan(0, ["0"])["0"]
    sent = Task("kd_train", 0, shipped.config, {"teacher": teacher})
    result = Result("0", 0, "kd_train", 20)
    student = create("cnn1", (1, 8, 8), 10)
    profile = get_profile("android-mid-range")
    a, b = client_clock(shipped, result, student, 1, profile), client_clock(sent, result, student, 1, profile)
    assert a.train_macs == b.train_macs > client_clock(Task("kd_train", 0), result, student, 1, profile).train_macs


def test_the_server_records_the_program_hash_a_client_ran():
    s = strategy("pfedclub", FakeExporter())
    own = weights("cnn1", 4)
    res = Result("0", 0, "kd_train", 20, {}, {"local": own}, records={TEACHER_PTE_SHA256: "ab" * 32})
    s.plan(0, ["0"])
    s.aggregate(0, {"0": res})
    assert s.record(0, "0")[TEACHER_PTE_SHA256] == "ab" * 32
