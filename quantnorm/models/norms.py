"""The two normalization functions, chosen by name from ``NORMS``.

- ``layer``: ``gamma * (x - mean) / sqrt(var + eps) + beta`` (biased variance over features).
  Exports as ONNX ``LayerNormalization`` (opset >= 17).
- ``rms``: ``gamma * x / sqrt(mean(x^2) + eps)``, no bias, computed in float32 as LLaMA does.
  Exports decomposed at opset 18 and as ``RMSNormalization`` at opset >= 23 (dynamo exporter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError


class LayerNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = None  # RMSNorm has no bias; SmoothQuant folding checks for this

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.to(x.dtype)


NORMS: dict[str, type[nn.Module]] = {"layer": LayerNorm, "rms": RMSNorm}


def make_norm(name: str, d_model: int) -> nn.Module:
    try:
        return NORMS[name](d_model)
    except KeyError:
        raise ConfigError(f"unknown norm {name!r}: choose one of {', '.join(NORMS)}") from None
