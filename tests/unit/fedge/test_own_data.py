"""A device's own data: folders of class folders and .npz files read into the run's task, the conversions made
and every refusal with its message."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedge.data.own_data import DataTask, OwnDataError, held_out_split, read_own_data, read_public_data

pytestmark = pytest.mark.timeout(60)
GRAY = DataTask((1, 4, 4), ("a", "b", "c"), (0.5,), (0.25,))
RGB = DataTask((3, 4, 4), ("a", "b", "c"), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


def png(path, value, size=(4, 4), mode="L"):
    path.parent.mkdir(parents=True, exist_ok=True)
    colour = value if mode == "L" else tuple(value)
    Image.new(mode, size, colour).save(path)


def folder(tmp_path, counts=None):
    """class a: n images of value 0, class c: m images of value 255 (b empty, i.e. absent)."""
    counts = counts or {"a": 3, "c": 2}
    for name, n in counts.items():
        for i in range(n):
            png(tmp_path / "d" / name / f"{i}.png", 0 if name == "a" else 255)
    return tmp_path / "d"


def test_a_folder_reads_labels_by_class_order_normalised_with_a_seeded_split(tmp_path):
    root = folder(tmp_path, {"a": 5, "c": 5})
    (root / ".DS_Store").write_bytes(b"junk")
    (root / "a" / "notes.txt").write_text("ignored")

    data = read_own_data(root, GRAY, seed=1)
    again = read_own_data(root, GRAY, seed=1)

    assert data.x_train.shape == (8, 1, 4, 4) and data.x_test.shape == (2, 1, 4, 4)
    assert sorted(data.y_test.tolist()) == [0, 2]  # 20 % of each class held out
    assert sorted(data.y_train.tolist()) == [0] * 4 + [2] * 4
    # (0/255 - 0.5)/0.25 = -2 for class a, (1 - 0.5)/0.25 = 2 for class c
    for x, y in ((data.x_train, data.y_train), (data.x_test, data.y_test)):
        expected = torch.where(y == 0, -2.0, 2.0).view(-1, 1, 1, 1).expand_as(x)
        assert torch.equal(x, expected)
    assert torch.equal(data.y_test, again.y_test) and torch.equal(data.x_train, again.x_train)


def test_the_held_out_split_depends_on_the_seed_only():
    y = np.repeat(np.arange(3), 10)
    train, test = held_out_split(y, 0.2, 7, Path("y"))
    assert len(test) == 6 and np.bincount(y[test]).tolist() == [2, 2, 2]
    assert np.array_equal(test, held_out_split(y, 0.2, 7, Path("y"))[1])
    assert not np.array_equal(test, held_out_split(y, 0.2, 8, Path("y"))[1])
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(30))


def test_conversions_rgb_to_gray_by_luma_and_bilinear_resize(tmp_path):
    png(tmp_path / "d" / "a" / "red.png", (255, 0, 0), size=(8, 6), mode="RGB")
    png(tmp_path / "d" / "a" / "blue.png", (0, 0, 255), size=(8, 6), mode="RGB")
    task = DataTask((1, 4, 4), ("a", "b"), (0.0,), (1.0,))

    x, y = read_public_data(tmp_path / "d", task)

    assert x.shape == (2, 1, 4, 4) and y.tolist() == [0, 0]
    # files are sorted: blue then red; Pillow's luma is 0.299 R + 0.587 G + 0.114 B, rounded to 8 bits
    assert x[0].unique().tolist() == [pytest.approx(29 / 255)] and x[1].unique().tolist() == [pytest.approx(76 / 255)]


def test_conversion_gray_to_rgb_and_an_unlabelled_folder(tmp_path):
    png(tmp_path / "p" / "one.png", 51)
    png(tmp_path / "p" / "two.jpg", 51)

    x, y = read_public_data(tmp_path / "p", RGB)

    assert y is None and x.shape == (2, 3, 4, 4)
    assert torch.allclose(x, torch.full_like(x, 0.2), atol=2 / 255)


def test_an_npz_in_every_layout_with_its_own_test_split(tmp_path):
    x = np.zeros((6, 4, 4), np.uint8)
    x[3:] = 255
    y = np.array([0, 0, 0, 2, 2, 2])
    for name, images in (("nhw", x), ("nchw", x[:, None]), ("nhwc", x[..., None]), ("float", x / 255.0)):
        np.savez(tmp_path / f"{name}.npz", x_train=images, y_train=y, x_test=images[:2], y_test=y[:2])
        data = read_own_data(tmp_path / f"{name}.npz", GRAY, seed=0)
        assert data.x_train.shape == (6, 1, 4, 4) and data.y_train.tolist() == y.tolist(), name
        assert data.x_test.shape == (2, 1, 4, 4) and data.y_test.tolist() == [0, 0], name
        assert data.x_train[:3].eq(-2).all() and data.x_train[3:].eq(2).all(), name


def test_an_npz_without_a_test_split_holds_one_out_and_is_resized_and_converted(tmp_path):
    rgb = np.full((10, 8, 8, 3), 255, np.uint8)
    np.savez(tmp_path / "d.npz", x_train=rgb, y_train=np.array(["a", "c"] * 5))

    data = read_own_data(tmp_path / "d.npz", GRAY, seed=3)

    assert data.x_train.shape == (8, 1, 4, 4) and data.x_test.shape == (2, 1, 4, 4)
    assert sorted(data.y_test.tolist()) == [0, 2]
    assert torch.allclose(data.x_train, torch.full_like(data.x_train, 2.0), atol=1e-5)


def test_an_unlabelled_public_npz(tmp_path):
    np.savez(tmp_path / "p.npz", x=np.zeros((5, 1, 4, 4), np.uint8))
    x, y = read_public_data(tmp_path / "p.npz", GRAY)
    assert y is None and x.shape == (5, 1, 4, 4)
    with pytest.raises(OwnDataError, match=r"p.npz: holds \['x'\]; expected x_train, y_train"):
        read_own_data(tmp_path / "p.npz", GRAY, seed=0)


def bad_npz(tmp_path, **arrays):
    np.savez(tmp_path / "bad.npz", **arrays)
    return tmp_path / "bad.npz"


OK_X = np.zeros((4, 4, 4), np.uint8)
OK_Y = np.array([0, 1, 2, 0])


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (dict(x_train=np.zeros((4, 16), np.uint8), y_train=OK_Y), r"x_train has shape \(4, 16\); expected images"),
        (dict(x_train=np.zeros((4, 5, 4, 4), np.uint8), y_train=OK_Y), r"shape \(4, 5, 4, 4\).*\(N, 1, 4, 4\)"),
        (dict(x_train=np.full((4, 4, 4), np.nan), y_train=OK_Y), "NaN or infinite pixels"),
        (dict(x_train=np.full((4, 4, 4), 3.0), y_train=OK_Y), r"float pixels must lie in \[0, 1\]"),
        (dict(x_train=np.full((4, 4, 4), 300), y_train=OK_Y), r"integer pixels must lie in 0..255"),
        (dict(x_train=OK_X, y_train=np.array([0, 1, 3, 0])), r"y_train: label 3 is outside the run's 3 classes"),
        (dict(x_train=OK_X, y_train=np.array([0, 1])), r"y_train has shape \(2,\); expected \(4,\)"),
        (dict(x_train=OK_X, y_train=np.array([0.0, 1, 2, 0])), "labels of type float64"),
        (dict(x_train=OK_X, y_train=np.array(["a", "b", "zebra", "a"])), r"unknown class name\(s\) \['zebra'\]"),
        (dict(x_train=OK_X), r"has x_train but no y_train"),
        (dict(x_train=OK_X, y_train=OK_Y, x_test=OK_X), "x_test and y_test come together"),
        (dict(images=OK_X), r"holds \['images'\]; expected x_train, y_train"),
        (dict(x_train=OK_X[:1], y_train=OK_Y[:1]), "need at least 2 to hold out a test split"),
        (dict(x_train=OK_X[:0], y_train=OK_Y[:0]), "holds no images"),
    ],
)
def test_a_bad_npz_is_refused_naming_the_file(tmp_path, arrays, message):
    with pytest.raises(OwnDataError, match=message) as e:
        read_own_data(bad_npz(tmp_path, **arrays), GRAY, seed=0)
    assert "bad.npz" in str(e.value)


def test_a_corrupt_or_pickled_npz_is_refused(tmp_path):
    (tmp_path / "c.npz").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(OwnDataError, match="c.npz: cannot read it as an .npz"):
        read_own_data(tmp_path / "c.npz", GRAY, seed=0)
    np.savez(tmp_path / "o.npz", x_train=np.array([{"a": 1}], dtype=object), y_train=OK_Y)
    with pytest.raises(OwnDataError, match="o.npz: cannot read it as an .npz"):
        read_own_data(tmp_path / "o.npz", GRAY, seed=0)


def test_an_unknown_class_folder_is_refused(tmp_path):
    root = folder(tmp_path)
    png(root / "zebra" / "0.png", 0)
    with pytest.raises(OwnDataError, match=r"zebra: unknown class folder 'zebra'; the run's classes are a, b, c"):
        read_own_data(root, GRAY, seed=0)


def test_an_empty_class_folder_is_refused(tmp_path):
    root = folder(tmp_path)
    (root / "b").mkdir()
    (root / "b" / "readme.txt").write_text("no images here")
    with pytest.raises(OwnDataError, match=r"/b: class folder 'b' has no .png, .jpg, .jpeg images"):
        read_own_data(root, GRAY, seed=0)


def test_a_corrupt_image_is_refused_naming_it(tmp_path):
    root = folder(tmp_path)
    (root / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(OwnDataError, match=r"a/broken.png: cannot read the image \(corrupt or not a PNG/JPEG\)"):
        read_own_data(root, GRAY, seed=0)


def test_a_16_bit_image_is_refused(tmp_path):
    root = folder(tmp_path)
    Image.fromarray(np.zeros((4, 4), np.uint16)).save(root / "a" / "deep.png")
    with pytest.raises(OwnDataError, match=r"deep.png: image mode I;16 .* is not supported"):
        read_own_data(root, GRAY, seed=0)


def test_folders_without_images_or_labels_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".DS_Store").write_bytes(b"x")
    with pytest.raises(OwnDataError, match="empty: no images; expected class folders named a, b, c"):
        read_own_data(tmp_path / "empty", GRAY, seed=0)
    png(tmp_path / "loose" / "0.png", 0)
    with pytest.raises(OwnDataError, match="loose: images without class folders have no labels"):
        read_own_data(tmp_path / "loose", GRAY, seed=0)
    with pytest.raises(OwnDataError, match="does not exist"):
        read_own_data(tmp_path / "nowhere", GRAY, seed=0)
    (tmp_path / "data.csv").write_text("1,2")
    with pytest.raises(OwnDataError, match="data.csv: not an .npz file"):
        read_own_data(tmp_path / "data.csv", GRAY, seed=0)


def test_images_for_a_task_of_other_than_1_or_3_channels_are_refused(tmp_path):
    root = folder(tmp_path)
    task = DataTask((2, 4, 4), ("a", "b", "c"), (0.0, 0.0), (1.0, 1.0))
    with pytest.raises(OwnDataError, match="images fill 1 .grayscale. or 3 .RGB. channels; the task's input is 2"):
        read_own_data(root, task, seed=0)


def test_an_inconsistent_task_is_refused():
    with pytest.raises(OwnDataError, match="norm_mean and norm_std need 3 entries"):
        DataTask((3, 4, 4), ("a", "b"), (0.5,), (0.25,))
    with pytest.raises(OwnDataError, match="at least 2 distinct classes"):
        DataTask((1, 4, 4), ("a", "a"), (0.5,), (0.25,))
