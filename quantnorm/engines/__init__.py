"""Other inference engines, measured beside quantnorm's own rows (``quantnorm evaluate --engines``).

Each engine is one module with one class implementing ``base.Engine``; ``ENGINES`` names them.
An engine's own package (llama-cpp-python, onnxruntime-genai) is imported only when it runs, so
quantnorm works without it and the row says "not measured: not installed".
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError
from .base import Engine, EngineModel, EngineRequest, NotMeasured, Speed

__all__ = ["ENGINES", "Engine", "EngineModel", "EngineRequest", "NotMeasured", "Speed", "get_engine"]

# name -> "module:class" (imported on use)
ENGINES: dict[str, str] = {
    "llamacpp": "llamacpp:LlamaCppEngine",
    "ortgenai": "ortgenai:OrtGenAIEngine",
}


def get_engine(name: str) -> Engine:
    if name not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}: choose from {', '.join(sorted(ENGINES)) or 'none'}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
