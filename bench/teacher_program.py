"""What shipping the teacher's ExecuTorch program takes off an executorch client each round: before, the client
exported the teacher's XNNPACK inference program itself and ran it (export.pte.teacher_logits_pte); now the server
exports it once per distinct teacher (parity-checked on its public data) and the client only checks its SHA-256,
loads it and runs it (fedge.teacher_program). Also: the task's bytes down (weights vs program).

    python bench/teacher_program.py [--dataset mnist-5k] [--samples 256] [--models cnn1,cnn2,cnn3,cnn4] [--repeats 3]

Per teacher architecture, medians of `--repeats` rounds: the client's teacher step before and after, and the
server's export (paid once per distinct teacher, not per client and round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from export.pte import teacher_logits_pte, teacher_program  # noqa: E402
from fedge import constants as C  # noqa: E402
from fedge.data.datasets import load_dataset  # noqa: E402
from fedge.data.partition import stratified_sample  # noqa: E402
from fedge.model.spec import build  # noqa: E402
from fedge.model.zoo import create  # noqa: E402
from fedge.teacher_program import (  # noqa: E402
    TEACHER_PTE,
    TEACHER_PTE_SHA256,
    TEACHER_SPEC,
    InferenceProgram,
    program_tensor,
    sha256_hex,
    shipped_program,
)
from fedge.wire.codec import encode_task  # noqa: E402
from fedge.wire.messages import Task, Weights  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, object]:
    """(median seconds of `repeats` calls, the last call's value)."""
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def client_after(task: Task, x: torch.Tensor) -> torch.Tensor:
    """What an executorch client does now: check the shipped bytes against their hash, load, run."""
    program, _ = shipped_program(task)
    return InferenceProgram(program).logits(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--data", default=None)
    p.add_argument("--samples", type=int, default=256, help="the client's training samples (teacher logits on all)")
    p.add_argument("--models", default="cnn1,cnn2,cnn3,cnn4", help="teacher architectures (zoo names)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--widths", choices=C.WIDTHS, default=C.DEFAULT_WIDTHS, help="zoo width preset (fedge/model/zoo.py)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ds = load_dataset(args.dataset, args.data)
    client = stratified_sample(ds.y, args.samples, C.DEFAULT_SEED)
    x, _ = ds.tensors(client)
    rest = np.setdiff1d(np.arange(len(ds)), client)
    public, _ = ds.tensors(stratified_sample(ds.y, C.EXECUTORCH_TEACHER_BATCH, C.DEFAULT_SEED, among=rest))
    print(hardware())
    print(f"{args.dataset}: teacher logits on {len(x)} samples, {args.threads} thread(s), median of {args.repeats}\n")
    head = (
        f"{'teacher':8s} {'before s':>9s} {'after s':>8s} {'saved s':>8s} {'server export s':>16s} "
        f"{'weights KB':>11s} {'program KB':>11s}"
    )
    print(head)
    print("-" * len(head))
    for name in args.models.split(","):
        spec = create(name, ds.input_shape, ds.num_classes, args.widths)
        torch.manual_seed(0)
        teacher = Weights(spec, build(spec).state_dict())
        before, want = timed(lambda: teacher_logits_pte(teacher, x), args.repeats)
        export_s, program = timed(lambda: teacher_program(teacher, public), args.repeats)
        sent = Task("kd_train", 1, {}, {"teacher": teacher})
        shipped = Task(
            "kd_train",
            1,
            {},
            tensors={TEACHER_PTE: program_tensor(program)},
            records={TEACHER_PTE_SHA256: sha256_hex(program), TEACHER_SPEC: spec.to_dict()},
        )
        after, got = timed(lambda: client_after(shipped, x), args.repeats)
        assert torch.allclose(got, want, atol=1e-4), f"{name}: shipped program's logits differ"
        print(
            f"{name:8s} {before:9.3f} {after:8.3f} {before - after:8.3f} {export_s:16.3f} "
            f"{len(encode_task(sent)) / 1024:11.1f} {len(encode_task(shipped)) / 1024:11.1f}"
        )


if __name__ == "__main__":
    main()
