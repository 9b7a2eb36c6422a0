"""Block features on public data: shapes, chaining, fc blocks' own features (the authors' bug), batching."""

from __future__ import annotations

import pytest
import torch

from fedge.model import zoo
from fedge.model.spec import build
from fedge.wire.messages import Weights
from methods.reassembly.features import BlockFeatures, block_features, to_vectors

pytestmark = pytest.mark.timeout(120)


def _model(name: str, seed: int = 0) -> Weights:
    spec = zoo.create(name, (1, 28, 28), 10)
    torch.manual_seed(seed)
    return Weights(spec, build(spec).state_dict())


def _public(n: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


def _logits(weights: Weights, x: torch.Tensor) -> torch.Tensor:
    model = build(weights.spec)
    model.load_state_dict(weights.state)
    with torch.no_grad():
        return model.eval()(x)


def test_cnn1_pooled_shapes_and_chaining() -> None:
    w, x = _model("cnn1"), _public()
    feats = block_features(w, x, batch_size=16)
    # cov1 (1,28,28)→(16,14,14), cov2 →(32,7,7), fc1 →(128,), fc2 →(10,): maps pool to C, vectors stay.
    assert [(tuple(f.inputs.shape), tuple(f.outputs.shape)) for f in feats] == [
        ((64, 1), (64, 16)),
        ((64, 16), (64, 32)),
        ((64, 32), (64, 128)),
        ((64, 128), (64, 10)),
    ]
    for f in feats:
        assert f.inputs.dtype == torch.float32 and f.inputs.device.type == "cpu"
    for a, b in zip(feats, feats[1:]):
        assert torch.equal(a.outputs, b.inputs)
    assert torch.allclose(feats[0].inputs, x.mean(dim=(2, 3)))


def test_fc_blocks_get_their_own_features() -> None:
    # Regression for the authors' bug (original-code-notes §1.4): their fc layers reused the last pooled
    # conv features as both input and output. Here fc1 sees cov2's pooled map but outputs its own 128-d
    # vector, and fc2's outputs are exactly the model's logits.
    w, x = _model("cnn1"), _public()
    feats = block_features(w, x)
    model = build(w.spec)
    model.load_state_dict(w.state)
    model.eval()
    with torch.no_grad():
        h2 = model.run_block(1, model.run_block(0, x))
        fc1 = model.run_block(2, h2)
    assert torch.allclose(feats[2].inputs, h2.mean(dim=(2, 3)), atol=1e-6)
    assert torch.allclose(feats[2].outputs, fc1, atol=1e-6)
    assert torch.allclose(feats[3].outputs, _logits(w, x), atol=1e-5)
    assert feats[3].inputs.shape != feats[2].inputs.shape
    assert not torch.equal(feats[3].outputs[:, :10], feats[2].outputs[:, :10])


def test_flatten_mode_keeps_whole_maps() -> None:
    w, x = _model("cnn1"), _public(8)
    feats = block_features(w, x, conv_features="flatten")
    assert [(f.inputs.shape[1], f.outputs.shape[1]) for f in feats] == [
        (784, 16 * 14 * 14),
        (16 * 14 * 14, 32 * 7 * 7),
        (32 * 7 * 7, 128),
        (128, 10),
    ]
    assert torch.equal(feats[0].inputs, x.reshape(8, -1))
    pooled = block_features(w, x)
    assert torch.allclose(feats[1].outputs.reshape(8, 32, 49).mean(-1), pooled[1].outputs, atol=1e-6)


def test_mobilenet_v2_blocks_and_logits() -> None:
    w, x = _model("mobilenet_v2"), _public(32)
    feats = block_features(w, x, batch_size=10)
    assert len(feats) == len(w.spec.blocks) == 13
    for f, b in zip(feats, w.spec.blocks):
        assert f.inputs.shape == (32, b.in_shape[0])
        assert f.outputs.shape == (32, b.out_shape[0])
    for a, b in zip(feats, feats[1:]):
        assert torch.equal(a.outputs, b.inputs)
    assert torch.allclose(feats[-1].outputs, _logits(w, x), atol=1e-5)


def test_batching_eval_mode_and_determinism() -> None:
    # cnn1 has dropout in fc1: in train mode two runs would differ.
    w, x = _model("cnn1"), _public(50)
    one = block_features(w, x, batch_size=50)
    small = block_features(w, x, batch_size=7)
    again = block_features(w, x, batch_size=50)
    for a, b, c in zip(one, small, again):
        assert torch.allclose(a.outputs, b.outputs, atol=1e-5)
        assert torch.equal(a.outputs, c.outputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    w, x = _model("cnn1"), _public(16)
    for a, b in zip(block_features(w, x), block_features(w, x, device="cuda")):
        assert b.outputs.device.type == "cpu"
        assert torch.allclose(a.outputs, b.outputs, atol=1e-4)


def test_bad_inputs_raise() -> None:
    w = _model("cnn1")
    with pytest.raises(ValueError, match="does not fit"):
        block_features(w, torch.randn(4, 3, 28, 28))
    with pytest.raises(ValueError, match="does not fit"):
        block_features(w, torch.randn(0, 1, 28, 28))
    with pytest.raises(ValueError, match="batch_size"):
        block_features(w, _public(4), batch_size=0)
    with pytest.raises(ValueError, match="conv_features"):
        block_features(w, _public(4), conv_features="max")
    with pytest.raises(ValueError, match="weights do not match spec"):
        block_features(Weights(w.spec, {}), _public(4))
    with pytest.raises(ValueError, match="conv_features"):
        to_vectors(torch.zeros(2, 3, 4, 4), "max")


def test_block_features_is_frozen() -> None:
    f = block_features(_model("cnn1"), _public(4))[0]
    assert isinstance(f, BlockFeatures)
    with pytest.raises(AttributeError):
        f.inputs = torch.zeros(1)  # type: ignore[misc]
