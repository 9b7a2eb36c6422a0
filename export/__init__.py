"""ONNX and ExecuTorch exporters with load-back parity checks."""

from fedge.errors import UserError
from fedge.extras import MissingExtra
from fedge.extras import require as require_extra

# Largest max-abs logit difference, runtime (onnxruntime or ExecuTorch) vs eager PyTorch, that an inference
# export passes (argmax must also agree on every sample): issue 5's bound for both formats.
PARITY_ATOL = 1e-4


class ExportError(UserError, ValueError):
    """A model cannot be exported, or the exported program does not reproduce eager PyTorch; the message
    gives the layer or the numbers."""


def require(*packages: str) -> None:
    """ExportError naming the extra to install when an optional package of the `export` extra is missing."""
    try:
        require_extra(*packages, what="export", extra="export")
    except MissingExtra as e:
        raise ExportError(str(e)) from None
