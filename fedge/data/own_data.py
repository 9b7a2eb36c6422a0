"""A device's own data (or the operator's public set): a folder of class folders of images, or an .npz, read
into the run's task — its input shape, class names and normalisation — within a memory limit.

Layouts:
- a folder `DIR/<class name>/<image>` (PNG or JPEG; other files such as `.DS_Store` are ignored), the label of
  an image being the position of its folder's name in the task's class names. An unlabelled set (a server's
  public set only) is a folder of images without class folders.
- an .npz (read with allow_pickle=False) holding `x_train, y_train` and optionally `x_test, y_test`; an
  unlabelled public set may hold only `x` (`x, y` is read as labelled). Images are (N, C, H, W), (N, H, W, C)
  or (N, H, W), uint8 or integer in 0..255, or float in [0, 1]; labels are integers (N,) or class names.

Conversions, each applied only where needed: grayscale to RGB (the gray value in every channel) and RGB to
grayscale (luma, ITU-R 601-2: 0.299 R + 0.587 G + 0.114 B; an alpha channel or palette is dropped first), and a
resize to the task's H x W (bilinear; a task with `resize=False`, as `fedge predict` makes without --resize, refuses
another size instead). Everything else (a wrong rank, a channel count other than 1 or 3, pixel
values out of range or NaN, labels outside the classes, an unknown or empty class folder, a corrupt or truncated
image, a folder without images) raises OwnDataError naming the file and what was expected.

Memory: sizes are checked as declared, before anything is decoded — the image count of a folder, each image's
pixels (its header), each .npz member's shape and dtype (its .npy header, against the bytes the member holds).
The reader's estimate (`max_bytes` of the read; `own_data_limit` of a device's memory) counts the raw arrays,
every float32 tensor it builds from them and the normalised copy; over the limit raises OwnDataError.
The headers (and a PNG's integrity) are read by fedge/data/data_files.py.
"""

from __future__ import annotations

import logging
import os
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedge import constants as C
from fedge.data.data_files import ZIP_ERRORS, BadMember, Member, load_member, npz_members, png_problem
from fedge.data.datasets import Dataset, normalise
from fedge.errors import UserError

log = logging.getLogger(__name__)
# Pillow modes of 8 bits per channel that convert to "L" or "RGB" without losing range.
_PIL_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")
_PIL_BYTES_PER_PIXEL = 4  # Pillow keeps every multi-band mode (RGB included) in 4 bytes a pixel
_F32 = 4
_MIB = 1 << 20


class OwnDataError(UserError, ValueError):
    """A device's own data (folder or .npz) that cannot be read into the run's task; the message names the file."""


def own_data_limit(memory_bytes: int) -> int:
    """The bytes a device with `memory_bytes` (its profile's) may spend reading its own data:
    C.OWN_DATA_MEMORY_SHARE of it. A negative memory raises ValueError."""
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
    return int(memory_bytes * C.OWN_DATA_MEMORY_SHARE)


@dataclass(frozen=True)
class DataTask:
    """What the run config (or, for `fedge predict`, a model's metadata: `owner` "model") states about every
    client's data: input shape (C, H, W), class names (a label is the position of its name) and per-channel
    mean/std of x/255; `resize` False refuses images of another H x W instead of resizing them. Inconsistent
    values raise OwnDataError."""

    input_shape: tuple[int, int, int]
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    owner: str = "run"
    resize: bool = True

    def __post_init__(self) -> None:
        c = self.input_shape[0] if len(self.input_shape) == 3 else 0
        if len(self.input_shape) != 3 or min(self.input_shape) < 1:
            raise OwnDataError(f"input_shape must be three positive integers C, H, W, got {self.input_shape}")
        if len(self.classes) < 2 or len(set(self.classes)) != len(self.classes):
            raise OwnDataError(f"class_names must name at least 2 distinct classes, got {self.classes}")
        if len(self.mean) != c or len(self.std) != c or min(self.std) <= 0:
            raise OwnDataError(
                f"norm_mean and norm_std need {c} entries (one per channel) and std > 0, "
                f"got mean {self.mean}, std {self.std}"
            )

    @classmethod
    def of(cls, ds: Dataset) -> DataTask:
        """The task of a registered dataset: its shape, classes and channel statistics."""
        return cls(ds.input_shape, ds.classes, ds.mean, ds.std)

    @property
    def shape_text(self) -> str:
        c, h, w = self.input_shape
        return f"{c}x{h}x{w} (C x H x W)"


@dataclass(frozen=True)
class OwnData:
    """Normalised float32 NCHW images and int64 labels; the test split is the file's own or held out (seeded)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def read_own_data(
    path: str | Path,
    task: DataTask,
    seed: int,
    test_fraction: float = C.OWN_TEST_FRACTION,
    max_bytes: int = C.OWN_DATA_DEFAULT_MAX_BYTES,
) -> OwnData:
    """A client's labelled data at `path` (folder or .npz) in the task's shape, normalised. Without a test split
    of its own, `test_fraction` of each class is held out, chosen by `seed` (the same seed, the same split).
    Bad input, or data whose declared size needs more than `max_bytes` to read (a device passes
    `own_data_limit` of its profile's memory), raises OwnDataError naming the file (see the module docstring)."""
    path = Path(path).expanduser()
    x, y, x_test, y_test = _read(path, task, True, max_bytes)
    assert y is not None
    if x_test is None or y_test is None:
        train, test = held_out_split(y, test_fraction, seed, path)
        x, y, x_test, y_test = x[train], y[train], x[test], y[test]
    log.info("own data %s: %d training and %d test examples", path, len(y), len(y_test))
    return OwnData(
        normalise(x, task.mean, task.std),
        torch.from_numpy(y),
        normalise(x_test, task.mean, task.std),
        torch.from_numpy(y_test),
    )


def read_labelled(
    path: str | Path, task: DataTask, max_bytes: int = C.OWN_DATA_DEFAULT_MAX_BYTES
) -> tuple[np.ndarray, np.ndarray, str, bool]:
    """Labelled data at `path` to evaluate a model on: (images float32 NCHW in [0, 1], int64 labels, which
    part was read, whether that is a test split). An .npz with a test split gives that split alone (its training
    part is what a device trained on); otherwise every image. Unlabelled or bad input, or more than `max_bytes`
    to read, raises OwnDataError (see the module docstring)."""
    path = Path(path).expanduser()
    x, y, x_test, y_test = _read(path, task, True, max_bytes)
    if x_test is not None and y_test is not None:
        return x_test, y_test, f"the test split (x_test, y_test) of {path}", True
    assert y is not None
    where = f"all images of {path}" if path.is_dir() else f"x_train, y_train of {path} (it has no test split)"
    return x, y, where, False


def read_public_data(
    path: str | Path, task: DataTask, max_bytes: int = C.OWN_DATA_DEFAULT_MAX_BYTES
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The server's public set at `path`: all its images normalised, with labels when it has them (class folders,
    or `y`/`y_train` in an .npz; a test split, if any, is added). Bad input, or more than `max_bytes` to read,
    raises OwnDataError."""
    path = Path(path).expanduser()
    x, y, x_test, y_test = _read(path, task, None, max_bytes)
    if x_test is not None and y is not None and y_test is not None:
        x, y = np.concatenate([x, x_test]), np.concatenate([y, y_test])
    return normalise(x, task.mean, task.std), None if y is None else torch.from_numpy(y)


def held_out_split(y: np.ndarray, fraction: float, seed: int, where: Path) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices: round(fraction * n) of each class to test, at least one example in all,
    drawn by `seed`. Fewer than 2 examples raise OwnDataError."""
    if len(y) < 2:
        raise OwnDataError(f"{where}: {len(y)} example(s); need at least 2 to hold out a test split")
    rng = np.random.default_rng(seed)
    test: list[np.ndarray] = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = min(int(round(fraction * len(idx))), len(idx) - 1)
        test.append(idx[:k])
    held = np.concatenate(test)
    if held.size == 0:
        held = rng.permutation(len(y))[:1]
    mask = np.zeros(len(y), dtype=bool)
    mask[held] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


Arrays = tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]


def _read(path: Path, task: DataTask, labelled: bool | None, max_bytes: int) -> Arrays:
    """(x_train float32 NCHW in [0, 1], y_train or None, x_test or None, y_test or None). `labelled`: True
    demands labels, None takes what is there."""
    if not path.exists():
        raise OwnDataError(f"data path {str(path)!r} does not exist; expected a folder of class folders or an .npz")
    if path.is_file():
        if path.suffix.lower() != ".npz":
            raise OwnDataError(f"{path}: not an .npz file; expected a folder of class folders or an .npz")
        return _read_npz(path, task, labelled, max_bytes)
    return _read_folder(path, task, labelled, max_bytes)


def _over_limit(what: str, need: str, max_bytes: int, advice: str) -> OwnDataError:
    """The refusal of data that needs more than `max_bytes` to read: `what` needs `need`, and what to do."""
    return OwnDataError(
        f"{what} need {need} to read, over this reader's limit of {max_bytes / _MIB:.1f} MiB "
        f"({C.OWN_DATA_MEMORY_SHARE:g} of the device profile's memory_bytes; "
        f"{C.OWN_DATA_DEFAULT_MAX_BYTES / _MIB:.0f} MiB without a profile); {advice}"
    )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


# ------------------------------------------------------------------------------------------------ folders


def _images_in(folder: Path, room: int) -> list[Path]:
    """The folder's image files, sorted; listing stops after `room` + 1 of them (more than the caller can take)."""
    found: list[Path] = []
    with os.scandir(folder) as entries:
        for e in entries:
            if e.name[:1] != "." and Path(e.name).suffix.lower() in C.IMAGE_EXTENSIONS and e.is_file():
                found.append(folder / e.name)
                if len(found) > room:
                    break
    return sorted(found)


def _read_folder(root: Path, task: DataTask, labelled: bool | None, max_bytes: int) -> Arrays:
    c, h, w = task.input_shape
    per_image = 3 * _F32 * c * h * w  # its float32 tensor, the split's copy of it and the normalised copy
    room = max_bytes // per_image
    folders = sorted(p for p in root.iterdir() if p.is_dir() and p.name[:1] != ".")
    loose = _images_in(root, room)
    expected = f"class folders named {', '.join(task.classes)} holding {', '.join(C.IMAGE_EXTENSIONS)} images"
    if folders and loose:
        raise OwnDataError(f"{root}: has both class folders and loose images ({loose[0].name}); expected {expected}")
    files, labels = loose, []
    if not folders:
        if not loose:
            raise OwnDataError(f"{root}: no images; expected {expected}")
        if labelled:
            raise OwnDataError(f"{root}: images without class folders have no labels; expected {expected}")
    for folder in folders:
        if folder.name not in task.classes:
            raise OwnDataError(
                f"{folder}: unknown class folder {folder.name!r}; the {task.owner}'s classes are "
                f"{', '.join(task.classes)}"
            )
        found = _images_in(folder, room - len(files))
        if not found:
            raise OwnDataError(f"{folder}: class folder {folder.name!r} has no {', '.join(C.IMAGE_EXTENSIONS)} images")
        files = files + found
        labels += [task.classes.index(folder.name)] * len(found)
        if len(files) > room:
            break
    if len(files) > room:
        raise _over_limit(
            f"{root}: more than {room} images, as float32 {task.shape_text} tensors,",
            f"over {len(files) * per_image / _MIB:.1f} MiB",
            max_bytes,
            "use fewer images, or a device with more memory",
        )
    x = np.empty((len(files), c, h, w), np.float32)
    spare = max_bytes - len(files) * per_image
    for i, p in enumerate(files):
        x[i] = _read_image(p, task, spare)
    return x, np.asarray(labels, dtype=np.int64) if folders else None, None, None


def _read_image(path: Path, task: DataTask, spare: int) -> np.ndarray:
    """One image as float32 (C, H, W) in [0, 1]: to grayscale or RGB and resized to H x W (bilinear) if needed.
    Its declared size is checked before it is decoded: decoding may use `spare` bytes."""
    from PIL import Image, UnidentifiedImageError

    c, h, w = task.input_shape
    if c not in (1, 3):
        raise OwnDataError(f"{path}: images fill 1 (grayscale) or 3 (RGB) channels; the task's input is {c} channels")
    try:
        with warnings.catch_warnings():
            # Pillow warns above Image.MAX_IMAGE_PIXELS and refuses twice that ("decompression bomb"): a refusal
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            opened = Image.open(path, formats=("PNG", "JPEG"))  # reads the header only
        with opened as img:
            _check_header(path, img.size, img.mode, task, spare)
            problem = png_problem(path) if img.format == "PNG" else None  # Pillow leaves a short stream's rows black
            if problem:
                raise OwnDataError(
                    f"{path}: the PNG is truncated or corrupt ({problem}); copy or export the image again"
                )
            img.load()
            img = img.convert("L" if c == 1 else "RGB")
            if img.size != (w, h):
                _refuse_size(task, f"{path}: the image is {img.size[0]}x{img.size[1]} (W x H)")
                img = img.resize((w, h), Image.Resampling.BILINEAR)
            pixels = np.asarray(img, dtype=np.float32) / 255.0
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise OwnDataError(
            f"{path}: refused before decoding: {_one_line(e)} Downscale it (the {task.owner} takes {w}x{h} images)"
        ) from None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError, zlib.error) as e:
        if isinstance(e, OwnDataError):
            raise
        raise OwnDataError(f"{path}: cannot read the image (corrupt or not a PNG/JPEG): {_one_line(e)}") from None
    return pixels[None] if c == 1 else pixels.transpose(2, 0, 1)


def _check_header(path: Path, size: tuple[int, int], mode: str, task: DataTask, spare: int) -> None:
    """OwnDataError for an image, as its header declares it, of an unsupported mode, more than
    C.OWN_IMAGE_MAX_PIXELS pixels, or whose decoding (Pillow's pixels and their conversion) needs over `spare`."""
    c, h, w = task.input_shape
    if mode not in _PIL_MODES:
        raise OwnDataError(
            f"{path}: image mode {mode} (more than 8 bits per channel) is not supported; "
            f"save it as 8-bit grayscale or RGB for the task's {task.shape_text}"
        )
    pixels = size[0] * size[1]
    if pixels > C.OWN_IMAGE_MAX_PIXELS:
        raise OwnDataError(
            f"{path}: the image declares {size[0]}x{size[1]} (W x H) = {pixels:,} pixels, more than the "
            f"{C.OWN_IMAGE_MAX_PIXELS:,} an image may have; downscale it (the {task.owner} takes {w}x{h} images)"
        )
    need = pixels * (_PIL_BYTES_PER_PIXEL + (1 if c == 1 else _PIL_BYTES_PER_PIXEL))
    if need > spare:
        raise _over_limit(
            f"{path}: the image's {size[0]}x{size[1]} (W x H) pixels",
            f"{need / _MIB:.1f} MiB",
            spare,
            f"downscale it (the {task.owner} takes {w}x{h} images), or use fewer images",
        )


# ------------------------------------------------------------------------------------------------ .npz


def _read_npz(path: Path, task: DataTask, labelled: bool | None, max_bytes: int) -> Arrays:
    try:
        with zipfile.ZipFile(path) as zf:
            members = npz_members(zf)
            x_key, y_key = _npz_keys(path, members, labelled)
            wanted = [k for k in (x_key, y_key, "x_test", "y_test") if k in members]
            need = sum(_member_cost(members[k], task, images=k[0] == "x") for k in wanted)
            if need > max_bytes:
                declared = ", ".join(f"{k} {members[k].shape} {members[k].dtype}" for k in wanted)
                raise _over_limit(
                    f"{path}: {declared}",
                    f"{need / _MIB:.1f} MiB as raw and float32 arrays",
                    max_bytes,
                    f"use fewer images, or store them as uint8 at the task's {task.shape_text}",
                )
            arrays = {k: load_member(zf, members[k]) for k in wanted}
    except OwnDataError:
        raise
    except BadMember as e:
        raise OwnDataError(f"{path}: {e}") from None
    except ZIP_ERRORS as e:
        raise OwnDataError(
            f"{path}: cannot read it as an .npz of arrays (corrupt, or holds pickled objects): {_one_line(e)}"
        ) from None
    x = _images(arrays.pop(x_key), task, f"{path}: {x_key}")
    y = _labels(arrays.pop(y_key), len(x), task, f"{path}: {y_key}") if y_key in arrays else None
    if "x_test" not in arrays:
        return x, y, None, None
    x_test = _images(arrays.pop("x_test"), task, f"{path}: x_test")
    return x, y, x_test, _labels(arrays.pop("y_test"), len(x_test), task, f"{path}: y_test")


def _npz_keys(path: Path, members: dict[str, Member], labelled: bool | None) -> tuple[str, str]:
    """The (images, labels) keys of an .npz; a missing or unpaired one raises OwnDataError."""
    keys = sorted(members)
    if "x_train" in members:
        x_key, y_key = "x_train", "y_train"
    elif "x" in members and labelled is None:
        x_key, y_key = "x", "y"
    else:
        want = "x_train, y_train (and optionally x_test, y_test)" + ("" if labelled else ", or x (unlabelled)")
        raise OwnDataError(f"{path}: holds {keys}; expected {want}")
    if labelled and y_key not in members:
        raise OwnDataError(f"{path}: has {x_key} but no {y_key}; a client's data needs labels")
    if ("x_test" in members) != ("y_test" in members):
        raise OwnDataError(f"{path}: x_test and y_test come together; it holds {keys}")
    return x_key, y_key


def _member_cost(m: Member, task: DataTask, images: bool) -> int:
    """Bytes reading member `m` takes at most: its raw array and, for images, every float32 tensor _images builds
    of it (the file's shape, its channels converted, its size changed) and the normalised copy; for labels, their
    decoded names and the int64 copy."""
    n = m.shape[0] if m.shape else 1
    if not images:
        return 2 * m.nbytes + 8 * n
    layout = _layout(m.shape, task)
    if layout is None:
        return m.nbytes  # refused by _images before any conversion
    cs, hs, ws, _ = layout
    c, h, w = task.input_shape
    converted = 0 if cs == c else c * hs * ws + (cs * hs * ws if c == 1 else 0)  # luma's weighted product
    floats = cs * hs * ws + converted + (c * h * w if (hs, ws) != (h, w) else 0) + c * h * w
    return m.nbytes + _F32 * n * floats


def _layout(shape: tuple[int, ...], task: DataTask) -> tuple[int, int, int, bool] | None:
    """(C, H, W, channels last) of the images of an array of `shape`: (N, H, W) is grayscale, (N, H, W, C)
    channels last when its 2nd axis cannot be channels; None for a shape that is not images of the task."""
    if len(shape) == 3:
        return 1, shape[1], shape[2], False
    if len(shape) == 4 and shape[1] not in (1, 3) and shape[3] in (1, 3):
        return shape[3], shape[1], shape[2], True
    if len(shape) != 4 or (shape[1:] != tuple(task.input_shape) and shape[1] not in (1, 3)):
        return None
    return shape[1], shape[2], shape[3], False


def _images(a: np.ndarray, task: DataTask, where: str) -> np.ndarray:
    """Float32 (N, C, H, W) in [0, 1] in the task's shape, converting channels and size where needed."""
    c, h, w = task.input_shape
    expected = f"expected images (N, {c}, {h}, {w}), (N, {h}, {w}, {c})" + (f" or (N, {h}, {w})" if c == 1 else "")
    layout = _layout(a.shape, task)
    if layout is None:
        raise OwnDataError(f"{where} has shape {a.shape}; {expected}")
    a = a[:, None] if a.ndim == 3 else a.transpose(0, 3, 1, 2) if layout[3] else a
    if len(a) == 0:
        raise OwnDataError(f"{where} holds no images; {expected}")
    if a.dtype.kind in "iu":
        if a.min() < 0 or a.max() > 255:
            raise OwnDataError(f"{where}: integer pixels must lie in 0..255, found {a.min()}..{a.max()}")
        f = a.astype(np.float32)
        f /= np.float32(255.0)  # in place: no second copy of the dataset
        x = torch.from_numpy(f)
    elif a.dtype.kind == "f":
        if not np.isfinite(a).all():
            raise OwnDataError(f"{where}: has NaN or infinite pixels")
        if a.min() < 0 or a.max() > 1:
            raise OwnDataError(f"{where}: float pixels must lie in [0, 1] (or store uint8 0..255)")
        x = torch.from_numpy(a.astype(np.float32))
    else:
        raise OwnDataError(f"{where}: pixels of type {a.dtype}; expected uint8 0..255 or float in [0, 1]")
    del a
    if x.shape[1] != c:
        if c not in (1, 3):
            raise OwnDataError(f"{where} has {x.shape[1]} channels; {expected}")
        x = x.repeat(1, 3, 1, 1) if c == 3 else (x * torch.tensor(C.LUMA_WEIGHTS).view(1, 3, 1, 1)).sum(1, True)
    if x.shape[2:] != (h, w):
        _refuse_size(task, f"{where}: images are {x.shape[3]}x{x.shape[2]} (W x H)")
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
    return x.numpy()


def _labels(a: np.ndarray, n: int, task: DataTask, where: str) -> np.ndarray:
    """Int64 labels (n,) in [0, classes): integers, or class names mapped to their position."""
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1 or len(a) != n:
        raise OwnDataError(f"{where} has shape {a.shape}; expected ({n},), one label per image")
    if a.dtype.kind in "US":
        names = [v.decode() if isinstance(v, bytes) else str(v) for v in a.tolist()]
        unknown = sorted(set(names) - set(task.classes))
        if unknown:
            raise OwnDataError(
                f"{where}: unknown class name(s) {unknown[:5]}; the {task.owner}'s classes are {task.classes}"
            )
        return np.asarray([task.classes.index(v) for v in names], dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise OwnDataError(f"{where}: labels of type {a.dtype}; expected integers or class names")
    if n and (a.min() < 0 or a.max() >= len(task.classes)):
        raise OwnDataError(
            f"{where}: label {a.min() if a.min() < 0 else a.max()} is outside the {task.owner}'s "
            f"{len(task.classes)} classes (0..{len(task.classes) - 1})"
        )
    return a.astype(np.int64)


def _refuse_size(task: DataTask, what: str) -> None:
    """OwnDataError when the task does not resize: `what` (the file and its size) against the task's."""
    if not task.resize:
        _, h, w = task.input_shape
        raise OwnDataError(
            f"{what}; the {task.owner} takes {w}x{h} images ({task.shape_text}). Resize them, or pass --resize "
            "to resize them as a device's reader does (bilinear)"
        )
