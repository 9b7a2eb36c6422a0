"""A teacher's ExecuTorch inference program as it travels in a `kd_train` task to an executorch client: the
server exports it (once per distinct teacher), the client only loads and runs it. Names on the wire, the bytes as
a uint8 tensor, its SHA-256, and loading it with the ExecuTorch runtime (no exporter needed).

Wire format of such a task: tensors[TEACHER_PTE] = the .pte bytes as a 1-D uint8 tensor, records[TEACHER_PTE_SHA256]
= their SHA-256 (hex), records[TEACHER_SPEC] = the teacher's ModelSpec as a dict (its input shape, classes and
MACs); no "teacher" model. A client reports records[TEACHER_PTE_SHA256] of the program it ran in its result. When
the server could not export (or parity-check) the teacher, the task carries no teacher and
records[TEACHER_PROGRAM_ERROR] says why.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fedge.executorch_program import dense
from fedge.model.spec import ModelSpec
from fedge.model.weights import to_bytes
from fedge.wire.messages import Task, Weights

TEACHER_PTE = "teacher_pte"
TEACHER_PTE_SHA256 = "teacher_pte_sha256"
TEACHER_SPEC = "teacher_spec"
TEACHER_PROGRAM_ERROR = "teacher_program_error"


class TeacherProgramError(ValueError):
    """A shipped teacher program is malformed, does not match its hash or spec, or does not load or run."""


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of `data`, as lowercase hex."""
    return hashlib.sha256(data).hexdigest()


def weights_digest(weights: Weights) -> str:
    """A content hash of a model (spec and tensors): equal for the same teacher sent to several clients."""
    return sha256_hex(to_bytes(weights.spec, weights.state))


def program_tensor(data: bytes) -> torch.Tensor:
    """Program bytes as the 1-D uint8 tensor a task carries (a copy)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def shipped_program(task: Task) -> tuple[bytes, ModelSpec] | None:
    """(program bytes, teacher spec) of a task that ships a teacher program, None if it ships none. A malformed
    tensor or spec, or bytes whose SHA-256 differ from the task's record, raise TeacherProgramError."""
    if TEACHER_PTE not in task.tensors:
        return None
    t = task.tensors[TEACHER_PTE]
    if t.dtype != torch.uint8 or t.dim() != 1 or len(t) == 0:
        raise TeacherProgramError(f"{TEACHER_PTE} must be a non-empty 1-D uint8 tensor, got {t.dtype} {list(t.shape)}")
    data = t.contiguous().numpy().tobytes()
    want = task.records.get(TEACHER_PTE_SHA256)
    if want != sha256_hex(data):
        raise TeacherProgramError(f"the teacher program's SHA-256 is {sha256_hex(data)}, the task says {want!r}")
    try:
        spec = ModelSpec.from_dict(task.records[TEACHER_SPEC])
    except Exception as e:  # a missing record or any malformation of it
        raise TeacherProgramError(f"record {TEACHER_SPEC!r} is not a model spec: {type(e).__name__}: {e}") from None
    return data, spec


def shipped_spec(records: dict[str, Any]) -> ModelSpec | None:
    """The teacher spec a task's records name, None without one (or a malformed one)."""
    try:
        return ModelSpec.from_dict(records[TEACHER_SPEC]) if TEACHER_SPEC in records else None
    except Exception:  # the client rejects a malformed spec; the clock then charges no teacher
        return None


class InferenceProgram:
    """An XNNPACK inference program loaded from bytes through `executorch.runtime` (what an Android app's
    `Module.load` is): `forward` takes float32 batches of a fixed size and gives logits. Raises
    TeacherProgramError when the bytes do not load (ImportError without the executorch package)."""

    def __init__(self, data: bytes) -> None:
        from executorch.runtime import Runtime

        self.data = data  # keep the buffer referenced while the program lives
        try:
            self.method = Runtime.get().load_program(data).load_method("forward")
            self.shape = tuple(self.method.metadata.input_tensor_meta(0).sizes())
        except Exception as e:  # the runtime raises RuntimeError/ValueError with an error code
            raise TeacherProgramError(f"not a loadable ExecuTorch inference program: {type(e).__name__}: {e}") from e

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits on `x` in batches of the program's fixed size (the last one padded with zeros, its padding
        dropped); inputs of another shape, or a run that fails, raise TeacherProgramError."""
        if tuple(x.shape[1:]) != self.shape[1:]:
            raise TeacherProgramError(
                f"the program takes inputs of shape {list(self.shape[1:])}, got {list(x.shape[1:])}"
            )
        batch, out = self.shape[0], []
        for xb in x.split(batch):
            n = len(xb)
            if n < batch:
                xb = torch.cat([xb, xb.new_zeros(batch - n, *self.shape[1:])])
            try:
                out.append(self.method.execute([dense(xb)])[0][:n])
            except Exception as e:
                raise TeacherProgramError(f"the program does not run: {type(e).__name__}: {e}") from e
        return torch.cat(out)
