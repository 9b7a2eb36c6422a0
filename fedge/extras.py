"""Which optional extra of the fedge package provides which third-party module, and the error that names it.

A device installs only the core (torch, numpy, safetensors, paho-mqtt, pillow); the server and simulation, the
embedded datasets, export and the tests each add an extra (pyproject.toml).
"""

from __future__ import annotations

import importlib.util

from fedge.errors import UserError

EXTRAS = {
    "tqdm": "server",
    "matplotlib": "server",
    "amqtt": "server",
    "mlxtend": "data",
    "sklearn": "data",
    "onnx": "export",
    "onnxscript": "export",
    "onnxruntime": "export",
    "executorch": "export",
    "torchvision": "vision",
    "ray": "ray",
}


class MissingExtra(UserError, ImportError):
    """An optional package is not installed; the message names the extra that brings it."""


def missing_extra(module: str, what: str, extra: str | None = None) -> MissingExtra | None:
    """The error for `what` needing `module` (a dotted name) of `extra` (default: its top level looked up in
    EXTRAS), or None when the module belongs to no extra (then it is a bug, not a missing install)."""
    top = module.split(".")[0]
    extra = extra or EXTRAS.get(top)
    if extra is None:
        return None
    return MissingExtra(
        f"{what} needs {top}, which is not installed; install the {extra} extra: pip install 'fedge[{extra}]'"
    )


def require(*modules: str, what: str, extra: str | None = None) -> None:
    """MissingExtra naming the extra (`extra`, else the one EXTRAS lists) when one of `modules` is not installed;
    a module of no extra is a programming error (ValueError)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            error = missing_extra(module, what, extra)
            if error is None:
                raise ValueError(f"{module} belongs to no extra of fedge (fedge.extras.EXTRAS)")
            raise error
