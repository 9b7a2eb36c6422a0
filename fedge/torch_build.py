"""Which torch build a device runs and what it costs it: a CUDA build on a machine without a usable GPU trains on
the CPU like the CPU build, but maps a few hundred MB of CUDA libraries for nothing (issue 32 measured 491 against
218 MB of RSS after `import torch` on aarch64, and a 4.7 GB venv against the CPU build's few hundred MB).

`python -m fedge.torch_build` measures, in a fresh interpreter, what `import torch` and a few training steps cost
this machine and prints it as JSON (`fedge doctor` runs it and reports it).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
# The one install that gives the CPU build on every platform, aarch64 (a Raspberry Pi) included: PyPI serves a
# CUDA build of torch 2.13 for aarch64 and x86_64 alike.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_INSTALL = f"pip install --index-url {CPU_INDEX} 'torch==2.13.*'"
# Shared libraries of CUDA, its math libraries, NCCL and torch's CUDA half, by file name (libcurl is not one).
_CUDA_LIBRARY = re.compile(
    r"/lib(cudart|cublas|cublaslt|cudnn\w*|cufft|cufile|curand|cusolver|cusparse\w*|cupti|nccl|nvrtc|nvjitlink"
    r"|nvtoolsext|nvshmem\w*|nvperf\w*|torch_cuda|c10_cuda)[.-][^/]*$",
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


def warn_cuda_without_gpu() -> str | None:
    """Log cuda_without_gpu's line, once, for this process's torch (a client at start-up); returns it."""
    line = cuda_without_gpu(torch_build())
    if line:
        log.warning("%s", line)
    return line


def cuda_libraries(smaps: str) -> dict[str, int]:
    """The CUDA libraries in a /proc/<pid>/smaps text: file name -> resident bytes of its mappings."""
    resident: dict[str, int] = {}
    library = None
    for line in smaps.splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            path = fields[5] if len(fields) > 5 else ""
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

    from fedge.spec import build as build_model
    from fedge.zoo import create

    torch.set_num_threads(1)
    model = build_model(create(PROBE_MODEL, PROBE_INPUT, PROBE_CLASSES, "cpu"))
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(PROBE_BATCH, *PROBE_INPUT), torch.randint(0, PROBE_CLASSES, (PROBE_BATCH,))
    for _ in range(PROBE_STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {
        "build": asdict(build),
        "import_seconds": seconds,
        "rss_before_import": before,
        "rss_after_import": after_import,
        "rss_after_training": rss_bytes(),
        "cuda_libraries": libraries,
        "python": sys.version.split()[0],
    }


if __name__ == "__main__":
    print(json.dumps(probe()))
