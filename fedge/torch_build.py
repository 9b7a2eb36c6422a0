"""Which torch build a device runs and what it costs it: a CUDA build on a machine without a usable GPU trains on
the CPU like the CPU build, but maps a few hundred MB of CUDA libraries for nothing (issue 32 measured 491 against
218 MB of RSS after `import torch`, natively on x86_64, and a 4.7 GB venv on aarch64); and on an ARMv8.0 Pi,
PyPI's aarch64 build dies with SIGILL (armv8_0_crash).

`python -m fedge.torch_build` measures, in a fresh interpreter, what `import torch` and a few training steps cost
this machine and prints it as JSON (`fedge doctor` runs it and reports it); with `--problems`, only the build's
problems on this machine, without training (what a probe that died of one of them could not say).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedge.errors import UserError

log = logging.getLogger(__name__)
# The one install that gives the CPU build on every platform, aarch64 (a Raspberry Pi) included: PyPI serves a
# CUDA build of torch 2.13 for aarch64 and x86_64 alike.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _torch_requirement() -> str:
    """fedge's own torch requirement (pyproject.toml, as installed), e.g. "torch==2.13.*"."""
    try:
        requirements = importlib.metadata.requires("fedge") or []
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        requirements = []
    return next((r.split(";")[0].strip() for r in requirements if re.match(r"torch\b", r)), "torch")


CPU_INSTALL = f"pip install --index-url {CPU_INDEX} '{_torch_requirement()}'"
# Shared libraries of CUDA, its math libraries, NCCL and torch's CUDA half, by file name (libcurl is not one).
_CUDA_LIBRARY = re.compile(
    r"/lib(cudart|cublas|cudnn|cufft|cufile|curand|cusolver|cusparse|cupti|nccl|nvrtc|nvjitlink|nvtoolsext|nvshmem"
    r"|nvperf|torch_cuda|c10_cuda)\w*[.-][^/]*$",
    re.IGNORECASE,
)
# What the probe trains to measure the runtime's memory after a backward pass and optimiser steps.
PROBE_MODEL, PROBE_INPUT, PROBE_CLASSES, PROBE_BATCH, PROBE_STEPS = "cnn1", (1, 28, 28), 10, 16, 3


@dataclass(frozen=True)
class TorchBuild:
    """torch's version, the CUDA version it was built for (None: a CPU build) and whether a CUDA device is usable."""

    version: str
    cuda: str | None
    gpu: bool

    @property
    def kind(self) -> str:
        """ "CPU build" or "CUDA 13.0 build"."""
        return "CPU build" if self.cuda is None else f"CUDA {self.cuda} build"


def torch_build() -> TorchBuild:
    """This process's torch build (imports torch)."""
    import torch

    cuda = torch.version.cuda
    return TorchBuild(torch.__version__, cuda, bool(cuda) and torch.cuda.is_available())


def cuda_without_gpu(build: TorchBuild) -> str | None:
    """One line for a CUDA build with no usable GPU: what it costs and the command that fixes it; else None."""
    if build.cuda is None or build.gpu:
        return None
    return (
        f"torch {build.version} is a {build.kind} on a machine without a usable GPU: it trains on the CPU all the "
        f"same but maps a few hundred MB of CUDA libraries for nothing; install the CPU build instead: {CPU_INSTALL}"
    )


def cpu_features(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags (the first `Features` line of /proc/cpuinfo, as aarch64 Linux writes it); None where
    there is no such line (x86 writes `flags`) or no /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Features":
            return set(value.split())
    return None


def bundled_nvpl() -> list[str]:
    """NVIDIA Performance Libraries bundled in this torch (torch/lib/libnvpl_*): PyPI's aarch64 CUDA build does
    its CPU BLAS with them, the CPU build with OpenBLAS."""
    import torch

    return sorted(p.name for p in (Path(torch.__file__).parent / "lib").glob("libnvpl_*"))


def armv8_0_crash(features: set[str] | None, nvpl: list[str], build: TorchBuild) -> str | None:
    """One line when this torch will die with SIGILL on this CPU: an aarch64 CPU without ARMv8.1's atomics (LSE;
    no `atomics` in its Features: the Cortex-A72 of a Raspberry Pi 4, the Cortex-A53 of a Zero 2 W) and NVPL BLAS,
    whose multi-threaded GEMM executes `ldaddal` (found with gdb on a core dump under qemu's cortex-a72: issue 32)."""
    if features is None or "atomics" in features or not nvpl:
        return None
    return (
        f"torch {build.version} bundles NVIDIA's NVPL BLAS ({nvpl[0]}), built for ARMv8.1+ atomics this CPU lacks "
        f"(no 'atomics' in /proc/cpuinfo's Features, as on a Raspberry Pi 4 or Zero 2 W): training with more than "
        f"one thread dies with SIGILL (Illegal instruction); install the CPU build instead: {CPU_INSTALL}"
    )


def _crash_and_cuda() -> tuple[str | None, str | None]:
    """armv8_0_crash's and cuda_without_gpu's lines for this process's torch on this machine (imports torch)."""
    build = torch_build()
    return armv8_0_crash(cpu_features(), bundled_nvpl(), build), cuda_without_gpu(build)


def build_problems() -> list[str]:
    """Every one-line problem of this process's torch on this machine (imports torch)."""
    return [line for line in _crash_and_cuda() if line]


class TorchBuildError(UserError):
    """This torch cannot train here as asked; the message says why and what to do."""


def check_client_build(threads: int) -> list[str]:
    """At a client's start: log each of build_problems' lines and return them; raise TorchBuildError instead
    when this torch would die of SIGILL training at `threads` > 1 (armv8_0_crash); at one thread it only warns
    (one thread trained under qemu's cortex-a72, issue 32)."""
    crash, cuda = _crash_and_cuda()
    if crash and threads > 1:
        raise TorchBuildError(f"{crash}; or run this client with --threads 1 (slower)")
    lines = [line for line in (crash, cuda) if line]
    for line in lines:
        log.warning("%s", line)
    return lines


def cuda_libraries(smaps: str) -> dict[str, int]:
    """The CUDA libraries in a /proc/<pid>/smaps text: file name -> resident bytes of its mappings."""
    resident: dict[str, int] = {}
    library = None
    for line in smaps.splitlines():
        fields = line.split(maxsplit=5)  # a header's path, the sixth field, may hold spaces
        if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            path = fields[5].strip() if len(fields) > 5 else ""
            library = Path(path).name if _CUDA_LIBRARY.search(path) else None
            if library is not None:
                resident.setdefault(library, 0)
        elif library is not None and fields[:1] == ["Rss:"] and len(fields) >= 2:
            resident[library] += int(fields[1]) * 1024
    return resident


def _own_smaps() -> str:
    try:
        return Path("/proc/self/smaps").read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux
        return ""


def probe() -> dict[str, Any]:
    """Measured in this (fresh) interpreter: seconds and RSS of `import torch`, the build, the CUDA libraries it
    mapped, and the RSS after PROBE_STEPS Adam steps of the zoo's PROBE_MODEL at PROBE_BATCH (the runtime's own
    memory once training has run, beside which a model's training footprint must fit)."""
    from fedge.memory import rss_bytes

    before = rss_bytes()
    start = time.perf_counter()
    import torch

    seconds = time.perf_counter() - start
    after_import = rss_bytes()
    build = torch_build()
    libraries = cuda_libraries(_own_smaps())
    problems = build_problems()

    from fedge.model.spec import build as build_model
    from fedge.model.zoo import create

    model = build_model(create(PROBE_MODEL, PROBE_INPUT, PROBE_CLASSES, "cpu"))  # at torch's threads, as a client
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(PROBE_BATCH, *PROBE_INPUT), torch.randint(0, PROBE_CLASSES, (PROBE_BATCH,))
    for _ in range(PROBE_STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {
        "build": asdict(build),
        "threads": torch.get_num_threads(),
        "build_problems": problems,
        "import_seconds": seconds,
        "rss_before_import": before,
        "rss_after_import": after_import,
        "rss_after_training": rss_bytes(),
        "cuda_libraries": libraries,
        "python": sys.version.split()[0],
    }


if __name__ == "__main__":
    print(json.dumps(build_problems() if sys.argv[1:] == ["--problems"] else probe()))
