"""ExecuTorch training programs: layers without an exact training form are refused naming the layer, the rewrites
exist for a reason, and the program keeps its weights apart."""

import executorch  # noqa: F401  (a test dependency: missing, this file must fail, not skip)
import pytest
import torch

import export.parity as parity
import export.training_program as tp
from export.parity import gated_training_program, gradient_parity
from export.training_program import ExportError, export_training
from fedge.executorch_program import NormLayer, update_running_stats
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import build, make_spec
from fedge.model.zoo import create

from helpers.export_models import BN_MODELS, POOLS, SHAPE, teacher_logits, weights

pytestmark = pytest.mark.timeout(300)


def test_the_batchnorm_rewrite_equals_training_mode_batchnorm_and_its_running_statistics():
    # prepare: a BatchNorm2d with non-trivial affine parameters and running statistics, momentum 0.3
    bn = torch.nn.BatchNorm2d(3, momentum=0.3)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (bn.weight, bn.bias, bn.running_mean):
            t.copy_(torch.randn(3, generator=gen))
        bn.running_var.copy_(torch.rand(3, generator=gen) + 0.5)
    x = 2 + 3 * torch.randn(5, 3, 4, 4, generator=gen)
    rewritten = tp.BatchStatNorm(bn, "bn")
    norms = (NormLayer("bn", 3, 0.3),)
    running = {f"bn.{k}": v.clone() for k, v in bn.state_dict().items() if k not in ("weight", "bias")}
    # execute
    y = rewritten(x)
    update_running_stats(running, norms, rewritten.recorded.stats[0])
    ref = bn.train()(x)
    # assert: same output, same running statistics (unbiased variance, count), same parameters
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for k, v in bn.state_dict().items():
        if f"bn.{k}" in running:
            torch.testing.assert_close(running[f"bn.{k}"], v, rtol=1e-6, atol=1e-6)
    assert dict(rewritten.named_parameters()).keys() == {"weight", "bias"}


@pytest.mark.parametrize("name", BN_MODELS)
def test_batchnorm_models_are_rewritten_for_training(name):
    spec = create(name, SHAPE, 10)
    form = tp.trainable_form(spec, build(spec))
    bns = [p for p, m in build(spec).named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert [n.name for n in tp.norm_layers(form)] == bns and bns
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in form.modules())
    assert {k for k, _ in form.named_parameters()} == {k for k, _ in build(spec).named_parameters()}


def test_a_batchnorm_without_affine_parameters_is_refused_naming_the_layer():
    conv = L("conv2d", {"out_channels": 2, "kernel_size": 3})
    spec = make_spec(
        "bn", (1, 8, 8), 10, [("c1", [conv, L("bn2d")]), ("fc", [L("flatten"), L("linear", {"out_features": 10})])]
    )
    model = build(spec)
    model.blocks[0][1] = torch.nn.BatchNorm2d(2, affine=False)
    with pytest.raises(ExportError, match=r"layer blocks\.0\.1 \(BatchNorm2d\) in block 'c1': only affine"):
        tp.trainable_form(spec, model)


def test_a_pool_without_an_exact_form_is_refused_naming_the_layer():
    spec = make_spec(
        "overlap",
        (1, 8, 8),
        10,
        [
            ("c1", [L("conv2d", {"out_channels": 2, "kernel_size": 3}), L("maxpool", {"kernel_size": 3, "stride": 2})]),
            ("fc", [L("flatten"), L("linear", {"out_features": 10})]),
        ],
    )
    with pytest.raises(ExportError, match=r"blocks\.0\.1 \(MaxPool2d\) in block 'c1'"):
        export_training(spec, weights(spec), batch_size=2)


def test_without_the_rewrite_maxpool_is_refused_and_would_give_wrong_gradients(monkeypatch):
    """Why the rewrite exists: the portable max_pool2d backward kernel gets the gradients wrong."""
    monkeypatch.setattr(tp, "_pool_rewrite", lambda module, name: None)
    with pytest.raises(ExportError, match="max_pool2d"):
        export_training(POOLS, weights(POOLS), batch_size=2)
    maxpool_only = make_spec(
        "mp",
        (1, 8, 8),
        10,
        [
            (
                "c1",
                [
                    L("conv2d", {"out_channels": 4, "kernel_size": 3, "padding": 1}),
                    L("relu"),
                    L("maxpool", {"kernel_size": 2}),
                ],
            ),
            ("fc", [L("flatten"), L("linear", {"out_features": 10})]),
        ],
    )
    monkeypatch.setattr(tp, "_BAD_TRAINING_OPS", set())
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    report = gradient_parity(maxpool_only, weights(maxpool_only), x, torch.arange(4), teacher_logits(4))
    assert not report.passed
    assert report.max_rel_err["blocks.0.0.weight"] > 1e-2
    parity._gated.cache_clear()
    with pytest.raises(ExportError, match=r"'mp' fails the ExecuTorch gradient-parity gate.*blocks\.0\.0\."):
        gated_training_program(maxpool_only, 4)
    parity._gated.cache_clear()


def test_the_program_keeps_the_weights_apart_and_loads_from_files_like_an_app(tmp_path, pools_program):
    # prepare
    pte, ptd = pools_program.write(tmp_path / "student-train.pte")
    other = export_training(POOLS, weights(POOLS, seed=1), batch_size=8)
    # execute: the path-based loader an app uses (program file + weights file)
    from executorch.extension.pybindings.portable_lib import _load_for_executorch
    from executorch.extension.training import TrainingModule

    module = TrainingModule(_load_for_executorch(str(pte), str(ptd)))
    out = module.forward_backward(
        "forward",
        (
            torch.zeros(8, 1, 9, 9),
            torch.zeros(8, dtype=torch.long),
            torch.zeros(8, 10),
            torch.tensor(0.2),
            torch.tensor(1.0),
            torch.tensor(1.0),  # kd_direction: KL(teacher ‖ student)
        ),
    )
    # assert: other weights give the same program, byte for byte, and another .ptd; the loaded weights are the
    # exported ones
    assert other.program == pte.read_bytes() and other.weights != ptd.read_bytes()
    assert len(out) == 4 and out[3].shape == (8, 10)
    params = {k.removeprefix("student."): v for k, v in module.named_parameters().items()}
    for k, v in weights(POOLS, seed=0).items():
        torch.testing.assert_close(params[k], v, rtol=0, atol=0)
