"""The hardware floor of server-side candidate work: FLOPs from specs alone, this machine's measured FLOP rate.

    python bench/floor.py [--threads 1] [--public 400] [--epochs 3] [--batch 64] [--blocks]

A candidate's stitch fine-tuning (methods/reassembly/finetune.py `_train_group`, pFedClub Eq. (2)) and its Eq. (4)
matching forward must do at least `candidate_flops` floating-point operations; at the best dense rate this machine
reaches on one torch thread (`machine_rate`) that takes `candidate_flops / machine_rate` seconds: the floor.
bench/server_step.py prints its measured seconds per candidate over that floor (`floor_lines`). `block_rates` times
each block of a model as it runs (forward + backward-to-input, eval mode), to show which blocks run far below the
floor's rate (depthwise convolutions and BatchNorm are memory-bound). Run as a script it prints the floor of every
Zoo I model treated as a candidate with one stitch at block 0 (MNIST-size input); --blocks adds every block's rate.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedge.constants import DEFAULT_WIDTHS  # noqa: E402
from fedge.model.spec import ModelSpec, build  # noqa: E402
from fedge.model.zoo import ZOOS, create  # noqa: E402
from methods.reassembly.fastblocks import fold_batchnorm  # noqa: E402

FLOPS_PER_MAC = 2  # a multiply-accumulate is two FLOPs (torch.utils.flop_counter's convention)
RATE_REPEATS = 8  # machine_rate: timed repeats of each workload after one warm-up; the best one counts
BLOCK_REPEATS = 2  # block_rates: timed repeats of each block after one warm-up
CONV_WORKLOAD = (64, 64, 14, 14)  # machine_rate: (batch, channels, H, W) through a 3x3 Conv2d channels -> channels
MATMUL_SIZE = 512  # machine_rate: an n x n by n x n float32 matmul (cache-resident: the best rate measured here)
MACS_CACHE_SIZE = 4096  # block_macs: architectures whose padding taps are remembered


# --- FLOPs from specs -------------------------------------------------------------------------


def _check(spec: ModelSpec, stitches: Sequence[int], counts: Mapping[str, float], sharing: int) -> tuple[int, ...]:
    blocks = tuple(sorted(set(stitches)))
    if any(not 0 <= i < len(spec.blocks) for i in blocks):
        raise ValueError(
            f"{spec.name!r} has {len(spec.blocks)} blocks; stitch indices {list(stitches)} are out of range"
        )
    bad = {k: v for k, v in counts.items() if not (math.isfinite(v) and v >= 0)}
    if bad or sharing < 1:
        raise ValueError(f"sample and step counts must be finite and >= 0 and sharing >= 1, got {bad or sharing}")
    return blocks


def _valid_taps(size: int, kernel: int, stride: int, pad: int, dilation: int, out: int) -> int:
    """Kernel taps that land inside the input, summed over the output positions of one spatial dimension."""
    return sum(sum(1 for t in range(kernel) if 0 <= i * stride - pad + t * dilation < size) for i in range(out))


def _padding_taps(conv: nn.Conv2d, x: torch.Tensor, y: torch.Tensor) -> int:
    """MACs per sample of `conv` that multiply zero padding (counted by BlockSpec.macs, skipped by direct conv)."""
    per_tap = conv.out_channels * conv.in_channels // conv.groups
    (h, w), (oh, ow) = x.shape[-2:], y.shape[-2:]
    pad = conv.padding if isinstance(conv.padding, tuple) else (0, 0)  # "valid"; "same" is not built by a spec
    kh, kw = conv.kernel_size
    valid = [
        _valid_taps(n, k, s, p, d, o)
        for n, k, s, p, d, o in zip((h, w), (kh, kw), conv.stride, pad, conv.dilation, (oh, ow))
    ]
    return per_tap * (oh * ow * kh * kw - valid[0] * valid[1])


@lru_cache(maxsize=MACS_CACHE_SIZE)
def _padding_macs(spec_json: str) -> tuple[int, ...]:
    spec = ModelSpec.from_json(spec_json)
    model = build(spec, "meta").eval()
    counts = []
    for i, block in enumerate(spec.blocks):
        taps: list[int] = []

        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            taps.append(_padding_taps(module, args[0], out))

        convs = [m for m in model.blocks[i].modules() if isinstance(m, nn.Conv2d)]
        handles = [m.register_forward_hook(hook) for m in convs]
        try:
            with torch.no_grad():
                model.blocks[i](torch.empty(1, *block.in_shape, device="meta"))
        except (RuntimeError, NotImplementedError):
            taps = []  # a layer meta tensors cannot run: its block keeps the spec's count
        finally:
            for handle in handles:
                handle.remove()
        counts.append(sum(taps))
    return tuple(counts)


def block_macs(spec: ModelSpec, count_padding: bool = False) -> tuple[int, ...]:
    """Forward MACs per sample of each block of `spec`, from the spec alone (a "meta" build, no weights).

    count_padding True: BlockSpec.macs, every kernel tap (the thop / torch.utils.flop_counter convention the
    project uses). False, the floor's count: less each Conv2d's taps that fall on zero padding, which direct
    convolution kernels (oneDNN's, what PyTorch runs float32 convolutions with on CPU) skip; it matters where maps
    are small and padding wide (cnn3's 5x5 convolutions on 3x3 maps: a third of its counted MACs; counted with
    them, its cov5 block "ran" at 1.85x this machine's dense rate). A block meta tensors cannot run keeps
    its spec count. Remembered per architecture (the spec without origins).
    """
    if count_padding:
        return tuple(b.macs for b in spec.blocks)
    padded = _padding_macs(spec.with_origin(None).to_json())
    return tuple(b.macs - p for b, p in zip(spec.blocks, padded))


def finetune_block_flops(
    spec: ModelSpec,
    stitches: Sequence[int],
    samples_per_step: float,
    steps: float,
    public_samples: float,
    sharing: int = 1,
    count_padding: bool = False,
) -> list[float]:
    """finetune_flops block by block (the same count, each block's part: to be divided by that block's own rate)."""
    counts = {"samples_per_step": samples_per_step, "steps": steps, "public_samples": public_samples}
    blocks = _check(spec, stitches, counts, sharing)
    if not blocks:
        return [0.0] * len(spec.blocks)
    macs, first, seen = block_macs(spec, count_padding), blocks[0], samples_per_step * steps
    out = []
    for i, m in enumerate(macs):
        f = FLOPS_PER_MAC * m
        passes = 0 if i < first else 1 + (i > first) + (i in blocks)  # forward, backward to input, weight gradient
        out.append(float(f * public_samples / sharing if i < first else f * passes * seen))
    return out


def matching_block_flops(
    spec: ModelSpec, stitches: Sequence[int], public_samples: float, sharing: int = 1, count_padding: bool = False
) -> list[float]:
    """matching_flops block by block."""
    blocks = _check(spec, stitches, {"public_samples": public_samples}, sharing)
    first = blocks[0] if blocks else len(spec.blocks)
    return [
        float(FLOPS_PER_MAC * m * public_samples / (sharing if i < first else 1))
        for i, m in enumerate(block_macs(spec, count_padding))
    ]


def finetune_flops(
    spec: ModelSpec,
    stitches: Sequence[int],
    samples_per_step: float,
    steps: float,
    public_samples: float,
    sharing: int = 1,
    count_padding: bool = False,
) -> float:
    """The FLOPs stitch fine-tuning of one candidate must do, from its spec alone (a lower bound).

    The model, per sample, with F(i) = 2 x block i's MACs (block_macs: conv and matrix products only, zero-padding
    taps left out unless count_padding) and s = the first stitch:
      - blocks 0..s-1 (frozen, before any stitch) run forward once on `public_samples` (the labeled case caches
        their outputs for all epochs): F(0..s-1) x public_samples, divided by `sharing`, the number of candidates
        that share this prefix (finetune.py trains them as one group, running the prefix once);
      - blocks s..end run forward on steps x samples_per_step samples, and on as many samples:
        backward to the input, ~F(i) again, for every block after s (frozen or stitch: the gradient must reach
        the stitches upstream; block s's own input is the cache, which needs none), and the weight gradient,
        ~F(i) again, for each stitch block only (frozen blocks have no grad).
    Only the product steps x samples_per_step matters: pass the real total (epochs x N for a labeled pass whose
    last batch is short; the unlabeled Eq. (3) case runs the prefix on every batch's two views, so there
    steps x samples_per_step = public_samples = 2 x epochs x N; candidate_flops does this). Not counted, so the
    bound holds: element-wise ops (BN, activations, pooling, the loss), the optimizer's update, any recomputation.
    No stitches: 0.0 (the candidate comes back unchanged). Stitch indices out of range, negative or non-finite
    counts, or sharing < 1 raise ValueError.
    """
    return sum(finetune_block_flops(spec, stitches, samples_per_step, steps, public_samples, sharing, count_padding))


def matching_flops(
    spec: ModelSpec, stitches: Sequence[int], public_samples: float, sharing: int = 1, count_padding: bool = False
) -> float:
    """The FLOPs of the candidate's forward over the public set (its Eq. (4) logits, finetune.public_logits).

    The blocks before the first stitch (all blocks when there is none) are divided by `sharing`, the number of
    candidates sharing them (public_logits runs a shared prefix once per batch). Counted as finetune_flops
    counts; the client model's own logits (once per client, not per candidate) are not included. Bad input
    raises ValueError as finetune_flops does.
    """
    return sum(matching_block_flops(spec, stitches, public_samples, sharing, count_padding))


def candidate_flops(
    spec: ModelSpec,
    stitches: Sequence[int],
    public_samples: int,
    epochs: int,
    labeled: bool = True,
    sharing: int = 1,
    count_padding: bool = False,
) -> float:
    """finetune_flops + matching_flops for `epochs` passes over `public_samples` (finetune.FinetuneConfig's
    epochs; the batch size does not change the count): the floor's FLOPs for one candidate. Unlabeled (Eq. (3))
    counts two views per sample and the prefix on every batch. Bad input raises ValueError."""
    views = 1 if labeled else 2
    prefix = public_samples if labeled else views * epochs * public_samples
    tune = finetune_flops(spec, stitches, views * public_samples, epochs, prefix, sharing, count_padding)
    return tune + matching_flops(spec, stitches, public_samples, sharing, count_padding)


# --- measured rates ---------------------------------------------------------------------------


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the body with torch at `threads` intra-op threads, restored after; threads < 1 raise ValueError."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_seconds(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up: kernel selection, allocator
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def dense_rates(threads: int = 1, repeats: int = RATE_REPEATS) -> dict[str, float]:
    """FLOP/s of each dense workload at `threads` torch threads, best of `repeats` after a warm-up:
    "conv3x3" (Conv2d 3x3, padding 1, on CONV_WORKLOAD, forward + backward-to-input, padding taps not counted)
    and "matmul" (MATMUL_SIZE cubed). threads or repeats < 1 raise ValueError."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    gen = torch.Generator().manual_seed(0)
    n, c, h, w = CONV_WORKLOAD
    conv = nn.Conv2d(c, c, 3, padding=1).requires_grad_(False)
    x = torch.randn(n, c, h, w, generator=gen, requires_grad=True)
    grad = torch.randn(n, c, h, w, generator=gen)
    taps = _valid_taps(h, 3, 1, 1, 1, h) * _valid_taps(w, 3, 1, 1, 1, w)  # counted as block_macs counts
    conv_flops = 2 * FLOPS_PER_MAC * n * c * c * taps  # forward + backward-to-input, the same MACs
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=gen) for _ in range(2))
    with torch_threads(threads):
        conv_s = _best_seconds(lambda: torch.autograd.grad(conv(x), x, grad), repeats)
        matmul_s = _best_seconds(lambda: a @ b, repeats)
    return {"conv3x3": conv_flops / conv_s, "matmul": FLOPS_PER_MAC * MATMUL_SIZE**3 / matmul_s}


def machine_rate(threads: int = 1, repeats: int = RATE_REPEATS) -> float:
    """This machine's achievable dense FLOP/s at `threads` torch threads: the best of dense_rates, the floor's
    rate (no Zoo I block measured by block_rates ran faster). About a second of wall time at one thread, and
    lower while other processes share the cores: best-of-repeats only partly hides that. Bad input raises
    ValueError."""
    return max(dense_rates(threads, repeats).values())


@dataclass(frozen=True)
class BlockRate:
    """One block timed as it runs: forward + backward-to-input FLOPs at a batch, and the best seconds."""

    index: int
    name: str
    flops: float
    seconds: float

    @property
    def rate(self) -> float:
        """FLOP/s (0.0 for a block without MACs, e.g. pooling only)."""
        return self.flops / self.seconds if self.seconds > 0 else 0.0


def block_rates(
    spec: ModelSpec, batch: int, threads: int = 1, repeats: int = BLOCK_REPEATS, fold: bool = False
) -> list[BlockRate]:
    """Each block of `spec` (fresh weights, eval mode, frozen) on a random batch of its in_shape: forward and
    backward to its input at `threads` torch threads, best of `repeats` after a warm-up. FLOPs are counted as
    finetune_flops counts them (2 x MACs each way), so a rate far below machine_rate marks a memory-bound block.
    fold: each block as pFedClub's candidates run it (methods/reassembly/fastblocks.py: BatchNorm folded, channels-last
    convolutions and inputs). batch, threads or repeats < 1 raise ValueError."""
    if batch < 1 or repeats < 1:
        raise ValueError(f"batch and repeats must be >= 1, got {batch} and {repeats}")
    gen = torch.Generator().manual_seed(0)
    macs = block_macs(spec)
    out = []
    with torch_threads(threads), torch.random.fork_rng():  # building draws fresh weights from the global RNG
        model = build(spec).eval().requires_grad_(False)
        for i, block in enumerate(spec.blocks):
            x = torch.randn(batch, *block.in_shape, generator=gen)
            if fold and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_(True)
            grad = torch.randn(batch, *block.out_shape, generator=gen)
            module = fold_batchnorm(model.blocks[i], channels_last=True) if fold else model.blocks[i]
            seconds = _best_seconds(lambda: torch.autograd.grad(module(x), x, grad), repeats)
            out.append(BlockRate(i, block.name, 2.0 * FLOPS_PER_MAC * macs[i] * batch, seconds))
    return out


# --- report lines -----------------------------------------------------------------------------


def floor_lines(
    per_candidate: Mapping[str, tuple[float, float]],
    flops: Mapping[str, float],
    rate: float,
    threads: int = 1,
    own_rate: Mapping[str, float] | None = None,
) -> list[str]:
    """The floor's inputs in one line, then `NAME per candidate / floor: R.RRx` per strategy.

    per_candidate: strategy → (measured seconds per candidate, floor seconds per candidate); flops: strategy →
    FLOPs per candidate (the floor's numerator); rate: machine_rate's FLOP/s. own_rate: strategy → seconds per
    candidate with each block at its own measured rate (block_rates); each adds `NAME per candidate / blocks' own
    rates: R.RRx (S.SSS s)`. A strategy whose measured seconds are not finite (no candidate trained) gets
    `NAME per candidate / floor: n/a`. A floor that is not positive and finite, or a non-positive rate, raises
    ValueError.
    """
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"machine rate must be positive and finite, got {rate}")
    bad = {n: f for n, (_, f) in per_candidate.items() if not (math.isfinite(f) and f > 0)}
    if bad:
        raise ValueError(f"floor seconds per candidate must be positive and finite, got {bad}")
    parts = [
        f"{name} {flops[name] / 1e9:.1f} GFLOP, floor {floor:.3f} s vs {seconds:.3f} s"
        for name, (seconds, floor) in per_candidate.items()
    ]
    thread_word = "thread" if threads == 1 else "threads"
    head = f"floor per candidate at {rate / 1e9:.1f} GFLOP/s (measured dense, {threads} torch {thread_word}): "
    lines = [head + "; ".join(parts)]
    for name, (seconds, floor) in per_candidate.items():
        ratio = f"{seconds / floor:.2f}x" if math.isfinite(seconds) else "n/a"
        lines.append(f"{name} per candidate / floor: {ratio}")
    for name, seconds in (own_rate or {}).items():
        measured = per_candidate[name][0]
        if math.isfinite(measured) and seconds > 0:
            lines.append(f"{name} per candidate / blocks' own rates: {measured / seconds:.2f}x ({seconds:.3f} s)")
    return lines


def block_rate_lines(rates: Sequence[BlockRate], peak: float) -> list[str]:
    """One line per block: index, name, GFLOP at its batch, GFLOP/s and the fraction of `peak` (machine_rate)."""
    return [
        f"  {r.index:3d} {r.name:24s} {r.flops / 1e9:8.3f} GFLOP {r.rate / 1e9:8.1f} GFLOP/s"
        f" {r.rate / peak:6.2f} of peak"
        for r in rates
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--public", type=int, default=400, help="public samples")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="batch size (the steps column, --blocks)")
    p.add_argument("--blocks", action="store_true", help="also time every block of every model")
    args = p.parse_args()
    rates = dense_rates(args.threads)
    peak = max(rates.values())
    steps = args.epochs * -(-args.public // args.batch)
    shown = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in rates.items())
    print(f"dense rates at {args.threads} torch thread(s): {shown}; floor rate {peak / 1e9:.1f} GFLOP/s")
    print(f"each model as a candidate with one stitch at block 0; {args.epochs} epochs x {args.public} public samples")
    head = f"{steps}x{args.batch} steps"
    print(f"{'model':14s} {'MMAC spec':>10s} {'floor':>8s} {head:>14s} {'exact':>8s} {'+ match':>8s}  GFLOP, floor s")
    for name in ZOOS["I"]:
        spec = create(name, (1, 28, 28), 10, DEFAULT_WIDTHS)
        full = finetune_flops(spec, (0,), args.batch, steps, args.public)
        exact = finetune_flops(spec, (0,), args.public, args.epochs, args.public)
        total = candidate_flops(spec, (0,), args.public, args.epochs)
        print(
            f"{name:14s} {spec.macs / 1e6:10.2f} {sum(block_macs(spec)) / 1e6:8.2f} {full / 1e9:14.2f}"
            f" {exact / 1e9:8.2f} {total / 1e9:8.2f}  {total / peak:.3f}"
        )
        if args.blocks:
            print("\n".join(block_rate_lines(block_rates(spec, args.batch, args.threads), peak)))


if __name__ == "__main__":
    main()
