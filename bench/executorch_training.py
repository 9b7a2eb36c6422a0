"""Time per local epoch of a student through its ExecuTorch training program vs eager PyTorch, and what the
simulated clock charges for the same epoch on the bundled Android profiles.

    python bench/executorch_training.py [--dataset mnist-5k] [--samples 256] [--batch-size 16] [--threads 1]

For each zoo model (BatchNorm ones on batch statistics, running statistics updated): one epoch over `--samples` real
images with CE + λ·KL to fixed teacher logits, SGD with momentum, the same batches on both sides (the
executorch client's `epoch_batches`, last batch filled up). Eager runs the same loss with torch.optim.SGD
(training mode with dropout off, as in the program) and, for reference, the torch runtime's own loop (Adam, dropout on).
Program export, the gradient-parity gate and loading are timed separately (once per client, not per epoch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from device_profiles import list_profiles, train_seconds  # noqa: E402
from edge_client.executorch_trainer import ExecuTorchTrainer, TrainingSession, epoch_batches  # noqa: E402
from edge_client.training import Distillation, TrainConfig, fit  # noqa: E402
from export.parity import gated_training_program, train_mode  # noqa: E402
from export.pte import teacher_logits_pte  # noqa: E402
from export.training_program import trainable_form  # noqa: E402
from fedge import constants as C  # noqa: E402
from fedge.data.datasets import load_dataset  # noqa: E402
from fedge.data.partition import stratified_sample  # noqa: E402
from fedge.distill import kd_loss  # noqa: E402
from fedge.model.spec import build  # noqa: E402
from fedge.model.zoo import MODELS, create  # noqa: E402
from fedge.wire.messages import Weights  # noqa: E402

KD_LAMBDA, TEMPERATURE, SGD_LR, MOMENTUM = C.KD_LAMBDA, C.KD_TEMPERATURE, C.SGD_LR, C.SGD_MOMENTUM


def eager_sgd_epoch(model, x, y, teacher, batch: int, seed: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=MOMENTUM)
    for idx in epoch_batches(len(x), batch, torch.Generator().manual_seed(seed)):
        opt.zero_grad(set_to_none=True)
        kd_loss(model(x[idx]), y[idx], teacher[idx], KD_LAMBDA, TEMPERATURE).backward()
        opt.step()


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--data", default=None)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="epochs timed per runtime (median)")
    p.add_argument("--widths", choices=C.WIDTHS, default=C.DEFAULT_WIDTHS, help="zoo width preset (fedge/model/zoo.py)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ds = load_dataset(args.dataset, args.data)
    x, y = ds.tensors(stratified_sample(ds.y, args.samples, C.DEFAULT_SEED))
    teacher = torch.randn(len(x), ds.num_classes, generator=torch.Generator().manual_seed(0))
    android = [p for p in list_profiles() if p.runtime == "executorch"]
    cfg = TrainConfig(epochs=1, batch_size=args.batch_size, lr=1e-3, seed=1, sgd_lr=SGD_LR, sgd_momentum=MOMENTUM)
    steps = -(-len(x) // args.batch_size)
    print(hardware())
    print(
        f"{args.dataset}: {len(x)} samples of {list(ds.input_shape)}, batch {args.batch_size} ({steps} steps per "
        f"epoch), {args.threads} torch thread(s); ExecuTorch: portable kernels (training has no XNNPACK); "
        f"median of {args.repeats} epochs"
    )
    print("ratio = ExecuTorch epoch / eager epoch (same loss, same batches, SGD)\n")
    head = (
        f"{'model':12s} {'export+gate s':>13s} {'ET epoch s':>10s} {'ET ms/step':>10s} {'eager SGD s':>11s} "
        f"{'eager ms/step':>13s} {'ET/eager':>8s} {'Adam s':>7s} {'teacher pte s':>13s} "
        + " ".join(f"{p.name:>18s}" for p in android)
    )
    print(head)
    print("-" * len(head))
    for name in MODELS:
        spec = create(name, ds.input_shape, ds.num_classes, args.widths)
        try:
            trainable_form(spec, build(spec))
        except ValueError as e:
            print(f"{name:12s} not trainable under executorch: {str(e)[:90]}")
            continue
        start = time.perf_counter()
        trainer = ExecuTorchTrainer(
            spec,
            args.batch_size,
            lambda b, spec=spec: TrainingSession(gated_training_program(spec, b)),
            teacher_logits_pte,
        )
        setup = time.perf_counter() - start
        torch.manual_seed(0)
        model = build(spec)
        kd = Distillation(teacher, KD_LAMBDA, TEMPERATURE)
        et = timed(lambda: trainer.fit(model, x, y, cfg, kd), args.repeats)
        eager = train_mode(build(spec))  # BatchNorm on batch statistics, no dropout: as in the program
        sgd = timed(lambda: eager_sgd_epoch(eager, x, y, teacher, args.batch_size, 1), args.repeats)
        adam = timed(lambda: fit(build(spec), x, y, cfg, kd), args.repeats)
        start = time.perf_counter()
        teacher_logits_pte(Weights(spec, model.state_dict()), x)
        tpte = time.perf_counter() - start
        sim = " ".join(f"{train_seconds(spec.macs, len(x), 1, p):18.3f}" for p in android)
        print(
            f"{name:12s} {setup:13.2f} {et:10.2f} {1e3 * et / steps:10.1f} {sgd:11.3f} {1e3 * sgd / steps:13.1f} "
            f"{et / sgd:8.1f} {adam:7.3f} "
            f"{tpte:13.2f} {sim}"
        )
    print(
        "\nlast columns: seconds the simulated clock charges for the same epoch on each Android profile "
        "(3 x forward MACs x samples / train_macs_per_s; device_profiles.capability.train_seconds)"
    )


if __name__ == "__main__":
    main()
