"""ONNX and ExecuTorch exporters with load-back parity checks."""

import importlib.util
from fedge.errors import UserError

# Largest max-abs logit difference, runtime (onnxruntime or ExecuTorch) vs eager PyTorch, that an inference
# export passes (argmax must also agree on every sample): issue 5's bound for both formats.
PARITY_ATOL = 1e-4


class ExportError(UserError, ValueError):
    """A model cannot be exported, or the exported program does not reproduce eager PyTorch; the message
    gives the layer or the numbers."""


def require(*packages: str) -> None:
    """ExportError naming the fix when an optional package of the `export` extra is not installed."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ExportError(f"{', '.join(missing)} not installed; install the export extra: pip install 'fedge[export]'")
