"""The `dcpfl` and `fedgh` strategies without transport: which fleets they take, what a task carries, Eqs. 8-12 per
round with statistics kept for absent classes, the refusal of bad uploads, FedGH's header steps and the GC
ablation."""

import pytest
import torch

from fedge.model.weights import load_module
from fedge.model.zoo import create
from fedge.wire.messages import ClientInfo, Result
from methods.dcpfl.class_stats import (
    COUNTS,
    COVARIANCES,
    GLOBAL_MEANS,
    KNOWN_CLASSES,
    MEANS,
    ClassStats,
    class_statistics,
)
from methods.dcpfl.heads import head_spec
from methods.dcpfl.maths import ce_step, pool
from methods.dcpfl.tasks import DCTrainTask
from server.strategy import StrategyConfig, StrategyError, create_strategy

pytestmark = pytest.mark.timeout(120)
CONFIG = StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0)
SHAPE, C = (1, 28, 28), 10
D = 128  # cnn1's representation
SMALL = {"virtual_samples": 200, "calibration_steps": 5}


def info(cid, model="cnn1", profile="rpi-4", num_train=40):
    return ClientInfo(cid, create(model, SHAPE, C).with_origin(cid), profile, num_train, 5)


def fleet(n=3):
    return {str(i): info(str(i)) for i in range(n)}


def strategy(name="dcpfl", clients=None, **options):
    s = create_strategy(name, CONFIG, None, (SMALL if name == "dcpfl" else {}) | options)
    s.setup(clients or fleet())
    return s


def upload(cid, classes, rnd=0, covariance=True, seed=None):
    """A client's dc_train reply: class_statistics of random features, 4-6 samples for each of `classes`."""
    gen = torch.Generator().manual_seed(seed if seed is not None else 100 * rnd + int(cid))
    y = torch.cat([torch.full((4 + (c + int(cid)) % 3,), c) for c in classes])
    z = torch.relu(torch.randn(len(y), D, generator=gen) + y[:, None] / 3)
    s = class_statistics(z, y, C, covariance)
    tensors = {MEANS: s.means.float(), COUNTS: s.counts}
    if covariance:
        tensors[COVARIANCES] = s.covariances.float()
    return Result(cid, rnd, "dc_train", len(y), {"train_loss": 1.0}, tensors=tensors)


def as_stats(result):
    t = result.tensors
    return ClassStats(t[COUNTS], t[MEANS], t.get(COVARIANCES))


def head_of(s):
    return {k: v.clone() for k, v in s.head.state.items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_fleet_whose_heads_differ_is_refused_naming_the_clients_of_each_head():
    clients = {"0": info("0"), "1": info("1", "fedgh_cnn1"), "2": info("2"), "3": info("3", "fedgh_cnn4")}
    for name in ("dcpfl", "fedgh"):
        with pytest.raises(
            StrategyError,
            match=r"heads differ: clients \['0', '2'\] have a 128-d .*; clients \['1', '3'\] have a 500-d",
        ):
            strategy(name, clients)
    strategy("fedgh", {str(i): info(str(i), f"fedgh_cnn{i + 1}") for i in range(5)})  # FedGH's zoo: one head


def test_a_model_without_a_head_and_an_executorch_client_are_refused():
    with pytest.raises(StrategyError, match=r"client 1: model 'mobilenet_v1' cannot be cut"):
        strategy("dcpfl", {"0": info("0"), "1": info("1", "mobilenet_v1")})
    with pytest.raises(StrategyError, match=r"only the torch runtime can: clients \['1'\] run \['executorch'\]"):
        strategy("dcpfl", {"0": info("0"), "1": info("1", profile="android-mid-range")})


def test_the_first_round_sends_the_head_and_no_global_means_a_later_round_the_means_of_the_classes_seen():
    s = strategy()
    tasks = s.plan(0, ["0", "2"])
    assert set(tasks) == {"0", "2"}
    t = tasks["0"]
    assert t.type == "dc_train" and t.tensors == {}
    assert t.models["head"].spec == head_spec(info("0").spec)
    settings = DCTrainTask.from_config(t.config)
    assert settings.aux_lambda == 0.1 and settings.covariance and not settings.upload
    replies = {"0": upload("0", [0, 1, 2]), "2": upload("2", [2, 5])}
    s.aggregate(0, replies)
    t1 = s.plan(1, ["1"])["1"]
    assert set(t1.tensors) == {GLOBAL_MEANS, KNOWN_CLASSES}
    assert t1.tensors[KNOWN_CLASSES].tolist() == [c in (0, 1, 2, 5) for c in range(C)]
    assert t1.tensors[GLOBAL_MEANS].shape == (C, D) and t1.tensors[GLOBAL_MEANS].dtype == torch.float32
    pooled = pool([as_stats(replies["0"]), as_stats(replies["2"])], C, s.options.max_client_share)
    assert torch.equal(t1.tensors[GLOBAL_MEANS], pooled.means.float())
    assert not same(t1.models["head"].state, t.models["head"].state)  # the head trained
    without_al = strategy(aux_lambda=0)
    without_al.aggregate(0, replies)
    assert without_al.stats.counts.any() and without_al.plan(1, ["1"])["1"].tensors == {}  # w/o AL: no means sent
    assert DCTrainTask.from_config(without_al.plan(1, ["1"])["1"].config).aux_lambda == 0


def test_a_class_absent_in_a_round_keeps_its_previous_statistics():
    s = strategy()
    first = {"0": upload("0", [0, 1], rnd=0), "1": upload("1", [1, 3], rnd=0)}
    s.aggregate(0, first)
    before = pool([as_stats(r) for r in first.values()], C, s.options.max_client_share)
    second = {"1": upload("1", [3, 4], rnd=1), "2": upload("2", [4], rnd=1)}
    s.aggregate(1, second)
    now = pool([as_stats(r) for r in second.values()], C, s.options.max_client_share)
    # 0, 1 absent in round 1: as round 0 left them; 3 (in both rounds) and 4: round 1's pool (Eq. 10 is over S_t)
    for c, want in ((0, before), (1, before), (3, now), (4, now)):
        assert s.stats.counts[c] == want.counts[c] > 0
        assert torch.equal(s.stats.means[c], want.means[c])
        assert torch.equal(s.stats.covariances[c], want.covariances[c])
    assert [c for c in range(C) if s.stats.counts[c] == 0] == [2, 5, 6, 7, 8, 9]
    assert s.summary()["classes_with_statistics"] == 4


def test_reply_rejection_gives_the_reason_of_a_bad_upload_and_none_for_a_good_one():
    s = strategy()
    task = s.plan(0, ["0"])["0"]
    client = s.clients["0"]
    good = upload("0", [0, 1, 2])
    assert s.reply_rejection(task, client, good) is None
    covs = good.tensors[COVARIANCES].clone()
    covs[1] = -covs[1]
    bad = Result("0", 0, "dc_train", good.num_examples, tensors=good.tensors | {COVARIANCES: covs})
    code, message = s.reply_rejection(task, client, bad)
    assert code == "statistics_not_psd" and "class 1" in message
    too_many = Result("0", 0, "dc_train", good.num_examples, tensors=good.tensors | {COUNTS: good.tensors[COUNTS] * 10})
    assert s.reply_rejection(task, client, too_many)[0] == "statistics_counts"  # 150 > the reply's 15 examples
    fedgh = strategy("fedgh")
    means_only = upload("0", [0, 1], covariance=False)
    assert fedgh.reply_rejection(fedgh.plan(0, ["0"])["0"], client, means_only) is None


def test_fedgh_asks_for_means_only_and_steps_its_header_once_per_client_class_prototype():
    s = strategy("fedgh")
    task = s.plan(0, ["0", "1"])["0"]
    settings = DCTrainTask.from_config(task.config)
    assert settings.covariance is False and settings.aux_lambda == 0 and task.tensors == {}
    assert set(s.expects(task, s.clients["0"]).tensors) == {MEANS, COUNTS}
    replies = {"1": upload("1", [2, 3], covariance=False), "0": upload("0", [0, 1, 2], covariance=False)}
    start = head_of(s)
    s.aggregate(0, replies)
    assert not same(start, s.head.state)  # the header is trained (the authors' code never steps it)
    ref = load_module(s.head.spec, start)
    for cid in ("0", "1"):  # client order, one step per class prototype
        stats = as_stats(replies[cid])
        for c in torch.nonzero(stats.counts).flatten().tolist():
            ce_step(ref, stats.means[c : c + 1], torch.tensor([c]), 0.01)
    assert same(ref.state_dict(), s.head.state)
    assert s.plan(1, ["0"])["0"].tensors == {}  # FedGH never sends means


def test_dcpfl_without_calibration_is_eq_8_alone_and_differs_from_with_calibration():
    replies = {"0": upload("0", [0, 1, 2]), "1": upload("1", [2, 3])}
    calibrated, plain = strategy(), strategy(calibration=False)
    assert same(head_of(calibrated), head_of(plain))
    start = head_of(plain)
    calibrated.aggregate(0, replies)
    plain.aggregate(0, replies)
    assert not same(head_of(calibrated), head_of(plain))
    ref = load_module(plain.head.spec, start)
    for cid in ("0", "1"):  # Eq. (8): one step per client on its class means
        stats = as_stats(replies[cid])
        held = torch.nonzero(stats.counts).flatten()
        ce_step(ref, stats.means[held], held, 0.01)
    assert same(ref.state_dict(), plain.head.state)


@pytest.mark.parametrize("name", ["dcpfl", "fedgh"])
def test_a_head_with_dropout_aggregates_the_same_whatever_the_global_rng(name):
    """mobilenet_v2's head is dropout + linear: the server steps it in eval mode, so no dropout mask is drawn."""
    clients = {str(i): info(str(i), "mobilenet_v2") for i in range(2)}
    d = head_spec(clients["0"].spec).input_shape[0]
    gen = torch.Generator().manual_seed(0)
    replies = {}
    for cid in clients:
        y = torch.arange(20) % 3
        s = class_statistics(torch.relu(torch.randn(20, d, generator=gen)), y, C, name == "dcpfl")
        tensors = {MEANS: s.means.float(), COUNTS: s.counts}
        if s.covariances is not None:
            tensors[COVARIANCES] = s.covariances.float()
        replies[cid] = Result(cid, 0, "dc_train", 20, tensors=tensors)
    heads = []
    for seed in (1, 2):
        s = strategy(name, clients)
        torch.manual_seed(seed)
        rng = torch.get_rng_state()
        s.aggregate(0, replies)
        assert torch.equal(torch.get_rng_state(), rng)  # nor does it move the global RNG
        heads.append(head_of(s))
    assert same(*heads)


def test_the_clock_is_told_of_the_statistics_pass():
    """dc_train's statistics cost a forward pass per sample and, with covariances, d² multiply-adds (z zᵀ)."""
    dc, gh = strategy(), strategy("fedgh")
    client = dc.clients["0"]
    assert dc.other_macs(dc.plan(0, ["0"])["0"], client) == client.spec.macs + D**2
    assert gh.other_macs(gh.plan(0, ["0"])["0"], client) == client.spec.macs
    assert dc.other_macs(dc.evaluation(0, ["0"])["0"], client) == 0
