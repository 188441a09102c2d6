"""Calibration data for static quantization: which windows, how they are fed, which method.

Calibration text comes from the calibration split ONLY (``data.Splits.calibration``): it never
overlaps the evaluation split, so a quantization score is never measured on calibration text.
Windows follow the evaluation protocol's layout (``[BOS] + b[s : s+window-1]``), so the
quantizer sees activations of the same shape and position statistics as the scored windows.
"""

from __future__ import annotations

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod
from tqdm import tqdm

from ..data import window_starts, windows_at
from ..errors import ConfigError

# Names a recipe uses -> ONNX Runtime's calibration methods.
#  minmax:       observed min/max of each tensor (one outlier sets the whole range)
#  entropy:      KL-divergence-optimal clipping of a histogram (TensorRT's method)
#  percentile:   clip at a percentile of |x| (recipe's ``percentile``, default 99.999)
#  distribution: ORT's mean/std histogram statistics (designed for float8; measured for INT8 too)
#  minmax-nosink: min/max over every token but the sink (position 0, where massive activations
#                 sit): the other tokens get a fine step, the sink's own values are clipped
CALIBRATION_METHODS: dict[str, CalibrationMethod] = {
    "minmax": CalibrationMethod.MinMax,
    "minmax-nosink": CalibrationMethod.MinMax,
    "entropy": CalibrationMethod.Entropy,
    "percentile": CalibrationMethod.Percentile,
    "distribution": CalibrationMethod.Distribution,
}


def get_calibration_method(name: str) -> CalibrationMethod:
    try:
        return CALIBRATION_METHODS[name]
    except KeyError:
        raise ConfigError(
            f"unknown calibration method {name!r}: choose one of {', '.join(CALIBRATION_METHODS)}"
        ) from None


def calibration_windows(corpus_bytes: np.ndarray, calib_range: tuple[int, int], window: int,
                        n_samples: int) -> np.ndarray:
    """Model inputs for calibration: int64 ``[n_samples, window]``, each starting with BOS.

    Candidates are the non-overlapping protocol windows of the calibration range
    (``start + k*window`` while the window fits, see ``data.window_starts``); no byte outside
    ``calib_range`` is read. Selection policy: ``n_samples`` windows evenly spaced over the
    candidates, window ``k`` taken for ``k = floor(i * available / n_samples)``, i = 0..n-1.
    Deterministic (no seed), always includes the first window, and spreads the samples over the
    whole range instead of taking one contiguous stretch of text (a corpus changes topic along
    its length; the calibration set should see all of it).
    """
    corpus_bytes = np.asarray(corpus_bytes)
    start, end = (int(v) for v in calib_range)
    if window < 1:
        raise ConfigError(f"calibration window must be >= 1 byte, got {window}")
    if not 0 <= start < end <= len(corpus_bytes):
        raise ConfigError(
            f"calibration range [{start}, {end}) is not inside the corpus of {len(corpus_bytes)} bytes"
        )
    starts = window_starts((start, end), window)
    available = len(starts)
    if available == 0:
        raise ConfigError(
            f"calibration range [{start}, {end}) ({end - start} bytes) holds no {window}-byte window: "
            "use a larger calibration fraction or a smaller context"
        )
    if not 1 <= n_samples <= available:
        raise ConfigError(
            f"calibration samples must be between 1 and {available} (the number of {window}-byte windows in "
            f"the calibration range), got {n_samples}"
        )
    chosen = (np.arange(n_samples, dtype=np.int64) * available) // n_samples
    inputs, _targets = windows_at(corpus_bytes, starts[chosen], window)
    return inputs


class WindowCalibrationReader(CalibrationDataReader):
    """Feeds calibration windows to ONNX Runtime's calibrator as ``{"input_ids": batch}``.

    ``batch_size`` windows per ``get_next`` (the last batch may be smaller). Rewindable
    (``rewind``), sized (``len`` = number of batches) and range-selectable (``set_range``, which
    ORT's ``CalibStridedMinMax`` uses). ``progress=True`` shows a tqdm bar over the batches.
    """

    def __init__(self, inputs: np.ndarray, batch_size: int = 1, input_name: str = "input_ids",
                 progress: bool = False, description: str = "calibrating", feed=None):
        inputs = np.asarray(inputs)
        if inputs.ndim != 2 or len(inputs) == 0:
            raise ConfigError(f"calibration inputs must be token ids of shape [n, seq] with n >= 1, got {inputs.shape}")
        if batch_size < 1:
            raise ConfigError(f"calibration batch size must be >= 1, got {batch_size}")
        self.inputs = np.ascontiguousarray(inputs, dtype=np.int64)
        self.batch_size = batch_size
        self.input_name = input_name
        # ids -> the graph's whole feed (``quantnorm.feeds.window_feeder``: a with-past graph's cache)
        self.feed = feed
        self.progress = progress
        self.description = description
        self._batches = [self.inputs[i:i + batch_size] for i in range(0, len(self.inputs), batch_size)]
        self._start, self._end = 0, len(self._batches)
        self._bar = None
        self.rewind()

    def __len__(self) -> int:
        return len(self._batches)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._start, self._end = max(0, start_index), min(len(self._batches), end_index)
        self.rewind()

    def rewind(self) -> None:
        self._next = self._start
        self._close_bar()

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._next >= self._end:
            self._close_bar()
            return None
        if self.progress and self._bar is None:
            self._bar = tqdm(total=self._end - self._start, desc=self.description, unit="batch", leave=False)
        batch = self._batches[self._next]
        self._next += 1
        if self._bar is not None:
            self._bar.update(1)
        return self.feed(batch) if self.feed is not None else {self.input_name: batch}

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


__all__ = ["CALIBRATION_METHODS", "WindowCalibrationReader", "calibration_windows", "get_calibration_method"]
