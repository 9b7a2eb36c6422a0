"""ONNX export: parity with eager PyTorch for every zoo model and for stitched teachers, metadata, dynamic batch,
the failure path, the run folder's final models, and `fedge export` / `fedge predict`."""

import json
import re

import numpy as np
import pytest
import torch
from torch import nn

from export import PARITY_ATOL
from export.onnx import ExportError, export_module, export_onnx, onnx_metadata, predict_onnx
from fedge.config import ConfigError, RunConfig, config_from
from fedge.data.datasets import load_dataset
from fedge.model.layers import LayerSpec as L
from fedge.model.spec import build, make_spec
from fedge.model.weights import load_model, load_module
from fedge.model.zoo import MODELS, create
from launch.cli import main

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def mnist():
    ds = load_dataset("mnist-5k")
    return ds, ds.tensors(np.arange(0, 5000, 250))[0]  # 20 real digits, every class


def fresh(spec, seed=0):
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in build(spec).state_dict().items()}


def assert_parity(path, spec, state, x):
    with torch.no_grad():
        want = load_module(spec, state).eval()(x).numpy()
    got = predict_onnx(path, x)
    assert np.abs(got - want).max() <= PARITY_ATOL
    assert (got.argmax(1) == want.argmax(1)).all()


@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_model_parity_on_real_digits(tmp_path, mnist, name):
    ds, x = mnist
    spec = create(name, ds.input_shape, ds.num_classes)
    state = fresh(spec)
    report = export_onnx(spec, state, tmp_path / f"{name}.onnx", x, {"client": "7", "round": "3"})
    assert report.max_abs_diff <= PARITY_ATOL and report.argmax_agree and report.samples == len(x)
    assert report.input_shape == ("batch", 1, 28, 28) and report.output_shape == ("batch", 10)
    for batch in (1, 7):  # dynamic batch: any batch size runs
        assert_parity(report.path, spec, state, x[:batch])


@pytest.mark.parametrize("name", ["cnn2", "mobilenet_v1"])  # two of them: every 32x32 export costs seconds
def test_rgb_32px_parity(tmp_path, name):
    spec = create(name, (3, 32, 32), 10)  # no small RGB dataset is bundled: normal inputs, as normalised data
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    state = fresh(spec)
    report = export_onnx(spec, state, tmp_path / "m.onnx", x, {})
    assert report.input_shape == ("batch", 3, 32, 32) and report.max_abs_diff <= PARITY_ATOL
    assert_parity(report.path, spec, state, x[:7])


def test_metadata_props(tmp_path, mnist):
    ds, x = mnist
    spec = create("cnn1", ds.input_shape, ds.num_classes).with_origin("7")
    report = export_onnx(
        spec,
        fresh(spec),
        tmp_path / "m.onnx",
        x,
        {"client": "7", "round": "3", "class_names": json.dumps(list(ds.classes))},
    )
    meta = onnx_metadata(report.path)
    assert meta["model"] == "cnn1" and meta["client"] == "7" and meta["round"] == "3"
    assert meta["params"] == str(spec.params) and meta["macs"] == str(spec.macs)
    assert meta["input_shape"] == "1x28x28" and meta["opset"] == str(report.opset) and report.opset >= 18
    assert json.loads(meta["class_names"]) == list(ds.classes)
    assert [b["client"] for b in json.loads(meta["blocks"])] == ["7"] * len(spec.blocks)
    assert meta["fedge_version"] and json.loads(meta["fedge_spec"])["name"] == "cnn1"


def test_conv_to_conv_stitches_with_resizes(tmp_path, mnist):
    ds, x = mnist
    spec = make_spec(
        "stitched",
        (1, 28, 28),
        10,
        [
            (
                "cov1",
                [
                    L("conv2d", {"out_channels": 16, "kernel_size": 5, "padding": 2}),
                    L("relu"),
                    L("maxpool", {"kernel_size": 2}),
                ],
            ),  # 16x14x14
            ("up", [L("stitch", {"out_shape": [8, 28, 28]})]),  # 1x1 conv + nearest upsample
            ("down", [L("stitch", {"out_shape": [12, 5, 5]})]),  # 1x1 conv + adaptive average pool 28 -> 5
            ("head", [L("stitch", {"out_shape": [10], "relu": False})]),  # linear stitch to the logits
        ],
    )
    state = fresh(spec, seed=1)
    report = export_onnx(spec, state, tmp_path / "t.onnx", x, {})
    assert report.max_abs_diff <= PARITY_ATOL
    assert_parity(report.path, spec, state, x[:1])


class Drifting(nn.Module):
    """A forward that differs while being exported from what it computes eagerly: the export cannot match."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def forward(self, x):
        y = self.fc(x.flatten(1))
        return y + 0.5 if torch.onnx.is_in_onnx_export() else y


def test_mismatch_raises_with_numbers_and_leaves_no_file(tmp_path, mnist):
    _, x = mnist
    path = tmp_path / "bad.onnx"
    with pytest.raises(ExportError, match=r"max abs logit difference .* \(allowed 0\.0001\)"):
        export_module(Drifting(), path, x, {})
    assert not path.exists()
    assert not list(tmp_path.iterdir())


def test_bad_sample_and_inputs_raise(tmp_path, mnist):
    _, x = mnist
    spec = create("cnn1", (3, 32, 32), 10)
    with pytest.raises(ExportError, match="takes"):
        export_onnx(spec, fresh(spec), tmp_path / "m.onnx", x, {})
    spec = create("cnn1", (1, 28, 28), 10)
    path = export_onnx(spec, fresh(spec), tmp_path / "m.onnx", x, {}).path
    with pytest.raises(ExportError, match="takes inputs of shape"):
        predict_onnx(path, np.zeros((2, 3, 32, 32), np.float32))
    with pytest.raises(ExportError, match="cannot load"):
        predict_onnx(tmp_path / "missing.onnx", x)


def test_export_onnx_config_flag():
    assert RunConfig().export_onnx is True
    assert config_from({"export_onnx": "false"}).export_onnx is False
    with pytest.raises(ConfigError, match="export_onnx"):
        config_from({"export_onnx": "maybe"})


def test_the_parity_sample_spans_the_classes_of_a_class_sorted_dataset(mnist):
    from export.run_models import PARITY_SAMPLES, parity_sample

    ds, _ = mnist  # mnist-5k is sorted by class: its first 64 images are all zeros
    x = parity_sample(ds)
    rows = {r.numpy().tobytes(): i for i, r in enumerate(ds.tensors(np.arange(len(ds)))[0])}  # image -> its index
    labels = ds.y[[rows[r.numpy().tobytes()] for r in x]]
    assert len(x) == PARITY_SAMPLES and set(np.bincount(labels, minlength=10).tolist()) == {6, 7}
    assert torch.equal(x, parity_sample(ds))


def test_run_writes_and_checks_final_teachers(run_dir):
    ds = load_dataset("digits")
    x = ds.tensors(np.arange(100, 164))[0]  # other real inputs than the export's own check
    teachers = sorted((run_dir / "models").glob("*/teacher.safetensors"))
    assert teachers, "the tiny pFedClub round built no teacher"
    conv_stitches = 0
    for path in teachers:
        spec, state = load_model(path)
        meta = onnx_metadata(path.with_suffix(".onnx"))
        assert meta["client"] == path.parent.name and meta["role"] == "teacher" and meta["dataset"] == "digits"
        assert len(json.loads(meta["blocks"])) == len(spec.blocks)
        assert_parity(path.with_suffix(".onnx"), spec, state, x)
        conv_stitches += sum(
            1
            for b in spec.blocks
            for ly in b.layers
            if ly.type == "stitch" and len(b.in_shape) == 3 and len(b.out_shape) == 3
        )
    assert conv_stitches, "no conv→conv stitch in this run's teachers"


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_export_and_predict(run_dir, tmp_path, capsys):
    client = sorted(p.name for p in (run_dir / "models").iterdir())[0]
    for what in ("teacher", "student"):
        code, out, err = cli(
            capsys, "export", run_dir, "--client", client, "--what", what, "--format", "onnx", "--out", tmp_path
        )
        assert code == 0, err
        assert (tmp_path / f"client{client}-{what}.onnx").exists() and "max abs logit difference" in out
    code, out, err = cli(
        capsys, "predict", tmp_path / f"client{client}-student.onnx", "--dataset", "digits", "--limit", "50"
    )
    assert code == 0, err
    assert re.search(r"^accuracy [\d.]+ \(\d+/50\) on a 50-sample draw from all samples of digits", out, re.M), out
    code, out, err = cli(
        capsys,
        "predict",
        tmp_path / f"client{client}-student.onnx",
        "--dataset",
        "digits",
        "--client",
        client,
        "--config",
        run_dir / "config.json",
    )
    assert code == 0, err
    assert f"client {client}'s test shard" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{missing}", "--client", "0"], "does not exist"),
        (["{run}", "--client", "99"], "has no client '99'"),
        (["{run}", "--client", "0", "--format", "tflite"], "unsupported format 'tflite'"),
        (["{run}", "--client", "0", "--what", "server"], "unknown model 'server'"),
    ],
)
def test_cli_export_errors(run_dir, tmp_path, capsys, argv, message):
    argv = [a.format(missing=tmp_path / "nope", run=run_dir) for a in argv]
    code, out, err = cli(capsys, "export", *argv, "--out", tmp_path / "o")
    assert code == 2 and out == ""
    assert err.startswith("fedge: error:") and message in err and len(err.strip().splitlines()) == 1


def test_cli_predict_errors(tmp_path, capsys):
    code, _, err = cli(capsys, "predict", tmp_path / "none.onnx", "--dataset", "digits")
    assert code == 2 and "none.onnx does not exist; give an ONNX file of `fedge export`" in err
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    code, _, err = cli(capsys, "predict", tmp_path / "junk.onnx", "--dataset", "digits")
    assert code == 2 and "onnxruntime cannot load" in err


def test_a_missing_optional_package_names_the_extra_to_install():
    from export import require

    require("onnx", "onnxruntime")  # installed: nothing happens
    with pytest.raises(
        ExportError,
        match=r"export needs no_such_package_xyz, which is not installed; install the "
        r"export extra: pip install 'fedge\[export\]'",
    ):
        require("onnx", "no_such_package_xyz")
