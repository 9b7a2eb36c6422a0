"""The server's block pool: uploaded client models split into blocks (spec + tensors) and put back together."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedge.model.spec import BlockSpec, ModelSpec
from fedge.model.weights import State
from fedge.wire.messages import Weights

Key = tuple[str, int]  # a pool block: (client id, block index in that client's model)


@dataclass(frozen=True)
class PoolBlock:
    """Block `index` of client `client`'s uploaded model; `state` keys are relative to the block ("0.weight")."""

    client: str
    index: int
    spec: BlockSpec
    state: State

    @property
    def key(self) -> Key:
        return self.client, self.index


def split_blocks(client: str, weights: Weights) -> list[PoolBlock]:
    """Decompose an uploaded model into its blocks (pFedClub §3.2.1 "Block Decomposition")."""
    blocks = []
    for i, spec in enumerate(weights.spec.blocks):
        prefix = f"blocks.{i}."
        state = {k[len(prefix) :]: v for k, v in weights.state.items() if k.startswith(prefix)}
        blocks.append(PoolBlock(client, i, spec, state))
    return blocks


def join_state(blocks: list[tuple[BlockSpec, State]]) -> State:
    """The model-level state dict (`blocks.<i>.*`) of blocks placed in this order."""
    return {f"blocks.{i}.{k}": v for i, (_, state) in enumerate(blocks) for k, v in state.items()}


def model_of(
    name: str, input_shape: tuple[int, ...], num_classes: int, blocks: list[tuple[BlockSpec, State]]
) -> Weights:
    """A whole model from consecutive blocks whose shapes already chain (ModelSpec validates that)."""
    spec = ModelSpec(name, tuple(input_shape), num_classes, tuple(b for b, _ in blocks))
    return Weights(spec, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in join_state(blocks).items()})
