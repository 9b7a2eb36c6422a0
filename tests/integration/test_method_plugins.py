"""A method that lives outside fedge: `fedge new-method` writes it, pip installs it beside fedge (its own
`fedge.methods` entry point, nothing of fedge edited), and fedge finds it: `fedge strategies` lists it, it runs
in-process and over the embedded broker with `fedge client` processes (which load its client half), its own test
passes, and fedge's contract tests cover it unedited. Each check runs in a fresh process, as a user's would."""

import json
import os
import re
import subprocess
import sys

import pytest

from launch.cli import main as cli_main

from helpers.federation import REPO

pytestmark = pytest.mark.timeout(600)
NAME = "example_avg"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """(the package folder `fedge new-method` wrote, an environment whose Python finds it installed)."""
    root = tmp_path_factory.mktemp("plugin")
    assert cli_main(["new-method", NAME, "--dir", str(root)]) == 0
    folder, site = root / f"fedge-{NAME}", root / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run([*pip, "--target", str(site), str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (site / f"fedge_{NAME}" / "client.py").exists() and list(site.glob(f"fedge_{NAME}-*.dist-info"))
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    return folder, os.environ | {"PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


def fedge(env, *argv, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def pytest_process(env, cwd, *argv):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv],
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
        cwd=cwd,
    )


def test_new_method_refuses_a_taken_name_and_a_bad_one(tmp_path, capsys):
    assert cli_main(["new-method", "fedavg", "--dir", str(tmp_path)]) == 2
    assert cli_main(["new-method", "Bad-Name", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'fedavg' exists" in err and "lower-case letter" in err and not list(tmp_path.iterdir())


def test_fedge_lists_the_installed_method_with_its_options(plugin):
    _, env = plugin
    done = fedge(env, "strategies", "--json")
    assert done.returncode == 0, done.stderr
    listed = {s["name"]: s for s in json.loads(done.stdout)}
    assert {"fedavg", "fedprox", NAME} <= set(listed)
    assert [o["name"] for o in listed[NAME]["options"]] == ["server_lr"]


@pytest.mark.parametrize("transport", ["inproc", "mqtt"])
def test_the_installed_method_runs_in_process_and_over_the_embedded_broker(plugin, tmp_path, transport):
    _, env = plugin
    argv = ["run", "--strategy", NAME, "--zoo", "cnn1", "--dataset", "digits", "--clients", "3", "--active", "3"]
    argv += ["--rounds", "2", "--local-epochs", "1", "--seed", "3", "--transport", transport, "--no-progress"]
    argv += ["--set", "export_onnx=false", "--set", "server_threads=1", "--out", str(tmp_path / "run")]
    if transport == "mqtt":
        argv += ["--processes", "2"]  # `fedge client` processes: they load the method's client half
    done = fedge(env, *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["strategy"] == NAME and summary["never_trained"] == []
    assert {s["status"] for s in summary["client_status"].values()} == {"trained"}
    assert summary["final_accuracy"]["mean"] > 0.3  # ten classes: chance is 0.1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(bool(r.get("trained")) for r in rows) == 6  # 3 clients x 2 rounds, every one a {NAME}_train task


def test_the_methods_own_test_passes(plugin):
    folder, env = plugin
    done = pytest_process(env, folder, str(folder / "tests"))
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"\b1 passed", done.stdout), done.stdout[-1000:]


def test_fedges_contract_tests_cover_the_installed_method_unedited(plugin):
    _, env = plugin
    done = pytest_process(env, REPO, "tests/contract", "-k", NAME)
    assert done.returncode == 0, done.stdout[-4000:]
    passed = int(re.search(r"(\d+) passed", done.stdout).group(1))
    assert passed >= 8, done.stdout[-2000:]  # every per-strategy contract (8 today), not a handful
