"""Splitting an uploaded model into pool blocks and joining blocks back is lossless."""

import pytest
import torch

from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.messages import Weights
from methods.reassembly.blocks import model_of, split_blocks

pytestmark = pytest.mark.timeout(60)


def test_split_then_join_is_identity():
    spec = create("mobilenet_v2", (1, 28, 28), 10).with_origin("3")
    weights = Weights(spec, build(spec).state_dict())
    blocks = split_blocks("3", weights)
    assert [b.key for b in blocks] == [("3", i) for i in range(len(spec.blocks))]
    assert all(not k.startswith("blocks.") for b in blocks for k in b.state)
    again = model_of(spec.name, spec.input_shape, 10, [(b.spec, b.state) for b in blocks])
    assert again.spec == spec
    assert set(again.state) == set(weights.state)
    assert all(torch.equal(again.state[k], weights.state[k]) for k in weights.state)
    again.state["blocks.0.0.weight"].add_(1.0)  # a copy: the pool is not aliased
    assert not torch.equal(again.state["blocks.0.0.weight"], weights.state["blocks.0.0.weight"])
