"""The torch build a device runs: the one-line warning for a CUDA build without a GPU (the build info faked, as a
Raspberry Pi with PyPI's aarch64 wheel would report it), and the CUDA libraries read from a process's smaps."""

import logging

import pytest

from fedge import torch_build as tb
from fedge.torch_build import (
    CPU_INSTALL,
    TorchBuild,
    armv8_0_crash,
    cpu_features,
    cuda_libraries,
    cuda_without_gpu,
    probe,
    warn_build_problems,
)
from launch.cli import main

pytestmark = pytest.mark.timeout(120)
PI = TorchBuild("2.13.0+cu130", "13.0", False)  # PyPI's aarch64 torch 2.13 on a Raspberry Pi


def test_a_cuda_build_without_a_gpu_gets_one_line_with_the_fix():
    line = cuda_without_gpu(PI)
    assert "\n" not in line and "torch 2.13.0+cu130 is a CUDA 13.0 build" in line and line.endswith(CPU_INSTALL)
    assert cuda_without_gpu(TorchBuild("2.13.0+cpu", None, False)) is None
    assert cuda_without_gpu(TorchBuild("2.13.0+cu130", "13.0", True)) is None  # a GPU uses what it maps


def test_fedge_client_on_a_cuda_build_without_a_gpu_warns_once_before_anything_else(monkeypatch, caplog, capsys):
    monkeypatch.setattr(tb, "torch_build", lambda: PI)
    with caplog.at_level(logging.WARNING, logger="fedge.torch_build"):
        code = main(
            ["client", "--broker", "mqtt://127.0.0.1:1", "--id", "99", "--dataset", "digits"]
        )  # refused after the warning
    warnings = [r.getMessage() for r in caplog.records if r.name == "fedge.torch_build"]
    assert warnings == [cuda_without_gpu(PI)]
    assert code == 2 and "client id '99'" in capsys.readouterr().err


def test_this_machines_cpu_build_is_not_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        assert warn_build_problems() == []
    assert not caplog.records


PI4_FEATURES = {"fp", "asimd", "evtstrm", "crc32", "cpuid"}  # a Raspberry Pi 4's Cortex-A72: ARMv8.0, no LSE
PI4_CPUINFO = "processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU part\t: 0xd08\n"


def test_nvpl_on_a_cpu_without_armv8_1_atomics_is_a_sigill_foretold():
    assert cpu_features(PI4_CPUINFO) == PI4_FEATURES
    assert cpu_features("processor\t: 0\nflags\t\t: fpu vme sse2\n") is None  # x86 says `flags`
    line = armv8_0_crash(PI4_FEATURES, ["libnvpl_blas_core.so.0"], PI)
    assert "\n" not in line and "SIGILL" in line and line.endswith(CPU_INSTALL)
    assert armv8_0_crash(PI4_FEATURES | {"atomics"}, ["libnvpl_blas_core.so.0"], PI) is None  # a Pi 5's A76
    assert armv8_0_crash(PI4_FEATURES, [], TorchBuild("2.13.0+cpu", None, False)) is None  # OpenBLAS
    assert armv8_0_crash(None, ["libnvpl_blas_core.so.0"], PI) is None  # not aarch64


SMAPS = """\
7f00000000-7f00100000 r-xp 00000000 08:01 11 /venv/lib/python3.11/site-packages/nvidia/cublas/lib/libcublasLt.so.13
Size:               1024 kB
Rss:                 512 kB
VmFlags: rd ex mr mw me
7f00100000-7f00200000 r--p 00100000 08:01 11 /venv/lib/python3.11/site-packages/nvidia/cublas/lib/libcublasLt.so.13
Rss:                 256 kB
7f00200000-7f00300000 r-xp 00000000 08:01 12 /usr/lib/aarch64-linux-gnu/libcurl.so.4.8.0
Rss:                 100 kB
7f00300000-7f00400000 r-xp 00000000 08:01 13 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so
Rss:                2048 kB
7f00400000-7f00500000 rw-p 00000000 00:00 0
Rss:                  64 kB
"""


def test_cuda_libraries_sums_the_resident_pages_of_each_cuda_library_and_nothing_else():
    assert cuda_libraries(SMAPS) == {"libcublasLt.so.13": 768 * 1024, "libtorch_cuda.so": 2048 * 1024}


def test_the_probe_measures_this_cpu_build():
    measured = probe()  # torch is imported already in the test process: only the build and the training are new
    assert measured["build"] == {"version": PI.version.replace("cu130", "cpu"), "cuda": None, "gpu": False}
    assert measured["cuda_libraries"] == {}
    assert 0 < measured["rss_after_import"] <= measured["rss_after_training"]
