"""`fedge doctor` on this machine (a fresh interpreter measures torch), and its verdicts from given numbers."""

import json

import pytest
import torch

from device_profiles import get_profile
from fedge.model.zoo import MODELS
from fedge.torch_build import TorchBuild, cuda_without_gpu
from launch.cli import main
from launch.doctor import meminfo, model_rows, problems

pytestmark = pytest.mark.timeout(300)
CPU_BUILD = pytest.mark.skipif(torch.version.cuda is not None, reason="checks this machine's CPU build of torch")
MB = 1_000_000


@CPU_BUILD
def test_doctor_measures_this_machine_and_lists_every_zoo_model(capsys):
    code = main(["doctor", "--profile", "rpi-zero-2w", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["problems"] == []
    torch = r["torch"]
    assert torch["kind"] == "CPU build" and torch["cuda_libraries"] == {}
    assert torch["import_seconds"] > 0  # measured in a fresh interpreter, where torch was not imported yet
    assert torch["rss_before_import"] < torch["rss_after_import"] <= torch["rss_after_training"]
    assert [row["model"] for row in r["models"]] == list(MODELS)
    admitted = {row["model"] for row in r["models"] if row["profile_admits"]}
    assert "cnn1" in admitted and "mobilenet_v3" not in admitted  # 1.53 M params > the Zero 2 W's 0.8 M


@CPU_BUILD
def test_doctor_text_names_the_build_and_the_verdict(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "CPU build" in out and "CUDA libraries mapped: none" in out and out.rstrip().endswith("no problems found")


def test_memory_verdicts_count_the_measured_runtime_beside_the_footprint():
    rows = model_rows(get_profile("rpi-4"), (1, 28, 28), 10, 16, "cpu", runtime_rss=300 * MB, available=None)
    assert all(r["fits_memory_now"] is None for r in rows)
    cnn1 = next(r for r in model_rows(None, (1, 28, 28), 10, 16, "cpu", 300 * MB, 10**12) if r["model"] == "cnn1")
    assert cnn1["profile_admits"] is None and cnn1["fits_memory_now"] and cnn1["needs_mb"] > 300
    tight = model_rows(None, (1, 28, 28), 10, 16, "cpu", 300 * MB, int(cnn1["needs_mb"] * MB) - 1)
    assert not any(r["fits_memory_now"] for r in tight)
    here = {"memory_available": int(cnn1["needs_mb"] * MB) - 1}
    build = TorchBuild("2.13.0+cu130", "13.0", False)
    found = problems({"rss_after_training": 300 * MB, "build_problems": [cuda_without_gpu(build)]}, tight, here)
    assert found[0] == cuda_without_gpu(build) and "not enough for the runtime" in found[1]


def test_meminfo_reads_total_and_available():
    text = "MemTotal:        3884324 kB\nMemFree:          100000 kB\nMemAvailable:    2000000 kB\n"
    assert meminfo(text) == {"MemTotal": 3884324 * 1024, "MemAvailable": 2000000 * 1024}


def test_a_probe_killed_by_sigill_is_reported_with_the_builds_own_diagnosis(monkeypatch, capsys):
    import subprocess

    from launch import doctor

    cause = "torch 2.13.0+cu130 bundles NVIDIA's NVPL BLAS ..."
    replies = {
        (): subprocess.CompletedProcess([], -4, "", "qemu: uncaught target signal 4 (Illegal instruction)"),
        ("--problems",): subprocess.CompletedProcess([], 0, json.dumps([cause]) + "\n", ""),
    }
    monkeypatch.setattr(doctor, "_fresh", lambda args, timeout: replies[tuple(args)])
    assert main(["doctor"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(killed by SIGILL): " + cause in err
