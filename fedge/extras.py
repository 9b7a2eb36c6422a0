"""Which optional extra of the fedge package provides which third-party module, and the error that names it.

A device installs only the core (torch, numpy, safetensors, paho-mqtt); the server and simulation, the embedded
datasets, export and the tests each add an extra (pyproject.toml).
"""

from __future__ import annotations

import importlib.util

from fedge.errors import UserError

EXTRAS = {"tqdm": "server", "matplotlib": "server", "amqtt": "server", "mlxtend": "data", "sklearn": "data",
          "onnx": "export", "onnxscript": "export", "onnxruntime": "export", "executorch": "export",
          "torchvision": "vision"}


class MissingExtra(UserError, ImportError):
    """An optional package is not installed; the message names the extra that brings it."""


def missing_extra(module: str, what: str) -> MissingExtra | None:
    """The error for `what` needing `module` (a dotted name; its top level is looked up in EXTRAS), or None when
    the module belongs to no extra (then it is a bug, not a missing install)."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return MissingExtra(f"{what} needs {top}, which is not installed; install the {extra} extra: "
                        f"pip install 'fedge[{extra}]'")


def require(*modules: str, what: str) -> None:
    """MissingExtra naming the extra when one of `modules` (each listed in EXTRAS) is not installed."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            error = missing_extra(module, what)
            raise error if error is not None else ImportError(f"{what} needs {module}, which is not installed")
