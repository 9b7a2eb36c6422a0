"""Benchmark: vectorised block similarity (pFedClub Eq. (1)) against a naive Python loop over block pairs.

Run `python bench/bench_cka.py [--device cpu|cuda] [--budget 4] [--threads T]`. Not a test: prints the hardware and a
table. Five Zoo-I models (random weights) on 1×28×28 random "public" samples give B = 52 blocks.
- vectorised: methods.reassembly.cka.block_similarity over all blocks (Grams of shared in/out tensors computed once).
- naive: a double loop over the upper triangle of block pairs calling linear_cka twice per pair (inputs,
  outputs), in float32 like the vectorised path. It runs for at most `--budget` seconds over pairs in a
  fixed random order and is then extrapolated to all pairs by the pair count (marked "~").
- flattened maps at N = 3,300 (3.3 GB of features, minutes of CPU) are run on the first model only and
  both columns extrapolated with cost models (vectorised: N²·ΣD + U²·N² over U distinct tensors; naive:
  Σ over pairs of min(N²(Dx+Dy), N(DxDy+Dx²+Dy²)) for inputs and outputs);
  the features column then also covers that model only.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedge.constants import DEFAULT_WIDTHS, WIDTHS  # noqa: E402
from fedge.model import zoo  # noqa: E402
from fedge.model.spec import build  # noqa: E402
from fedge.wire.messages import Weights  # noqa: E402
from methods.reassembly.cka import block_similarity, choose_method, linear_cka  # noqa: E402
from methods.reassembly.features import block_features  # noqa: E402
from methods.reassembly.grouping import group_blocks  # noqa: E402

MODELS = ("cnn2", "cnn4", "mobilenet_v1", "mobilenet_v2", "mobilenet_v3")
SIZES = (400, 3300)
MODES = ("pool", "flatten")
FLATTEN_FULL_LIMIT = 1000  # above this N, flattened features are run on the first model and extrapolated


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = "/".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    gpu = f", CUDA {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (
        f"CPU {cpu} ({os.cpu_count()} logical cores), torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, python {platform.python_version()}{gpu}; load average {load}"
    )


def models(widths: str) -> list[Weights]:
    out = []
    for i, name in enumerate(MODELS):
        spec = zoo.create(name, (1, 28, 28), 10, widths)
        torch.manual_seed(i)
        out.append(Weights(spec, build(spec).state_dict()))
    return out


def block_dims(weights: list[Weights], mode: str) -> list[tuple[int, int]]:
    """(D_in, D_out) of every block's feature vectors, from the specs alone."""

    def dim(shape: tuple[int, ...]) -> int:
        return shape[0] if len(shape) == 3 and mode == "pool" else math.prod(shape)

    return [(dim(tuple(b.in_shape)), dim(tuple(b.out_shape))) for w in weights for b in w.spec.blocks]


def distinct_dims(weights: list[Weights], mode: str) -> list[int]:
    """Dimensions of the distinct feature tensors (per model: its input and every block output)."""
    return [d for w in weights for d in [block_dims([w], mode)[0][0]] + [o for _, o in block_dims([w], mode)]]


def pair_cost(n: int, dx: int, dy: int) -> float:
    return min(n * n * (dx + dy), n * (dx * dy + dx * dx + dy * dy))


def naive_cost(n: int, dims: list[tuple[int, int]], pairs: list[tuple[int, int]]) -> float:
    return sum(pair_cost(n, dims[i][0], dims[j][0]) + pair_cost(n, dims[i][1], dims[j][1]) for i, j in pairs)


def vector_cost(n: int, dims: list[int]) -> float:
    return n * n * (sum(dims) + len(dims) ** 2)


def naive(feats: list, budget: float) -> tuple[float, list[tuple[int, int]]]:
    """Seconds spent on the upper-triangle pair loop (pairs in a fixed random order, so that a run cut
    short by the budget is a fair sample) and the pairs done before the budget ran out."""
    pairs = [(i, j) for i in range(len(feats)) for j in range(i, len(feats))]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
    start, done = time.perf_counter(), []
    for i, j in (pairs[k] for k in order):
        a, b = feats[i], feats[j]
        linear_cka(a.inputs, b.inputs, dtype=torch.float32) + linear_cka(a.outputs, b.outputs, dtype=torch.float32)
        done.append((i, j))
        if time.perf_counter() - start > budget:
            break
    return time.perf_counter() - start, done


def row(weights: list[Weights], n: int, mode: str, device: str, budget: float, gen: torch.Generator) -> str:
    """One table row: all models, or only the first one with extrapolation for heavy flattened runs."""
    partial = mode == "flatten" and n > FLATTEN_FULL_LIMIT
    run = weights[:1] if partial else weights
    x = torch.randn(n, 1, 28, 28, generator=gen)
    start = time.perf_counter()
    feats = [f for w in run for f in block_features(w, x, device=device, conv_features=mode)]
    t_feat = time.perf_counter() - start
    start = time.perf_counter()
    sim = block_similarity(feats, device=device)
    t_vec = time.perf_counter() - start
    t_naive, done = naive(feats, budget)
    start = time.perf_counter()
    group_blocks(sim, k=4, seed=0)
    t_group = time.perf_counter() - start
    all_dims, all_distinct = block_dims(weights, mode), distinct_dims(weights, mode)
    all_pairs = [(i, j) for i in range(len(all_dims)) for j in range(i, len(all_dims))]
    n_est = len(done) < len(all_pairs)
    if partial:  # FLOPs dominate: scale by the cost models
        t_naive *= naive_cost(n, all_dims, all_pairs) / naive_cost(n, block_dims(run, mode), done)
        t_vec *= vector_cost(n, all_distinct) / vector_cost(n, distinct_dims(run, mode))
    else:  # a random sample of the same pairs: scale by the pair count
        t_naive *= len(all_pairs) / len(done)
    mb = sum(all_distinct) * n * 4 / 2**20
    feat = f"{'~' if partial else ' '}{t_feat:8.2f}{'*' if partial else ' '}"
    return (
        f"{n:>5} {mode:>7} {sum(all_distinct):>7} {choose_method(n, all_distinct):>7} {feat:>11} {mb:>6.0f} "
        f"{'~' if partial else ' '}{t_vec:10.3f} {'~' if n_est else ' '}{t_naive:10.3f} "
        f"{t_naive / t_vec:>6.0f}x {t_group if not partial else float('nan'):>9.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", type=float, default=4.0, help="seconds per naive-loop measurement")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--widths", choices=WIDTHS, default=DEFAULT_WIDTHS, help="zoo width preset (fedge/model/zoo.py)"
    )
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(hardware())
    weights = models(args.widths)
    print(
        f"models: {', '.join(MODELS)} → B = {sum(len(w.spec.blocks) for w in weights)} blocks, "
        f"{len(distinct_dims(weights, 'pool'))} distinct feature tensors; device {args.device}"
    )
    warm = [f for w in weights for f in block_features(w, torch.randn(8, 1, 28, 28), device=args.device)]
    group_blocks(block_similarity(warm, device=args.device), k=4, seed=0)  # first-call overheads
    print(
        f"{'N':>5} {'conv':>7} {'ΣD':>7} {'method':>7} {'features s':>11} {'MB':>6} "
        f"{'vectorised s':>11} {'naive loop s':>11} {'ratio':>7} {'group s':>9}"
    )
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        for mode in MODES:
            print(row(weights, n, mode, args.device, args.budget, gen), flush=True)
    print(
        "~ = extrapolated with the cost models (module docstring); * = first model only. features s = "
        "block_features; MB = distinct feature tensors of all 5 models; ratio = naive / vectorised; "
        "group s = group_blocks (k = 4) on the B×B similarity."
    )


if __name__ == "__main__":
    main()
