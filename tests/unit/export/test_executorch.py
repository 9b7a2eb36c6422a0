"""ExecuTorch export: inference parity of every zoo model, gradient parity of the trainable ones, refusals."""

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import executorch  # noqa: F401  (a test dependency: missing, this file must fail, not skip)

import export.executorch as et  # noqa: E402
from edge_client.training import kd_kl  # noqa: E402  (tests may import edge_client; export/ may not)
from export.executorch import (  # noqa: E402
    ExportError, export_pte, export_training, gradient_parity, kd_loss, train_step_pte)
from fedge.data import load_dataset  # noqa: E402
from fedge.layers import LayerSpec as L  # noqa: E402
from fedge.spec import build, make_spec  # noqa: E402
from fedge.zoo import MODELS, create  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SHAPE = (1, 28, 28)
BN_MODELS = ["cnn4", "mobilenet_v1", "mobilenet_v2", "mobilenet_v3"]
TRAINABLE = [m for m in MODELS if m not in BN_MODELS]


@pytest.fixture(scope="module")
def mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight real digits of eight classes (every 625th of the 5,000 images: labels 0-3 and 5-8)."""
    return load_dataset("mnist-5k").tensors(np.arange(0, 5000, 625))


def weights(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build(spec).state_dict().items()}


def teacher_logits(n: int, seed: int = 1) -> torch.Tensor:
    return 3 * torch.randn(n, 10, generator=torch.Generator().manual_seed(seed))


# --- the loss -----------------------------------------------------------------------------------

@pytest.mark.parametrize("lam,temperature", [(0.0, 1.0), (0.2, 1.0), (1.0, 2.5)])
def test_kd_loss_is_edge_clients_loss(lam, temperature):
    # prepare
    gen = torch.Generator().manual_seed(3)
    z, t, y = torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen), torch.arange(6)
    # execute
    got = kd_loss(z, y, t, lam, temperature)
    # assert
    want = F.cross_entropy(z, y) + lam * kd_kl(z, t, temperature)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


# --- inference ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_inference_pte_matches_eager(name, mnist, tmp_path):
    spec = create(name, SHAPE, 10)
    x, _ = mnist
    report = export_pte(spec, weights(spec), tmp_path / f"{name}.pte", x)
    assert report.max_abs_diff <= 1e-4 and report.argmax_match
    assert report.delegated_calls >= 1
    assert (tmp_path / f"{name}.pte").stat().st_size == report.size_bytes
    print(f"{name}: max |diff| {report.max_abs_diff:.2e}, portable ops {report.non_delegated_ops}")


def test_export_pte_rejects_a_sample_of_the_wrong_shape(tmp_path):
    spec = create("cnn1", SHAPE, 10)
    with pytest.raises(ExportError, match=r"\(N, 1, 28, 28\)"):
        export_pte(spec, weights(spec), tmp_path / "m.pte", torch.zeros(2, 3, 28, 28))
    assert not (tmp_path / "m.pte").exists()


# --- training -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TRAINABLE)
def test_gradient_parity_of_trainable_zoo_models(name, mnist):
    spec = create(name, SHAPE, 10)
    x, y = mnist
    report = gradient_parity(spec, weights(spec), x, y, teacher_logits(len(x)), kd_lambda=0.2, temperature=2.0)
    print(f"{name}: loss {report.loss_eager:.6f} vs {report.loss_pte:.6f}, worst grad rel err {report.worst:.2e}")
    assert report.passed, report.max_rel_err
    assert set(report.max_rel_err) == {k for k, _ in build(spec).named_parameters()}


@pytest.mark.parametrize("name", BN_MODELS)
def test_batchnorm_models_are_refused_for_training(name):
    spec = create(name, SHAPE, 10)
    with pytest.raises(ExportError, match=r"blocks\.\d+\.\d+ \(BatchNorm2d\) in block '\w+' is BatchNorm"):
        export_training(spec, weights(spec), None, 0.2, 1.0, batch_size=4)


POOLS = make_spec("pools", (1, 9, 9), 10, [
    ("c1", [L("conv2d", {"out_channels": 4, "kernel_size": 3, "padding": 1}), L("relu"),
            L("maxpool", {"kernel_size": 2})]),                                  # 9 → 4 (odd side is cropped)
    ("c2", [L("conv2d", {"out_channels": 6, "kernel_size": 3, "padding": 1}), L("relu"),
            L("avgpool", {"kernel_size": 2}), L("adaptive_avgpool"), L("flatten"),
            L("dropout", {"p": 0.5}), L("linear", {"out_features": 10})]),
])


def test_pool_rewrites_give_exact_gradients_through_the_pte():
    x = torch.rand(5, 1, 9, 9, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 3, 5, 7, 9])
    report = gradient_parity(POOLS, weights(POOLS), x, y, teacher_logits(5), kd_lambda=0.5, temperature=1.0)
    assert report.passed, report.max_rel_err


@pytest.fixture(scope="module")
def pools_program() -> bytes:
    """POOLS exported for training with weights A (seed 0), batches of 8, dropout off."""
    return export_training(POOLS, weights(POOLS, seed=0), None, 0.2, 1.0, batch_size=8, dropout=False)


def test_train_step_pte_is_one_sgd_step_at_the_given_parameters(mnist, pools_program):
    # prepare: the program is exported with weights A, the step runs at weights B
    x, y = mnist
    t = teacher_logits(len(x))
    program = pools_program
    model = build(POOLS).eval()
    model.load_state_dict(weights(POOLS, seed=7))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    xs = F.adaptive_avg_pool2d(x, 9)  # the 9×9 model on real digits
    # execute
    loss, new, grads = train_step_pte(program, params, xs, y, t, lr=0.1)
    # assert
    ref = kd_loss(model(xs), y, t, 0.2, 1.0)
    ref.backward()
    assert loss == pytest.approx(float(ref), rel=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(new[k], params[k] - 0.1 * grads[k], rtol=0, atol=1e-6)


def test_train_step_pte_rejects_parameters_that_do_not_match(pools_program):
    params = {k: v for k, v in build(POOLS).named_parameters() if not k.endswith("bias")}
    with pytest.raises(ExportError, match=r"missing \['blocks\.0\.0\.bias'"):
        train_step_pte(pools_program, params, torch.zeros(8, 1, 9, 9), torch.zeros(8, dtype=torch.long),
                       torch.zeros(8, 10), 0.1)


def test_a_pool_without_an_exact_form_is_refused_naming_the_layer():
    spec = make_spec("overlap", (1, 8, 8), 10, [
        ("c1", [L("conv2d", {"out_channels": 2, "kernel_size": 3}), L("maxpool", {"kernel_size": 3, "stride": 2})]),
        ("fc", [L("flatten"), L("linear", {"out_features": 10})]),
    ])
    with pytest.raises(ExportError, match=r"blocks\.0\.1 \(MaxPool2d\) in block 'c1'"):
        export_training(spec, weights(spec), None, 0.2, 1.0, batch_size=2)


def test_without_the_rewrite_maxpool_is_refused_and_would_give_wrong_gradients(monkeypatch):
    """Why the rewrite exists: the portable max_pool2d backward kernel gets the gradients wrong."""
    monkeypatch.setattr(et, "_pool_rewrite", lambda module, name: None)
    with pytest.raises(ExportError, match="max_pool2d"):
        export_training(POOLS, weights(POOLS), None, 0.2, 1.0, batch_size=2)
    maxpool_only = make_spec("mp", (1, 8, 8), 10, [
        ("c1", [L("conv2d", {"out_channels": 4, "kernel_size": 3, "padding": 1}), L("relu"),
                L("maxpool", {"kernel_size": 2})]),
        ("fc", [L("flatten"), L("linear", {"out_features": 10})]),
    ])
    monkeypatch.setattr(et, "_BAD_TRAINING_OPS", set())
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    report = gradient_parity(maxpool_only, weights(maxpool_only), x, torch.arange(4), teacher_logits(4))
    assert not report.passed
    assert report.max_rel_err["blocks.0.0.weight"] > 1e-2
