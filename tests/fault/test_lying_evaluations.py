"""An evaluation reply is checked whatever the strategy calls its evaluation task (FedMN's modular_evaluate,
FedAvg+'s tune_evaluate, Per-FedAvg's meta_evaluate, as `evaluate`): a client that reports an accuracy above 1, or
none, is refused with the counted reason `metrics`, and the run ends with the honest clients' accuracies. Before,
such a reply was taken (an accuracy of 7 in the mean) or stopped the server (no accuracy: a KeyError)."""

import dataclasses

import pytest

from fedge.config import config_from
from launch.simulation import run_simulation

pytestmark = pytest.mark.timeout(300)
ROUNDS = 2


def lying(metrics, evaluation):
    def turn(honest):
        def handler(task):
            res = honest(task)
            return dataclasses.replace(res, metrics=metrics) if task.type == evaluation else res

        return handler

    return turn


@pytest.mark.parametrize(
    "strategy, zoo, evaluation",
    [
        ("fedmn", "fedmn_2x2x2_cnn1", "modular_evaluate"),
        ("fedavg+", "cnn1", "tune_evaluate"),
        ("perfedavg", "cnn1", "meta_evaluate"),
    ],
)
def test_an_impossible_or_missing_accuracy_is_refused_and_the_run_goes_on(tmp_path, strategy, zoo, evaluation):
    settings = dict(strategy=strategy, zoo=zoo, dataset="digits", clients=4, active=4, rounds=ROUNDS, local_epochs=1)
    cfg = config_from(settings | {"seed": 0, "transport": "inproc", "out": str(tmp_path), "export_onnx": False})
    adversaries = {
        "1": lying({"accuracy": 7.0, "loss": 0.0}, evaluation),
        "2": lying({"loss": 0.1}, evaluation),
    }
    summary = run_simulation(cfg, progress=False, adversaries=adversaries)
    assert summary["rejected_replies"] == {"metrics": 2 * ROUNDS}
    accuracy = summary["final_accuracy"]["per_client"]
    assert set(accuracy) == {"0", "3"} and all(0 <= a <= 1 for a in accuracy.values())
    for c in "12":  # their training was taken; every evaluation of theirs was refused
        status = summary["client_status"][c]
        assert (status["refused"], status["evaluated"]) == ({"metrics": ROUNDS}, False), status
        assert f"refused: metrics x{ROUNDS}" in status["reason"]
