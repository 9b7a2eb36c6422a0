"""A model cut as feature extractor + classifier head (DC-PFL §3, FedGH): the head is the model's last block when
that block is a single linear layer on a vector (dropout before it allowed), the representation is that block's
input, z = f_θ(x) ∈ R^d. Both halves use these: the server sends the global head as a one-block model of its own
(input (d,), output the classes) and the client puts it into, and takes it out of, its own model."""

from __future__ import annotations

from dataclasses import replace

import torch

from fedge.model.spec import ModelSpec, Origin, SpecModel
from fedge.model.weights import State

HEAD_MODEL = "head"  # the name (and block origin) of a head's own spec


class HeadError(ValueError):
    """A model has no head that can be cut off, or a head does not fit the model; the message says why."""


def head_problem(spec: ModelSpec) -> str | None:
    """Why `spec` cannot be cut as extractor + head, or None when its last block is [dropout...] + one linear on
    a vector."""
    last = spec.blocks[-1]
    kinds = [layer.type for layer in last.layers]
    if len(last.in_shape) != 1:
        return f"its last block {last.name!r} takes a {list(last.in_shape)} map, not a representation vector"
    if kinds.count("linear") != 1 or kinds[-1] != "linear" or set(kinds[:-1]) - {"dropout"}:
        return f"its last block {last.name!r} is {kinds}, not one linear layer (after optional dropout)"
    return None


def head_spec(spec: ModelSpec) -> ModelSpec:
    """The head of `spec` as a model of its own: the last block, input (d,), output the classes; HeadError when
    the model has no such head. Two models share a head exactly when their head specs are equal."""
    problem = head_problem(spec)
    if problem:
        raise HeadError(f"model {spec.name!r} cannot be cut as extractor + head: {problem}")
    last = spec.blocks[-1]
    block = replace(last, name=HEAD_MODEL, origin=Origin(HEAD_MODEL))
    return ModelSpec(HEAD_MODEL, last.in_shape, spec.num_classes, (block,))


def representation_size(spec: ModelSpec) -> int:
    """d, the size of the representation the extractor gives (HeadError when there is no head)."""
    return head_spec(spec).input_shape[0]


def _prefix(spec: ModelSpec) -> str:
    return f"blocks.{len(spec.blocks) - 1}."


def head_state(spec: ModelSpec, state: State) -> State:
    """The head's tensors out of a whole model's state, named as in head_spec's model (detached copies)."""
    prefix = _prefix(spec)
    return {"blocks.0." + k[len(prefix) :]: v.detach().clone() for k, v in state.items() if k.startswith(prefix)}


def put_head(model: SpecModel, head: State) -> None:
    """Load a head's tensors (named as head_spec's model) into the last block of `model`, in place; HeadError
    when they do not match the block's tensors."""
    block = model.blocks[-1]
    own = {k: v for k, v in block.state_dict().items()}
    renamed = {k[len("blocks.0.") :]: v for k, v in head.items() if k.startswith("blocks.0.")}
    if set(renamed) != set(own) or any(renamed[k].shape != own[k].shape for k in own):
        raise HeadError(
            f"the head's tensors {sorted(head)} do not fit the last block of {model.spec.name!r} ({sorted(own)})"
        )
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(renamed[k])


def extract(model: SpecModel, x: torch.Tensor) -> torch.Tensor:
    """z = f_θ(x): every block but the head, in the model's current mode."""
    for block in model.blocks[:-1]:
        x = block(x)
    return x
