"""`fedge export --format pte / pte-train`: the written programs load like an app loads them and match PyTorch;
bad requests are one-line errors that write nothing."""

import json

import executorch  # noqa: F401  (a test dependency: missing, this file must fail, not skip)
import numpy as np
import pytest
import torch

from export.pte import predict_pte
from fedge.data.datasets import load_dataset
from fedge.executorch_program import TRAIN_INPUTS
from fedge.model.spec import build

pytestmark = pytest.mark.timeout(300)


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
    code, out, err = cli(
        capsys, "export", run_dir, "--client", "1", "--what", "student", "--format", "pte-train", "--out", tmp_path
    )
    # assert: program, weights and manifest; the manifest's shapes drive one SGD step of the loaded files
    assert code == 0, err
    assert "worst relative gradient error" in out
    manifest = json.loads((tmp_path / "client1-student-train.json").read_text())
    assert manifest["program"] == "client1-student-train.pte" and manifest["weights"] == "client1-student-train.ptd"
    assert [i["name"] for i in manifest["inputs"]] == list(TRAIN_INPUTS) and manifest["batch_size"] == 32
    assert manifest["inputs"][5] == {"name": "kd_direction", "dtype": "float32", "shape": []}
    assert manifest["kd_direction"] == "teacher_student"
    module = TrainingModule(
        _load_for_executorch(str(tmp_path / manifest["program"]), str(tmp_path / manifest["weights"]))
    )
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
    from fedge.model.weights import load_model

    code, out, err = cli(
        capsys, "export", run_dir, "--client", "2", "--format", "pte", "--batch", "4", "--out", tmp_path
    )
    assert code == 0, err
    manifest = json.loads((tmp_path / "client2-teacher.json").read_text())
    assert manifest["inputs"][0]["shape"] == [4, 1, 8, 8] and manifest["outputs"][0]["shape"] == [4, 10]
    spec, state = load_model(run_dir / "models" / "2" / "teacher.safetensors")
    model = build(spec).eval()
    model.load_state_dict(state)
    x = load_dataset("digits").tensors(np.arange(200, 210))[0]
    torch.testing.assert_close(predict_pte(tmp_path / "client2-teacher.pte", x), model(x).detach(), rtol=0, atol=1e-4)


def test_cli_exports_a_batchnorm_students_program_with_its_batch_statistics(run_dir, tmp_path, capsys):
    # prepare: client 0 has cnn4 (three BatchNorm layers: 32, 64 and 128 channels)
    from executorch.extension.pybindings.portable_lib import _load_for_executorch
    from executorch.extension.training import TrainingModule

    # execute
    code, out, err = cli(
        capsys,
        "export",
        run_dir,
        "--client",
        "0",
        "--what",
        "student",
        "--format",
        "pte-train",
        "--batch",
        "4",
        "--out",
        tmp_path,
    )
    # assert: the manifest names the BN statistics output and its layout; the program returns it
    assert code == 0, err
    manifest = json.loads((tmp_path / "client0-student-train.json").read_text())
    assert [(n["name"], n["channels"], n["momentum"]) for n in manifest["batchnorm"]] == [
        ("blocks.0.1", 32, 0.1),
        ("blocks.2.1", 64, 0.1),
        ("blocks.4.1", 128, 0.1),
    ]
    assert manifest["outputs"][-1] == {"name": "bn_stats", "dtype": "float32", "shape": [2 * (32 + 64 + 128)]}
    assert not any("running" in k for k in manifest["parameters"])
    module = TrainingModule(
        _load_for_executorch(str(tmp_path / manifest["program"]), str(tmp_path / manifest["weights"]))
    )
    dtypes = {"float32": torch.float32, "int64": torch.long}
    inputs = [torch.randn(i["shape"]).to(dtypes[i["dtype"]]) for i in manifest["inputs"]]
    inputs[1], inputs[4] = torch.zeros(4, dtype=torch.long), torch.tensor(1.0)
    stats = module.forward_backward("forward", inputs)[-1]
    assert stats.shape == (448,) and bool((stats[32:64] >= 0).all())  # layer 1's variances


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--client", "1", "--what", "teacher", "--format", "pte-train"], "use --what student"),
        (["--client", "1", "--format", "pte", "--batch", "0"], "--batch must be positive"),
    ],
)
def test_cli_executorch_export_errors(run_dir, tmp_path, capsys, argv, message):
    code, out, err = cli(capsys, "export", run_dir, *argv, "--out", tmp_path)
    assert code == 2 and out == ""
    assert err.startswith("fedge: error:") and message in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())
