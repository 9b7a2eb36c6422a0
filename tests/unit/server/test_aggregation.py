"""The aggregators by hand: the mean as each strategy had it, coordinate-wise median and trimmed mean (also over
HeteroFL's slices), Krum and multi-Krum, and their refusals."""

import pytest
import torch

from fedge.config import ConfigError
from server.aggregation import Aggregation, combine, krum_selection, weighted_average
from server.slices import sliced_average

pytestmark = pytest.mark.timeout(60)


def parts(*values, share=1.0):
    return [({"w": torch.tensor(v, dtype=torch.float32), "n": torch.tensor(i)}, share) for i, v in enumerate(values)]


BASE = {"w": torch.zeros(2), "n": torch.tensor(0)}


def test_mean_is_the_strategies_own_average_bit_for_bit():
    ps = [({"w": torch.randn(5, 3)}, s) for s in (0.2, 0.3, 0.5)]
    base = {"w": torch.zeros(5, 3)}
    assert torch.equal(
        combine(base, ps, Aggregation())["w"], weighted_average([p for p, _ in ps], [0.2, 0.3, 0.5])["w"]
    )
    sliced = [({"w": torch.ones(2, 3)}, 1.0), ({"w": torch.full((5, 3), 3.0)}, 1.0)]
    assert torch.equal(combine(base, sliced, Aggregation())["w"], sliced_average(base, sliced)["w"])


def test_coordinate_wise_median_by_hand():
    out = combine(BASE, parts([1.0, 5.0], [2.0, -4.0], [100.0, 6.0]), Aggregation("median"))
    assert out["w"].tolist() == [2.0, 5.0] and int(out["n"]) == 2  # integer buffers: the largest
    even = combine(BASE, parts([1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [1e9, 0.0]), Aggregation("median"))
    assert even["w"].tolist() == [2.5, 0.0]  # the mean of the two middle values


def test_trimmed_mean_drops_the_fraction_at_each_end():
    values = [[float(v), 0.0] for v in (1, 2, 3, 4, -1000)]  # sorted: -1000, 1, 2, 3, 4; 20 % of 5 = 1 each end
    out = combine(BASE, parts(*values), Aggregation("trimmed_mean", trim_fraction=0.2))
    assert out["w"].tolist() == [2.0, 0.0]
    none_cut = combine(BASE, parts(*values), Aggregation("trimmed_mean", trim_fraction=0.1))  # floor(0.5) = 0
    assert out["w"].dtype == torch.float32 and none_cut["w"][0].item() == pytest.approx(-990 / 5)


def test_median_over_slices_uses_only_the_parts_holding_each_element():
    base = {"w": torch.full((3,), 7.0)}
    ps = [({"w": torch.tensor([1.0])}, 1.0), ({"w": torch.tensor([2.0, 10.0])}, 1.0), ({"w": torch.tensor([9.0])}, 1.0)]
    out = combine(base, ps, Aggregation("median"))
    assert out["w"].tolist() == [2.0, 10.0, 7.0]  # element 0: 1, 2, 9; element 1: 10 alone; element 2: nobody


def test_krum_picks_the_upload_closest_to_the_others_and_multi_krum_averages_the_best():
    base = {"w": torch.zeros(2)}
    close = [[1.0, 1.0], [1.1, 0.9], [0.9, 1.1], [1.0, 1.05]]
    ps = [({"w": torch.tensor(v)}, 1.0) for v in close + [[50.0, -50.0]]]
    krum = Aggregation("krum", byzantine=1)
    assert krum_selection(base, ps, krum) == [3]  # [1, 1.05] is closest to its 2 nearest others
    assert combine(base, ps, krum)["w"].tolist() == pytest.approx([1.0, 1.05])
    multi = combine(base, ps, Aggregation("multi_krum", byzantine=1))  # the 4 best: every close one
    assert multi["w"].tolist() == pytest.approx([1.0, 1.0125])


def test_krum_over_slices_does_not_prefer_the_narrow_ones():
    """HeteroFL: parts of rates 1, 1, 1, 1/2, 1/4 updating the same direction; zero-padding the narrow ones would make
    them look closest to each other. Compared on what both hold, the full-width agreeing parts win."""
    base = {"w": torch.zeros(8, 8)}
    wide = [({"w": torch.full((8, 8), 1.0 + 0.01 * i)}, 1.0) for i in range(3)]
    narrow = [({"w": torch.full((4, 4), 1.5)}, 1.0), ({"w": torch.full((2, 2), 1.6)}, 1.0)]
    how = Aggregation("krum", byzantine=1)
    assert krum_selection(base, wide + narrow, how) == [1]
    assert krum_selection(base, wide + narrow, Aggregation("multi_krum", byzantine=1)) == [0, 1, 2, 3]


def test_krum_compares_learned_tensors_only():
    base = {"w": torch.zeros(2), "bn.running_var": torch.ones(2)}
    ps = [
        ({"w": torch.tensor(w), "bn.running_var": torch.tensor(v)}, 1.0)
        for w, v in (
            ([1.0, 1.0], [900.0, 900.0]),
            ([1.0, 1.1], [1.0, 1.0]),
            ([1.1, 1.0], [2.0, 2.0]),
            ([1.0, 0.9], [3.0, 3.0]),
            ([9.0, -9.0], [1.0, 1.0]),
        )
    ]
    how = Aggregation("krum", byzantine=1)
    assert krum_selection(base, ps, how, learned={"w"}) == [0]  # its weights sit among the others'
    assert krum_selection(base, ps, how) != [0]  # its BatchNorm statistics would have ruled it out


def test_krum_with_too_few_uploads_takes_the_median():
    out = combine(BASE, parts([1.0, 0.0], [3.0, 0.0], [100.0, 0.0]), Aggregation("krum", byzantine=1))
    assert out["w"].tolist() == [3.0, 0.0]  # 3 <= 2f + 2: Krum's pick would be arbitrary


@pytest.mark.parametrize(
    "kw", [{"kind": "mode"}, {"trim_fraction": 0.5}, {"trim_fraction": -0.1}, {"byzantine": -1}], ids=str
)
def test_bad_aggregation_settings_are_refused(kw):
    with pytest.raises(ConfigError):
        Aggregation(**kw)


def test_no_parts_or_a_non_positive_share_is_an_error():
    with pytest.raises(ValueError):
        combine(BASE, [], Aggregation("median"))
    with pytest.raises(ValueError):
        combine(BASE, parts([1.0, 0.0], share=0.0), Aggregation("median"))
