"""A device's own data cannot exhaust the device (issue 28, item 6): crafted images and .npz files whose headers
declare more than the device can hold, and truncated images, are refused before decoding with one line naming
the file, in the reader and through `fedge client --data-dir`, whose peak RSS stays within its profile's limit."""

from __future__ import annotations

import functools
import io
import os
import struct
import subprocess
import sys
import threading
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npy_format
from PIL import Image, ImageFile

from device_profiles import get_profile
from fedge import constants as C
from fedge.data.own_data import DataTask, OwnDataError, own_data_limit, read_labelled, read_own_data, read_public_data

pytestmark = pytest.mark.timeout(120)
TASK = DataTask((1, 28, 28), ("a", "b"), (0.5,), (0.25,))
SMALL = "rpi-zero-2w"  # the smallest device profile: 256 MiB, so a 64 MiB own-data limit
LIMIT = own_data_limit(get_profile(SMALL).memory_bytes)


# ------------------------------------------------------------------------------------------------ crafted files


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(width: int, height: int, idat: bytes, iend: bool = True, interlace: int = 0) -> bytes:
    """An 8-bit grayscale PNG written by hand: IHDR, one IDAT holding `idat`, IEND."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, interlace)
    head = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)
    return head + (chunk(b"IEND", b"") if iend else b"")


@functools.lru_cache(maxsize=1)
def zero_rows(side: int) -> bytes:
    """The zlib stream of a side x side black image, compressed row by row (never side² bytes in memory)."""
    z = zlib.compressobj(9)
    row = bytes(side + 1)
    return b"".join(z.compress(row) for _ in range(side)) + z.flush()


def npy_member(zf: zipfile.ZipFile, key: str, shape: tuple[int, ...], dtype: str, body: int | None = None) -> None:
    """An .npy member whose header declares `shape` and `dtype`, followed by `body` (default: all) zero bytes,
    written a MiB at a time."""
    with zf.open(f"{key}.npy", "w", force_zip64=True) as f:
        header = {"descr": npy_format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
        npy_format.write_array_header_1_0(f, header)
        left = int(np.prod(shape)) * np.dtype(dtype).itemsize if body is None else body
        block = bytes(1 << 20)
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)


def class_folder(root: Path, name: str, data: bytes) -> Path:
    """root/a/<name> holding `data`, beside an honest image in root/b: a folder that only `name` spoils."""
    for folder in ("a", "b"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    Image.new("L", (28, 28), 7).save(root / "b" / "honest.png")
    (root / "a" / name).write_bytes(data)
    return root


def bomb_png(tmp: Path) -> Path:
    """A 70-byte PNG declaring 65535 x 65535 pixels (4.3 G), no image data to speak of."""
    return class_folder(tmp / "bomb", "bomb.png", png_bytes(65535, 65535, zlib.compress(b"")))


def wide_png(tmp: Path) -> Path:
    """A ~0.15 MB PNG of a black 12000 x 12000 image, valid to the last byte (144 M pixels)."""
    return class_folder(tmp / "wide", "wide.png", png_bytes(12000, 12000, zero_rows(12000)))


def short_png(tmp: Path) -> Path:
    """A PNG with every chunk and CRC intact whose image stream stops after 10 of its 28 rows (Pillow alone
    leaves the other 18 black)."""
    return class_folder(tmp / "short", "short.png", png_bytes(28, 28, zlib.compress(bytes(29) * 10)))


def huge_npz(tmp: Path) -> Path:
    """A 0.4 kB .npz whose x_train header declares a (1e6, 1e6) float64 array (8 TB) with a 64-byte body."""
    with zipfile.ZipFile(tmp / "huge.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        npy_member(zf, "x_train", (1_000_000, 1_000_000), "<f8", body=64)
        npy_member(zf, "y_train", (4,), "<i8")
    return tmp / "huge.npz"


def zeros_npz(tmp: Path) -> Path:
    """A ~0.3 MB .npz of 400,000 black 28 x 28 uint8 images (314 MB decompressed, 1.25 GB as float32)."""
    with zipfile.ZipFile(tmp / "zeros.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        npy_member(zf, "x_train", (400_000, 28, 28), "|u1")
        npy_member(zf, "y_train", (400_000,), "|u1")
    return tmp / "zeros.npz"


CRAFTED = {
    "bomb.png": (bomb_png, r"bomb.png: refused before decoding: Image size \(4294836225 pixels\) exceeds"),
    "wide.png": (wide_png, r"wide.png: refused before decoding: Image size \(144000000 pixels\) exceeds"),
    "short.png": (short_png, r"short.png: the PNG is truncated or corrupt \(its image data hold 290 of the 812"),
    "huge.npz": (huge_npz, r"huge.npz: x_train declares a \(1000000, 1000000\) float64 array of 8,000,000,000,000"),
    "zeros.npz": (zeros_npz, r"zeros.npz: x_train \(400000, 28, 28\) uint8, .* over this reader's limit of 64.0"),
}


def refusal(path: Path, max_bytes: int = LIMIT) -> str:
    with pytest.raises(OwnDataError) as e:
        read_own_data(path, TASK, seed=0, max_bytes=max_bytes)
    message = str(e.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------------ the reader


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_each_crafted_file_is_refused_in_one_line_naming_it(tmp_path, name):
    make, message = CRAFTED[name]
    import re

    assert re.search(message, refusal(make(tmp_path)))


def test_the_crafted_files_are_as_small_as_reported(tmp_path):
    assert len((bomb_png(tmp_path) / "a" / "bomb.png").read_bytes()) < 100
    assert (wide_png(tmp_path) / "a" / "wide.png").stat().st_size < 420_000
    assert zeros_npz(tmp_path).stat().st_size < 400_000


def test_without_a_profile_the_default_limit_still_refuses_them(tmp_path):
    """`fedge predict` and the server's public set read with OWN_DATA_DEFAULT_MAX_BYTES (2 GiB)."""
    zeros = zeros_npz(tmp_path)
    with pytest.raises(OwnDataError, match=r"zeros.npz: .* over this reader's limit of 2048.0 MiB"):
        read_labelled(zeros, TASK)
    with pytest.raises(OwnDataError, match="huge.npz: x_train declares"):
        read_public_data(huge_npz(tmp_path), TASK)
    with pytest.raises(OwnDataError, match="wide.png: refused before decoding"):
        read_labelled(wide_png(tmp_path), TASK)


def test_an_image_over_the_pixel_cap_or_the_budget_is_refused_by_its_header(tmp_path):
    """Refused from the IHDR alone: the image data are empty, so any decoding would fail otherwise."""
    side = int(C.OWN_IMAGE_MAX_PIXELS**0.5) + 1  # over the cap, under Pillow's own warning
    capped = class_folder(tmp_path / "cap", "cap.png", png_bytes(side, side, b""))
    assert f"cap.png: the image declares {side}x{side} (W x H)" in refusal(
        capped, max_bytes=C.OWN_DATA_DEFAULT_MAX_BYTES
    )
    big = class_folder(tmp_path / "big", "big.png", png_bytes(6000, 6000, b""))  # 36 M pixels: 172 MiB to decode
    assert "big.png: the image's 6000x6000 (W x H) pixels need 171.7 MiB to read, over" in refusal(big)


def test_a_jpeg_declaring_huge_dimensions_is_refused(tmp_path):
    buf = io.BytesIO()
    Image.new("L", (28, 28), 9).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 65535, 65535)  # height, width
    root = class_folder(tmp_path / "jpeg", "bomb.jpg", bytes(data))
    assert "bomb.jpg: refused before decoding" in refusal(root)


@pytest.mark.parametrize(
    ("name", "data", "problem"),
    [
        ("cut.png", lambda whole: whole[: len(whole) // 2], "cannot read the image|truncated or corrupt"),
        ("no-iend.png", lambda whole: whole[:-12], r"truncated or corrupt \(it ends before its IEND chunk\)"),
        ("bad-crc.png", lambda whole: whole[:-1] + bytes([whole[-1] ^ 1]), "IEND chunk is cut short or its CRC"),
    ],
)
def test_a_truncated_png_is_refused_not_read_as_black(tmp_path, name, data, problem):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (28, 28), dtype=np.uint8)).save(buf, "PNG")
    root = class_folder(tmp_path / "t", name, data(buf.getvalue()))
    import re

    assert re.search(f"{name}: .*({problem})", refusal(root))


def test_truncated_images_are_never_loaded_by_pillow():
    import launch.cli  # noqa: F401 (everything `fedge client` imports)

    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def adam7(pixels: np.ndarray) -> bytes:
    """The raw (unfiltered) Adam7 stream of 8-bit grayscale `pixels`, pass by pass."""
    rows = b""
    for x0, y0, dx, dy in (
        (0, 0, 8, 8),
        (4, 0, 8, 8),
        (0, 4, 4, 8),
        (2, 0, 4, 4),
        (0, 2, 2, 4),
        (1, 0, 2, 2),
        (0, 1, 1, 2),
    ):
        part = pixels[y0::dy, x0::dx]
        if part.size:
            rows += b"".join(b"\x00" + r.tobytes() for r in part)
    return rows


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA", "adam7"])
def test_whole_pngs_of_every_mode_and_interlaced_still_load(tmp_path, mode):
    """The completeness check counts each mode's packed rows (1-bit rows of 13 px included) and Adam7's passes."""
    rng = np.random.default_rng(1)
    gray = rng.integers(0, 255, (13, 13), dtype=np.uint8)
    for folder in ("a", "b"):
        (tmp_path / "d" / folder).mkdir(parents=True)
        if mode == "adam7":
            (tmp_path / "d" / folder / "i.png").write_bytes(png_bytes(13, 13, zlib.compress(adam7(gray)), interlace=1))
        else:
            Image.fromarray(gray).convert(mode).save(tmp_path / "d" / folder / "i.png")
    x, y = read_public_data(tmp_path / "d", DataTask((1, 13, 13), ("a", "b"), (0.0,), (1.0,)))
    assert x.shape == (2, 1, 13, 13) and y.tolist() == [0, 1]
    if mode in ("L", "adam7"):
        assert np.allclose(x[0, 0].numpy(), gray / 255.0, atol=1e-6)


def test_a_folder_of_more_images_than_the_limit_is_refused_before_any_is_decoded(tmp_path):
    """The images are garbage: had one been opened the refusal would say it cannot read it."""
    per_image = 3 * 4 * 28 * 28  # float32 tensor, split copy, normalised copy
    for k in range(12):
        (tmp_path / "d" / "ab"[k % 2]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / "ab"[k % 2] / f"{k}.png").write_bytes(b"not a png")
    message = refusal(tmp_path / "d", max_bytes=10 * per_image)
    assert message.startswith(f"{tmp_path / 'd'}: more than 10 images, as float32 1x28x28 (C x H x W) tensors")
    assert "cannot read the image" in refusal(tmp_path / "d", max_bytes=12 * per_image)


def test_an_npz_is_refused_by_its_declared_cost_and_an_honest_one_just_under_it_loads(tmp_path):
    """uint8 28x28 at the task's shape: 784 raw + 2 x 3136 float32 bytes an image, labels 2 x 1 + 8."""
    x = np.zeros((100, 28, 28), np.uint8)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=np.zeros(100, np.uint8))
    need = 100 * (784 + 2 * 3136 + 2 + 8)
    assert read_own_data(tmp_path / "d.npz", TASK, seed=0, max_bytes=need).x_train.shape == (80, 1, 28, 28)
    assert "d.npz: x_train (100, 28, 28) uint8, y_train (100,) uint8 need 0.7 MiB" in refusal(
        tmp_path / "d.npz", need - 1
    )


def test_an_npz_member_holding_fewer_bytes_than_declared_is_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / "short.npz", "w") as zf:
        npy_member(zf, "x_train", (10, 28, 28), "|u1", body=100)
        npy_member(zf, "y_train", (10,), "|u1")
    assert "short.npz: x_train declares a (10, 28, 28) uint8 array of 7,840 bytes but holds 100" in refusal(
        tmp_path / "short.npz"
    )


# ------------------------------------------------------------------------------------------------ the client


def run_client(data: Path, config: Path, out: Path) -> subprocess.Popen:
    """`fedge client --data-dir` on the smallest profile; the broker is never reached (the data fail first)."""
    args = ["--broker", "mqtt://127.0.0.1:9", "--id", "0", "--profile", SMALL, "--config", str(config)]
    with open(out, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "client", *args, "--data-dir", str(data)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=Path(__file__).parents[2],
        )


def peak_rss_and_code(p: subprocess.Popen, timeout: float = 90.0) -> tuple[int, int]:
    """(peak RSS in bytes, exit code) of a child, from the kernel's rusage of that child alone (os.wait4)."""
    watchdog = threading.Timer(timeout, p.kill)
    watchdog.start()
    try:
        _, status, usage = os.wait4(p.pid, 0)
    finally:
        watchdog.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024, p.returncode  # ru_maxrss is in KiB on Linux


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB per child via os.wait4")
def test_fedge_client_refuses_each_crafted_file_in_one_line_within_its_memory_limit(tmp_path):
    """Each crafted file against a client whose data path does not exist (same imports, nothing read): the
    client's peak RSS may exceed that baseline by at most its own-data limit (64 MiB on rpi-zero-2w)."""
    config = tmp_path / "run.toml"
    task = 'input_shape = [1, 28, 28]\nclass_names = ["a", "b"]\nnorm_mean = [0.5]\nnorm_std = [0.25]\n'
    config.write_text(task + 'zoo = "cnn1"\nclients = 2\nactive = 2\n')
    paths = {name: make(tmp_path) for name, (make, _) in CRAFTED.items()}
    paths["baseline"] = tmp_path / "nowhere"
    procs = {name: run_client(path, config, tmp_path / f"{name}.err") for name, path in paths.items()}
    results = {name: peak_rss_and_code(p) for name, p in procs.items()}
    baseline, _ = results.pop("baseline")
    assert "does not exist" in (tmp_path / "baseline.err").read_text()
    for name, (peak, code) in results.items():
        stderr = (tmp_path / f"{name}.err").read_text()
        assert code == 2, (name, stderr)
        assert "Traceback" not in stderr and stderr.count("\n") == 1, (name, stderr)
        assert stderr.startswith("fedge: error: ") and name in stderr, (name, stderr)
        assert peak <= baseline + LIMIT, (name, peak / 2**20, baseline / 2**20)
