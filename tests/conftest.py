"""Makes tests/helpers importable as ``helpers`` (the suite runs with --import-mode=importlib); loads its fixtures."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest_plugins = ["helpers.brokers", "helpers.rabbitmq"]
