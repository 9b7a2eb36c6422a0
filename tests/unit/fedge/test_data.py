"""Tests for fedge.data.datasets: the dataset registry, embedded datasets and the file formats it parses."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from fedge.data.datasets import (
    CIFAR10_CLASSES,
    Dataset,
    DatasetError,
    list_datasets,
    load_dataset,
    make_dataset,
    read_idx,
)

pytestmark = pytest.mark.timeout(120)

SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + array.astype(np.uint8).tobytes()
    with (gzip.open if path.suffix == ".gz" else open)(path, "wb") as fh:
        fh.write(payload)


def _write_cifar_bin(path: Path, labels: list[int], first_pixels: list[tuple[int, int, int]]) -> None:
    records = []
    for label, (r, g, b) in zip(labels, first_pixels):
        planes = np.zeros((3, 32, 32), dtype=np.uint8)
        planes[:, 0, 0] = (r, g, b)
        planes[2, 31, 31] = 7  # last byte of the record: checks the record length
        records.append(bytes([label]) + planes.tobytes())
    path.write_bytes(b"".join(records))


# ---------------------------------------------------------------- registry and embedded data


def test_registry_lists_all_datasets() -> None:
    assert list_datasets() == ["cifar10", "digits", "mnist", "mnist-5k", "svhn"]


def test_mnist_5k_loads_500_real_digits_per_class() -> None:
    ds = load_dataset("mnist-5k")

    assert ds.x.shape == (5000, 1, 28, 28) and ds.x.dtype == np.uint8
    assert ds.y.dtype == np.int64
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    assert ds.classes == tuple(str(d) for d in range(10))
    assert np.bincount(ds.y).tolist() == [500] * 10
    assert ds.x.max() == 255 and ds.x.min() == 0
    assert 0.10 < ds.mean[0] < 0.16 and 0.28 < ds.std[0] < 0.34  # MNIST: 0.1307, 0.3081


def test_digits_loads_as_8x8_scaled_to_255() -> None:
    ds = load_dataset("digits")

    assert ds.x.shape == (1797, 1, 8, 8) and ds.x.dtype == np.uint8
    assert ds.num_classes == 10
    assert ds.x.max() == 255  # 16 * 255 / 16
    raw = load_digits().images  # 0..16
    assert (ds.x[:, 0][raw == 16] == 255).all() and (ds.x[:, 0][raw == 0] == 0).all()
    assert (ds.x[:, 0][raw == 8] == 128).all()  # 127.5 rounded
    assert (ds.x[:, 0][raw == 1] == 16).all()  # 15.94 rounded


def test_load_is_cached_and_arrays_are_read_only() -> None:
    first, second = load_dataset("digits"), load_dataset("digits")

    assert first is second
    with pytest.raises(ValueError):
        first.x[0, 0, 0, 0] = 1


def test_tensors_normalise_whole_set_to_zero_mean_unit_std() -> None:
    ds = load_dataset("mnist-5k")

    images, labels = ds.tensors(np.arange(len(ds)))

    assert images.shape == (5000, 1, 28, 28) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.tolist() == ds.y.tolist()
    assert abs(images.mean().item()) < 1e-4
    assert abs(images.std().item() - 1.0) < 1e-3


def test_tensors_hand_checked_values() -> None:
    x = np.array([0, 255, 0, 255], dtype=np.uint8).reshape(4, 1, 1, 1)
    ds = make_dataset("toy", x, np.array([0, 1, 0, 1]), ("a", "b"))

    images, labels = ds.tensors(np.array([1, 0]))

    assert ds.mean == (0.5,) and ds.std == (0.5,)
    assert images.flatten().tolist() == [1.0, -1.0]  # (1 - 0.5) / 0.5, (0 - 0.5) / 0.5
    assert labels.tolist() == [1, 0]


def test_tensors_per_channel_statistics() -> None:
    x = np.zeros((2, 3, 1, 1), dtype=np.uint8)
    x[:, 0] = 51  # constant channel: std 0 -> replaced by 1.0
    x[0, 1], x[1, 1] = 0, 102
    ds = make_dataset("toy", x, np.array([0, 0]), ("a",))

    assert ds.mean == pytest.approx((0.2, 0.2, 0.0))
    assert ds.std == pytest.approx((1.0, 0.2, 1.0))


def test_tensors_reject_bad_indices() -> None:
    ds = load_dataset("digits")
    with pytest.raises(DatasetError, match="out of range"):
        ds.tensors(np.array([0, 1797]))
    with pytest.raises(DatasetError, match="1-D integer"):
        ds.tensors(np.array([0.5]))


def test_dataset_rejects_bad_arrays() -> None:
    with pytest.raises(DatasetError, match="labels must lie"):
        make_dataset("toy", np.zeros((2, 1, 2, 2), np.uint8), np.array([0, 2]), ("a", "b"))
    with pytest.raises(DatasetError, match="uint8"):
        make_dataset("toy", np.zeros((2, 1, 2, 2), np.float32), np.array([0, 1]), ("a", "b"))
    with pytest.raises(DatasetError, match=r"y int64 \(N,\)"):
        Dataset("toy", np.zeros((2, 1, 2, 2), np.uint8), np.zeros(3, np.int64), ("a",), (0.0,), (1.0,))


def test_unknown_dataset_lists_available_names() -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset("imagenet")
    for name in ("cifar10", "digits", "mnist", "mnist-5k", "svhn"):
        assert name in str(info.value)


def test_embedded_dataset_refuses_a_data_path(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="embedded"):
        load_dataset("mnist-5k", tmp_path)


def test_missing_root_says_path_files_and_how(tmp_path: Path) -> None:
    missing = tmp_path / "nope.npz"
    with pytest.raises(DatasetError) as info:
        load_dataset("mnist", missing)
    message = str(info.value)
    assert str(missing) in message and "does not exist" in message
    assert "train-images-idx3-ubyte" in message and "x_train" in message and "--data" in message


def test_empty_directory_says_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="test_32x32.mat"):
        load_dataset("svhn", tmp_path)


def test_no_root_without_torchvision_asks_for_data_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes the import fail
    with pytest.raises(DatasetError, match=r"torchvision is not installed.*--data"):
        load_dataset("cifar10")


# ---------------------------------------------------------------- .npz files


def test_npz_nhw_is_pooled_train_then_test(tmp_path: Path) -> None:
    x_train = np.arange(3 * 28 * 28, dtype=np.int64).reshape(3, 28, 28) % 256
    x_test = np.full((2, 28, 28), 9, dtype=np.uint8)
    path = tmp_path / "mnist.npz"
    np.savez(
        path,
        x_train=x_train.astype(np.uint8),
        y_train=np.array([1, 2, 3], np.uint8),
        x_test=x_test,
        y_test=np.array([[0], [9]], np.uint8),
    )

    ds = load_dataset("mnist", path)

    assert ds.x.shape == (5, 1, 28, 28)
    assert ds.y.tolist() == [1, 2, 3, 0, 9]
    assert ds.x[1, 0, 0, 0] == (28 * 28) % 256 and ds.x[4, 0, 5, 5] == 9


def test_npz_nhwc_becomes_nchw(tmp_path: Path) -> None:
    x_train = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    x_train[0, 1, 2] = (10, 20, 30)  # pixel (row 1, col 2) of image 0, RGB
    path = tmp_path / "c.npz"
    np.savez(
        path, x_train=x_train, y_train=np.array([3, 4]), x_test=np.zeros((1, 32, 32, 3), np.uint8), y_test=np.array([9])
    )

    ds = load_dataset("cifar10", path)

    assert ds.x.shape == (3, 3, 32, 32)
    assert ds.x[0, :, 1, 2].tolist() == [10, 20, 30]
    assert ds.classes == CIFAR10_CLASSES and ds.classes[9] == "truck"


def test_directory_with_named_npz_is_used(tmp_path: Path) -> None:
    np.savez(
        tmp_path / "mnist.npz",
        x_train=np.zeros((1, 28, 28), np.uint8),
        y_train=np.array([5]),
        x_test=np.zeros((1, 28, 28), np.uint8),
        y_test=np.array([6]),
    )
    assert load_dataset("mnist", tmp_path).y.tolist() == [5, 6]


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"x_train": np.zeros((1, 28, 28), np.uint8), "y_train": np.array([0])}, "lacks arrays"),
        (
            {
                "x_train": np.zeros((1, 32, 32, 3), np.uint8),
                "y_train": np.array([0]),
                "x_test": np.zeros((1, 32, 32, 3), np.uint8),
                "y_test": np.array([0]),
            },
            r"NHWC \(N, 28, 28, 1\)",
        ),
        (
            {
                "x_train": np.zeros((1, 28, 28)),
                "y_train": np.array([0]),
                "x_test": np.zeros((1, 28, 28), np.uint8),
                "y_test": np.array([0]),
            },
            "integer images",
        ),
        (
            {
                "x_train": np.zeros((1, 28, 28), np.uint8),
                "y_train": np.array([10]),
                "x_test": np.zeros((1, 28, 28), np.uint8),
                "y_test": np.array([0]),
            },
            r"labels must lie in \[0, 10\)",
        ),
        (
            {
                "x_train": np.zeros((2, 28, 28), np.uint8),
                "y_train": np.array([0]),
                "x_test": np.zeros((1, 28, 28), np.uint8),
                "y_test": np.array([0]),
            },
            "labels",
        ),
    ],
)
def test_bad_npz_contents_are_rejected(tmp_path: Path, arrays: dict[str, np.ndarray], match: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DatasetError, match=match):
        load_dataset("mnist", path)


def test_npz_with_object_arrays_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pickled.npz"
    objects = np.array([{"a": 1}], dtype=object)
    np.savez(path, x_train=objects, y_train=objects, x_test=objects, y_test=objects)
    with pytest.raises(DatasetError, match="pickle-free"):
        load_dataset("mnist", path)


def test_non_npz_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "data.pkl"
    path.write_bytes(b"not read")
    with pytest.raises(DatasetError, match="not an .npz"):
        load_dataset("mnist", path)


def test_random_bytes_named_npz_are_called_what_they_are(tmp_path: Path) -> None:
    path = tmp_path / "mnist.npz"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(DatasetError) as info:
        load_dataset("mnist", path)
    message = str(info.value)
    assert "is not an .npz file" in message and str(path) in message and "pickled" not in message


# ---------------------------------------------------------------- official layouts


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_directory(tmp_path: Path, gz: bool) -> None:
    suffix = ".gz" if gz else ""
    train = np.arange(2 * 28 * 28).reshape(2, 28, 28) % 251
    _write_idx(tmp_path / f"train-images-idx3-ubyte{suffix}", train)
    _write_idx(tmp_path / f"train-labels-idx1-ubyte{suffix}", np.array([7, 3]))
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", np.full((1, 28, 28), 200))  # mixed .gz / plain
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([1]))

    ds = load_dataset("mnist", tmp_path)

    assert ds.x.shape == (3, 1, 28, 28)
    assert ds.y.tolist() == [7, 3, 1]
    assert np.array_equal(ds.x[:2, 0], train.astype(np.uint8)) and ds.x[2].min() == 200


def test_read_idx_rejects_truncated_and_foreign_files(tmp_path: Path) -> None:
    good = tmp_path / "ok-idx1-ubyte"
    _write_idx(good, np.array([1, 2, 3]))
    assert read_idx(good).tolist() == [1, 2, 3]
    truncated = tmp_path / "short"
    truncated.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(DatasetError, match="truncated"):
        read_idx(truncated)
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"\x80\x04garbage")
    with pytest.raises(DatasetError, match="magic"):
        read_idx(foreign)


def test_mnist_directory_with_some_files_names_the_missing_ones(tmp_path: Path) -> None:
    _write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((1, 28, 28)))
    with pytest.raises(DatasetError, match="t10k-labels-idx1-ubyte"):
        load_dataset("mnist", tmp_path)


def test_cifar_binary_batches(tmp_path: Path) -> None:
    batches = tmp_path / "cifar-10-batches-bin"
    batches.mkdir()
    for i in range(1, 6):
        _write_cifar_bin(batches / f"data_batch_{i}.bin", [i], [(i, 2 * i, 3 * i)])
    _write_cifar_bin(batches / "test_batch.bin", [0, 9], [(100, 110, 120), (0, 0, 0)])

    ds = load_dataset("cifar10", tmp_path)

    assert ds.x.shape == (7, 3, 32, 32)
    assert ds.y.tolist() == [1, 2, 3, 4, 5, 0, 9]
    assert ds.x[1, :, 0, 0].tolist() == [2, 4, 6]  # R, G, B planes of data_batch_2's image
    assert ds.x[5, :, 0, 0].tolist() == [100, 110, 120]
    assert (ds.x[:, 2, 31, 31] == 7).all()


def test_cifar_binary_with_partial_record_is_rejected(tmp_path: Path) -> None:
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        _write_cifar_bin(tmp_path / name, [0], [(0, 0, 0)])
    (tmp_path / "test_batch.bin").write_bytes(b"\x00" * 3072)
    with pytest.raises(DatasetError, match="3073-byte record"):
        load_dataset("cifar10", tmp_path)


def test_cifar_python_pickle_layout_is_refused(tmp_path: Path) -> None:
    pickled = tmp_path / "cifar-10-batches-py"
    pickled.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (pickled / name).write_bytes(b"\x80\x04 never unpickled")
    with pytest.raises(DatasetError) as info:
        load_dataset("cifar10", tmp_path)
    message = str(info.value)
    assert "cifar-10-batches-py" in message and "pickle" in message and "safety" in message
    assert "binary version" in message and ".npz" in message


def test_svhn_mat_files_map_label_10_to_0(tmp_path: Path) -> None:
    scipy_io = pytest.importorskip("scipy.io")
    x = np.zeros((32, 32, 3, 2), dtype=np.uint8)
    x[4, 5, :, 1] = (1, 2, 3)  # image 1, row 4, col 5
    scipy_io.savemat(tmp_path / "train_32x32.mat", {"X": x, "y": np.array([[10], [3]], np.uint8)})
    scipy_io.savemat(tmp_path / "test_32x32.mat", {"X": x[..., :1], "y": np.array([[1]], np.uint8)})

    ds = load_dataset("svhn", tmp_path)

    assert ds.x.shape == (3, 3, 32, 32)
    assert ds.y.tolist() == [0, 3, 1]
    assert ds.x[1, :, 4, 5].tolist() == [1, 2, 3]


# ---------------------------------------------------------------- shared benchmark data


@pytest.mark.skipif(not (SHARED_DATA / "mnist.npz").is_file(), reason="no ../shared/data/mnist.npz")
def test_shared_full_mnist_has_70000_samples() -> None:
    ds = load_dataset("mnist", SHARED_DATA / "mnist.npz")

    assert ds.x.shape == (70000, 1, 28, 28)
    assert np.bincount(ds.y)[0] == 5923 + 980  # official train + test counts of digit 0
