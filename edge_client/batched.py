"""Many clients' local training as one batched computation: models of one architecture stacked and trained together
with `torch.func.functional_call` + `vmap` (the simulation's batched clients, on a CPU or a GPU).

Each client keeps everything `edge_client.training.fit` gives it: its own data, its own batch order (a generator
seeded with its seed), its own dropout masks (drawn as the eager CPU kernel draws them, from its own generator),
its own Adam state and step count, its own BatchNorm statistics, its own last-epoch losses. Clients with more data
take more steps; a step trains only the clients that have a batch at it, grouped by batch size (a client's last
batch of an epoch is short). So each model is the one `fit` trains alone, up to float rounding (the batched
kernels sum in another order; on a GPU, convolutions in float32, not TF32).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vmap

from edge_client.training import Distillation, TrainConfig, TrainStats, ce_kd_terms, check_fit_inputs

ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which `fit` uses
ADAM_EPS = 1e-8


@dataclass(frozen=True)
class FitJob:
    """One client's `fit(model, x, y, cfg, kd)`, to run together with others (edge_client.training.fit)."""

    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    cfg: TrainConfig
    kd: Distillation | None = None


def settings_key(job: FitJob) -> tuple:
    """Jobs train together only with equal keys, and models of one architecture: the same epochs, batch size and
    learning rate, and the same distillation settings (or none)."""
    kd = None if job.kd is None else (job.kd.kd_lambda, job.kd.temperature, job.kd.kd_direction)
    return job.cfg.epochs, job.cfg.batch_size, job.cfg.lr, kd


class _MaskedDropout(nn.Module):
    """nn.Dropout with its mask given (the `mask` buffer, passed to functional_call per client and step)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.register_buffer("mask", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask if self.training else x


def _template(model: nn.Module, device: torch.device, sample: torch.Tensor) -> tuple[nn.Module, list]:
    """A copy of `model` on `device` whose dropouts take their masks as buffers, and [(buffer name, p, a sample's
    shape at it)] in the order the forward pass reaches them (the order an eager pass draws its masks)."""
    template = copy.deepcopy(model).to(device)
    for name, module in list(template.named_modules()):
        if type(module) is nn.Dropout and 0 < module.p < 1:  # p 0 and 1 draw nothing: they stay as they are
            parent, _, child = name.rpartition(".")
            setattr(template.get_submodule(parent), child, _MaskedDropout(module.p))
    order: list[tuple[str, float, tuple[int, ...]]] = []
    hooks = [
        m.register_forward_pre_hook(lambda m, args, name=name: order.append((f"{name}.mask", m.p, args[0].shape[1:])))
        for name, m in template.named_modules()
        if isinstance(m, _MaskedDropout)
    ]
    with torch.no_grad():
        template.eval()(sample.to(device))
    for h in hooks:
        h.remove()
    if len({name for name, *_ in order}) != len(order):
        raise ValueError("a dropout module runs twice in one forward pass: batched training has one mask per module")
    return template.train(), order


class _Stack:
    """The jobs' parameters, buffers and Adam moments stacked along a leading client axis on the device."""

    def __init__(self, jobs: list[FitJob], device: torch.device) -> None:
        models = [dict(j.model.named_parameters()) for j in jobs]
        self.params = {n: torch.stack([m[n].detach() for m in models]).to(device).requires_grad_() for n in models[0]}
        buffers = [dict(j.model.named_buffers()) for j in jobs]
        self.buffers = {n: torch.stack([b[n] for b in buffers]).to(device) for n in buffers[0]}
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()}

    @torch.no_grad()
    def adam_step(self, rows: slice | torch.Tensor, lr: float, step: int) -> None:
        """torch.optim.Adam's step (its single-tensor arithmetic, defaults) on the given clients, their `step`-th."""
        beta1, beta2 = ADAM_BETAS
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        for n, p in self.params.items():
            grad, m, v, w = p.grad[rows], self.exp_avg[n][rows], self.exp_avg_sq[n][rows], p[rows]
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            w.addcdiv_(m, (v.sqrt() / bias_correction2_sqrt).add_(ADAM_EPS), value=-step_size)
            if isinstance(rows, torch.Tensor):  # rows gathered copies: write them back
                self.exp_avg[n][rows], self.exp_avg_sq[n][rows], p[rows] = m, v, w
        self.clear_grads()

    def clear_grads(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def write_back(self, jobs: list[FitJob]) -> None:
        """Each job's model gets its trained parameters and buffers (one copy from the device per stacked tensor)."""
        params = {n: p.detach().cpu() for n, p in self.params.items()}
        buffers = {n: b.cpu() for n, b in self.buffers.items()}
        for i, job in enumerate(jobs):
            for n, p in job.model.named_parameters():
                p.copy_(params[n][i])
            for n, b in job.model.named_buffers():
                b.copy_(buffers[n][i])


def _schedule(jobs: list[FitJob], offsets: list[int]) -> list[list[torch.Tensor]]:
    """Each client's batches in the order `fit` takes them (indices into the concatenated data): every epoch a
    permutation from a generator seeded with its seed, split into batches."""
    out = []
    for job, offset in zip(jobs, offsets):
        gen = torch.Generator().manual_seed(job.cfg.seed)
        batches = []
        for _ in range(job.cfg.epochs):
            batches += [b + offset for b in torch.randperm(len(job.x), generator=gen).split(job.cfg.batch_size)]
        out.append(batches)
    return out


def fit_together(jobs: list[FitJob], device: torch.device | str = "cpu") -> list[TrainStats | ValueError]:
    """Train every job's model in place as `fit` would alone (within float tolerance), all in one batched
    computation on `device`. Returns each job's last-epoch TrainStats, or the ValueError `fit` raises for it (no
    data, teacher logits that do not match, a loss that became non-finite, a batch its layers refuse); the others
    train all the same. The jobs must share a `settings_key` and an architecture (else ValueError)."""
    device = torch.device(device)
    errors: dict[int, ValueError] = {}
    for i, job in enumerate(jobs):
        try:
            check_fit_inputs(job.x, job.kd)
        except ValueError as e:
            errors[i] = e
    live = [j for i, j in enumerate(jobs) if i not in errors]
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions, as on the CPU (torch's default allows TF32)
    try:
        stats = iter(_train(live, device) if live else [])
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    return [errors[i] if i in errors else next(stats) for i in range(len(jobs))]


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU without waiting for it (pinned, non-blocking)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _train(jobs: list[FitJob], device: torch.device) -> list[TrainStats | ValueError]:
    """fit_together on jobs whose data and teachers were checked."""
    first, epochs = jobs[0], jobs[0].cfg.epochs
    if len({settings_key(j) for j in jobs}) != 1:
        raise ValueError("jobs trained together need the same epochs, batch size, learning rate and distillation")
    if epochs < 1:
        return [TrainStats(math.nan, math.nan, 0.0) for _ in jobs]  # as `fit`
    template, dropouts = _template(first.model, device, first.x[:1])
    stack = _Stack(jobs, device)
    sizes = [len(j.x) for j in jobs]
    schedule = _schedule(jobs, [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]])
    x, y = torch.cat([j.x for j in jobs]).to(device), torch.cat([j.y for j in jobs]).to(device)
    teacher = None if first.kd is None else torch.cat([j.kd.teacher_logits for j in jobs]).to(device)
    mask_gens = [torch.Generator().manual_seed(j.cfg.seed) for j in jobs]  # `fit` seeds the global one for dropout
    sums = torch.zeros(len(jobs), epochs, 3, dtype=torch.float64, device=device)  # per epoch: loss, CE, aux sums
    failed: dict[int, ValueError] = {}

    def client_terms(params, buffers, xb, yb, tb):
        logits = functional_call(template, (params, buffers), (xb,))
        return torch.stack(ce_kd_terms(logits, yb, tb, first.kd))

    batched_terms = vmap(client_terms, in_dims=(0, 0, 0, 0, None if teacher is None else 0), randomness="error")
    for t in range(max(len(s) for s in schedule)):
        groups: dict[int, list[int]] = {}
        for i, batches in enumerate(schedule):
            if t < len(batches) and i not in failed:
                groups.setdefault(len(batches[t]), []).append(i)
        for size, members in groups.items():
            rows = _to(torch.tensor(members), device)
            every = len(members) == len(jobs)  # then the stacked tensors themselves, not gathered copies
            idx = _to(torch.cat([schedule[i][t] for i in members]), device)
            buffers = {n: b if every else b[rows] for n, b in stack.buffers.items()}
            for name, p, shape in dropouts:  # as the eager CPU kernel: bernoulli(1 - p) / (1 - p), in forward order
                masks = [torch.empty((size, *shape)).bernoulli_(1 - p, generator=mask_gens[i]) for i in members]
                buffers[name] = _to(torch.stack(masks).div_(1 - p), device)
            shape = (len(members), size)
            try:
                terms = batched_terms(
                    {n: w if every else w[rows] for n, w in stack.params.items()},
                    buffers,
                    x[idx].view(*shape, *x.shape[1:]),
                    y[idx].view(shape),
                    None if teacher is None else teacher[idx].view(*shape, -1),
                )
                terms[:, 0].sum().backward()
            except ValueError as e:  # e.g. BatchNorm on one value per channel: these clients fail, as `fit` would
                failed |= {i: ValueError(str(e)) for i in members}
                stack.clear_grads()
                continue
            if not every:  # BatchNorm updated the gathered copies' statistics
                for n, b in stack.buffers.items():
                    b[rows] = buffers[n]
            stack.adam_step(slice(None) if every else rows, first.cfg.lr, t + 1)  # each client's (t+1)-th step
            epoch_of = _to(torch.tensor([t // (len(schedule[i]) // epochs) for i in members]), device)
            sums[rows, epoch_of] += terms.detach().double() * size
    stack.write_back(jobs)
    means = (sums / torch.tensor(sizes, dtype=torch.float64, device=device)[:, None, None]).cpu()
    return [failed.get(i) or _stats(means[i]) for i in range(len(jobs))]


def _stats(means: torch.Tensor) -> TrainStats | ValueError:
    """A client's last-epoch TrainStats from its per-epoch mean (loss, CE, aux), or `fit`'s ValueError for the first
    epoch whose loss is not finite."""
    bad = [float(loss) for loss in means[:, 0] if not math.isfinite(float(loss))]
    return ValueError(f"training diverged: loss is {bad[0]}") if bad else TrainStats(*means[-1].tolist())
