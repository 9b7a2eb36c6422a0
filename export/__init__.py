"""ONNX and ExecuTorch exporters with load-back parity checks."""


class ExportError(ValueError):
    """A model cannot be exported, or the exported program does not reproduce eager PyTorch; the message
    gives the layer or the numbers."""
