"""Fixtures shared by the server unit tests."""

import pytest
import torch

from fedge.model.spec import build
from fedge.model.zoo import MODELS, create
from fedge.wire.messages import Weights


@pytest.fixture(scope="package")
def zoo_uploads():
    """One uploaded model (spec + seeded random weights) per zoo architecture at 1×28×28, by model name."""
    out = {}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for name in MODELS:
            spec = create(name, (1, 28, 28), 10)
            out[name] = Weights(spec, build(spec).state_dict())
    return out
