"""No honest device is refused (issue 28): every zoo model, at both width presets, trained honestly for the default
run's epochs on a non-IID shard (two digit classes, as the default partition gives), passes every check the server
applies to an upload: against the model it was sent (FedAvg's round) and against a fresh initialisation of its
architecture (a pFedClub client's first upload)."""

import math

import numpy as np
import pytest
import torch

from edge_client.training import TrainConfig, train
from fedge import constants as C
from fedge.data.datasets import load_dataset
from fedge.data.partition import stratified_sample
from fedge.model.spec import SpecError, build
from fedge.model.weights import load_module
from fedge.model.zoo import MODELS, create
from fedge.wire.messages import ClientInfo, Result, Task, Weights
from fedge.wire.payloads import Expected
from server.coordinator import Coordinator, LoopConfig
from server.runlog import RunLog
from server.strategy import Strategy, StrategyConfig, create_strategy

pytestmark = pytest.mark.timeout(300)
SHARD = 96  # samples of two classes: 6 Adam steps an epoch at the default batch size
PROFILE = "jetson-orin-nano"  # a profile every zoo model fits


@pytest.fixture(scope="module")
def shards() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Two-class shards of real digits: 8x8 (sklearn's digits), and mnist-5k's 28x28 for the models too deep for
    8x8 (FedGH's CNNs); the small images keep 24 models' training within the suite's time."""
    out = {}
    for name in ("digits", C.DEFAULT_DATASET):
        ds = load_dataset(name)
        two = np.flatnonzero((ds.y == 3) | (ds.y == 8))
        out[name] = ds.tensors(two[stratified_sample(ds.y[two], SHARD, seed=0)])
    return out


def zoo_model(name: str, widths: str, shards: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple:
    """The model at the smallest input it takes, and that shard."""
    for x, y in shards.values():
        try:
            return create(name, tuple(x.shape[1:]), 10, widths), x, y
        except SpecError:
            continue
    raise AssertionError(f"{name} takes none of {list(shards)}")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("widths", C.WIDTHS)
def test_an_honestly_trained_upload_of_every_zoo_model_is_accepted(name, widths, shards, tmp_path):
    spec, x, y = zoo_model(name, widths, shards)
    info = ClientInfo("0", spec.with_origin("0"), PROFILE, num_train=len(y), num_test=1)
    config = StrategyConfig(C.DEFAULT_LOCAL_EPOCHS, C.DEFAULT_BATCH_SIZE, C.DEFAULT_LR, C.DEFAULT_SEED)
    strategy = create_strategy("fedavg", config)
    coordinator = Coordinator(strategy, None, {"0": info}, LoopConfig(1, 1, 0, 1, progress=False), RunLog(tmp_path, {}))
    strategy.setup(coordinator.clients)
    task = strategy.plan(0, ["0"])["0"]
    model = load_module(task.models["global"].spec, task.models["global"].state)
    loss = train(model, x, y, TrainConfig(C.DEFAULT_LOCAL_EPOCHS, C.DEFAULT_BATCH_SIZE, C.DEFAULT_LR, 0))
    upload = Weights(spec, {k: v.detach().clone() for k, v in model.state_dict().items()})
    reply = Result("0", 0, "train", len(y), {"train_loss": loss}, {"local": upload})
    for sent in (task, Task("train", 0, task.config)):  # the global model it trained from; nothing of its kind
        assert set(coordinator.accepted({"0": reply}, {"0": sent})) == {"0"}, coordinator.rejected
    assert coordinator.rejected == {}


class OwnUploads(Strategy):
    """What pFedClub declares of a kd_train reply: the client's own model, of its registered architecture."""

    def expects(self, task: Task, client: ClientInfo) -> Expected:
        return Expected(models={"local": client.spec})


def own_uploads_coordinator(cid: str, spec, num_train: int, epochs: int, tmp_path) -> Coordinator:
    """A coordinator of one client whose strategy declares the client's own model."""
    info = ClientInfo(cid, spec, PROFILE, num_train=num_train, num_test=1)
    strategy = OwnUploads(StrategyConfig(epochs, 16, 1e-3, 0))
    return Coordinator(strategy, None, {cid: info}, LoopConfig(1, 1, 0, 1, progress=False), RunLog(tmp_path, {}))


def test_the_default_runs_cnn4_client_with_its_measured_running_variance_is_accepted_and_a_lying_one_is_not(tmp_path):
    """Issue 28's client 7: the default run's only cnn4, 383.6 of whose 384.9 norm was one BatchNorm running_var,
    was refused as over 10 x the 27.41 of a fresh initialisation; a negative running variance is a lie, and so is one
    of 1e11, which ruined a two-client FedAvg run (nothing round-relative exists with two uploads)."""
    spec = create("cnn4", (1, 28, 28), 10).with_origin("7")
    coordinator = own_uploads_coordinator("7", spec, 450, 1, tmp_path)
    state = build(spec).state_dict()
    name = "blocks.0.1.running_var"
    measured = state | {name: torch.full_like(state[name], 383.6 / state[name].numel() ** 0.5)}
    task = Task("kd_train", 0)
    huge = state | {name: torch.full_like(state[name], 1e11)}  # within the absolute 1e12, not 100 x the reference's
    for running_var, code in ((measured, None), (state | {name: -state[name]}, "buffers"), (huge, "norm_bound")):
        coordinator.rejected.clear()
        reply = Result("7", 0, "kd_train", 450, {"train_loss": 0.1}, {"local": Weights(spec, running_var)})
        kept = coordinator.accepted({"7": reply}, {"7": task})
        assert (set(kept), dict(coordinator.rejected)) == (({"7"}, {}) if code is None else (set(), {code: 1}))


def test_a_first_upload_with_the_running_variances_of_the_papers_client_setting_is_accepted(tmp_path):
    """Issue 31's client 4: an honest cnn4 on CIFAR-10 trained 10 epochs on ~860 images (the pFedClub paper's client
    setting) uploaded running statistics of norm 3,577, 239 x a fresh model's placeholder 14.97, and was refused at
    100 x in every round: its first upload (no model sent, as pFedHR's and pFedClub's rounds) and FedAvg's first
    round (the global model sent still has the placeholders). Both are accepted now; the next upload is bounded by
    100 x this one, and a running variance of 1e11 is still refused on a first upload."""
    spec = create("cnn4", (3, 32, 32), 10).with_origin("4")
    coordinator = own_uploads_coordinator("4", spec, 860, 10, tmp_path)
    state = build(spec).state_dict()
    variances = [n for n in state if n.endswith("running_var")]
    fresh = math.sqrt(sum(float(state[n].square().sum()) for n in variances))

    def scaled(ratio: float) -> dict[str, torch.Tensor]:  # every running variance `ratio` x: buffer norm ratio x fresh
        return state | {n: state[n] * ratio for n in variances}

    global_model = Weights(spec.with_origin(None), state)
    for rnd, (sent, ratio, code) in enumerate(
        [
            ({}, 239.0, None),  # the measured first upload, nothing sent
            ({}, 239.0 * 150, "norm_bound"),  # the next one: 150 x its previous accepted upload
            ({"global": global_model}, 1e11, "norm_bound"),  # placeholders sent: 1e11 is still a lie
        ]
    ):
        coordinator.rejected.clear()
        if rnd == 2:
            coordinator.buffer_norms.clear()  # a client the server has not heard from, trained from the global model
            coordinator.accepted(
                {"4": Result("4", 0, "kd_train", 860, {"train_loss": 0.1}, {"local": Weights(spec, scaled(239.0))})},
                {"4": Task("kd_train", 0, models=sent)},
            )
            assert coordinator.rejected == {}, "the measured statistics, trained from a global model of placeholders"
            coordinator.buffer_norms.clear()
        reply = Result("4", rnd, "kd_train", 860, {"train_loss": 0.1}, {"local": Weights(spec, scaled(ratio))})
        kept = coordinator.accepted({"4": reply}, {"4": Task("kd_train", rnd, models=sent)})
        assert (set(kept), dict(coordinator.rejected)) == (({"4"}, {}) if code is None else (set(), {code: 1})), (
            rnd,
            fresh,
        )
