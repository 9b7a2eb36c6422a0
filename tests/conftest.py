"""Makes tests/helpers importable as ``helpers`` (the suite runs with --import-mode=importlib); loads its fixtures;
runs the unit and contract tests at one torch thread."""

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

pytest_plugins = ["helpers.brokers", "helpers.rabbitmq"]
ONE_THREAD = ("unit", "contract")  # integration and fault tests set threads where they compare runs


@pytest.fixture(autouse=True)
def one_torch_thread(request):
    """A unit or contract test runs torch at one intra-op thread, as `fedge run`'s clients do: the tiny models gain
    nothing from more, and on two cores shared with other work (another pytest, a run) torch's waiting threads made
    single tests 5-10x slower (a pFedHR fine-tuning test: 25 s at two threads, 3 s at one). A test that needs
    another count sets it; the count is restored after each test."""
    if request.path.relative_to(TESTS).parts[0] not in ONE_THREAD:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
