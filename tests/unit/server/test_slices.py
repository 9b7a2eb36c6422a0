"""Top-left slices and sliced averaging (HeteroFL Eq. (2)) by hand."""

import pytest
import torch

from server.slices import crop, region, sliced_average

pytestmark = pytest.mark.timeout(30)


def test_region_is_the_top_left_of_every_dimension():
    assert region((2, 1), (4, 3)) == (slice(0, 2), slice(0, 1))
    assert region(torch.Size([]), torch.Size([])) == ()
    with pytest.raises(ValueError, match="does not fit"):
        region((2, 4), (4, 3))
    with pytest.raises(ValueError, match="does not fit"):
        region((2,), (4, 3))


def test_crop_takes_the_leading_rows_and_columns():
    t = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(crop(t, (2, 2)), torch.tensor([[0.0, 1.0], [4.0, 5.0]]))
    assert torch.equal(crop(t, (3, 4)), t)
    conv = torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2)
    assert torch.equal(crop(conv, (1, 2, 2, 2)), conv[:1, :2])
    with pytest.raises(ValueError):
        crop(t, (4, 1))


def test_each_element_is_the_weighted_mean_of_the_parts_that_hold_it():
    base = {"w": torch.full((2, 3), 7.0), "b": torch.zeros(3), "n": torch.tensor(4)}
    full = {"w": torch.ones(2, 3), "b": torch.ones(3), "n": torch.tensor(2)}
    half = {"w": torch.full((1, 2), 4.0), "n": torch.tensor(9)}  # no "b": it covers none of it
    out = sliced_average(base, [(full, 1.0), (half, 2.0)])
    # the top-left 1x2 is held by both: (1·1 + 2·4) / 3 = 3; the rest by the full part only
    assert torch.equal(out["w"], torch.tensor([[3.0, 3.0, 1.0], [1.0, 1.0, 1.0]]))
    assert torch.equal(out["b"], torch.ones(3))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 9  # integer buffers: the largest value present
    assert out["w"].dtype == torch.float32


def test_elements_no_part_holds_keep_the_base_value():
    base = {"w": torch.arange(4.0)}
    out = sliced_average(base, [({"w": torch.tensor([10.0])}, 0.3), ({"w": torch.tensor([20.0, 30.0])}, 0.1)])
    # element 0: (0.3·10 + 0.1·20) / 0.4 = 12.5; element 1: 30 (one part); elements 2, 3: the base's
    assert torch.allclose(out["w"], torch.tensor([12.5, 30.0, 2.0, 3.0]))
    assert torch.equal(sliced_average(base, [])["w"], base["w"])


def test_bad_weights_and_parts_that_do_not_fit_are_refused():
    base = {"w": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="positive weights"):
        sliced_average(base, [({"w": torch.zeros(1, 1)}, 0.0)])
    with pytest.raises(ValueError, match="does not fit"):
        sliced_average(base, [({"w": torch.zeros(3, 1)}, 1.0)])
