"""ONNX and ExecuTorch exporters with load-back parity checks."""
