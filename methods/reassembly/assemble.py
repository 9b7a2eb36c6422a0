"""Candidate models from pool blocks: stitches where shapes differ, sizes from specs, the pFedClub+ size filter.

A stitch is the registered `stitch` layer, ReLU(Wᵀx + b) (pFedHR §3.1.3, pFedClub §3.2.3), kept small
(a 1×1 conv between feature maps); its parameters count in ModelSpec.params, hence in |w*|. One goes at
every seam between blocks that were not consecutive in one model (pFedHR §3.1.3: "any two consecutive
layers in the candidate"), so Eq. (2) has something to train at every join; where the shapes already
match it starts as the identity (W = I, b = 0). Stitches are the only blocks trained during server
fine-tuning; `assemble` says where they are.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from device_profiles import DeviceProfile, fits, within_size_bound
from fedge.model.layers import LayerSpec, Shape, layer_type
from fedge.model.spec import BlockSpec, Device, ModelSpec, Origin, build_block, make_block
from fedge.model.weights import State, check_state
from fedge.wire.messages import Weights
from methods.reassembly.blocks import PoolBlock, model_of
from methods.reassembly.fastblocks import FastBlocks

STITCH_MODEL = "stitch"  # Origin.model of a stitch block; its Origin.client is None and block -1
Part = PoolBlock | BlockSpec


def _spec_of(part: Part) -> BlockSpec:
    """A pool block's spec with its origin naming the client and index it came from."""
    if isinstance(part, BlockSpec):
        return part
    return replace(part.spec, origin=replace(part.spec.origin, client=part.client, block=part.index))


def stitch_block(number: int, in_shape: Shape, out_shape: Shape, logits: bool = False) -> BlockSpec:
    """Block "stitch<number>": one `stitch` layer mapping in_shape to out_shape (SpecError if impossible).

    A stitch that produces the model's logits (`logits`) has no ReLU, so logits can be negative.
    """
    args: dict[str, object] = {"out_shape": list(out_shape)} | ({"relu": False} if logits else {})
    layers = [LayerSpec("stitch", args)]
    return make_block(f"stitch{number}", layers, tuple(in_shape), Origin(STITCH_MODEL, None, -1))


def consecutive(a: Origin | None, b: Origin) -> bool:
    """True when block b directly followed block a in one uploaded model (a None: b is a model's first block)."""
    if b.model == STITCH_MODEL:
        return False
    if a is None:
        return b.block == 0
    return (a.model, a.client, a.block + 1) == (b.model, b.client, b.block)


def stitched_blocks(
    blocks: Sequence[Part], input_shape: Shape, num_classes: int | None
) -> tuple[list[BlockSpec], tuple[int, ...]]:
    """`blocks` in order with their stitches, and the stitches' positions; no tensors.

    A stitch goes at every seam between blocks that were not consecutive in one uploaded model (the
    model input counts as the block before each model's first block), and wherever consecutive shapes
    differ, the last out_shape vs (num_classes,) included; nowhere else. num_classes None stops at the
    last block's output (a prefix of a candidate, as pFedClub+'s pruning sizes it). Pool blocks keep
    their spec, with origin (model, client, index). Raises SpecError for a shape no stitch can produce.
    """
    specs = [_spec_of(b) for b in blocks]
    out: list[BlockSpec] = []
    stitches: list[int] = []
    shape = tuple(input_shape)
    for j, target in enumerate([s.in_shape for s in specs] + ([] if num_classes is None else [(num_classes,)])):
        seam = j < len(specs) and not consecutive(specs[j - 1].origin if j else None, specs[j].origin)
        if shape != tuple(target) or seam:
            stitches.append(len(out))
            out.append(stitch_block(len(stitches) - 1, shape, tuple(target), logits=j == len(specs)))
        if j < len(specs):
            out.append(specs[j])
            shape = specs[j].out_shape
    return out, tuple(stitches)


def candidate_spec(
    name: str, blocks: Sequence[Part], input_shape: Shape, num_classes: int
) -> tuple[ModelSpec, tuple[int, ...]]:
    """The stitched spec of `blocks` in order (`stitched_blocks`), and the positions of its stitch blocks.

    Raises ValueError for no blocks and SpecError for a shape no stitch can produce.
    """
    if not blocks:
        raise ValueError(f"candidate {name!r} has no blocks; a candidate needs at least one")
    out, stitches = stitched_blocks(blocks, input_shape, num_classes)
    return ModelSpec(name, tuple(input_shape), num_classes, tuple(out)), stitches


def stitched_params(blocks: Sequence[Part], input_shape: Shape, num_classes: int) -> int:
    """|w*|: parameters of the assembled candidate, stitches included, from specs alone (no tensors)."""
    return candidate_spec("candidate", blocks, input_shape, num_classes)[0].params


def init_stitch(block: BlockSpec, rng: np.random.Generator) -> State:
    """Fresh weights for a stitch block, drawn from `rng` (no global RNG).

    A stitch whose in and out shapes match starts as the identity: W = I (a 1×1 conv or a square
    linear map), b = 0, so ReLU(Wᵀx + b) passes a non-negative input through unchanged (a negative one,
    e.g. a MobileNet linear bottleneck's, is clipped: the papers' stitch form). Others get PyTorch's
    default Linear/Conv2d initialisation: weight and bias ~ U(±1/√fan_in), fan_in = the weight's
    in-features × kernel area. State keys are block-relative ("0.proj.weight").
    """
    if block.in_shape == block.out_shape:
        return _identity(block)
    state: State = {}
    shape = block.in_shape
    for i, layer in enumerate(block.layers):
        kind = layer_type(layer.type)
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in kind.build(layer.args, shape).state_dict().items()}
        for key, size in shapes.items():
            prefix = key.rsplit(".", 1)[0]
            fan_in = math.prod(shapes[f"{prefix}.weight"][1:])
            bound = 1.0 / math.sqrt(fan_in)
            state[f"{i}.{key}"] = torch.from_numpy(rng.uniform(-bound, bound, size).astype(np.float32))
        shape = tuple(kind.out_shape(layer.args, shape))
    return state


def _identity(block: BlockSpec) -> State:
    state: State = {}
    for i, layer in enumerate(block.layers):
        with torch.device("meta"):
            shapes = {
                k: tuple(v.shape)
                for k, v in layer_type(layer.type).build(layer.args, block.in_shape).state_dict().items()
            }
        for key, size in shapes.items():
            if key.endswith("weight"):
                eye = torch.eye(size[0], size[1], dtype=torch.float32)
                state[f"{i}.{key}"] = eye.reshape(size).clone()
            else:
                state[f"{i}.{key}"] = torch.zeros(size, dtype=torch.float32)
    return state


def assemble(
    name: str, blocks: Sequence[PoolBlock], input_shape: Shape, num_classes: int, rng: np.random.Generator
) -> tuple[Weights, tuple[int, ...]]:
    """A candidate model (spec + tensors) from pool blocks, and the positions of its stitch blocks.

    Blocks are placed in order with stitches at seams and where shapes differ (`candidate_spec`); stitch
    weights are fresh from `rng`; block tensors are copied, so training the candidate never
    changes the pool. Only the stitches are meant to be trained (pFedClub Eq. (2)-(3)).
    Raises ValueError for no blocks, SpecError for impossible shapes, and WeightsError when a
    block's tensors do not match its spec.
    """
    spec, stitches = candidate_spec(name, blocks, input_shape, num_classes)
    states = iter(b.state for b in blocks)
    parts = [(b, init_stitch(b, rng) if i in stitches else next(states)) for i, b in enumerate(spec.blocks)]
    weights = model_of(name, tuple(input_shape), num_classes, parts)
    check_state(weights.spec, weights.state)
    return weights, stitches


def assemble_modules(
    name: str,
    blocks: Sequence[PoolBlock],
    input_shape: Shape,
    num_classes: int,
    rng: np.random.Generator,
    frozen: Callable[[PoolBlock], nn.Module],
    device: Device = "cpu",
    channels_last: bool = True,
) -> tuple[FastBlocks, tuple[int, ...]]:
    """The candidate `assemble` would give, as a module to fine-tune and run, and the positions of its stitches.

    Its pool blocks are `frozen(block)` (one module per pool block, shared by every candidate holding it: eval
    mode, no grad, e.g. BatchNorm folded), never copied; its stitches are fresh modules on `device`, trainable,
    with the weights `assemble` draws from the same `rng` (in the same order), built without a random init. The
    module computes what `assemble`'s weights do up to float rounding; `assembled_weights` gives those weights.
    `channels_last`: frozen blocks that convolve take channels-last inputs (their weights must be channels-last).
    """
    spec, stitches = candidate_spec(name, blocks, input_shape, num_classes)
    parts = iter(blocks)
    modules = []
    for i, block in enumerate(spec.blocks):
        if i not in stitches:
            modules.append(frozen(next(parts)))
            continue
        with torch.device("meta"):
            stitch = build_block(block)
        stitch.load_state_dict(init_stitch(block, rng), assign=True)
        modules.append(stitch.to(device).requires_grad_(True).train())
    frozen_at = [i for i in range(len(spec.blocks)) if i not in stitches]
    return FastBlocks(spec, nn.ModuleList(modules), frozen_at, channels_last), stitches


def assembled_weights(candidate: FastBlocks, blocks: Sequence[PoolBlock]) -> Weights:
    """The weights of a candidate built by `assemble_modules` from `blocks`: the pool blocks' own tensors (never the
    frozen modules' folded ones) and its stitches' current ones, on the CPU and checked against its spec."""
    parts = iter(blocks)
    states = [
        (b, next(parts).state if i in candidate.frozen else {k: v.detach().cpu() for k, v in m.state_dict().items()})
        for i, (b, m) in enumerate(zip(candidate.spec.blocks, candidate.blocks))
    ]
    weights = model_of(candidate.spec.name, candidate.spec.input_shape, candidate.spec.num_classes, states)
    check_state(weights.spec, weights.state)
    return weights


def size_problems(
    blocks: Sequence[Part], client_spec: ModelSpec, eta: float | None, profile: DeviceProfile | None = None
) -> list[str]:
    """Why the candidate stitched from `blocks` breaks |w*| ≤ (1+η)|w| or the device profile; [] if it does not.

    pFedClub+ (§4.4): |w*| is the stitched candidate's parameter count (stitches included, from
    specs alone), |w| = client_spec.params; the model's input shape and classes are the client's.
    eta=None skips the bound (plain pFedClub); profile=None skips `fits` (params, MACs, memory).
    Raises like `within_size_bound` for eta <= -1 or not finite, and like `candidate_spec` for an
    empty candidate.
    """
    spec, _ = candidate_spec("candidate", blocks, client_spec.input_shape, client_spec.num_classes)
    problems = []
    if eta is not None and not within_size_bound(spec.params, client_spec.params, eta):
        problems.append(
            f"params {spec.params:,} > (1+η)|w| = {(1 + eta) * client_spec.params:,.1f} "
            f"(η={eta}, |w|={client_spec.params:,}; pFedClub+ §4.4)"
        )
    if profile is not None:
        verdict = fits(spec, profile)
        problems += [f"does not fit profile {profile.name!r}: {f}" for f in verdict.failures]
    return problems
