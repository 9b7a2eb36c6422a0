"""Every client of a run is accounted for (issue 33): summary.json's client_status and the end table say which
clients trained, which were never selected, which were refused (with the reason code and its count) and which
failed, and the mean says over how many of how many clients."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from fedge.wire.messages import Result, Task
from launch.cli import print_summary
from launch.simulation import run_simulation
from server.client_status import FAILED, NEVER_SELECTED, OFFLINE, REFUSED, TRAINED, ClientCounts
from server.coordinator import sample_clients

from helpers.federation import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is scripts, not an installed package
from bench.robust import liar  # noqa: E402

pytestmark = pytest.mark.timeout(240)
CLIENTS, ACTIVE, ROUNDS, SEED = 7, 4, 2, 0


def failing(honest):
    """An adversary whose client reports every training task as failed (evaluations stay honest)."""

    def handler(task: Task) -> Result:
        res = honest(task)
        if task.type == "evaluate":
            return res
        return dataclasses.replace(res, models={}, error="training diverged")

    return handler


def test_the_summary_and_the_end_table_account_for_every_client(tmp_path, capsys):
    picked = [sample_clients([str(i) for i in range(CLIENTS)], ACTIVE, SEED, rnd) for rnd in range(ROUNDS)]
    selected = sorted({cid for ids in picked for cid in ids}, key=int)
    never = sorted(set(map(str, range(CLIENTS))) - set(selected), key=int)
    always = [cid for cid in selected if all(cid in ids for ids in picked)]
    assert never and always, picked  # the seed gives a never-selected client and one selected every round
    # the liar among three uploads every round (the outlier check needs a median); the broken client once at least
    lying, broken = always[0], [cid for cid in selected if cid != always[0]][0]
    cfg = make_config(
        tmp_path / "run", clients=CLIENTS, active=ACTIVE, rounds=ROUNDS, seed=SEED, transport="inproc", workers=1
    )
    summary = run_simulation(cfg, progress=False, adversaries={lying: liar("scaled"), broken: failing})
    status = summary["client_status"]
    assert set(status) == set(map(str, range(CLIENTS)))
    assert {cid for cid, s in status.items() if s["status"] == NEVER_SELECTED} == set(never)
    times = sum(ids.count(lying) for ids in picked)
    assert status[lying]["status"] == REFUSED and status[lying]["refused"] == {"update_outlier": times}
    assert f"update_outlier x{times}" in status[lying]["reason"]
    assert status[broken]["status"] == FAILED and "training diverged" in status[broken]["reason"]
    honest = set(selected) - {lying, broken}
    assert {cid for cid, s in status.items() if s["status"] == TRAINED} == honest
    assert all(status[c]["trained"] == status[c]["sent"] == sum(ids.count(c) for ids in picked) for c in honest)
    # FedAvg evaluates every client on the global model: the liar and the never-selected ones too
    evaluated = summary["final_accuracy"]["per_client"]
    assert all(status[c]["evaluated"] == (c in evaluated) for c in status)

    print_summary(summary | {"out": str(tmp_path / "run")})
    table = capsys.readouterr().out
    rows = {line.split()[0]: line for line in table.splitlines()[1 : CLIENTS + 1]}
    assert set(rows) == set(status)
    assert all(NEVER_SELECTED in rows[c] for c in never) and REFUSED in rows[lying] and FAILED in rows[broken]
    assert f"client {lying} refused: update_outlier x{times}" in table
    assert f"over {len(evaluated)} of {CLIENTS} clients" in table


@pytest.mark.parametrize(
    "counts, status",
    [
        (ClientCounts(), NEVER_SELECTED),
        (ClientCounts(sent=2, trained=1), TRAINED),
        (ClientCounts(sent=2, unanswered=2), OFFLINE),
        (ClientCounts(sent=1, refused={"client_failed": 1}, last_refusal="out of memory"), FAILED),
        (ClientCounts(sent=2, refused={"client_failed": 1, "norm_bound": 1}), REFUSED),
    ],
)
def test_a_clients_status_follows_from_its_counts(counts, status):
    assert counts.status()[0] == status
