"""bench/reproduce.py: presets expand to the paper's runs, the scale arithmetic, the direction checks on hand-written
numbers, the Markdown with the paper's value, the paper's numbers against its text, and one tiny end-to-end run."""

import argparse
import json
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # bench/ is scripts, not an installed package

from bench import reproduce  # noqa: E402
from bench.reproduce_paper import PAPER, Cell, paper_value  # noqa: E402
from bench.reproduce_plan import FULL, SCALES, Axes, ReproError, expand, parse_scale, preset_cells  # noqa: E402
from bench.reproduce_report import (  # noqa: E402
    NOISE,
    CellStats,
    ClientResult,
    SeedResult,
    beats_local,
    direction,
    holds,
    render,
    seed_result,
)
from bench.runs import folder_state  # noqa: E402
from launch import cli  # noqa: E402

pytestmark = pytest.mark.timeout(120)

PAPER_TEXT = ROOT.parent / "shared" / "papers" / "pfedclub-neurips2024.txt"


def runs_of(preset, tmp_path, seeds=(0, 1, 2), scale=SCALES["small"], **kwargs):
    return expand(preset_cells(preset, Axes(**kwargs)), seeds, scale, tmp_path, tmp_path)


def test_table3_is_five_variants_per_partition_and_seed_plus_local(tmp_path):
    runs = runs_of("table3", tmp_path)

    club = [r for r in runs if r.cell.strategy == "pfedclub"]
    assert len(club) == 5 * 2 * 3 and len([r for r in runs if r.cell.strategy == "local"]) == 2 * 3
    assert {(r.values["options"]["ablation"], r.values["partition"], r.seed) for r in club} == {
        (v, p, s) for v in ("none", "max", "min", "noc", "nbc") for p in ("iid", "noniid") for s in (0, 1, 2)
    }
    first = club[0]
    assert first.values["options"] == {
        "clusters": 4, "kd_lambda": 0.2, "finetune_epochs": 3, "public": "unlabeled", "ablation": "none",
        "max_candidates": 16,
    }  # fmt: skip
    assert (first.values["zoo"], first.values["dataset"], first.values["lr"]) == ("III", "cifar10", 1e-3)
    assert first.values["classes_per_client"] == 2 and first.values["export_onnx"] is False
    assert len({r.folder for r in runs}) == len(runs)
    for run in runs:
        run.config()  # every run config resolves against its strategy's options


def test_table1_has_the_papers_rows_and_local_once_per_group(tmp_path):
    runs = runs_of("table1", tmp_path, seeds=(0,))

    assert len(runs) == 2 * 3 * 2 * (1 + 2 * 2)
    assert all(paper_value(r.cell) for r in runs if r.cell.strategy != "local")
    assert paper_value(Cell("table1", "mnist", "III", "noniid", "pfedclub", "unlabeled")) == "93.52±1.37"
    assert paper_value(Cell("table1", "cifar10", "I", "iid", "pfedhr", "labeled")) == "73.21±3.24"
    assert paper_value(Cell("table3", "cifar10", "III", "iid", "pfedclub", "unlabeled", "noc")) == "62.19"
    assert paper_value(Cell("table3", "mnist", "III", "iid", "pfedclub", "unlabeled", "noc")) is None


def test_fig3_is_one_client_per_model_all_active_with_pfedclub_plus_eta(tmp_path):
    runs = runs_of("fig3", tmp_path, seeds=(0,), datasets=("mnist",))

    assert [r.cell.method for r in runs] == ["local", "pFedHR", "pFedClub", "pFedClub+ (η=0.1)"]
    for run in runs:
        assert run.values["zoo"].split(",") == [
            "cnn1", "cnn2", "cnn3", "cnn4", "mobilenet_v1", "mobilenet_v2", "mobilenet_v3"
        ]  # fmt: skip
        assert run.values["clients"] == run.values["active"] == 7 and run.values["partition"] == "noniid"
    assert runs[-1].config().options["eta"] == 0.1 and "eta" not in runs[2].values["options"]


def test_scale_arithmetic():
    assert parse_scale("full") is FULL and parse_scale("1") is FULL
    assert (FULL.clients, FULL.active, FULL.rounds, FULL.local_epochs) == (50, 5, 100, 10)
    assert FULL.samples_per_client is None and FULL.public_samples is None
    s = parse_scale("0.2")
    assert (s.clients, s.active, s.rounds, s.local_epochs, s.samples_per_client, s.public_samples) == (
        10,
        5,
        20,
        10,
        240,
        None,
    )  # fmt: skip
    # the paper's public set (the server's) at every scale but smoke
    assert SCALES["small"].public_samples is SCALES["medium"].public_samples is None
    tiny = parse_scale("0.01")
    assert (tiny.clients, tiny.active, tiny.rounds, tiny.samples_per_client, tiny.public_samples) == (5, 5, 2, 20, None)
    for bad in ("0", "1.5", "huge"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_scale(bad)


def test_the_header_names_the_scale_the_run_set_leaves(tmp_path, capsys):
    small = SCALES["small"]
    assert small.overridden({"lr": "0.1"}) is small  # a key no scale sets leaves it as it is
    n5 = small.overridden({"clients": "5", "active": "5", "rounds": "3", "max_samples_per_client": "none"})
    assert (n5.clients, n5.active, n5.rounds, n5.local_epochs, n5.samples_per_client) == (5, 5, 3, 2, None)
    assert n5.name == "small with --run-set clients=5, active=5, rounds=3, max_samples_per_client=none"
    argv = ["--preset", "table1", "--zoos", "III", "--public", "labeled", "--partition", "iid", "--datasets", "mnist"]
    argv += ["--seeds", "0", "--out", str(tmp_path), "--dry-run", "--run-set", "clients=5", "--run-set", "rounds=3"]
    assert reproduce.main(argv) == 0
    out = capsys.readouterr().out
    assert "- scale small with --run-set clients=5, rounds=3: N=5 clients, M=5 active per round, T=3 rounds" in out
    assert "--set clients=5" in out and "--set rounds=3" in out  # and the runs are those
    assert reproduce.main([*argv, "--run-set", "clients=five"]) == 2  # a bad value: one line, no traceback
    assert "error:" in capsys.readouterr().err


def test_overrides_go_where_they_belong_and_bad_ones_are_refused(tmp_path):
    cells = preset_cells("fig3", Axes(datasets=("mnist",)))
    runs = expand(cells, (0,), FULL, tmp_path, tmp_path, "cpu", {"rounds": "7"}, {"kd_lambda": "0.5"})
    assert all(r.values["rounds"] == "7" for r in runs)
    assert [r.values["options"].get("kd_lambda") for r in runs] == [None, "0.5", "0.5", "0.5"]  # local has none
    assert runs[-1].config().rounds == 7
    for run_set, option_set, match in [
        ({"widths_unknown": "x"}, {}, "not a run-level key"),
        ({"seed": "3"}, {}, "flag of its own"),
        ({}, {"public": "labeled"}, "vary it per cell"),
        ({}, {"no_such_option": "1"}, "no strategy of these presets"),
    ]:
        with pytest.raises(ReproError, match=match):
            expand(cells, (0,), FULL, tmp_path, tmp_path, "cpu", run_set, option_set)


def stats_of(cell, finals, last3s=None, phi_max=None):
    clients = {} if phi_max is None else {"0": ClientResult("cnn1", None, None, phi_max, phi_max)}
    results = [SeedResult(f, lt, clients) for f, lt in zip(finals, last3s or finals)]
    return cell, CellStats(cell, list(range(len(finals))), results)


def test_direction_checks_on_hand_written_numbers():
    club = Cell("table1", "mnist", "I", "iid", "pfedclub", "labeled")
    hr, local = Cell("table1", "mnist", "I", "iid", "pfedhr", "labeled"), Cell("table1", "mnist", "I", "iid", "local")
    stats = dict([stats_of(club, [80, 82], [70, 72]), stats_of(hr, [79, 81], [75, 75]), stats_of(local, [78, 80])])

    check = direction(club, stats)
    assert (check.final, check.last3) == (True, False)
    assert check.paper is False  # the paper's own MNIST IID Zoo I labeled: pFedClub 94.02 < pFedHR 94.67
    assert direction(hr, stats) is None and beats_local(local, stats) is None
    assert (beats_local(club, stats).final, beats_local(club, stats).last3) == (True, False)

    full = Cell("table3", "cifar10", "III", "noniid", "pfedclub", "unlabeled")
    ablated = Cell("table3", "cifar10", "III", "noniid", "pfedclub", "unlabeled", "max")
    check = direction(ablated, dict([stats_of(full, [70.0, 69.0]), stats_of(ablated, [71.0, 70.0])]))
    assert (check.final, check.paper) == (False, True)  # ours: max above full in both seeds; paper: 71.68 ≥ 66.89
    # means 4 points apart, but one seed goes the other way; and one seed alone: within noise
    check = direction(ablated, dict([stats_of(full, [80.0, 69.0]), stats_of(ablated, [71.0, 70.0])]))
    assert check.final == NOISE and holds(check.final) == "≈"
    assert direction(ablated, dict([stats_of(full, [70.0]), stats_of(ablated, [71.0])])).final == NOISE

    plus = Cell("fig3", "svhn", "I", "noniid", "pfedclub+", "unlabeled", one_per_model=True, eta=0.1)
    club3 = Cell("fig3", "svhn", "I", "noniid", "pfedclub", "unlabeled", one_per_model=True)
    for plus_acc, phi_max, expected in [(80.5, 0.08, True), (80.5, 0.12, False), (78.5, 0.0, False)]:
        check = direction(plus, dict([stats_of(club3, [80.0]), stats_of(plus, [plus_acc], phi_max=phi_max)]))
        assert check.final is expected
    assert check.paper is True  # Fig. 3(a), SVHN: |82.51 - 83.21| ≤ 1
    assert direction(plus, {}).final is None  # nothing ran: n/a


def test_render_puts_the_papers_value_and_the_checks_beside_ours():
    club = Cell("table1", "mnist", "III", "noniid", "pfedclub", "unlabeled")
    hr = Cell("table1", "mnist", "III", "noniid", "pfedhr", "unlabeled")
    stats = dict([stats_of(hr, [90.0, 92.0]), stats_of(club, [91.0, 93.0], [90.0, 90.0])])
    stats[club].results[:] = [
        replace(r, own_share=s, self_rounds=n) for r, s, n in zip(stats[club].results, (0.6, 0.8), (2, 4))
    ]

    text = render(stats, ["# title"])
    assert "| mnist | III | noniid | unlabeled | pFedClub | 92.00±1.41 | 0.700±0.141 | 3.0±1.4 |" in text

    assert text.startswith("# title\n")
    assert "## Table 1" in text
    line = next(r for r in text.splitlines() if "| pFedClub |" in r)
    assert line == (
        "| mnist | III | noniid | unlabeled | pFedClub | 92.00±1.41 | 90.00±0.00 | 93.52±1.37 | ≥ pFedHR | ✓ ≈ | ✓ | "
        "n/a n/a |"
    )  # last-3: 0 and -2 per seed, no direction
    assert (
        "- mnist III noniid unlabeled: pFedClub − pFedHR (≥ pFedHR), seeds [0, 1]: final +1.00, +1.00 per seed "
        "(mean +1.00) ✓; last-3 +0.00, -2.00 per seed (mean -1.00) ≈"
    ) in text.splitlines()


def test_seed_result_takes_the_final_mean_and_the_last_three_rounds():
    summary = {
        "final_accuracy": {"mean": 0.75, "per_client": {"0": 0.5, "1": 1.0}},
        "models": {"0": "cnn1", "1": "cnn2"},
        "phi": {"0": 0.2},
        "own_block_share": {"0": 0.5, "1": None},  # client 1 never got a candidate
        "teacher_is_self_rounds": {"0": 2, "1": 1},
    }
    rows = [{"round": 0, "client": "0", "trained": True, "accuracy": 0.1, "phi": 0.3}]
    rows += [{"round": r, "client": "0", "trained": True, "accuracy": a} for r, a in ((1, 0.2), (2, 0.4), (3, 0.6))]
    rows += [{"round": 3, "client": "1", "trained": True, "accuracy": 1.0, "phi": 0.1}]
    rows += [{"round": 3, "client": "2", "trained": False, "accuracy": 0.0}]  # evaluated, not trained: not counted

    result = seed_result(summary, rows)

    assert result.final == 75.0
    assert result.last3 == pytest.approx((20 + 40 + (60 + 100) / 2) / 3)
    assert result.clients["0"] == ClientResult("cnn1", 50.0, pytest.approx(40.0), 0.2, 0.3)
    assert result.clients["1"].phi is None and result.clients["1"].phi_max == 0.1
    assert (result.own_share, result.self_rounds) == (0.5, 3)
    assert seed_result(summary | {"own_block_share": {}, "teacher_is_self_rounds": None}, rows).self_rounds is None


@pytest.mark.skipif(not PAPER_TEXT.is_file(), reason="no ../shared/papers/pfedclub-neurips2024.txt")
def test_the_embedded_numbers_are_the_papers():
    text = PAPER_TEXT.read_text().replace(" .", ".")  # the PDF text splits non-bold numbers: "92 .88±1.10"
    table1 = text[text.index("Table 1:") : text.index("the submodel training technique")]
    number = r"(\d+\.\d+±\d+\.\d+)"
    printed = re.findall(rf"(pFedHR|pFedClub) {' '.join([number] * 6)}", table1)
    ours = [(s, (v["mnist"] + v["cifar10"])) for (_, _, s), v in PAPER["table1"].items()]
    assert [(m.lower(), (a, b, e, f)) for m, a, b, _, _, e, f in printed] == ours
    for variant, label in (("max", "pFedClub max"), ("min", "pFedClub min"), ("noc", "pFedClub noc")):
        assert re.search(rf"{label} \S+ \S+ {' '.join(PAPER['table3'][variant]['cifar10'])}", text)
    assert "pFedClub nbc 63.01 59.47 61.38 56.02" in text and "pFedClub 82.50 81.03 74.71 71.68" in text
    assert all(v in text for v in PAPER["fig3"].values())


@pytest.fixture
def one_thread():
    """The tiny models run far faster on one thread when other processes share the cores."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_tiny_reproduction_runs_then_is_reused(tmp_path, capsys, one_thread):
    argv = ["--preset", "table1", "--datasets", "digits", "--zoos", "III", "--public", "unlabeled", "--threads", "1"]
    argv += ["--partition", "noniid", "--seeds", "0", "--scale", "smoke", "--device", "cpu", "--out", str(tmp_path)]
    # what is checked here is running and reusing, not the 225-step floor nor pFedClub's 16 candidates
    argv += ["--set", "finetune_min_steps=12", "--set", "max_candidates=2"]

    assert reproduce.main(argv) == 0
    first = capsys.readouterr()
    assert reproduce.main(argv + ["--workers", "2"]) == 0  # another worker count trains the same: reused
    second = capsys.readouterr()

    assert "3 ran" in first.out and "3 reused" in second.out
    assert second.out == (tmp_path / "results.md").read_text() + "\n"
    assert "| digits | III | noniid | unlabeled | pFedClub |" in second.out
    assert second.err.count("reused in") == 3
    assert (tmp_path / "results.json").is_file()


def test_the_dry_runs_fedge_run_command_writes_the_folder_the_reproduction_reuses(tmp_path, one_thread):
    """--dry-run prints each run's `fedge run` command; a user who runs it gets the run's folder: the reproduction
    reuses it (it did not: fedge run records transport inproc and a one-thread server, the reproduction did not)."""
    argv = ["--preset", "table1", "--datasets", "digits", "--zoos", "III", "--public", "unlabeled", "--threads", "1"]
    argv += ["--partition", "noniid", "--seeds", "0", "--scale", "smoke", "--device", "cpu", "--out", str(tmp_path)]
    argv += ["--set", "finetune_min_steps=12", "--set", "max_candidates=2"]
    torch.set_num_threads(1)
    run = next(r for r in reproduce.plan(reproduce.parse_args(argv)) if r.cell.strategy == "pfedclub")
    words = shlex.split(run.command())
    assert words[:2] == ["fedge", "run"] and "server_threads=1" in words
    assert cli.main(words[1:] + ["--workers", "1"]) == 0  # the worker count is not part of a run's config
    assert folder_state(run.folder, replace(run.config(), out=str(run.folder))) == "finished"


def test_a_reproduction_in_chunks_pauses_after_whole_rounds_and_continues_to_the_same_rows(
    tmp_path, capsys, one_thread
):
    """--chunk-minutes, as a lent GPU's few minutes are used (here --device cpu): a chunk ends after the round
    that spends its time, later runs are left; the same command continues them (exit 3 until all finished), and
    the rows and numbers are those of the run in one go."""
    argv = ["--preset", "table1", "--datasets", "digits", "--zoos", "III", "--public", "unlabeled", "--threads", "1"]
    argv += ["--partition", "noniid", "--seeds", "0", "--scale", "smoke", "--device", "cpu", "--no-local"]
    argv += ["--set", "finetune_min_steps=12", "--set", "max_candidates=2"]
    assert reproduce.main(argv + ["--out", str(tmp_path / "whole")]) == 0
    chunked = argv + ["--out", str(tmp_path / "chunks"), "--chunk-minutes", "0.0001"]
    statuses = []
    while not statuses or statuses[-1] == 3:
        statuses.append(reproduce.main(chunked))
        assert len(statuses) <= 8, "the chunks do not advance"
    err = capsys.readouterr().err
    # two runs (pFedHR, pFedClub) of two rounds: each chunk runs one round (it spends the chunk's time), so each
    # run paused once after its first round, and each chunk left the run after the one it advanced
    assert statuses == [3, 3, 3, 0] and err.count("paused: the chunk's time is up") == 2

    def rows(out):
        keys = ("round", "client", "trained", "accuracy", "loss", "train_loss", "phi")
        return [
            {k: r.get(k) for k in keys}
            for folder in sorted((out / "smoke").iterdir())
            for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
        ]

    assert rows(tmp_path / "chunks") == rows(tmp_path / "whole") and len(rows(tmp_path / "whole")) > 0
    cells = [json.loads((tmp_path / out / "results.json").read_text())["cells"] for out in ("whole", "chunks")]
    assert cells[0] == cells[1]
