"""`fedge predict` does not flatter a model: a --limit sample keeps the class proportions of a class-sorted set and
is reproducible by seed, the per-class table adds up, the model's client and its classes come from the ONNX
metadata with a warning off those classes, own data (class folders, .npz) scores as the dataset does, and each
mismatch between the data and the model is a one-line error saying what to do."""

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from export.onnx import export_onnx, onnx_metadata, predict_onnx
from fedge.data.datasets import load_dataset
from fedge.data.partition import describe, make_partition, stratified_sample
from fedge.model.spec import build
from fedge.model.zoo import create
from launch.cli import main
from launch.runs import partition_config

pytestmark = pytest.mark.timeout(300)


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def teacher(run_dir):
    """(client id, the run's final teacher ONNX of that client, the client's training classes by name)."""
    from fedge.config import load_config

    path = sorted((run_dir / "models").glob("*/teacher.onnx"))[0]
    cid = path.parent.name
    cfg = load_config(run_dir / "config.json", {})
    ds = load_dataset(cfg.dataset)
    row = describe(make_partition(ds.y, ds.num_classes, partition_config(cfg)), ds.y)[int(cid)]
    return cid, path, {ds.classes[c]: n for c, n in row["train_counts"].items()}


def table_rows(out):
    """The printed per-class table: {class: (samples, correct)} and the `all` row."""
    rows = dict(
        (m[1], (int(m[2].replace(",", "")), int(m[3].replace(",", ""))))
        for m in re.finditer(r"^(\S+) +([\d,]+) +([\d,]+) +(?:[\d.]+|-)(?:  (?:yes|no))?$", out, re.M)
    )
    return rows, rows.pop("all")


def sorted_npz(path, ds, **extra):
    """The dataset as a device's .npz, sorted by class (the order that made `--limit` take one class)."""
    order = np.argsort(ds.y, kind="stable")
    np.savez(path, x_train=ds.x[order], y_train=ds.y[order], **extra)
    return path


def test_the_runs_models_carry_their_run_and_their_clients_classes(run_dir, teacher):
    cid, path, held = teacher
    meta = onnx_metadata(path)
    assert meta["run"] == str(run_dir.resolve()) and meta["strategy"] == "pfedclub" and meta["client"] == cid
    assert json.loads(meta["client_classes"]) == held and len(held) == 2  # the run's noniid split: 2 classes


def test_limit_on_a_class_sorted_set_is_a_seeded_sample_keeping_class_proportions(teacher, digits, tmp_path, capsys):
    _, path, _ = teacher
    data = sorted_npz(tmp_path / "sorted.npz", digits)
    argv = ("predict", path, "--data-dir", data, "--limit", 200, "--seed", 3, "--out", tmp_path / "o")

    code, out, err = cli(capsys, *argv)

    assert code == 0, err
    assert "200 of its 1,797 samples drawn by seed 3 with the class proportions kept" in out
    assert re.search(r"^accuracy [\d.]+ \(\d+/200\) on a 200-sample draw from x_train, y_train of ", out, re.M), out
    report = json.loads((tmp_path / "o" / "per_class.json").read_text())
    counts = np.array([r["samples"] for r in report["per_class"]])
    share = np.bincount(digits.y, minlength=10) * 200 / len(digits.y)
    assert np.abs(counts - share).max() < 1, counts  # within one sample per class, though the file is sorted
    assert counts.sum() == report["total"] == 200
    assert sum(r["correct"] for r in report["per_class"]) == report["correct"]
    assert np.array(report["confusion"]).sum(1).tolist() == counts.tolist()
    assert report["data"]["sample"] == {"seed": 3, "drawn_from": 1797, "limit": 200}
    assert (tmp_path / "o" / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows, total = table_rows(out)
    assert total == (200, report["correct"]) and [rows[c][0] for c in digits.classes] == counts.tolist()
    assert cli(capsys, *argv[:-2])[1] == out.rsplit("wrote ", 1)[0]  # the same seed, the same sample and scores
    other = cli(capsys, *argv[:-4], "--seed", 4)[1]
    assert "drawn by seed 4" in other and other != out


def test_the_warning_appears_off_the_clients_classes_and_not_on_its_own_test_shard(
    run_dir, teacher, digits, tmp_path, capsys
):
    cid, path, held = teacher

    code, out, err = cli(capsys, "predict", path, "--dataset", "digits")

    assert code == 0, err
    never = [c for c in digits.classes if c not in held]
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"client {cid} never held classes {', '.join(never)}" in warnings[0]
    assert f"trained: client {cid} trained on classes {', '.join(f'{c} ({n:,})' for c, n in held.items())}" in out
    rows, total = table_rows(out)
    assert sum(s for s, _ in rows.values()) == total[0] == len(digits) and sum(k for _, k in rows.values()) == total[1]

    code, out, err = cli(
        capsys, "predict", path, "--dataset", "digits", "--client", cid, "--config", run_dir / "config.json"
    )

    assert code == 0, err
    assert "\nwarning:" not in out and f"client {cid}'s test shard of digits" in out
    rows, total = table_rows(out)
    assert set(rows) == set(held) and sum(n for n, _ in rows.values()) == total[0]
    assert f"no samples of classes {', '.join(never)}" in out

    shard = ("predict", path, "--dataset", "digits", "--client", cid, "--config", run_dir / "config.json")
    code, out, err = cli(capsys, *shard, "--limit", 20, "--out", tmp_path)

    assert code == 0, err
    assert f"20 of its {total[0]} samples drawn by seed 0" in out and "\nwarning:" not in out
    report = json.loads((tmp_path / "per_class.json").read_text())
    assert report["data"]["sample"]["drawn_from"] == total[0] and report["total"] == 20 and report["warning"] is None


def expected(path, ds, idx):
    """(correct, total) of the ONNX model on the dataset's samples `idx`, computed here, not by the CLI."""
    x, y = ds.tensors(idx)
    return int((predict_onnx(path, x).argmax(1) == y.numpy()).sum()), len(idx)


def scored(out):
    return tuple(map(int, re.search(r"^accuracy \S+ \((\d+)/(\d+)\)", out, re.M).groups()))


def test_own_data_in_a_folder_or_an_npz_scores_as_the_dataset_does(teacher, digits, tmp_path, capsys):
    _, path, _ = teacher
    idx = stratified_sample(digits.y, 60, seed=1)
    for i in idx:
        folder = tmp_path / "own" / digits.classes[digits.y[i]]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(digits.x[i, 0]).save(folder / f"{i}.png")
    rest = np.setdiff1d(np.arange(len(digits)), idx)  # a device's training part: not scored when a test split exists
    np.savez(
        tmp_path / "own.npz", x_train=digits.x[rest], y_train=digits.y[rest], x_test=digits.x[idx], y_test=digits.y[idx]
    )
    want = expected(path, digits, idx)

    for data, where in (
        (tmp_path / "own", "all images of"),
        (tmp_path / "own.npz", "the test split (x_test, y_test) of"),
    ):
        code, out, err = cli(capsys, "predict", path, "--data-dir", data)
        assert code == 0, err
        assert scored(out) == want and f"data: {where} {data}" in out
        assert ("note: if this is client" in out) == (where == "all images of")  # a device trains on most of it


def npz(path, x, y):
    np.savez(path, x_train=x, y_train=y)
    return path


def png_folder(root, name, size):
    (root / name).mkdir(parents=True)
    Image.new("L", size, 128).save(root / name / "a.png")
    return root


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda t, d: ["--data-dir", npz(t / "big.npz", np.zeros((3, 28, 28), np.uint8), np.arange(3))],
            "images are 28x28 (W x H); the model takes 8x8 images (1x8x8 (C x H x W)). Resize them, or pass --resize",
        ),
        (
            lambda t, d: ["--data-dir", png_folder(t / "f", "3", (16, 12))],
            "the image is 16x12 (W x H); the model takes 8x8",
        ),
        (
            lambda t, d: ["--data-dir", png_folder(t / "f", "cat", (8, 8))],
            "unknown class folder 'cat'; the model's classes are 0, 1, 2, 3, 4, 5, 6, 7, 8, 9",
        ),
        (
            lambda t, d: ["--data-dir", npz(t / "l.npz", d.x[:3], np.array([1, 12, 3]))],
            "label 12 is outside the model's 10 classes",
        ),
        (
            lambda t, d: ["--data-dir", npz(t / "n.npz", d.x[:2], np.array(["7", "seven"]))],
            "unknown class name(s) ['seven']",
        ),
        (lambda t, d: ["--dataset", "mnist-5k"], "takes 1x8x8 (C x H x W) inputs, mnist-5k's images are 1x28x28"),
        (lambda t, d: [], "say what to score the model on: --dataset NAME"),
        (lambda t, d: ["--dataset", "digits", "--data-dir", t], "say what to score the model on"),
        (lambda t, d: ["--dataset", "digits", "--limit", "0"], "--limit must be at least 1, got 0"),
        (
            lambda t, d: ["--data-dir", sorted_npz(t / "s.npz", d), "--client", "0"],
            "--client, --config and --data go with --dataset",
        ),
        (lambda t, d: ["--dataset", "digits", "--config", t / "config.json"], "--config goes with --client"),
        (lambda t, d: ["--dataset", "digits", "--resize"], "--resize goes with --data-dir"),
    ],
)
def test_each_mismatch_is_a_one_line_error(teacher, digits, tmp_path, capsys, make, message):
    code, out, err = cli(capsys, "predict", teacher[1], *make(tmp_path, digits))
    assert code == 2 and out == ""
    assert err.startswith("fedge: error:") and message in err and len(err.strip().splitlines()) == 1, err


def test_resize_reads_other_sizes_as_a_device_does(teacher, tmp_path, capsys):
    data = npz(tmp_path / "big.npz", np.zeros((3, 28, 28), np.uint8), np.arange(3))
    code, out, err = cli(capsys, "predict", teacher[1], "--data-dir", data, "--resize")
    assert code == 0, err
    assert scored(out)[1] == 3


def test_a_model_without_fedge_metadata_cannot_read_own_data_nor_a_dataset_of_other_classes(digits, tmp_path, capsys):
    spec = create("cnn1", digits.input_shape, digits.num_classes)
    sample, state = digits.tensors(stratified_sample(digits.y, 8, seed=0))[0], fresh(spec)
    bare = export_onnx(spec, state, tmp_path / "bare.onnx", sample, {}).path
    code, _, err = cli(capsys, "predict", bare, "--data-dir", sorted_npz(tmp_path / "s.npz", digits))
    assert code == 2 and "lacks the metadata class_names, mean, std that reading your own data needs" in err
    letters = json.dumps(list("abcdefghij"))
    other = export_onnx(spec, state, tmp_path / "other.onnx", sample, {"class_names": letters}).path
    code, _, err = cli(capsys, "predict", other, "--dataset", "digits")
    assert code == 2 and "was trained on classes a, b, c, d, e, f, g, h, i, j; digits has 0, 1, 2" in err
    code, out, err = cli(capsys, "predict", bare, "--dataset", "digits", "--limit", "100")
    assert code == 0 and "trained: not a client's model" in out and "\nwarning:" not in out, err


def fresh(spec):
    torch.manual_seed(0)
    return build(spec).state_dict()


def test_a_shared_model_is_not_judged_by_its_clients_classes(tmp_path, capsys):
    from fedge.config import config_from
    from launch.simulation import run_simulation

    out = tmp_path / "heterofl"
    settings = dict(
        strategy="heterofl", dataset="digits", clients=3, active=3, rounds=1, local_epochs=1, transport="inproc"
    )
    run_simulation(config_from(settings | {"out": str(out), "seed": 0}), progress=False)
    model = out / "models" / "0" / "model.onnx"
    meta = onnx_metadata(model)
    assert meta["personalized"] == "false" and "client_classes" not in meta and meta["strategy"] == "heterofl"

    code, printed, err = cli(capsys, "predict", model, "--dataset", "digits")

    assert code == 0, err
    assert "trained: heterofl shares models between clients (not personalized)" in printed
    assert "\nwarning:" not in printed and "  held" not in printed


def test_scores_need_samples_and_the_run_shards_they_name(teacher, tmp_path, capsys):
    from fedge.config import config_from

    tiny = config_from(dict(dataset="digits", clients=3, active=3, partition="iid", max_samples_per_client=10))
    (tmp_path / "tiny.json").write_text(tiny.to_json())  # one sample of each class: no client keeps a test sample
    own = config_from(dict(dataset="digits", clients=3, active=3, data_dir=str(tmp_path / "client-{id}")))
    (tmp_path / "own.json").write_text(own.to_json())

    code, _, err = cli(
        capsys, "predict", teacher[1], "--dataset", "digits", "--client", "1", "--config", tmp_path / "tiny.json"
    )
    assert code == 2 and "client 1's test shard of digits holds no samples to score" in err
    code, _, err = cli(
        capsys, "predict", teacher[1], "--dataset", "digits", "--client", "1", "--config", tmp_path / "own.json"
    )
    assert code == 2 and "had its clients read their own data" in err and "with --data-dir" in err


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"client_classes": "[1, 2]"}, "'client_classes' should be a JSON object of class name: training samples"),
        ({"client_classes": '{"3": -1}'}, "'client_classes' should be a JSON object"),
        ({"mean": "0.5"}, "'mean' should be a JSON list of numbers, one per channel, got '0.5'"),
        ({"class_names": '"0123456789"'}, "'class_names' should be a JSON list of class names"),
        ({"class_names": "[0, 1"}, "'class_names' should be a JSON list of class names"),
    ],
)
def test_malformed_metadata_is_a_one_line_error(digits, tmp_path, capsys, meta, message):
    spec = create("cnn1", digits.input_shape, digits.num_classes)
    sample = digits.tensors(stratified_sample(digits.y, 8, seed=0))[0]
    path = export_onnx(spec, fresh(spec), tmp_path / "m.onnx", sample, meta).path
    code, out, err = cli(capsys, "predict", path, "--dataset", "digits")
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, err
