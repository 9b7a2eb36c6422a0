"""Stitch fine-tuning (pFedClub Eq. 2/3), NT-Xent, prefix sharing and teacher matching (Eq. 4)."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedge.model.layers import LayerSpec as L
from fedge.model.spec import ModelSpec, Origin, build, make_block
from fedge.model.weights import load_module
from fedge.wire.messages import Weights
from methods.reassembly.fastblocks import fast_blocks
from methods.reassembly.finetune import (
    FinetuneConfig,
    augment,
    finetune_candidates,
    finetune_stitches,
    match_score,
    module_logits,
    nt_xent,
    public_logits,
    run_blocks,
    select_teacher,
    stitch_blocks,
    train_stitch_modules,
)

pytestmark = pytest.mark.timeout(120)

IN = (1, 8, 8)
MARK = 7  # out_channels of the prefix conv: unique, so a forward hook can count the prefix's work
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _conv(out: int) -> L:
    return L("conv2d", {"out_channels": out, "kernel_size": 3, "padding": 1})


def _stitch(i: int, in_shape: tuple, out_shape: tuple):
    return make_block(f"stitch{i}", [L("stitch", {"out_shape": list(out_shape)})], in_shape, Origin("stitch", None, i))


def cand_spec(prefix_client: str = "a") -> ModelSpec:
    """prefix block (conv-BN-ReLU) | stitch | conv-BN-ReLU-pool-dropout | stitch | linear: stitches at 1, 3."""
    b0 = make_block("cov1", [_conv(MARK), L("bn2d"), L("relu")], IN, Origin("toy", prefix_client, 0))
    b2 = make_block(
        "cov2",
        [_conv(6), L("bn2d"), L("relu"), L("maxpool", {"kernel_size": 2}), L("dropout")],
        (5, 8, 8),
        Origin("toy", "b", 1),
    )
    b4 = make_block("fc", [L("linear", {"out_features": 3})], (12,), Origin("toy", "c", 3))
    return ModelSpec("cand", IN, 3, (b0, _stitch(1, (MARK, 8, 8), (5, 8, 8)), b2, _stitch(3, (6, 4, 4), (12,)), b4))


def plain_spec() -> ModelSpec:
    b0 = make_block("cov1", [_conv(4), L("bn2d"), L("relu"), L("flatten")], IN, Origin("toy", "z", 0))
    b1 = make_block("fc", [L("linear", {"out_features": 3})], (256,), Origin("toy", "z", 1))
    return ModelSpec("plain", IN, 3, (b0, b1))


def weights(spec: ModelSpec, seed: int, prefix: Weights | None = None) -> Weights:
    """Random weights with non-trivial BN running stats; blocks.0.* copied from `prefix` when given."""
    torch.manual_seed(seed)
    module = build(spec)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if prefix is not None:
        state.update({k: v.clone() for k, v in prefix.state.items() if k.startswith("blocks.0.")})
    return Weights(spec, state)


def public(n: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *IN, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def equal_states(a: Weights, b: Weights, blocks: set[int] | None = None) -> bool:
    keys = [k for k in a.state if blocks is None or int(k.split(".")[1]) in blocks]
    return all(torch.equal(a.state[k], b.state[k]) for k in keys)


# --- NT-Xent (Eq. 3) --------------------------------------------------------------------------


def test_nt_xent_of_orthonormal_views_is_the_hand_value():
    e = torch.eye(2)
    # anchor e1: positive cos 1, negatives e2 (cos 0) twice  ->  -log(e / (e + 2)) for all four anchors
    assert float(nt_xent(e, e.clone(), tau=1.0)) == pytest.approx(math.log(1 + 2 / math.e), abs=1e-6)


def test_nt_xent_matches_eq3_computed_by_hand():
    z1 = torch.tensor([[1.0, 2.0], [0.5, -1.0], [-2.0, 0.3]])
    z2 = torch.tensor([[0.9, 2.2], [1.0, -0.2], [-1.0, -1.0]])
    tau = 0.5
    z = [list(map(float, r)) for r in torch.cat([z1, z2])]

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    n, total = 3, 0.0
    for i in range(2 * n):
        j = (i + n) % (2 * n)
        denominator = sum(math.exp(cos(z[i], z[k]) / tau) for k in range(2 * n) if k != i)
        total += -math.log(math.exp(cos(z[i], z[j]) / tau) / denominator)
    assert float(nt_xent(z1, z2, tau)) == pytest.approx(total / (2 * n), rel=1e-5)


def test_nt_xent_is_lower_for_aligned_views_than_for_random_ones():
    gen = torch.Generator().manual_seed(1)
    z1 = torch.randn(16, 8, generator=gen)
    aligned = z1 + 0.05 * torch.randn(16, 8, generator=gen)
    unrelated = torch.randn(16, 8, generator=gen)
    assert float(nt_xent(z1, aligned, 0.07)) < float(nt_xent(z1, unrelated, 0.07)) - 1.0


def test_nt_xent_rejects_mismatched_views_and_bad_tau():
    with pytest.raises(ValueError, match="equal"):
        nt_xent(torch.ones(3, 2), torch.ones(2, 2), 0.07)
    with pytest.raises(ValueError, match="tau"):
        nt_xent(torch.ones(3, 2), torch.ones(3, 2), 0.0)


# --- augmentation -----------------------------------------------------------------------------


def test_augment_is_a_replicate_padded_shift_and_deterministic_by_generator():
    x = torch.arange(2 * 1 * 5 * 5, dtype=torch.float32).reshape(2, 1, 5, 5)
    view = augment(x, torch.Generator().manual_seed(3), pad=1, noise_std=0.0)
    padded = F.pad(x, (1, 1, 1, 1), mode="replicate")
    for n in range(2):
        shifts = [padded[n, :, dy : dy + 5, dx : dx + 5] for dy in range(3) for dx in range(3)]
        assert any(torch.equal(view[n], s) for s in shifts)
    again = augment(x, torch.Generator().manual_seed(3), pad=1, noise_std=0.0)
    assert torch.equal(view, again)
    noisy = augment(x, torch.Generator().manual_seed(3), pad=0, noise_std=0.1)
    assert noisy.shape == x.shape and 0 < float((noisy - x).std()) < 0.2


# --- fine-tuning (Eq. 2 / Eq. 3) --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("labeled", [True, False])
def test_only_stitches_change_and_frozen_blocks_stay_bit_identical(labeled, device):
    cand = weights(cand_spec(), seed=1)
    x, y = public()
    cfg = FinetuneConfig(epochs=2, batch_size=16, labeled=labeled, lr=1e-2)
    tuned = finetune_stitches(cand, (1, 3), x, y if labeled else None, cfg, device)
    assert tuned.spec == cand.spec
    assert all(v.device.type == "cpu" for v in tuned.state.values())
    assert equal_states(tuned, cand, {0, 2, 4})  # weights, BN running stats, num_batches_tracked
    for k in [k for k in cand.state if k.split(".")[1] in ("1", "3")]:
        assert not torch.equal(tuned.state[k], cand.state[k]), k


def test_unlabeled_path_trains_without_labels_and_labeled_path_needs_them():
    cand = weights(cand_spec(), seed=1)
    x, _ = public()
    tuned = finetune_stitches(cand, (1, 3), x, None, FinetuneConfig(labeled=False, epochs=1))
    assert not torch.equal(tuned.state["blocks.1.0.proj.weight"], cand.state["blocks.1.0.proj.weight"])
    with pytest.raises(ValueError, match="y_public"):
        finetune_stitches(cand, (1, 3), x, None, FinetuneConfig(labeled=True))


def test_labeled_finetuning_fits_learnable_public_labels():
    cand = weights(cand_spec(), seed=2)
    x, y = public(64)
    x = x + 3.0 * F.one_hot(y, 8).float()[:, None, :, None]  # class c brightens image row c

    def ce(w: Weights) -> float:
        return float(F.cross_entropy(public_logits([w], x)[0], y))

    tuned = finetune_stitches(cand, (1, 3), x, y, FinetuneConfig(epochs=25, lr=3e-2, batch_size=16))
    assert ce(cand) > 1.0 and ce(tuned) < 0.3


def test_the_step_floor_is_reached_with_smaller_batches_first_then_more_passes():
    assert FinetuneConfig(epochs=3).schedule(4800) == (64, 225)  # the paper's public set: the floor is its own steps
    assert FinetuneConfig(epochs=3, min_steps=225).schedule(4800) == (64, 225)
    assert FinetuneConfig(epochs=3, min_steps=225).schedule(10_000) == (64, 3 * 157)  # more data: more steps
    assert FinetuneConfig(epochs=3, min_steps=225).schedule(400) == (8, 225)  # 21 steps at 64 -> 225 at the floor
    assert FinetuneConfig(epochs=3, min_steps=100).schedule(400) == (12, 100)
    assert FinetuneConfig(epochs=1, min_steps=0).schedule(40) == (40, 1)
    with pytest.raises(ValueError, match="min_batch"):
        FinetuneConfig(min_batch=0)


def test_a_stitch_at_a_shape_changing_seam_learns_with_the_step_floor_and_stays_random_without():
    # The seams of cand_spec change shapes (7x8x8 -> 5x8x8, 6x4x4 -> 12). On a learnable task with the paper's
    # protocol on a 40-sample public set (3 epochs at batch 64 = 3 steps, Adam lr 1e-3) the loss barely moves
    # (1.18 -> 1.14); at the floor of 225 steps it falls (-> 0.94). The record is the steps and the last pass's loss.
    cand = weights(cand_spec(), seed=3)
    x, y = public(40)
    x = x + 3.0 * F.one_hot(y, 8).float()[:, None, :, None]

    def ce(w: Weights) -> float:
        return float(F.cross_entropy(public_logits([w], x)[0], y))

    epochs_only, floor = (
        finetune_candidates([(cand, (1, 3))], x, y, FinetuneConfig(epochs=3, min_steps=m))[0] for m in (0, 225)
    )
    assert (epochs_only.steps, floor.steps) == (3, 225)
    assert ce(epochs_only.weights) > ce(cand) - 0.1
    assert ce(floor.weights) < ce(epochs_only.weights) - 0.15 and floor.loss < epochs_only.loss - 0.15


def test_candidate_without_stitches_comes_back_identical():
    plain = weights(plain_spec(), seed=3)
    x, y = public()
    assert stitch_blocks(plain.spec) == ()
    assert finetune_stitches(plain, (), x, y) is plain
    cand = weights(cand_spec(), seed=1)
    out = finetune_candidates([(plain, ()), (cand, (1, 3))], x, y, FinetuneConfig(epochs=1))
    assert out[0].weights is plain and out[0].steps == 0 and out[0].loss is None
    assert out[1].weights.spec == cand.spec and out[1].steps == 1 and out[1].loss > 0


def test_bad_inputs_raise_value_error():
    cand = weights(cand_spec(), seed=1)
    x, y = public()
    with pytest.raises(ValueError, match="out of range"):
        finetune_stitches(cand, (1, 9), x, y)
    with pytest.raises(ValueError, match="public data"):
        finetune_stitches(cand, (1, 3), torch.zeros(4, 3, 8, 8), y[:4])
    with pytest.raises(ValueError, match="labels"):
        finetune_stitches(cand, (1, 3), x, y + 3)
    with pytest.raises(ValueError):
        FinetuneConfig(tau=0.0)


# --- shared prefixes --------------------------------------------------------------------------


def count_prefix_samples(fn):
    """Run fn() and count the samples that went through the prefix conv (out_channels == MARK)."""
    seen = [0]

    def hook(module, args, output):
        if isinstance(module, nn.Conv2d) and module.out_channels == MARK:
            seen[0] += args[0].shape[0]

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        result = fn()
    finally:
        handle.remove()
    return seen[0], result


@pytest.mark.parametrize("labeled", [True, False])
def test_shared_prefix_runs_once_not_once_per_candidate(labeled):
    x, y = public(40)
    first = weights(cand_spec(), seed=10)
    cands = [first] + [weights(cand_spec(), seed=10 + i, prefix=first) for i in range(1, 5)]
    cfg = FinetuneConfig(epochs=3, batch_size=16, labeled=labeled)
    n, runs = count_prefix_samples(lambda: finetune_candidates([(c, (1, 3)) for c in cands], x, y, cfg))
    tuned = [r.weights for r in runs]
    # labeled: one cached pass over the public set; unlabeled: both views of every batch, once per epoch.
    # Without sharing it would be 5 candidates × 3 epochs × 40 (× 2 views) samples.
    assert n == (40 if labeled else 3 * 2 * 40)
    alone = [finetune_stitches(c, (1, 3), x, y, cfg) for c in cands]
    assert all(equal_states(a, b) for a, b in zip(tuned, alone))  # sharing changes no result


def test_prefixes_of_different_origin_or_weights_are_not_shared():
    x, y = public(40)
    a = weights(cand_spec("a"), seed=20)
    other_client = weights(cand_spec("q"), seed=21)
    same_origin_other_weights = weights(cand_spec("a"), seed=22)
    cfg = FinetuneConfig(epochs=2, batch_size=16)
    items = [(a, (1, 3)), (other_client, (1, 3)), (same_origin_other_weights, (1, 3))]
    n, runs = count_prefix_samples(lambda: finetune_candidates(items, x, y, cfg))
    tuned = [r.weights for r in runs]
    assert n == 3 * 40
    assert all(equal_states(t, finetune_stitches(c, s, x, y, cfg)) for t, (c, s) in zip(tuned, items))


def test_finetuning_is_deterministic_given_the_seed():
    cand = weights(cand_spec(), seed=1)
    x, _ = public()
    runs = [
        finetune_stitches(cand, (1, 3), x, None, FinetuneConfig(labeled=False, epochs=1, seed=s)) for s in (5, 5, 6)
    ]
    assert equal_states(runs[0], runs[1])
    assert not equal_states(runs[0], runs[2])


def shared_candidates(n: int, batch_stats: bool = False) -> list:
    """n candidates (cand_spec, stitches at 1 and 3) as FastBlocks over ONE set of frozen block modules (blocks 0, 2
    and 4 are the same objects, as pFedClub's pool blocks are), each with its own stitches. batch_stats: block 2's
    BatchNorm has no running statistics, so eval mode normalises it by the batch's."""
    frozen = weights(cand_spec(), seed=30)
    out = []
    for i in range(n):
        module = load_module(cand_spec(), weights(cand_spec(), seed=30 + i, prefix=frozen).state)
        if batch_stats:
            bn = module.blocks[2][1]
            bn.running_mean = bn.running_var = None
        fb = fast_blocks(module, (1, 3))
        for j in (0, 2, 4):
            fb.blocks[j] = out[0].blocks[j] if out else fb.blocks[j]
        out.append(fb.train())
    return out


def calls_of(module: nn.Module) -> list[int]:
    """The batch sizes `module` is called with, from now on (a forward hook)."""
    sizes: list[int] = []
    module.register_forward_hook(lambda m, args, out: sizes.append(len(args[0])))
    return sizes


@pytest.mark.parametrize("labeled", [True, False])
def test_lockstep_runs_a_shared_frozen_block_once_and_trains_bit_for_bit_as_one_after_another(labeled):
    # The Zoo I CNNs' kind of block (conv-BN-ReLU-pool, folded, channels-last): oneDNN's kernels give each sample
    # the same bits at any batch size, so lockstep is exact here; MobileNets' are not (test_pfedclub.py).
    x, y = public(40)
    cfg = FinetuneConfig(epochs=2, batch_size=16, labeled=labeled)
    runs = {}
    for lockstep in (False, True):
        cands = shared_candidates(3)
        sizes = calls_of(cands[0].blocks[2])
        tuned = train_stitch_modules(
            cands, [(1, 3)] * 3, x, y, FinetuneConfig(**{**cfg.__dict__, "lockstep": lockstep})
        )
        logits = module_logits(cands, [1] * 3, x, lockstep)
        stitches = [{k: v.clone() for b in (1, 3) for k, v in c.blocks[b].state_dict().items()} for c in cands]
        runs[lockstep] = (tuned, logits, stitches, sizes)
    (plain, plain_logits, plain_stitches, one_by_one), (step, step_logits, step_stitches, together) = runs.values()
    per_batch = 16 if labeled else 32  # two views per sample unlabeled
    assert one_by_one[:3] == [per_batch] * 3 and together[0] == 3 * per_batch  # once for all three candidates
    assert len(together) * 3 == len(one_by_one)
    assert step == plain and all(torch.equal(a, b) for a, b in zip(step_logits, plain_logits))
    for a, b in zip(step_stitches, plain_stitches):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(plain_stitches[0]["0.proj.weight"], plain_stitches[1]["0.proj.weight"])


def test_lockstep_never_concatenates_through_batch_statistics():
    # A BatchNorm without running statistics normalises by the batch: concatenating candidates would mix them.
    cands = shared_candidates(2, batch_stats=True)
    sizes = calls_of(cands[0].blocks[2])
    with torch.no_grad():
        together = run_blocks(cands, 2, torch.randn(8, 5, 8, 8), lockstep=True)
        apart = run_blocks(cands, 2, torch.randn(8, 5, 8, 8), lockstep=False)
    assert sizes == [8, 8, 8, 8] and len(together) == len(apart) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("labeled", [True, False])
def test_cuda_and_cpu_agree_up_to_float_tolerance(labeled):
    cand = weights(cand_spec(), seed=1)
    x, y = public()
    cfg = FinetuneConfig(epochs=2, batch_size=16, labeled=labeled)
    cpu = finetune_stitches(cand, (1, 3), x, y, cfg, "cpu")
    gpu = finetune_stitches(cand, (1, 3), x, y, cfg, "cuda")
    assert all(torch.allclose(cpu.state[k], gpu.state[k], atol=1e-4) for k in cpu.state)


# --- matching (Eq. 4) -------------------------------------------------------------------------


def test_match_score_hand_values():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert match_score(a, a.clone()) == pytest.approx(1.0)
    assert match_score(a, -a) == pytest.approx(-1.0)
    b = torch.tensor([[1.0, 1.0], [0.0, 5.0]])  # cos = 1/√2 and 1
    assert match_score(a, b) == pytest.approx((1 / math.sqrt(2) + 1) / 2)
    with pytest.raises(ValueError, match="equal"):
        match_score(a, a[:1])


def test_public_logits_share_prefixes_and_equal_a_plain_forward():
    x, _ = public(30)
    first = weights(cand_spec(), seed=30)
    models = [first, weights(cand_spec(), seed=31, prefix=first), weights(plain_spec(), seed=32)]
    n, logits = count_prefix_samples(lambda: public_logits(models, x))
    assert n == 30
    for w, got in zip(models, logits):
        module = build(w.spec)
        module.load_state_dict(w.state)
        with torch.no_grad():
            assert torch.allclose(got, module.eval()(x), atol=1e-6)


def test_select_teacher_picks_the_planted_best_and_breaks_ties_low():
    x, _ = public(50)
    client = weights(plain_spec(), seed=40)
    others = [weights(cand_spec(), seed=41), weights(plain_spec(), seed=42)]
    copy = Weights(client.spec, {k: v.clone() for k, v in client.state.items()})
    best, scores = select_teacher(client, [others[0], others[1], copy], x)
    assert best == 2 and len(scores) == 3
    assert scores[2] == pytest.approx(1.0) and max(scores[:2]) < 0.99
    best, _ = select_teacher(client, [others[0], copy, copy], x)
    assert best == 1
    with pytest.raises(ValueError):
        select_teacher(client, [], x)
