"""Fine-tuning on public data (stitches of reassembled candidates, pFedClub §3.2.3; whole client copies, pFedHR
§3.1.3) and teacher matching (Eq. (4))."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from fedge import constants as C
from fedge.model.spec import Device, ModelSpec, SpecModel
from fedge.model.weights import load_module
from fedge.wire.messages import Weights
from methods.reassembly.fastblocks import FastBlocks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneConfig:
    """Stitch fine-tuning settings.

    epochs 3 and Adam lr 1e-3: pFedClub §4.1 / pFedHR §4.1 and the authors' `--sfine`; τ = 0.07: pFedClub
    §4.1; batch 64 (the authors used 8). `labeled` picks Eq. (2) (CE) or Eq. (3) (NT-Xent on two views).
    `crop_pad` and `noise_std` define the views of `augment` (no paper value: ours). `min_steps` is a floor on
    optimiser steps (`schedule`), reached with batches down to `min_batch`. `lockstep`: candidates step together
    and a frozen block several of them hold at one depth runs once on their inputs concatenated (`run_blocks`).
    Invalid values raise ValueError.
    """

    epochs: int = C.FINETUNE_EPOCHS
    lr: float = C.DEFAULT_LR
    batch_size: int = C.FINETUNE_BATCH_SIZE
    tau: float = C.NT_XENT_TAU
    labeled: bool = True
    seed: int = 0
    crop_pad: int = C.AUGMENT_CROP_PAD
    noise_std: float = C.AUGMENT_NOISE_STD
    min_steps: int = 0
    min_batch: int = C.FINETUNE_MIN_BATCH_SIZE
    lockstep: bool = False

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.batch_size < 1 or self.crop_pad < 0 or self.min_steps < 0:
            raise ValueError(f"epochs >= 0, batch_size >= 1, crop_pad >= 0 and min_steps >= 0 are required, got {self}")
        if not 1 <= self.min_batch <= self.batch_size:
            raise ValueError(f"1 <= min_batch <= batch_size is required, got {self}")
        if not (self.lr > 0 and self.tau > 0 and self.noise_std >= 0):
            raise ValueError(f"lr > 0, tau > 0 and noise_std >= 0 are required, got {self}")

    def schedule(self, n: int) -> tuple[int, int]:
        """(batch size, optimiser steps) over n public samples: `epochs` passes at `batch_size` when that makes at
        least `min_steps` steps; otherwise exactly min_steps steps, at the batch that spreads epochs x n samples
        over them (not below min_batch, not above batch_size), so a small public set buys steps with smaller
        batches before it buys them with more samples. Passes continue past `epochs` until the steps are done."""
        batch = min(self.batch_size, n)
        steps = self.epochs * -(-n // batch)
        if steps >= self.min_steps or self.epochs == 0:
            return batch, steps
        return min(batch, max(self.min_batch, self.epochs * n // self.min_steps)), self.min_steps


@dataclass(frozen=True)
class Tuned:
    """A fine-tuned model, the optimiser steps it took and its mean loss over the last pass of them (the last
    ⌈N / batch⌉ steps; None when it took none)."""

    weights: Weights
    steps: int
    loss: float | None


def batches(n: int, batch: int, steps: int, gen: torch.Generator, equal: bool = False) -> Iterator[torch.Tensor]:
    """`steps` batches of sample indices: successive random permutations of range(n) (from `gen`), each cut into
    batches of `batch` (the last of a pass shorter) or, `equal`, into ⌈n / batch⌉ near-equal ones (no one-sample
    tail for BatchNorm)."""
    done = 0
    while done < steps:
        perm = torch.randperm(n, generator=gen)
        for idx in perm.tensor_split(-(-n // batch)) if equal else perm.split(batch):
            if done == steps:
                return
            done += 1
            yield idx


def _last_pass_mean(losses: Sequence[torch.Tensor], per_pass: int) -> float | None:
    tail = losses[-per_pass:]
    return float(torch.stack(tail).mean()) if tail else None


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float) -> torch.Tensor:
    """NT-Xent of pFedClub Eq. (3) (SimCLR), averaged over all 2N anchors.

    Row i of z1 and row i of z2 are two views of one sample. Over the 2N×2N cosine similarities / τ,
    each anchor's positive is its other view ((i, i+N) and (i+N, i)) and its self-similarity is excluded
    from the denominator. Shapes must be equal and (N, D), N ≥ 1, τ > 0, else ValueError.
    """
    if z1.shape != z2.shape or z1.dim() != 2 or len(z1) == 0:
        raise ValueError(f"nt_xent needs two equal (N, D) batches, got {list(z1.shape)} and {list(z2.shape)}")
    if not tau > 0:
        raise ValueError(f"nt_xent needs tau > 0, got {tau}")
    n = len(z1)
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = (z @ z.T) / tau
    self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(self_mask, -math.inf)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def augment(x: torch.Tensor, gen: torch.Generator, pad: int, noise_std: float) -> torch.Tensor:
    """One random view per sample for Eq. (3): a random crop of the edge-padded image, plus Gaussian noise.

    For (N, C, H, W) input: pad by `pad` pixels replicating the border (so a digit's background stays
    background), cut a random H×W window (a shift of up to ±pad pixels), then add N(0, noise_std²) noise
    (inputs are normalised, so the noise is in units of the per-channel std). No flips: digits and text
    are not mirror-symmetric. Other inputs get the noise only. All random numbers are drawn on the CPU
    from `gen`, so CPU and CUDA runs see the same views.
    """
    out = x
    if x.dim() == 4 and pad > 0:
        n, c, h, w = x.shape
        dev = x.device
        oy = torch.randint(0, 2 * pad + 1, (n,), generator=gen).to(dev)
        ox = torch.randint(0, 2 * pad + 1, (n,), generator=gen).to(dev)
        padded = F.pad(x, (pad, pad, pad, pad), mode="replicate")
        rows = (oy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
        cols = (ox[:, None] + torch.arange(w, device=dev))[:, None, None, :]
        out = padded[
            torch.arange(n, device=dev)[:, None, None, None],
            torch.arange(c, device=dev)[None, :, None, None],
            rows,
            cols,
        ]
    if noise_std > 0:
        out = out + noise_std * torch.randn(x.shape, generator=gen).to(x.device)
    return out


def stitch_blocks(spec: ModelSpec) -> tuple[int, ...]:
    """Indices of the blocks that hold a `stitch` layer (the only trainable ones of a candidate)."""
    return tuple(i for i, b in enumerate(spec.blocks) if any(ly.type == "stitch" for ly in b.layers))


# --- shared frozen prefixes -------------------------------------------------------------------


def _prefix_key(weights: Weights, n: int) -> tuple[tuple[str, str | None, int], ...]:
    return tuple((b.origin.model, b.origin.client, b.origin.block) for b in weights.spec.blocks[:n])


def _same_prefix(a: Weights, b: Weights, n: int) -> bool:
    """Equal block specs and bit-equal tensors for blocks 0..n-1 (origins alone are not trusted)."""
    if a.spec.blocks[:n] != b.spec.blocks[:n]:
        return False
    keys = [k for k in a.state if int(k.split(".")[1]) < n]
    return all(torch.equal(a.state[k], b.state[k]) for k in keys)


def _group_by_prefix(models: Sequence[Weights], lengths: Sequence[int]) -> list[list[int]]:
    """Indices of models grouped by identical frozen prefix (same origins, then verified bit-equal)."""
    groups: dict[tuple, list[list[int]]] = {}
    for i, (w, n) in enumerate(zip(models, lengths)):
        bucket = groups.setdefault(_prefix_key(w, n), [])
        for group in bucket:
            if _same_prefix(models[group[0]], w, n):
                group.append(i)
                break
        else:
            bucket.append([i])
    return [g for bucket in groups.values() for g in bucket]


def _run(module: nn.Module, lo: int, hi: int, x: torch.Tensor) -> torch.Tensor:
    for i in range(lo, hi):
        x = module.run_block(i, x)
    return x


def _per_sample(block: nn.Module) -> bool:
    """Whether a frozen block computes each sample on its own: no parameter to train and no BatchNorm that normalises
    by the batch's statistics (train mode, or no running statistics)."""
    return not any(p.requires_grad for p in block.parameters()) and not any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)
        for m in block.modules()
    )


def run_blocks(modules: Sequence[nn.Module], start: int, x: torch.Tensor, lockstep: bool) -> list[torch.Tensor]:
    """Each module's blocks start..end on x (modules with `run_block`).

    lockstep: depth by depth, a frozen block that several candidates (FastBlocks) hold as one module object runs
    once on their inputs concatenated along the batch, then its output is split back (the GPU path: fewer, larger
    kernel launches). Each sample meets the same operations, but a kernel may pick another algorithm for another
    batch size: on CPU (oneDNN) convolutions of the Zoo I CNNs give bit-equal results, MobileNets' depthwise and
    1x1 convolutions differ in the last bits (tests/unit/server/test_finetune.py).
    """
    if not lockstep:
        return [_run(m, start, len(m.blocks), x) for m in modules]
    xs = [x] * len(modules)
    depth = start
    live = [i for i, m in enumerate(modules) if depth < len(m.blocks)]
    while live:
        holders: dict[int, list[int]] = {}
        for i in live:
            holders.setdefault(id(modules[i].blocks[depth]), []).append(i)
        for group in holders.values():
            block = modules[group[0]].blocks[depth]
            if len(group) == 1 or not all(isinstance(modules[i], FastBlocks) for i in group) or not _per_sample(block):
                for i in group:
                    xs[i] = modules[i].run_block(depth, xs[i])
                continue
            ins = [modules[i].block_input(depth, xs[i]) for i in group]
            outs = block(torch.cat(ins)).split([len(t) for t in ins])
            for i, y in zip(group, outs):
                xs[i] = modules[i].block_output(depth, y)
        depth += 1
        live = [i for i in live if depth < len(modules[i].blocks)]
    return xs


@torch.no_grad()
def _prefix_outputs(module: nn.Module, n: int, x: torch.Tensor) -> torch.Tensor:
    """Blocks 0..n-1 (frozen, eval mode) on all of x, in evaluation batches."""
    return torch.cat([_run(module, 0, n, xb) for xb in x.split(C.EVAL_BATCH_SIZE)])


# --- fine-tuning (Eq. 2 / Eq. 3) --------------------------------------------------------------


def _frozen_module(weights: Weights, trainable: Sequence[int], device: Device) -> SpecModel:
    """The candidate on `device`: every block outside `trainable` frozen (no grad) and in eval mode."""
    module = load_module(weights.spec, weights.state, device).eval()
    for i, block in enumerate(module.blocks):
        block.requires_grad_(i in trainable)
        if i in trainable:
            block.train()
    return module


def _check_trainable(weights: Weights, trainable: Sequence[int]) -> tuple[int, ...]:
    blocks = tuple(sorted(set(trainable)))
    if any(not 0 <= i < len(weights.spec.blocks) for i in blocks):
        raise ValueError(
            f"candidate {weights.spec.name!r} has {len(weights.spec.blocks)} blocks; "
            f"trainable block indices {list(trainable)} are out of range"
        )
    return blocks


def _check_public(spec: ModelSpec, x: torch.Tensor, y: torch.Tensor | None, cfg: FinetuneConfig) -> None:
    if len(x) == 0 or tuple(x.shape[1:]) != tuple(spec.input_shape):
        raise ValueError(f"public data must be (N >= 1, *{list(spec.input_shape)}), got {list(x.shape)}")
    if cfg.labeled:
        if y is None or y.shape != (len(x),):
            raise ValueError(
                "labeled fine-tuning (Eq. 2) needs y_public of shape (N,); pass labeled=False "
                "for unlabeled public data (Eq. 3)"
            )
        if int(y.min()) < 0 or int(y.max()) >= spec.num_classes:
            raise ValueError(f"public labels must lie in [0, {spec.num_classes}), got [{int(y.min())}, {int(y.max())}]")


def _loss(module: nn.Module, out: torch.Tensor, target: torch.Tensor | None, cfg: FinetuneConfig) -> torch.Tensor:
    """A candidate's loss on one batch: CE on the labels (Eq. 2) or NT-Xent on its two views' logits (Eq. 3);
    a non-finite one raises ValueError (the candidate diverged)."""
    loss = F.cross_entropy(out, target) if target is not None else nt_xent(*out.chunk(2), cfg.tau)
    if not torch.isfinite(loss):
        raise ValueError(f"fine-tuning candidate {module.spec.name!r} diverged: loss is {float(loss)}")
    return loss


def _train_group(
    modules: list[nn.Module], start: int, x: torch.Tensor, y: torch.Tensor | None, cfg: FinetuneConfig
) -> tuple[int, list[float | None]]:
    """Train the stitches of candidates sharing frozen blocks 0..start-1, on the same batches; returns
    the steps taken and each candidate's mean loss over the last pass. cfg.lockstep: one forward of all of them
    (`run_blocks`), one backward of their losses, then each one's Adam step; otherwise one after another.

    Labeled (Eq. 2): the shared prefix runs once over the whole public set and its outputs are cached for
    all epochs and candidates. Unlabeled (Eq. 3): each batch's two views go through the prefix once for
    the whole group. Candidate results do not depend on the group: batches and views come from cfg.seed,
    and the global RNG is never used (frozen blocks are in eval mode; stitches have no dropout).
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    base = modules[0]
    cache = _prefix_outputs(base, start, x) if cfg.labeled else None
    opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=cfg.lr) for m in modules]
    batch, steps = cfg.schedule(len(x))
    losses: list[list[torch.Tensor]] = [[] for _ in modules]
    for idx in batches(len(x), batch, steps, gen):
        idx = idx.to(x.device)
        if cache is not None:
            feats = cache[idx]
        else:
            views = torch.cat([augment(x[idx], gen, cfg.crop_pad, cfg.noise_std) for _ in range(2)])
            with torch.no_grad():
                feats = _run(base, 0, start, views)
        target = y[idx] if cache is not None else None
        if cfg.lockstep:
            step = [_loss(m, out, target, cfg) for m, out in zip(modules, run_blocks(modules, start, feats, True))]
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            torch.autograd.backward(step)
            for opt in opts:
                opt.step()
        else:
            step = []
            for module, opt in zip(modules, opts):
                opt.zero_grad(set_to_none=True)
                step.append(_loss(module, _run(module, start, len(module.blocks), feats), target, cfg))
                step[-1].backward()
                opt.step()
        for seen, loss in zip(losses, step):
            seen.append(loss.detach())
    per_pass = -(-len(x) // batch)
    return steps, [_last_pass_mean(seen, per_pass) for seen in losses]


def _shared_prefix_groups(modules: Sequence[nn.Module], starts: Sequence[int]) -> list[list[int]]:
    """Indices of modules whose blocks 0..start-1 are the same module objects (so that prefix runs once)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (module, n) in enumerate(zip(modules, starts)):
        groups.setdefault((n, *(id(b) for b in module.blocks[:n])), []).append(i)
    return list(groups.values())


def _share_prefixes(models: Sequence[Weights], modules: Sequence[SpecModel], starts: Sequence[int]) -> None:
    """Make modules whose prefixes are equal (same origins, verified bit-equal) use one set of prefix block modules."""
    for group in _group_by_prefix(models, starts):
        base = modules[group[0]]
        for i in group[1:]:
            for j in range(starts[i]):
                modules[i].blocks[j] = base.blocks[j]


def train_stitch_modules(
    modules: Sequence[nn.Module],
    trainable: Sequence[tuple[int, ...]],
    x: torch.Tensor,
    y: torch.Tensor | None,
    cfg: FinetuneConfig,
) -> list[tuple[int, float | None]]:
    """Train the trainable (stitch) blocks of candidates given as modules with `run_block`, every other block frozen
    in eval mode; candidates whose blocks before their first stitch are the same module objects train in lockstep
    (`_train_group`). Returns each one's (steps, last-pass loss); (0, None) without a trainable block. x and y
    must be on the modules' device. Public data that do not fit a candidate, or missing or out-of-range labels
    when cfg.labeled, raise ValueError before any training."""
    out: list[tuple[int, float | None]] = [(0, None)] * len(modules)
    todo = [i for i, t in enumerate(trainable) if t]
    for i in todo:
        _check_public(modules[i].spec, x, y, cfg)
    for group in _shared_prefix_groups([modules[i] for i in todo], [trainable[i][0] for i in todo]):
        members = [todo[g] for g in group]
        t0 = time.perf_counter()
        steps, losses = _train_group([modules[i] for i in members], trainable[members[0]][0], x, y, cfg)
        for i, loss in zip(members, losses):
            out[i] = (steps, loss)
        log.debug(
            "fine-tuned %d candidates sharing %d prefix blocks, %d steps, in %.3fs",
            len(members),
            trainable[members[0]][0],
            steps,
            time.perf_counter() - t0,
        )
    return out


def finetune_candidates(
    candidates: Sequence[tuple[Weights, tuple[int, ...]]],
    x_public: torch.Tensor,
    y_public: torch.Tensor | None,
    cfg: FinetuneConfig = FinetuneConfig(),
    device: Device = "cpu",
) -> list[Tuned]:
    """Fine-tune the stitch blocks of many candidates (pFedClub Eq. (2) labeled / Eq. (3) unlabeled).

    Each item is (candidate, its trainable stitch block indices); every other block stays frozen and
    bit-identical. Candidates whose blocks before the first stitch have the same origins (and, checked,
    equal weights) are trained together so that prefix is computed once (see _train_group). Candidates
    without stitches come back unchanged (the same object, 0 steps). Returns new Weights on the CPU with their
    steps and final loss, in input order. Raises ValueError on out-of-range indices, public data that do not fit
    a candidate, missing or out-of-range labels when cfg.labeled, or divergence; WeightsError when a state does
    not match its spec.
    """
    trainable = [_check_trainable(w, t) for w, t in candidates]
    todo = [i for i, t in enumerate(trainable) if t]
    x = x_public.to(device)
    y = y_public.to(device) if cfg.labeled and y_public is not None else None
    modules = [_frozen_module(candidates[i][0], trainable[i], device) for i in todo]
    _share_prefixes([candidates[i][0] for i in todo], modules, [trainable[i][0] for i in todo])
    runs = train_stitch_modules(modules, [trainable[i] for i in todo], x, y, cfg)
    out = [Tuned(w, 0, None) for w, _ in candidates]
    for i, module, (steps, loss) in zip(todo, modules, runs):
        state = {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}
        out[i] = Tuned(Weights(candidates[i][0].spec, state), steps, loss)
    return out


def finetune_stitches(
    candidate: Weights,
    trainable_blocks: Sequence[int],
    x_public: torch.Tensor,
    y_public: torch.Tensor | None,
    cfg: FinetuneConfig = FinetuneConfig(),
    device: Device = "cpu",
) -> Weights:
    """Fine-tune one candidate's stitches with all block weights frozen (pFedClub Eq. (2) / Eq. (3)).

    Labeled: CE on (x_public, y_public). Unlabeled (cfg.labeled False; y_public is never read): NT-Xent
    on the candidate's logits for two augmented views. No stitches → the candidate itself. Bad input
    raises as finetune_candidates does.
    """
    return finetune_candidates([(candidate, tuple(trainable_blocks))], x_public, y_public, cfg, device)[0].weights


def train_model(
    model: Weights,
    x_public: torch.Tensor,
    y_public: torch.Tensor | None,
    cfg: FinetuneConfig = FinetuneConfig(),
    device: Device = "cpu",
) -> Tuned:
    """A copy of a whole model with all parameters fine-tuned on public data, with its steps and final loss (pFedHR
    §3.1.3: the client copies before Eq. (5), and the candidates' "parameters of the stitched models").

    Adam, train mode, the steps of cfg.schedule: CE on y_public if cfg.labeled (as Eq. (2)), else NT-Xent on the
    logits of two augmented views (Eq. (3); y_public is never read). Each pass splits a cfg.seed permutation into
    near-equal batches (no one-sample tail for BatchNorm). Views and dropout come from cfg.seed with the global
    RNG forked and restored, so the copy is deterministic. `model` is never changed; the copy comes back on the
    CPU. Bad input or divergence raises as finetune_candidates does.
    """
    _check_public(model.spec, x_public, y_public, cfg)
    x = x_public.to(device)
    y = y_public.to(device) if cfg.labeled and y_public is not None else None
    gen = torch.Generator().manual_seed(cfg.seed)
    batch, steps = cfg.schedule(len(x))
    losses: list[torch.Tensor] = []
    with torch.random.fork_rng():  # building the module and dropout draw from the global generator
        torch.manual_seed(cfg.seed)
        module = load_module(model.spec, model.state, device).train()
        opt = torch.optim.Adam(module.parameters(), lr=cfg.lr)
        for idx in batches(len(x), batch, steps, gen, equal=True):
            idx = idx.to(x.device)
            if y is not None:
                loss = F.cross_entropy(module(x[idx]), y[idx])
            else:
                views = torch.cat([augment(x[idx], gen, cfg.crop_pad, cfg.noise_std) for _ in range(2)])
                loss = nt_xent(*module(views).chunk(2), cfg.tau)
            if not torch.isfinite(loss):
                raise ValueError(f"fine-tuning model {model.spec.name!r} diverged: loss is {float(loss)}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    state = {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}
    return Tuned(Weights(model.spec, state), steps, _last_pass_mean(losses, -(-len(x) // batch)))


def finetune_model(
    model: Weights,
    x_public: torch.Tensor,
    y_public: torch.Tensor | None,
    cfg: FinetuneConfig = FinetuneConfig(),
    device: Device = "cpu",
) -> Weights:
    """`train_model`'s fine-tuned copy alone (pFedHR §3.1.3, before Eq. (5))."""
    return train_model(model, x_public, y_public, cfg, device).weights


# --- matching (Eq. 4) -------------------------------------------------------------------------


def match_score(client_logits: torch.Tensor, candidate_logits: torch.Tensor) -> float:
    """pFedClub Eq. (4): the mean over public samples of cos(client logits, candidate logits).

    Both must be (N, classes) with N ≥ 1 and equal shapes (never broadcast), else ValueError.
    """
    if client_logits.shape != candidate_logits.shape or client_logits.dim() != 2 or len(client_logits) == 0:
        raise ValueError(
            f"logits must be two equal (N >= 1, classes) tensors, got "
            f"{list(client_logits.shape)} and {list(candidate_logits.shape)}"
        )
    return float(F.cosine_similarity(client_logits, candidate_logits, dim=1).mean())


@torch.no_grad()
def public_logits(models: Sequence[Weights], x_public: torch.Tensor, device: Device = "cpu") -> list[torch.Tensor]:
    """Each model's logits on x_public (eval mode, CPU result); blocks before the first stitch that several
    models share (same origins, equal weights) run once per batch. Bad weights raise WeightsError.
    """
    starts = [(stitch_blocks(w.spec) or (len(w.spec.blocks),))[0] for w in models]
    modules = [_frozen_module(w, (), device) for w in models]
    _share_prefixes(models, modules, starts)
    return module_logits(modules, starts, x_public.to(device))


@torch.no_grad()
def module_logits(
    modules: Sequence[nn.Module], starts: Sequence[int], x: torch.Tensor, lockstep: bool = False
) -> list[torch.Tensor]:
    """Each module's logits on x (CPU results), in evaluation batches; modules whose blocks 0..start-1 are the same
    objects run them once per batch, and the rest as `run_blocks` does with `lockstep`."""
    out: list[torch.Tensor | None] = [None] * len(modules)
    for group in _shared_prefix_groups(modules, starts):
        start = starts[group[0]]
        parts: list[list[torch.Tensor]] = [[] for _ in group]
        for xb in x.split(C.EVAL_BATCH_SIZE):
            feats = _run(modules[group[0]], 0, start, xb)
            for part, logits in zip(parts, run_blocks([modules[i] for i in group], start, feats, lockstep)):
                part.append(logits.cpu())
        for i, part in zip(group, parts):
            out[i] = torch.cat(part)
    return [t for t in out if t is not None]


def select_teacher(
    client: Weights, candidates: Sequence[Weights], x_public: torch.Tensor, device: Device = "cpu"
) -> tuple[int, list[float]]:
    """The candidate whose logits on x_public are most like the client model's (pFedClub Eq. (4)).

    The client model is used as uploaded (pFedClub; pFedHR's code also fine-tuned it first). Returns
    (index of the best candidate, all scores); ties go to the lowest index, a non-finite score never
    wins. No candidates, candidates whose classes differ from the client's, or no candidate with a
    finite score raise ValueError.
    """
    if not candidates:
        raise ValueError("select_teacher needs at least one candidate")
    if len(x_public) == 0:
        raise ValueError("select_teacher needs public data")
    logits = public_logits([client, *candidates], x_public, device)
    return best_match(logits[0], logits[1:])


def best_match(client_logits: torch.Tensor, candidate_logits: Sequence[torch.Tensor]) -> tuple[int, list[float]]:
    """Eq. (4) scores of every candidate's logits against the client's, and the index of the best one.

    Ties go to the lowest index; a non-finite score never wins; no finite score raises ValueError.
    """
    scores = [match_score(client_logits, c) for c in candidate_logits]
    if not any(math.isfinite(s) for s in scores):
        raise ValueError(f"no candidate gives finite logits on the public data (scores {scores})")
    best = max(range(len(scores)), key=lambda i: (scores[i] if math.isfinite(scores[i]) else -math.inf, -i))
    return best, scores
