"""ExecuTorch export: inference parity of every zoo model, gradient parity of the trainable ones, refusals."""

import json

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import executorch  # noqa: F401  (a test dependency: missing, this file must fail, not skip)

import export.executorch as et  # noqa: E402
from edge_client.training import kd_kl  # noqa: E402  (tests may import edge_client; export/ may not)
from export.executorch import (  # noqa: E402
    ExportError, export_pte, export_training, gated_training_program, gradient_parity, kd_loss, train_step_pte)
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
        export_training(spec, weights(spec), batch_size=4)


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
    return export_training(POOLS, weights(POOLS, seed=0), batch_size=8)


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
        export_training(spec, weights(spec), batch_size=2)


def test_without_the_rewrite_maxpool_is_refused_and_would_give_wrong_gradients(monkeypatch):
    """Why the rewrite exists: the portable max_pool2d backward kernel gets the gradients wrong."""
    monkeypatch.setattr(et, "_pool_rewrite", lambda module, name: None)
    with pytest.raises(ExportError, match="max_pool2d"):
        export_training(POOLS, weights(POOLS), batch_size=2)
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
    et._gated.cache_clear()
    with pytest.raises(ExportError, match=r"'mp' fails the ExecuTorch gradient-parity gate.*blocks\.0\.0\."):
        gated_training_program(maxpool_only, 4)
    et._gated.cache_clear()


def test_the_program_keeps_the_weights_apart_and_loads_from_files_like_an_app(tmp_path, pools_program):
    # prepare
    pte, ptd = pools_program.write(tmp_path / "student-train.pte")
    other = export_training(POOLS, weights(POOLS, seed=1), batch_size=8)
    # execute: the path-based loader an app uses (program file + weights file)
    from executorch.extension.pybindings.portable_lib import _load_for_executorch
    from executorch.extension.training import TrainingModule
    module = TrainingModule(_load_for_executorch(str(pte), str(ptd)))
    out = module.forward_backward("forward", (torch.zeros(8, 1, 9, 9), torch.zeros(8, dtype=torch.long),
                                              torch.zeros(8, 10), torch.tensor(0.2), torch.tensor(1.0)))
    # assert: other weights give the same program, byte for byte, and another .ptd; the loaded weights are the
    # exported ones
    assert other.program == pte.read_bytes() and other.weights != ptd.read_bytes()
    assert len(out) == 4 and out[3].shape == (8, 10)
    params = {k.removeprefix("student."): v for k, v in module.named_parameters().items()}
    for k, v in weights(POOLS, seed=0).items():
        torch.testing.assert_close(params[k], v, rtol=0, atol=0)


def test_one_program_serves_every_lambda_and_temperature(mnist, pools_program):
    x, y = mnist
    xs, t = F.adaptive_avg_pool2d(x, 9), teacher_logits(len(x))
    model = build(POOLS).eval()
    model.load_state_dict(weights(POOLS, seed=2))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    for lam, temperature in [(0.0, 1.0), (0.7, 3.0)]:
        loss, _, grads = train_step_pte(pools_program, params, xs, y, t, 0.0, lam, temperature)
        model.zero_grad()
        ref = kd_loss(model(xs), y, t, lam, temperature)
        ref.backward()
        assert loss == pytest.approx(float(ref), rel=1e-5)
        for k, p in model.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6)


def test_inference_export_handles_inputs_with_a_size_one_channel_of_stride_one(tmp_path):
    """The digits dataset's (N, 1, 8, 8) tensors have channel stride 1; ExecuTorch would read that as a permuted
    dim order (XNNPACK then fails with 0x10), so the sample is made dense before tracing."""
    spec = create("cnn1", (1, 8, 8), 10)
    x = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(0)).as_strided((4, 1, 8, 8), (64, 1, 8, 1))
    assert x.stride() == (64, 1, 8, 1)
    report = export_pte(spec, weights(spec), tmp_path / "m.pte", x)
    assert report.max_abs_diff <= 1e-4
    # predict_pte: 6 inputs through a batch-4 program (the second batch padded)
    model = build(spec).eval()
    model.load_state_dict(weights(spec))
    six = torch.cat([x, x[:2].flip(0)])
    torch.testing.assert_close(et.predict_pte(tmp_path / "m.pte", six), model(six).detach(), rtol=0, atol=1e-4)


# --- fedge export --format pte / pte-train --------------------------------------------------------

def cli(capsys, *argv):
    from launch.cli import main
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exports_a_students_training_program_an_app_can_step(run_dir, tmp_path, capsys):
    # prepare: client 1 has cnn1 (zoo III, seed 0), the run's batch size is 32
    from executorch.extension.pybindings.portable_lib import _load_for_executorch
    from executorch.extension.training import TrainingModule, get_sgd_optimizer
    # execute
    code, out, err = cli(capsys, "export", run_dir, "--client", "1", "--what", "student", "--format", "pte-train",
                         "--out", tmp_path)
    # assert: program, weights and manifest; the manifest's shapes drive one SGD step of the loaded files
    assert code == 0, err
    assert "worst relative gradient error" in out
    manifest = json.loads((tmp_path / "client1-student-train.json").read_text())
    assert manifest["program"] == "client1-student-train.pte" and manifest["weights"] == "client1-student-train.ptd"
    assert [i["name"] for i in manifest["inputs"]] == list(et.TRAIN_INPUTS) and manifest["batch_size"] == 32
    module = TrainingModule(_load_for_executorch(str(tmp_path / manifest["program"]), str(tmp_path / manifest["weights"])))
    dtypes = {"float32": torch.float32, "int64": torch.long}
    inputs = [torch.zeros(i["shape"], dtype=dtypes[i["dtype"]]) for i in manifest["inputs"]]
    inputs[4] += 1.0  # temperature
    module.forward_backward("forward", inputs)
    params = module.named_parameters()
    assert {k: list(v.shape) for k, v in params.items()} == manifest["parameters"]
    before = {k: v.clone() for k, v in params.items()}
    get_sgd_optimizer(params, manifest["sgd_lr"], manifest["sgd_momentum"], 0, 0, False).step(module.named_gradients())
    assert any(not torch.equal(before[k], v) for k, v in params.items())


def test_cli_exports_a_teacher_inference_program_equal_to_eager(run_dir, tmp_path, capsys):
    from fedge.weights import load_model
    code, out, err = cli(capsys, "export", run_dir, "--client", "2", "--format", "pte", "--batch", "4", "--out", tmp_path)
    assert code == 0, err
    manifest = json.loads((tmp_path / "client2-teacher.json").read_text())
    assert manifest["inputs"][0]["shape"] == [4, 1, 8, 8] and manifest["outputs"][0]["shape"] == [4, 10]
    spec, state = load_model(run_dir / "models" / "2" / "teacher.safetensors")
    model = build(spec).eval()
    model.load_state_dict(state)
    x = load_dataset("digits").tensors(np.arange(200, 210))[0]
    torch.testing.assert_close(et.predict_pte(tmp_path / "client2-teacher.pte", x), model(x).detach(),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("argv, message", [
    (["--client", "0", "--what", "student", "--format", "pte-train"], "'cnn4' cannot be trained under ExecuTorch"),
    (["--client", "1", "--what", "teacher", "--format", "pte-train"], "use --what student"),
    (["--client", "1", "--format", "pte", "--batch", "0"], "--batch must be positive"),
])
def test_cli_executorch_export_errors(run_dir, tmp_path, capsys, argv, message):
    code, out, err = cli(capsys, "export", run_dir, *argv, "--out", tmp_path)
    assert code == 2 and out == ""
    assert err.startswith("fedge: error:") and message in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())
