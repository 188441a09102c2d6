"""ONNX Runtime's execution providers by name: the one place their names are spelled.

The CLI and the policy take short names (``cpu``, ``cuda``, ``tensorrt``); sessions, results.json
and ORT itself use ORT's names; tables and reports print the label. This module sits at the
bottom of the package so that modules below ``measure`` (calibration, which opens its own CPU
session) name a provider the same way; ``measure.sessions`` builds on it and decides which
providers really load.
"""

from __future__ import annotations

PROVIDERS: dict[str, str] = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
CPU = PROVIDERS["cpu"]
CUDA = PROVIDERS["cuda"]
TENSORRT = PROVIDERS["tensorrt"]


def short_provider(provider: str) -> str:
    """``CPUExecutionProvider`` -> ``CPU``: the label tables and reports print."""
    return provider.replace("ExecutionProvider", "")
