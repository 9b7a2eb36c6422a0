"""The simulated clock: compute and transfer per client with hand-computed numbers on the rpi-4 profile
(train_macs_per_s 2.975e9, uplink 20e6, downlink 107.5e6 bit/s, rtt 0.010 s), the round's time, the totals."""

from types import SimpleNamespace

import pytest

from device_profiles import get_profile
from fedge.model.spec import build
from fedge.model.zoo import create
from fedge.wire.codec import encode_result, encode_task
from fedge.wire.messages import ClientInfo, Result, Task, Weights
from server import clock
from server.clock import RunClock, client_clock, round_seconds, task_epochs, train_macs
from server.strategy import Strategy, StrategyConfig

pytestmark = pytest.mark.timeout(60)
RPI = get_profile("rpi-4")


def test_train_macs_is_three_forward_passes_per_sample_and_epoch_plus_the_teachers_one():
    assert train_macs(1_000_000, 100, 2) == 600_000_000
    assert train_macs(1_000_000, 100, 2, teacher_macs=500_000) == 650_000_000
    with pytest.raises(ValueError):
        train_macs(1_000_000, -1, 2)
    with pytest.raises(TypeError):
        train_macs(1_000_000, 100, True)


def test_compute_seconds_on_rpi4():
    assert clock.compute_seconds(5_950_000_000, RPI) == pytest.approx(2.0)
    assert clock.compute_seconds(650_000_000, RPI) == pytest.approx(650e6 / 2.975e9)


@pytest.fixture
def sized_payloads(monkeypatch):
    """Task and reply of 1,075,000 and 250,000 bytes: 0.010 + 8.6e6/107.5e6 = 0.09 s down, 0.010 + 2e6/20e6 =
    0.11 s up on rpi-4."""
    monkeypatch.setattr(clock, "bytes_down", lambda task: 1_075_000)
    monkeypatch.setattr(clock, "bytes_up", lambda result: 250_000)


def test_a_client_is_charged_download_then_training_then_upload(sized_payloads):
    trained = SimpleNamespace(macs=1_000_000)
    task = Task("train", 0, {"epochs": 2})
    c = client_clock(task, Result("0", 0, "train", 100), trained, 2, RPI)

    assert (c.bytes_down, c.bytes_up, c.train_macs) == (1_075_000, 250_000, 600_000_000)
    assert c.down_seconds == pytest.approx(0.09) and c.up_seconds == pytest.approx(0.11)
    assert c.compute_seconds == pytest.approx(600e6 / 2.975e9)
    assert c.transfer_seconds == pytest.approx(0.20)
    assert c.seconds == pytest.approx(0.20 + 600e6 / 2.975e9)
    fields = c.fields()
    assert fields["sim_seconds"] == c.seconds and fields["bytes_up"] == 250_000
    assert set(fields) == {
        "sim_compute_seconds",
        "sim_transfer_seconds",
        "sim_seconds",
        "bytes_down",
        "bytes_up",
        "train_macs",
    }


def test_a_distillation_teacher_is_charged_one_forward_pass_per_sample(sized_payloads):
    teacher = SimpleNamespace(spec=SimpleNamespace(macs=500_000))
    task = Task("kd_train", 1, {"epochs": 2}, {"teacher": teacher})
    c = client_clock(task, Result("0", 1, "kd_train", 100), SimpleNamespace(macs=1_000_000), 2, RPI)

    assert c.train_macs == 650_000_000
    assert c.compute_seconds == pytest.approx(650e6 / 2.975e9)


def test_a_strategys_other_work_is_charged_once_per_sample_beside_the_teachers(sized_payloads):
    teacher = SimpleNamespace(spec=SimpleNamespace(macs=500_000))
    task = Task("kd_train", 1, {"epochs": 2}, {"teacher": teacher})
    c = client_clock(task, Result("0", 1, "kd_train", 100), SimpleNamespace(macs=1_000_000), 2, RPI, 250_000)

    assert c.train_macs == 600_000_000 + 100 * (500_000 + 250_000)


def test_payload_bytes_are_the_codecs():
    spec = create("cnn1", (1, 8, 8), 10)
    weights = Weights(spec, build(spec).state_dict())
    task = Task("train", 0, {"epochs": 1}, {"global": weights})
    result = Result("0", 0, "train", 10, {"train_loss": 0.5}, {"local": weights})

    assert clock.bytes_down(task) == len(encode_task(task)) > 4 * spec.params
    assert clock.bytes_up(result) == len(encode_result(result)) > 4 * spec.params
    assert clock.bytes_down(Task("train", 0)) < 4 * spec.params


def test_the_round_takes_as_long_as_its_slowest_client():
    assert round_seconds([1.0, 7.5, 3.0], missing=False, deadline_s=600.0) == 7.5
    assert round_seconds([], missing=False, deadline_s=None) == 0.0


def test_a_client_that_never_replied_costs_the_deadline_when_there_is_one():
    assert round_seconds([1.0, 7.5], missing=True, deadline_s=600.0) == 600.0
    assert round_seconds([1.0, 700.0], missing=True, deadline_s=600.0) == 700.0
    assert round_seconds([1.0, 7.5], missing=True, deadline_s=None) == 7.5  # in-process: no deadline


def test_the_run_clock_adds_up_rounds_and_survives_its_checkpoint(sized_payloads):
    c = client_clock(Task("train", 0), Result("0", 0, "train", 100), SimpleNamespace(macs=1_000_000), 1, RPI)
    run = RunClock()
    first = run.close_round({"0": c}, missing=False, deadline_s=None)
    second = run.close_round({"0": c, "1": c}, missing=True, deadline_s=5.0)

    assert first["round_sim_seconds"] == c.seconds and first["cumulative_train_macs"] == 300_000_000
    assert second["round_sim_seconds"] == 5.0
    assert second["cumulative_sim_seconds"] == c.seconds + 5.0
    assert run.summary() == {
        "sim_seconds_total": c.seconds + 5.0,
        "train_macs_total": 900_000_000,
        "network_bytes_total": 3 * (1_075_000 + 250_000),
    }
    again = RunClock()
    again.load_state(run.state())
    assert again.summary() == run.summary()


def test_a_checkpoint_from_before_the_clock_starts_it_at_zero():
    old = RunClock()
    old.load_state(None)
    assert old.summary() == {"sim_seconds_total": 0.0, "train_macs_total": 0, "network_bytes_total": 0}
    with pytest.raises(TypeError):
        old.load_state([1, 2])


def test_task_epochs_come_from_the_task_else_the_run():
    assert task_epochs(Task("train", 0, {"epochs": 3}), 1) == 3
    assert task_epochs(Task("custom", 0, {}), 2) == 2
    assert task_epochs(Task("custom", 0, {"epochs": True}), 2) == 2


def test_the_trained_model_is_the_one_sent_as_model_else_the_clients_own():
    own, sent = create("cnn1", (1, 8, 8), 10), create("cnn2", (1, 8, 8), 10)
    info = ClientInfo("0", own, "rpi-4", 10, 5)
    strategy = Strategy(StrategyConfig(local_epochs=1, batch_size=8, lr=1e-3, seed=0))
    model = Weights(sent, build(sent).state_dict())

    assert strategy.trained_spec(Task("train", 0, models={"model": model}), info) == sent
    assert strategy.trained_spec(Task("train", 0, models={"global": model}), info) == own
    assert strategy.trained_spec(Task("kd_train", 0), info) == own
