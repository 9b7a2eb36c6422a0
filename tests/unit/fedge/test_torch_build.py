"""The torch build a device runs: the one-line warning for a CUDA build without a GPU (the build info faked, as a
Raspberry Pi with PyPI's aarch64 wheel would report it), and the CUDA libraries read from a process's smaps."""

import logging

import pytest
import torch

from fedge import torch_build as tb
from fedge.torch_build import (
    CPU_INSTALL,
    TorchBuild,
    armv8_0_crash,
    check_client_build,
    cpu_features,
    cuda_libraries,
    cuda_without_gpu,
    probe,
)
from launch.cli import main

pytestmark = pytest.mark.timeout(120)
CPU_BUILD = pytest.mark.skipif(torch.version.cuda is not None, reason="checks this machine's CPU build of torch")
PI = TorchBuild("2.13.0+cu130", "13.0", False)  # PyPI's aarch64 torch 2.13 on a Raspberry Pi


def test_a_cuda_build_without_a_gpu_gets_one_line_with_the_fix():
    line = cuda_without_gpu(PI)
    assert "\n" not in line and "torch 2.13.0+cu130 is a CUDA 13.0 build" in line and line.endswith(CPU_INSTALL)
    assert cuda_without_gpu(TorchBuild("2.13.0+cpu", None, False)) is None
    assert cuda_without_gpu(TorchBuild("2.13.0+cu130", "13.0", True)) is None  # a GPU uses what it maps


PI4_FEATURES = {"fp", "asimd", "evtstrm", "crc32", "cpuid"}  # a Raspberry Pi 4's Cortex-A72: ARMv8.0, no LSE
PI4_CPUINFO = "processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU part\t: 0xd08\n"
NVPL = ["libnvpl_blas_core.so.0"]
CLIENT = ["client", "--broker", "mqtt://127.0.0.1:1", "--id", "99", "--dataset", "digits"]  # id 99 is refused


@pytest.fixture
def pi4_with_pypis_torch(monkeypatch):
    monkeypatch.setattr(tb, "torch_build", lambda: PI)
    monkeypatch.setattr(tb, "cpu_features", lambda: PI4_FEATURES)
    monkeypatch.setattr(tb, "bundled_nvpl", lambda: NVPL)


def test_fedge_client_on_pypis_aarch64_build_on_a_pi_4_refuses_to_train_multithreaded(pi4_with_pypis_torch, capsys):
    assert main(CLIENT + ["--threads", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "SIGILL" in err
        and err.rstrip().endswith("or run this client with --threads 1 (slower)")
    )


def test_at_one_thread_it_warns_once_each_before_anything_else(pi4_with_pypis_torch, caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="fedge.torch_build"):
        code = main(CLIENT + ["--threads", "1"])
    warnings = [r.getMessage() for r in caplog.records if r.name == "fedge.torch_build"]
    assert warnings == [armv8_0_crash(PI4_FEATURES, NVPL, PI), cuda_without_gpu(PI)]
    assert code == 2 and "client id '99'" in capsys.readouterr().err  # refused for its id, after the warnings


@CPU_BUILD
def test_this_machines_cpu_build_is_not_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        assert check_client_build(threads=2) == []
    assert not caplog.records


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
7f00500000-7f00600000 r-xp 00000000 08:01 14 /home/a b/venv/nvidia/cusolver/lib/libcusolverMg.so.12
Rss:                   4 kB
"""


def test_cuda_libraries_sums_the_resident_pages_of_each_cuda_library_and_nothing_else():
    assert cuda_libraries(SMAPS) == {
        "libcublasLt.so.13": 768 * 1024,
        "libtorch_cuda.so": 2048 * 1024,
        "libcusolverMg.so.12": 4096,
    }


@CPU_BUILD
def test_the_probe_measures_this_cpu_build():
    measured = probe()  # torch is imported already in the test process: only the build and the training are new
    assert measured["build"] == {"version": PI.version.replace("cu130", "cpu"), "cuda": None, "gpu": False}
    assert measured["cuda_libraries"] == {}
    # both measured; their order holds in a fresh interpreter (tests/unit/test_doctor.py), not in this long-lived
    # process, which may hand memory back between the two (seen: 49 KB less after training in a full run)
    assert measured["rss_after_import"] > 0 and measured["rss_after_training"] > 0
