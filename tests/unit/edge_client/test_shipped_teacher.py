"""An executorch client given its teacher as the XNNPACK program the server exported (fedge.teacher_program): it
runs exactly that program (its SHA-256 comes back in the result), refuses bytes that do not match their hash, and
never imports the exporter for it."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import edge_client  # noqa: F401  (registers the task handlers)
from edge_client.agent import ClientAgent, ClientData, TaskError
from edge_client.executorch_trainer import ExecuTorchTrainer, TrainingSession
from edge_client.training import predict
from export.parity import gated_training_program
from export.pte import teacher_program
from fedge.data.datasets import load_dataset
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.teacher_program import (
    TEACHER_PTE,
    TEACHER_PTE_SHA256,
    TEACHER_SPEC,
    program_tensor,
    sha256_hex,
)
from fedge.wire.messages import Task, Weights

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[3]
DIGITS = load_dataset("digits")
SHAPE, CLASSES = DIGITS.input_shape, DIGITS.num_classes
CONFIG = {"epochs": 1, "batch_size": 8, "lr": 1e-3, "sgd_lr": 0.05, "sgd_momentum": 0.9, "seed": 1, "upload": True}


def teacher() -> Weights:
    spec = create("cnn2", SHAPE, CLASSES)
    torch.manual_seed(3)
    return Weights(spec, {k: v.detach().clone() for k, v in build(spec).state_dict().items()})


@pytest.fixture(scope="module")
def shipped() -> tuple[Weights, bytes]:
    """A teacher and its program as the server exports it (parity-checked on a sample of 32)."""
    t = teacher()
    return t, teacher_program(t, DIGITS.tensors(np.arange(100, 132))[0])


def shipping_task(t: Weights, program: bytes, sha: str | None = None) -> Task:
    records = {TEACHER_PTE_SHA256: sha or sha256_hex(program), TEACHER_SPEC: t.spec.to_dict()}
    return Task("kd_train", 0, CONFIG, tensors={TEACHER_PTE: program_tensor(program)}, records=records)


def et_agent(spec_name: str = "cnn1") -> ClientAgent:
    """An executorch client that cannot run a teacher sent as weights (no teacher_logits)."""
    spec = create(spec_name, SHAPE, CLASSES)
    x, y = DIGITS.tensors(np.arange(40))
    trainer = ExecuTorchTrainer(spec, 8, lambda b: TrainingSession(gated_training_program(spec, b)))
    return ClientAgent("7", spec, ClientData(x[:28], y[:28], x[28:], y[28:]), "android-mid-range", 0, trainer=trainer)


def test_a_shipped_teacher_program_is_run_and_its_hash_comes_back(shipped):
    t, program = shipped
    agent = et_agent()
    result = agent.handle(shipping_task(t, program))
    assert result.records == {TEACHER_PTE_SHA256: sha256_hex(program)}
    assert result.metrics["kd_loss"] > 0 and "local" in result.models
    # the logits it distilled from are the teacher's (through the program: 28 samples, one padded batch of 32)
    model = build(t.spec)
    model.load_state_dict(t.state)
    got = agent.trainer.program_logits(program, agent.data.x_train)
    torch.testing.assert_close(got, predict(model, agent.data.x_train), rtol=0, atol=1e-4)
    assert agent.trainer.teacher[0] == sha256_hex(program)  # the program it loaded is the one shipped


def test_a_program_whose_hash_differs_from_the_record_is_refused(shipped):
    t, program = shipped
    with pytest.raises(TaskError, match="SHA-256"):
        et_agent().handle(shipping_task(t, program, sha="0" * 64))
    tampered = bytearray(program)
    tampered[len(tampered) // 2] ^= 0xFF
    with pytest.raises(TaskError, match="SHA-256"):
        et_agent().handle(shipping_task(t, bytes(tampered), sha=sha256_hex(program)))


def test_an_executorch_client_without_a_weights_runner_refuses_teacher_weights(shipped):
    t, _ = shipped
    with pytest.raises(TaskError, match="only as its ExecuTorch program"):
        et_agent().handle(Task("kd_train", 0, CONFIG, {"teacher": t}))


def test_a_torch_client_refuses_a_teacher_program(shipped):
    t, program = shipped
    x, y = DIGITS.tensors(np.arange(40))
    agent = ClientAgent("3", create("cnn1", SHAPE, CLASSES), ClientData(x[:28], y[:28], x[28:], y[28:]), "rpi-4", 0)
    with pytest.raises(TaskError, match="cannot run a teacher program"):
        agent.handle(shipping_task(t, program))


CHILD = """
import json, sys
from pathlib import Path
import numpy as np
import edge_client
from edge_client.agent import ClientAgent, ClientData
from edge_client.executorch_trainer import ExecuTorchTrainer, TrainingSession
from fedge.data.datasets import load_dataset
from fedge.executorch_program import TrainingProgram
from fedge.wire.messages import Task
from fedge.model.spec import ModelSpec
from fedge.teacher_program import TEACHER_PTE, TEACHER_PTE_SHA256, TEACHER_SPEC, program_tensor, sha256_hex

d = Path(sys.argv[1])
meta = json.loads((d / "meta.json").read_text())
train = TrainingProgram(
    (d / "train.pte").read_bytes(), (d / "train.ptd").read_bytes(), 8, tuple(meta["shape"]), meta["classes"]
)
spec = ModelSpec.from_dict(meta["student"])
ds = load_dataset("digits")
x, y = ds.tensors(np.arange(40))
trainer = ExecuTorchTrainer(spec, 8, lambda b: TrainingSession(train))
agent = ClientAgent("7", spec, ClientData(x[:28], y[:28], x[28:], y[28:]), "android-mid-range", 0, trainer=trainer)
program = (d / "teacher.pte").read_bytes()
records = {TEACHER_PTE_SHA256: sha256_hex(program), TEACHER_SPEC: meta["teacher"]}
task = Task("kd_train", 0, meta["config"], tensors={TEACHER_PTE: program_tensor(program)}, records=records)
result = agent.handle(task)
ours = sorted(m for m in sys.modules if m == "export" or m.startswith("export."))
print(json.dumps({"export_modules": ours, "ran": result.records[TEACHER_PTE_SHA256], "kd": result.metrics["kd_loss"]}))
"""


def test_an_executorch_client_running_a_shipped_program_never_imports_the_exporter(shipped, tmp_path):
    # prepare: the training program is exported here (the launcher does it at start-up), the teacher's on the server
    t, program = shipped
    student = create("cnn1", SHAPE, CLASSES)
    gated_training_program(student, 8).write(tmp_path / "train.pte")
    (tmp_path / "teacher.pte").write_bytes(program)
    meta = {"shape": list(SHAPE), "classes": CLASSES, "student": student.to_dict(), "teacher": t.spec.to_dict()}
    (tmp_path / "meta.json").write_text(json.dumps(meta | {"config": CONFIG}))
    # execute: a fresh interpreter that is only the client
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    # assert
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["export_modules"] == []
    assert out["ran"] == sha256_hex(program) and out["kd"] > 0
