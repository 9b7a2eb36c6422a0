"""Batch-1 inference latency of eager PyTorch, onnxruntime and ExecuTorch (XNNPACK) on the same models.

    python bench/export_latency.py [--dataset mnist-5k] [--data PATH] [--threads 1] [--warmup 10] [--runs 200]
                                   [--run-dir RUN] [--teachers 4]

Models: every zoo model (fresh weights, the dataset's input shape and classes), then the final personalized
teachers of a pFedClub run: `--run-dir` reuses a run folder, otherwise a small in-process federation
(4 clients, 2 rounds, 200 samples per client) is run into a temporary folder first. Each model is exported
with export.onnx.export_onnx (parity-checked on 8 real images) and export.pte.export_pte (a program
for batch 1, checked on one real image), all files in a temporary folder. Every runtime uses `--threads`
threads (torch.set_num_threads; onnxruntime intra/inter-op threads; ExecuTorch's threadpool reset).
Prints p50/p95 milliseconds per sample over `--runs` timed calls after `--warmup` calls, and each runtime's
latency as a ratio to eager. A model or runtime that fails is reported in its row, not raised.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import hardware  # noqa: E402
from export.onnx import INPUT_NAME, export_onnx  # noqa: E402
from export.pte import export_pte  # noqa: E402
from export.run_models import load_final_model, parity_sample, run_config  # noqa: E402
from fedge.constants import DEFAULT_WIDTHS, WIDTHS  # noqa: E402
from fedge.data.datasets import load_dataset  # noqa: E402
from fedge.executorch_program import dense  # noqa: E402
from fedge.model.spec import build  # noqa: E402
from fedge.model.weights import load_module  # noqa: E402
from fedge.model.zoo import MODELS, create  # noqa: E402

RUNTIMES = ("eager", "ORT", "ET")
FEDERATION = {
    "strategy": "pfedclub",
    "rounds": 2,
    "local_epochs": 1,
    "clients": 4,
    "active": 4,
    "max_samples_per_client": 200,
    "max_public_samples": 500,
    "finetune_epochs": 1,
    "export_onnx": "false",
    "device": "cpu",
}


def latency(fn, warmup: int, runs: int) -> tuple[float, float]:
    """(p50, p95) in milliseconds of `runs` calls of fn() after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = np.empty(runs)
    for i in range(runs):
        start = time.perf_counter_ns()
        fn()
        times[i] = time.perf_counter_ns() - start
    p50, p95 = np.percentile(times, [50, 95]) / 1e6
    return float(p50), float(p95)


def run_federation(out: Path, dataset: str, data: str | None) -> None:
    """A small pFedClub federation in this machine's one process (transport inproc) into `out`."""
    cmd = [
        sys.executable,
        "-m",
        "launch.cli",
        "run",
        "--transport",
        "inproc",
        "--no-progress",
        "--out",
        str(out),
        "--dataset",
        dataset,
    ]
    cmd += ["--data", data] if data else []
    for key, value in FEDERATION.items():
        cmd += ["--set", f"{key}={value}"]
    print(f"running a pFedClub federation for teachers: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the federation failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")


def bench_model(spec, state, sample: torch.Tensor, stem: Path, args) -> dict:
    """Latencies {runtime: (p50, p95) or 'failed: ...'} and ExecuTorch's non-delegated ops for one model;
    its exports are written to `stem`.onnx and `stem`.pte."""
    import onnxruntime as ort
    from executorch.runtime import Runtime

    row: dict = {"ops": ""}
    x1 = dense(sample[:1])  # canonical strides, as the ExecuTorch runtime reads a dim order from them
    try:
        model = load_module(spec, state, "cpu").eval()
        with torch.inference_mode():
            row["eager"] = latency(lambda: model(x1), args.warmup, args.runs)
    except Exception as e:  # noqa: BLE001 - a failure is reported in the row
        row["eager"] = f"failed: {type(e).__name__}: {e}"
    try:
        path = stem.with_suffix(".onnx")
        export_onnx(spec, state, path, sample, {})
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = args.threads
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feed = {INPUT_NAME: x1.numpy()}
        row["ORT"] = latency(lambda: session.run(None, feed), args.warmup, args.runs)
    except Exception as e:  # noqa: BLE001
        row["ORT"] = f"failed: {type(e).__name__}: {e}"
    try:
        path = stem.with_suffix(".pte")
        report = export_pte(spec, state, path, x1)
        row["ops"] = ",".join(report.non_delegated_ops) or "-"
        method = Runtime.get().load_program(path).load_method("forward")
        row["ET"] = latency(lambda: method.execute([x1]), args.warmup, args.runs)
    except Exception as e:  # noqa: BLE001
        row["ET"] = f"failed: {type(e).__name__}: {e}"
    return row


def print_table(rows: list[tuple[str, object, dict]]) -> None:
    head = (
        f"{'model':16s} {'params':>9s} {'MACs':>11s} {'eager p50':>9s} {'p95':>7s} {'ORT p50':>8s} {'p95':>7s} "
        f"{'ET p50':>7s} {'p95':>7s} {'ORT/eager p50':>13s} {'p95':>5s} {'ET/eager p50':>12s} {'p95':>5s}  "
        f"ET non-delegated ops"
    )
    print(head)
    print("-" * len(head))
    for name, spec, r in rows:
        cells, failures = [], []
        for rt in RUNTIMES:
            ok = isinstance(r[rt], tuple)
            cells += [f"{r[rt][0]:.3f}", f"{r[rt][1]:.3f}"] if ok else ["-", "-"]
            if not ok:
                failures.append(f"{rt} {r[rt]}")
        ratios = []
        for rt in ("ORT", "ET"):
            ok = isinstance(r[rt], tuple) and isinstance(r["eager"], tuple)
            ratios += [f"{r[rt][i] / r['eager'][i]:.2f}" if ok else "-" for i in (0, 1)]
        print(
            f"{name:16s} {spec.params:9,d} {spec.macs:11,d} {cells[0]:>9s} {cells[1]:>7s} {cells[2]:>8s} "
            f"{cells[3]:>7s} {cells[4]:>7s} {cells[5]:>7s} {ratios[0]:>13s} {ratios[1]:>5s} {ratios[2]:>12s} "
            f"{ratios[3]:>5s}  {r['ops']}"
        )
        for failure in failures:
            print(f"{'':16s} {failure}")


def teachers(args, tmp: Path, rows: list, origins: list[str]) -> None:
    """Append a row and a block-origins line for each of the first `--teachers` teachers of the run."""
    run_dir = Path(args.run_dir) if args.run_dir else tmp / "run"
    if not args.run_dir:
        run_federation(run_dir, args.dataset, args.data)
    cfg = run_config(run_dir)
    sample = parity_sample(load_dataset(cfg["dataset"], cfg.get("data")), 8)
    for client in [str(i) for i in range(min(args.teachers, int(cfg["clients"])))]:
        label = f"teacher {client}"
        try:
            weights, _ = load_final_model(run_dir, client, "teacher")
        except Exception as e:  # noqa: BLE001 - e.g. a client that never got a teacher
            origins.append(f"{label}: failed: {e}")
            continue
        spec = weights.spec
        rows.append((label, spec, bench_model(spec, weights.state, sample, tmp / f"teacher-{client}", args)))
        blocks = " ".join(
            b.name if b.origin.client is None else f"{b.name}<{b.origin.model}@c{b.origin.client}" for b in spec.blocks
        )
        origins.append(f"{label}: {spec.name}, {spec.params:,d} params, {spec.macs:,d} MACs: {blocks}")
        print(f"  {label} done", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="mnist-5k", help="zoo input shape, classes and sample images")
    p.add_argument("--data", default=None, help="dataset files, for datasets that are not embedded")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--run-dir", default=None, help="reuse this pFedClub run folder's teachers")
    p.add_argument("--teachers", type=int, default=4, help="at most this many teachers (clients 0, 1, ...)")
    p.add_argument("--widths", choices=WIDTHS, default=DEFAULT_WIDTHS, help="zoo width preset (fedge/model/zoo.py)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count, _unsafe_reset_threadpool

    _unsafe_reset_threadpool(args.threads)
    ds = load_dataset(args.dataset, args.data)
    sample = parity_sample(ds, 8)
    print(f"hardware: {hardware()}")
    print(
        f"settings: {args.threads} thread(s) (torch {torch.get_num_threads()}, onnxruntime intra/inter-op "
        f"{args.threads}, ExecuTorch threadpool {_threadpool_get_thread_count()}); batch 1; warmup {args.warmup}, "
        f"runs {args.runs}; dataset {ds.name} input {tuple(ds.input_shape)}, {ds.num_classes} classes",
        flush=True,
    )

    with tempfile.TemporaryDirectory(prefix="export-latency-") as tmp:
        tmp = Path(tmp)
        rows = []
        for name in MODELS:
            spec = create(name, ds.input_shape, ds.num_classes, args.widths)
            state = {k: v.detach().clone() for k, v in build(spec).state_dict().items()}
            rows.append((name, spec, bench_model(spec, state, sample, tmp / name, args)))
            print(f"  {name} done", flush=True)

        origins = []
        try:
            teachers(args, tmp, rows, origins)
        except Exception as e:  # noqa: BLE001 - the zoo rows still print
            origins.append(f"failed: {type(e).__name__}: {e}")

    print(f"\nteachers from {args.run_dir or 'a fresh run'} (block<model@client it came from; stitch layers bare):")
    for line in origins:
        print(f"  {line}")
    print("\nper-sample latency in ms (batch 1); ratio = runtime latency / eager latency (< 1: faster than eager)")
    print_table(rows)


if __name__ == "__main__":
    main()
