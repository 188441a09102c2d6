"""INT8 activation quantization in numpy: what the per-token and per-tensor dynamic recipes do to
one tensor, for probes that predict a recipe's error before it is built (and for the tests'
reference arithmetic). ``quantnorm.quantize.pertoken`` writes the same arithmetic as a graph."""

from __future__ import annotations

import numpy as np

ACT_ZERO_POINT = 128
ACT_QMAX = 127.0
EPS = 1e-8  # an all-zero row (padding) gets a tiny scale instead of a division by zero


def fake_quantize_rows(x: np.ndarray) -> np.ndarray:
    """Per-token (per-row) symmetric uint8 around 128, as the pertoken recipes' graph computes it."""
    x = np.asarray(x, dtype=np.float32)
    s = np.maximum(np.abs(x).max(axis=-1, keepdims=True), EPS) / np.float32(ACT_QMAX)
    q = np.clip(np.rint(x / s) + ACT_ZERO_POINT, 0, 255)
    return (q - ACT_ZERO_POINT) * s


def fake_quantize_tensor_asym(x: np.ndarray) -> np.ndarray:
    """ORT's dynamic recipe on one tensor: asymmetric uint8, one scale and zero point for all of it."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / 255.0 or 1.0
    zp = np.clip(np.rint(-lo / scale), 0, 255)
    return (np.clip(np.rint(x / scale) + zp, 0, 255) - zp) * scale


def db(signal: float, noise: float) -> float | None:
    """10 log10(signal / noise); None without signal, inf without noise."""
    if signal <= 0:
        return None
    return float("inf") if noise <= 0 else float(10 * np.log10(signal / noise))


class FakeQuantSqnr:
    """Running SQNR sums of one MatMul input under per-token and per-tensor dynamic INT8."""

    def __init__(self) -> None:
        self.signal = self.per_token = self.per_tensor = 0.0

    def add(self, x: np.ndarray) -> None:
        flat = np.asarray(x).reshape(-1, np.shape(x)[-1]).astype(np.float64)
        self.signal += float((flat ** 2).sum())
        self.per_token += float(((flat - fake_quantize_rows(flat)) ** 2).sum())
        self.per_tensor += float(((flat - fake_quantize_tensor_asym(flat)) ** 2).sum())

    def to_dict(self) -> dict:
        return {"per_token": db(self.signal, self.per_token), "per_tensor_dynamic": db(self.signal, self.per_tensor)}
