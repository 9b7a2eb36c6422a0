"""The CLI's contracts (JSON outputs) and its one-line errors for bad input."""

import json
import subprocess
import sys

import pytest
import torch

from launch.cli import main

pytestmark = pytest.mark.timeout(120)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_zoo_json_contract(capsys):
    code, out, _ = run(capsys, "zoo", "--json", "--input", "1x28x28")
    rows = json.loads(out)
    assert code == 0
    fedgh = [f"fedgh_cnn{i}" for i in range(1, 6)]
    pfedclub = ["cnn1", "cnn2", "cnn3", "cnn4", "mobilenet_v1", "mobilenet_v2", "mobilenet_v3"]
    assert [r["name"] for r in rows] == pfedclub + fedgh
    # the representation a shared head (DC-PFL, FedGH) takes: none for MobileNetV1, whose last block pools a map
    assert {r["name"]: r["representation"] for r in rows if r["name"] in ("cnn1", "mobilenet_v1", "fedgh_cnn3")} == {
        "cnn1": 128,
        "mobilenet_v1": None,
        "fedgh_cnn3": 500,
    }
    assert all(isinstance(r["params"], int) and isinstance(r["macs"], int) and r["blocks"] > 0 for r in rows)
    assert all(r["executorch_training"] == "yes" for r in rows)  # BatchNorm included (export.training_program)


def test_zoo_lists_the_paper_widths(capsys):
    code, out, _ = run(capsys, "zoo", "--json", "--input", "3x32x32", "--widths", "paper")
    params = {r["name"]: r["params"] for r in json.loads(out)}
    assert code == 0 and params["mobilenet_v2"] == 2_236_682 and params["cnn1"] == 222_184


def test_profiles_json_contract(capsys):
    code, out, _ = run(capsys, "profiles", "--json")
    rows = json.loads(out)
    names = {r["name"] for r in rows}
    assert (
        code == 0
        and {
            "rpi-zero-2w",
            "rpi-4",
            "rpi-5",
            "jetson-orin-nano",
            "android-low-end",
            "android-mid-range",
            "android-flagship",
            "gpu-server",
        }
        <= names
    )
    assert all({"name", "runtime", "max_params", "max_macs"} <= set(r) for r in rows)


def test_data_describes_a_partition(capsys):
    code, out, _ = run(capsys, "data", "--dataset", "digits", "--clients", "5", "--json")
    info = json.loads(out)
    assert code == 0 and info["samples"] == 1797 and len(info["clients"]) == 5
    assert all(len(c["classes"]) == 2 for c in info["clients"])


def test_run_prints_per_client_accuracy(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "run",
        "--dataset",
        "digits",
        "--zoo",
        "cnn1",
        "--clients",
        "3",
        "--active",
        "3",
        "--rounds",
        "1",
        "--local-epochs",
        "1",
        "--set",
        "export_onnx=false",  # the final models' ONNX files are not what this checks
        "--out",
        str(tmp_path / "r"),
        "--no-progress",
    )
    assert code == 0 and "mean final accuracy" in out
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["clients"] == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--strategy", "nope"], "unknown strategy 'nope'; available: "),  # in registration order
        (["run", "--set", "bogus=1"], "strategy 'pfedclub' has no option(s) ['bogus']; its options: clusters,"),
        (["run", "--strategy", "fedavg", "--set", "eta=0.2"], "strategy 'fedavg' has no option(s) ['eta']"),
        (["run", "--strategy", "pfedclub+", "--set", "eta=-2"], "eta must be > -1"),
        (["run", "--set", "clusters=many"], "clusters='many' is not a valid int"),
        (["run", "--set", "rounds"], "--set expects key=value"),
        (["run", "--clients", "2", "--active", "5"], "active (5) cannot exceed clients (2)"),
        (["run", "--zoo", "IV"], "unknown zoo 'IV'"),
        (["run", "--set", "widths=huge"], "widths must be one of cpu, paper (the zoo's width preset), got 'huge'"),
        (["run", "--dataset", "imagenet"], "unknown dataset"),
        (["run", "--config", "/nonexistent.toml"], "cannot read config file"),
        (["data", "--dataset", "mnist", "--data", "/nonexistent"], "/nonexistent"),
        (["profiles", "--validate", "/nonexistent.toml"], "nonexistent"),
    ],
)
def test_bad_input_gives_one_clear_line(capsys, tmp_path, argv, message):
    code, out, err = run(capsys, *argv, *(["--out", str(tmp_path / "r"), "--no-progress"] if argv[0] == "run" else []))
    last = err.strip().splitlines()[-1]
    assert code == 2
    assert last.startswith("fedge: error:") and message in last
    assert "Traceback" not in err


def test_bad_toml_config(capsys, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("rounds = [\n")
    code, _, err = run(capsys, "run", "--config", str(path))
    assert code == 2 and "not valid TOML" in err


def test_toml_config_with_overrides_on_top(capsys, tmp_path):
    path = tmp_path / "run.toml"
    # export_onnx = false: the final models' ONNX files are not what this checks
    path.write_text(
        'dataset = "digits"\nzoo = "cnn1"\nclients = 2\nactive = 2\nrounds = 3\nlocal_epochs = 1\nexport_onnx = false\n'
    )
    code, _, err = run(
        capsys, "run", "--config", str(path), "--rounds", "1", "--out", str(tmp_path / "r"), "--no-progress"
    )
    assert code == 0 and json.loads((tmp_path / "r" / "config.json").read_text())["rounds"] == 1


def test_strategy_options_from_a_toml_table_and_set_are_recorded_with_their_defaults(capsys, tmp_path):
    path = tmp_path / "run.toml"
    # workers = 1: the clients in this process (starting worker processes is not what this checks)
    path.write_text(
        'strategy = "fedavg"\ndataset = "digits"\nzoo = "cnn1"\nclients = 2\nactive = 2\nrounds = 1\n'
        'local_epochs = 1\ntransport = "inproc"\nworkers = 1\n[options]\nmax_client_share = 0.75\n'
    )
    code, _, err = run(capsys, "run", "--config", str(path), "--out", str(tmp_path / "r"), "--no-progress")
    assert code == 0, err
    assert json.loads((tmp_path / "r" / "config.json").read_text())["options"] == {"max_client_share": 0.75}
    code, _, err = run(
        capsys,
        "run",
        "--config",
        str(path),
        "--set",
        "max_client_share=1",
        "--out",
        str(tmp_path / "s"),
        "--no-progress",
    )
    assert code == 0 and json.loads((tmp_path / "s" / "config.json").read_text())["options"] == {
        "max_client_share": 1.0
    }


def test_strategies_lists_every_strategy_with_its_options(capsys):
    code, out, _ = run(capsys, "strategies", "--json")
    listed = {s["name"]: {o["name"]: o["default"] for o in s["options"]} for s in json.loads(out)}
    assert listed["fedavg"] == {"max_client_share": 0.5} and listed["local"] == {"every_round": True}
    assert listed["pfedclub+"]["eta"] == 0.1 and "eta" not in listed["pfedclub"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_client_device_cuda_without_a_gpu_says_so(capsys, tmp_path):
    # --client-device cuda alone picks the batched engine, then finds no GPU: one line, no traceback
    code, _, err = run(capsys, "run", "--transport", "inproc", "--client-device", "cuda", "--out", str(tmp_path / "r"))
    assert code != 0 and "client_device cuda: torch sees no CUDA device here" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_bad_input_shape_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["zoo", "--input", "28x28"])
    assert exit_info.value.code == 2 and "expected CxHxW" in capsys.readouterr().err


def test_console_script_help():
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "run", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--local-epochs" in result.stdout and "--set KEY=VALUE" in result.stdout
    assert "pfedclub+: pFedClub+" in result.stdout and "eta (float, default 0.1)" in result.stdout
