"""FedAvg's aggregation by hand, and its refusal of heterogeneous fleets."""

import pytest
import torch

from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result, Weights
from methods.fedavg.server import FedAvg, FedAvgOptions
from server.aggregation import capped_shares, weighted_average
from server.strategy import StrategyConfig, StrategyError

pytestmark = pytest.mark.timeout(60)
CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)


def test_weighted_average_by_hand():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(5)}
    out = weighted_average([a, b], [1, 2])
    assert torch.allclose(out["w"], torch.tensor([3.0, 6.0]))
    assert out["w"].dtype == torch.float32 and int(out["n"]) == 5
    with pytest.raises(ValueError):
        weighted_average([], [])


def info(cid, model):
    spec = create(model, (1, 8, 8), 10).with_origin(cid)
    return ClientInfo(cid, spec, "rpi-4", 10, 5)


def test_heterogeneous_fleet_is_refused_with_advice():
    with pytest.raises(StrategyError, match=r"same model.*\['cnn1', 'cnn2'\].*--zoo cnn1"):
        FedAvg(CONFIG).setup({"0": info("0", "cnn1"), "1": info("1", "cnn2")})


def test_capped_shares_by_hand():
    assert capped_shares([30, 10], 1.0) == [0.75, 0.25]  # no cap: FedAvg's example weights
    assert capped_shares([30, 10], 0.5) == [0.5, 0.5]
    assert capped_shares([300, 100, 100], 0.5) == [0.5, 0.25, 0.25]
    assert capped_shares([90, 5, 5], 0.4) == [0.4, 0.3, 0.3]
    assert capped_shares([1_000_000, 100, 100, 100], 0.5) == pytest.approx([0.5, 1 / 6, 1 / 6, 1 / 6])
    assert capped_shares([100, 20, 20, 10], 0.35) == pytest.approx([0.35, 0.26, 0.26, 0.13])  # twice round
    assert capped_shares([7, 1, 1], 0.3) == [1 / 3] * 3  # 3 x 0.3 < 1: no split fits, all equal
    assert capped_shares([5], 0.5) == [1.0]
    with pytest.raises(ValueError):
        capped_shares([3, 0], 0.5)


def test_one_client_claiming_a_million_examples_gets_at_most_its_cap():
    strategy = FedAvg(CONFIG)
    strategy.setup({cid: info(cid, "cnn1") for cid in "012"})
    spec = strategy.global_model.spec
    honest = {k: torch.ones_like(v) for k, v in strategy.global_model.state.items()}
    hostile = {k: torch.full_like(v, 101) for k, v in honest.items()}
    strategy.aggregate(
        0,
        {
            "0": Result("0", 0, "train", 10, models={"local": Weights(spec, honest)}),
            "1": Result("1", 0, "train", 10, models={"local": Weights(spec, honest)}),
            "2": Result("2", 0, "train", 10**6, models={"local": Weights(spec, hostile)}),
        },
    )
    w = strategy.global_model.state["blocks.0.0.weight"]
    assert torch.allclose(w, torch.full_like(w, 51.0))  # 0.25 * 1 + 0.25 * 1 + 0.5 * 101
    assert strategy.record(0, "2") == {"aggregation_share": 0.5}


def test_aggregate_weights_by_examples_and_tolerates_no_replies():
    strategy = FedAvg(CONFIG, options=FedAvgOptions(max_client_share=1.0))
    strategy.setup({"0": info("0", "cnn1"), "1": info("1", "cnn1")})
    before = strategy.global_model
    strategy.aggregate(0, {})
    assert strategy.global_model is before
    spec = before.spec
    ones = {k: torch.ones_like(v) for k, v in before.state.items()}
    threes = {k: torch.full_like(v, 3) for k, v in before.state.items()}
    strategy.aggregate(
        1,
        {
            "0": Result("0", 1, "train", 30, models={"local": Weights(spec, ones)}),
            "1": Result("1", 1, "train", 10, models={"local": Weights(spec, threes)}),
        },
    )
    w = strategy.global_model.state["blocks.0.0.weight"]
    assert torch.allclose(w, torch.full_like(w, 1.5))
