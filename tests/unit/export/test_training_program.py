"""ExecuTorch training programs: layers without an exact training form are refused naming the layer, the rewrites
exist for a reason, and the program keeps its weights apart."""

import executorch  # noqa: F401  (a test dependency: missing, this file must fail, not skip)
import pytest
import torch

import export.parity as parity
import export.training_program as tp
from export.parity import gated_training_program, gradient_parity
from export.training_program import ExportError, export_training
from fedge.layers import LayerSpec as L
from fedge.spec import make_spec
from fedge.zoo import create

from helpers.export_models import BN_MODELS, POOLS, SHAPE, teacher_logits, weights

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", BN_MODELS)
def test_batchnorm_models_are_refused_for_training(name):
    spec = create(name, SHAPE, 10)
    with pytest.raises(ExportError, match=r"blocks\.\d+\.\d+ \(BatchNorm2d\) in block '\w+' is BatchNorm"):
        export_training(spec, weights(spec), batch_size=4)


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
