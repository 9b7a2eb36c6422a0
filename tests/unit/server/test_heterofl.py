"""HeteroFL: which submodel each client gets, sliced aggregation by hand, tasks, records and state."""

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_profiles import get_profile
from fedge.checkpoint import load_tree, save_tree, tree_digest
from fedge.config import ConfigError
from fedge.model.spec import build, tensor_shapes
from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result, Weights
from methods.fedtrans.transforms import Cell, widen
from methods.heterofl.server import HeteroFL, HeteroFLOptions, parse_rates
from server.capacity import compatible
from server.slices import crop
from server.strategy import StrategyConfig, StrategyError

pytestmark = pytest.mark.timeout(120)
CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)
TORCH_PROFILES = ["rpi-zero-2w", "rpi-4", "rpi-5", "jetson-orin-nano", "gpu-server"]
INPUT = (1, 28, 28)
SMALLEST = 250_000  # above every generated global model's 1/16 submodel (cnn4's: 214 k MACs)


def info(cid, model="cnn4", profile="rpi-4"):
    return ClientInfo(cid, create(model, INPUT, 10).with_origin(cid), profile, 20, 5)


def strategy(clients, **options):
    s = HeteroFL(CONFIG, options=HeteroFLOptions(**options))
    s.setup(clients)
    return s


def capacity_file(tmp_path, capacities):
    path = Path(tmp_path) / "capacity.json"
    path.write_text(json.dumps(capacities))
    return str(path)


def grown(tmp_path, shape=INPUT):
    """A model no client registered: cnn1 with its second conv widened (as FedTrans grows it), as a JSON file."""
    spec = create("cnn1", shape, 10)
    model = build(spec)
    wide = widen(spec, dict(model.state_dict()), Cell(1, 0)).spec
    path = Path(tmp_path) / "grown.json"
    path.write_text(wide.to_json())
    return wide, str(path)


def test_the_global_model_from_a_spec_file_is_cut_for_every_client(tmp_path):
    """FedTrans's comparison gives HeteroFL the largest model FedTrans grew (App. A.1): a spec file, not a
    registered model; each client gets the largest slice of it that fits."""
    wide, path = grown(tmp_path)
    fleet = {"0": info("0", "cnn1", "rpi-zero-2w"), "1": info("1", "cnn3")}
    caps = capacity_file(tmp_path, {"0": wide.macs - 1, "1": wide.macs})  # client 0: just below the whole model
    s = strategy(fleet, model_file=path, capacity_file=caps)
    assert s.global_model.spec == wide and s.rate == {"0": 0.5, "1": 1.0} and s.specs["1"] == wide
    assert s.specs["0"].macs < wide.macs and compatible(s.specs["0"], wide.macs - 1, get_profile("rpi-zero-2w"))
    (tmp_path / "rgb").mkdir()
    _, other = grown(tmp_path / "rgb", (3, 32, 32))
    with pytest.raises(StrategyError, match=r"takes input \(3, 32, 32\)"):
        strategy(fleet, model_file=other)
    with pytest.raises(StrategyError, match="model_file"):
        strategy(fleet, model_file=str(tmp_path / "missing.json"))


def test_options_are_checked():
    assert parse_rates("1,0.5,0.25") == (1.0, 0.5, 0.25)
    for bad in ("0.5,0.25", "1,0.25,0.5", "1,1", "1,0", "1,x", "1,1.5"):
        with pytest.raises(ConfigError, match="rates"):
            HeteroFLOptions(rates=bad)
    with pytest.raises(ConfigError, match="max_client_share"):
        HeteroFLOptions(max_client_share=0)
    with pytest.raises(ConfigError, match="not both"):
        HeteroFLOptions(model="cnn3", model_file="grown.json")


def test_the_largest_fitting_rate_by_profile_and_the_global_model_is_the_largest_registered():
    s = strategy({"0": info("0", "cnn1", "rpi-zero-2w"), "1": info("1", "cnn4"), "2": info("2", "cnn2")})
    assert s.global_model.spec == create("cnn4", INPUT, 10)
    # cnn4 at 1/2 needs 10.8 M MACs, over the zero's 9.2 M; at 1/4 2.8 M
    assert s.rate == {"0": 0.25, "1": 1.0, "2": 1.0}
    assert s.specs["0"].name == "cnn4@0.25" and s.specs["1"] == s.global_model.spec
    assert strategy({"0": info("0", "cnn1"), "1": info("1", "cnn4")}, model="cnn1").global_model.spec.name == "cnn1"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(TORCH_PROFILES), st.one_of(st.none(), st.integers(SMALLEST, 60_000_000))),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["cnn2", "cnn4", "mobilenet_v2"]),
    st.booleans(),
)
def test_no_client_ever_gets_a_model_above_its_capacity(fleet, model, with_file):
    clients = {str(i): info(str(i), "cnn1" if p == "rpi-zero-2w" else model, p) for i, (p, _) in enumerate(fleet)}
    capacities = {str(i): c or get_profile(p).max_macs for i, (p, c) in enumerate(fleet)}
    with tempfile.TemporaryDirectory() as tmp:
        options = {"capacity_file": capacity_file(tmp, capacities)} if with_file else {}
        if not with_file:
            capacities = {cid: get_profile(c.profile).max_macs for cid, c in clients.items()}
        s = strategy(clients, **options)
    for cid, client in clients.items():
        profile = get_profile(client.profile)
        assert s.capacity[cid] == capacities[cid]
        assert s.specs[cid].macs <= capacities[cid] and compatible(s.specs[cid], capacities[cid], profile)
        larger = [r for r in parse_rates(s.options.rates) if r > s.rate[cid]]
        assert not any(compatible(s.submodel_spec(s.global_model.spec, r), capacities[cid], profile) for r in larger)
        task = s.plan(0, [cid])[cid]
        assert task.models["model"].spec.macs <= capacities[cid]


def test_a_client_that_fits_nothing_and_non_torch_clients_are_refused(tmp_path):
    path = capacity_file(tmp_path, {"0": 1000, "1": 10**9})
    with pytest.raises(StrategyError, match=r"client 0 \(capacity 1,000 MACs.*cnn4@0.0625, needs [\d,]+ MACs"):
        strategy({"0": info("0"), "1": info("1")}, capacity_file=path)
    with pytest.raises(StrategyError, match=r"clients \['1'\] run \['executorch'\]"):
        strategy({"0": info("0"), "1": info("1", "cnn1", "android-flagship")})
    with pytest.raises(StrategyError, match=r"no client registered model 'cnn3'.*\['cnn4'\]"):
        strategy({"0": info("0")}, model="cnn3")
    with pytest.raises(StrategyError, match=r"no capacity for clients \['1'\]"):
        strategy({"0": info("0"), "1": info("1")}, capacity_file=capacity_file(tmp_path, {"0": 5}))


def half_and_full(tmp_path, **options):
    """Client 0 at rate 1, client 1 at rate 1/2 (by capacity file), global cnn1 (convs 16, 32; fc 128)."""
    full = create("cnn1", INPUT, 10)
    half_macs = strategy({"0": info("0", "cnn1")}).submodel_spec(full, 0.5).macs
    path = capacity_file(tmp_path, {"0": full.macs, "1": half_macs})
    return strategy({"0": info("0", "cnn1"), "1": info("1", "cnn1")}, capacity_file=path, **options)


def reply(s, cid, value, examples=10):
    spec = s.specs[cid]
    state = {k: torch.full(shape, value, dtype=dtype) for k, (shape, dtype) in tensor_shapes(spec).items()}
    return Result(cid, 0, "train_model", examples, {"train_loss": 1.0}, {"model": Weights(spec, state)})


def test_sliced_aggregation_by_hand(tmp_path):
    s = half_and_full(tmp_path, max_client_share=1.0)
    assert s.rate == {"0": 1.0, "1": 0.5}
    s.aggregate(0, {"0": reply(s, "0", 1.0), "1": reply(s, "1", 3.0)})
    g = s.global_model.state
    conv = g["blocks.0.0.weight"]  # [16, 1, 5, 5]; the half model holds [:8]
    assert conv.shape == (16, 1, 5, 5)
    assert torch.equal(conv[:8], torch.full((8, 1, 5, 5), 2.0)) and torch.equal(conv[8:], torch.ones(8, 1, 5, 5))
    fc = g["blocks.2.1.weight"]  # [128, 32·7·7]; the half model holds [:64, :16·7·7]
    assert torch.equal(fc[:64, :784], torch.full((64, 784), 2.0))
    assert torch.equal(fc[64:], torch.ones(64, 1568)) and torch.equal(fc[:, 784:], torch.ones(128, 784))
    logits = g["blocks.3.0.weight"]  # [10, 128]: both hold every row, the half model the first 64 columns
    assert torch.equal(logits[:, :64], torch.full((10, 64), 2.0)) and torch.equal(logits[:, 64:], torch.ones(10, 64))
    # weighted by examples: 30 at 1.0 and 10 at 3.0 give 1.5 where both hold an element
    s.aggregate(1, {"0": reply(s, "0", 1.0, 30), "1": reply(s, "1", 3.0, 10)})
    assert float(s.global_model.state["blocks.0.0.weight"][0, 0, 0, 0]) == 1.5
    assert s.record(1, "1")["aggregation_share"] == 0.25


def test_tasks_carry_the_clients_slices_and_records_say_what_each_got(tmp_path):
    s = half_and_full(tmp_path)
    tasks = s.plan(3, ["1", "0"])
    assert {cid: t.type for cid, t in tasks.items()} == {"0": "train_model", "1": "train_model"}
    sent = tasks["1"].models["model"]
    assert sent.spec == s.specs["1"] and any(ly.type == "scaler" for b in sent.spec.blocks for ly in b.layers)
    for name, tensor in sent.state.items():
        assert torch.equal(tensor, crop(s.global_model.state[name], tensor.shape)) and tensor.is_contiguous()
    assert tasks["0"].models["model"].spec == s.global_model.spec
    expected = s.expects(tasks["1"], info("1", "cnn1"))
    assert expected.models == {"model": s.specs["1"]} and expected.optional == {"activeness"}
    evals = s.evaluation(3, ["0", "1"])
    assert evals["1"].type == "evaluate" and evals["1"].models["global"].spec == s.specs["1"]
    assert s.expects(evals["1"], info("1", "cnn1")).models == {}
    row = s.record(3, "1")
    assert row["rate"] == 0.5 and row["assigned_model"] == "cnn1@0.5" and row["assigned_macs"] == s.specs["1"].macs
    assert row["capacity"] == s.specs["1"].macs and row["assigned_params"] == s.specs["1"].params
    assert s.summary()["rate"] == {"0": 1.0, "1": 0.5}
    finals = s.final_models()
    assert set(finals) == {"0", "1"} and finals["1"]["model"].spec == s.specs["1"]
    assert all(ly.type != "scaler" for b in half_and_full(tmp_path, scaler=False).specs["1"].blocks for ly in b.layers)


def test_state_round_trips_and_refuses_another_architecture(tmp_path):
    a = half_and_full(tmp_path)
    a.aggregate(0, {"0": reply(a, "0", 1.0), "1": reply(a, "1", 3.0)})
    save_tree(tmp_path / "s.safetensors", a.state())
    b = half_and_full(tmp_path)
    b.load_state(load_tree(tmp_path / "s.safetensors"))
    assert tree_digest(b.state()) == tree_digest(a.state()) and b.summary() == a.summary()
    other = strategy({"0": info("0", "cnn2")})
    with pytest.raises(StrategyError, match="checkpoint holds a global 'cnn1'"):
        other.load_state(a.state())
