"""Teacher programs for executorch clients: exported on the server once per distinct teacher (by content hash)
and put in the client's kd_train task in place of the teacher's weights (fedge.teacher_program's wire format)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch

from fedge.teacher_program import (
    TEACHER_PROGRAM_ERROR,
    TEACHER_PTE,
    TEACHER_PTE_SHA256,
    TEACHER_SPEC,
    program_tensor,
    sha256_hex,
    weights_digest,
)
from fedge.wire.messages import Records, Task, Tensors, Weights

log = logging.getLogger(__name__)

# How the server turns a teacher into its parity-checked XNNPACK inference program (the launcher injects
# export.pte's; server/ may not import export/). Raises ValueError when the teacher cannot be exported or checked.
ProgramExporter = Callable[[Weights], bytes]


class TeacherPrograms:
    """Exported teacher programs by the teacher's content hash, and the outcome of failed exports (not retried).
    `exports` counts exports run, `hits` the times a kept one served a task."""

    def __init__(self, export: ProgramExporter) -> None:
        self.export = export
        self.programs: dict[str, tuple[bytes, str]] = {}  # teacher digest -> (program, its SHA-256)
        self.tensors: dict[str, torch.Tensor] = {}  # teacher digest -> the program as the task's uint8 tensor
        self.failures: dict[str, str] = {}  # teacher digest -> why it could not be exported
        self.exports = 0
        self.hits = 0

    def program(self, teacher: Weights) -> tuple[bytes, str]:
        """(program bytes, their SHA-256) for `teacher`, exported at its first request; ValueError (the exporter's,
        or the kept one of an earlier failure) when it cannot be exported."""
        return self._program(weights_digest(teacher), teacher)

    def _program(self, digest: str, teacher: Weights) -> tuple[bytes, str]:
        if digest in self.failures:
            raise ValueError(self.failures[digest])
        if digest in self.programs:
            self.hits += 1
            return self.programs[digest]
        self.exports += 1
        try:
            data = self.export(teacher)
        except ValueError as e:
            self.failures[digest] = str(e)
            raise
        self.programs[digest] = (data, sha256_hex(data))
        self.tensors[digest] = program_tensor(data)  # one copy, shared by every task that ships it
        return self.programs[digest]

    def keep_only(self, teachers: Iterable[Weights]) -> None:
        """Forget the programs (and failures) of teachers no longer kept, so memory follows the kept teachers."""
        live = {weights_digest(t) for t in teachers}
        self.programs = {d: p for d, p in self.programs.items() if d in live}
        self.failures = {d: f for d, f in self.failures.items() if d in live}
        self.tensors = {d: t for d, t in self.tensors.items() if d in live}

    def task(self, rnd: int, config: dict[str, Any], teacher: Weights) -> Task:
        """A kd_train task shipping `teacher`'s program and spec instead of its weights, or, when the program cannot
        be exported, one without a teacher whose records say why (the client then trains with CE alone)."""
        digest = weights_digest(teacher)
        try:
            _, sha = self._program(digest, teacher)
        except ValueError as e:
            name = teacher.spec.name
            log.error("round %d: teacher %r has no ExecuTorch program; the task goes without it: %s", rnd, name, e)
            return Task("kd_train", rnd, config, records={TEACHER_PROGRAM_ERROR: str(e)})
        tensors: Tensors = {TEACHER_PTE: self.tensors[digest]}
        records: Records = {TEACHER_PTE_SHA256: sha, TEACHER_SPEC: teacher.spec.to_dict()}
        return Task("kd_train", rnd, config, tensors=tensors, records=records)
