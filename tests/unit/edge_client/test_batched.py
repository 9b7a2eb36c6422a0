"""Batched local training (edge_client/batched.py) against `fit`, client by client: every zoo model, clients of
unequal data (short last batches, a batch of one), with and without a teacher, give the models `fit` gives alone
within float tolerance; a client trained with another's seed does not; a client's bad data fail that client only."""

import copy

import pytest
import torch

from edge_client.batched import FitJob, fit_together
from edge_client.training import Distillation, TrainConfig, fit, predict
from fedge.model import zoo
from fedge.model.spec import build

SIZES = [70, 45, 33, 64]  # at batch 32: last batches of 6, 13 and 1 sample, and none
# How far a batched model's logits on a probe batch lie from the one `fit` trains alone, relative to how far
# training moved them. Measured after one epoch: at most 1e-6 without BatchNorm, 3.4e-3 with it (a conv bias
# before BatchNorm has a gradient that is rounding noise, which Adam turns into steps of lr); a client trained
# with the next client's seed lies 0.14 to 0.8 away.
TOLERANCE = 1e-2


def fleet(model: str, teacher: float | None = None, seed_shift: int = 0):
    """Per-client (model, x, y, cfg, kd) and the same clients as FitJobs (the jobs' seeds shifted by `seed_shift`),
    with a probe batch and each model's logits on it before training."""
    spec = zoo.create(model, (1, 28, 28), 10)
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(64, 1, 28, 28, generator=g)
    alone, jobs, before = [], [], []
    for i, n in enumerate(SIZES):
        torch.manual_seed(100 + i)
        m = build(spec)
        before.append(predict(m, probe))
        x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
        kd = None if teacher is None else Distillation(torch.randn(n, 10, generator=g), kd_lambda=teacher)
        cfg = TrainConfig(epochs=1, batch_size=32, lr=1e-3, seed=7 + i)
        alone.append((m, x, y, cfg, kd))
        shifted = TrainConfig(epochs=1, batch_size=32, lr=1e-3, seed=7 + i + seed_shift)
        jobs.append(FitJob(copy.deepcopy(m), x, y, shifted, kd))
    return alone, jobs, probe, before


def distances(model: str, teacher: float | None = None, seed_shift: int = 0, device: str = "cpu"):
    alone, jobs, probe, before = fleet(model, teacher, seed_shift)
    stats = [fit(*a) for a in alone]
    batched = fit_together(jobs, device)
    out = []
    for (m, *_), job, start, s, b in zip(alone, jobs, before, stats, batched):
        ref = predict(m, probe)
        out.append((float((ref - predict(job.model, probe)).norm() / (ref - start).norm()), s, b))
    return out


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("model", list(zoo.MODELS))
def test_every_zoo_model_trains_batched_as_alone(model):
    for distance, alone, batched in distances(model):
        assert distance < TOLERANCE
        assert batched.loss == pytest.approx(alone.loss, rel=1e-3) and batched.ce == pytest.approx(alone.ce, rel=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run it where one is lent)")
@pytest.mark.parametrize("model", ["cnn1", "cnn4", "mobilenet_v3"])
def test_clients_batched_on_a_gpu_train_as_alone_on_the_cpu(model):
    for distance, alone, batched in distances(model, teacher=0.2, device="cuda"):
        assert distance < TOLERANCE
        assert batched.loss == pytest.approx(alone.loss, rel=1e-3)


@pytest.mark.parametrize("kd_lambda", [0.2, 0.0])
def test_distillation_batched_as_alone(kd_lambda):
    # cnn4: BatchNorm and two dropouts; λ = 0 trains on CE and measures the KL
    for distance, alone, batched in distances("cnn4", teacher=kd_lambda):
        assert distance < TOLERANCE
        assert batched.kd == pytest.approx(alone.kd, rel=1e-3) and batched.kd > 0


@pytest.mark.parametrize("model", ["cnn1", "cnn4"])
def test_the_tolerance_tells_another_seed_apart(model):
    # each client's own batch order and dropout masks matter far beyond the tolerance
    assert all(distance > 10 * TOLERANCE for distance, *_ in distances(model, seed_shift=1))


def test_a_clients_bad_data_fail_that_client_only():
    alone, jobs, probe, _ = fleet("cnn1")
    jobs[1].x[3] = float("nan")
    jobs[2] = FitJob(jobs[2].model, jobs[2].x[:0], jobs[2].y[:0], jobs[2].cfg)
    jobs[3] = FitJob(jobs[3].model, jobs[3].x, jobs[3].y, jobs[3].cfg, Distillation(torch.zeros(5, 10)))
    outcomes = fit_together(jobs)
    assert "diverged" in str(outcomes[1]) and "no training data" in str(outcomes[2])
    assert "teacher logits must be" in str(outcomes[3])
    m, *rest = alone[0]
    assert fit(m, *rest).loss == pytest.approx(outcomes[0].loss, rel=1e-5)
    assert torch.allclose(predict(m, probe), predict(jobs[0].model, probe), rtol=1e-4, atol=1e-5)


def test_jobs_of_other_settings_are_refused():
    _, jobs, _, _ = fleet("cnn1")
    other = jobs[1].cfg.__class__(epochs=2, batch_size=32, lr=1e-3, seed=1)
    with pytest.raises(ValueError, match="same epochs"):
        fit_together([jobs[0], FitJob(jobs[1].model, jobs[1].x, jobs[1].y, other)])


def mlp(middle: torch.nn.Module) -> torch.nn.Module:
    """Flatten, 16 → 6, `middle`, 6 → 3: for 1×4×4 inputs of 3 classes."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 6), middle, torch.nn.Linear(6, 3))


def small_jobs(model: torch.nn.Module, sizes: list[int]) -> list[FitJob]:
    g = torch.Generator().manual_seed(0)
    return [
        FitJob(
            copy.deepcopy(model),
            torch.randn(n, 1, 4, 4, generator=g),
            torch.randint(0, 3, (n,), generator=g),
            TrainConfig(epochs=1, batch_size=8, lr=1e-3, seed=i),
        )
        for i, n in enumerate(sizes)
    ]


def test_a_batch_its_layers_refuse_fails_that_client_only():
    # BatchNorm refuses one value per channel in training: the client whose last batch holds one sample fails, as
    # `fit` fails it alone; the others train
    model = mlp(torch.nn.BatchNorm1d(6))
    jobs = small_jobs(model, [16, 17, 12])
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        fit(copy.deepcopy(model), jobs[1].x, jobs[1].y, jobs[1].cfg)
    outcomes = fit_together(jobs)
    assert "more than 1 value per channel" in str(outcomes[1])
    assert all(o.loss > 0 for o in (outcomes[0], outcomes[2]))
    for job, outcome in zip(jobs[::2], outcomes[::2]):
        alone = copy.deepcopy(model)
        assert fit(alone, job.x, job.y, job.cfg).loss == pytest.approx(outcome.loss, rel=1e-5)


def test_dropout_of_p_1_trains_and_a_dropout_run_twice_is_refused():
    drop_all = mlp(torch.nn.Dropout(1.0))
    jobs = small_jobs(drop_all, [16, 9])
    for job, outcome in zip(jobs, fit_together(small_jobs(drop_all, [16, 9]))):
        assert fit(copy.deepcopy(drop_all), job.x, job.y, job.cfg).loss == pytest.approx(outcome.loss, rel=1e-6)

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop = torch.nn.Linear(16, 3), torch.nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.drop(self.fc(x.flatten(1))))

    with pytest.raises(ValueError, match="runs twice in one forward pass"):
        fit_together(small_jobs(Twice(), [8, 8]))
