"""Run a calibration method over calibration windows and return the tensor ranges.

We drive ONNX Runtime's calibrators ourselves (instead of letting ``quantize_static`` do it) so
that each method runs with settings that make it what its name says (see ``entropy.py``: ORT's
built-in entropy settings reduce it to MinMax), and so that the ranges can be saved and handed
to ``quantize_static`` through its calibration cache.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import numpy as np
from onnxruntime.quantization.calibrate import create_calibrator

from . import WindowCalibrationReader, get_calibration_method
from .entropy import ENTROPY_NUM_BINS, ENTROPY_QUANTIZED_BINS, fast_entropy_collector

HISTOGRAM_BINS = 2048  # percentile and distribution: ORT's defaults


def method_details(method: str, percentile: float = 99.999) -> dict:
    """What a method ran with, for the settings record of results.json."""
    if method == "entropy":
        return {"num_bins": ENTROPY_NUM_BINS, "num_quantized_bins": ENTROPY_QUANTIZED_BINS,
                "threshold_search": "quantnorm (TensorRT/MXNet KL search)"}
    if method == "percentile":
        return {"num_bins": HISTOGRAM_BINS, "percentile": percentile, "symmetric_range": True}
    if method == "distribution":
        # For INT8 ORT uses the histogram's edges, i.e. [-max|x|, max|x|]: a symmetric MinMax.
        return {"num_bins": HISTOGRAM_BINS, "int8_range": "[-max|x|, max|x|]"}
    return {}


def collect_ranges(model_path: str | Path, method: str, inputs: np.ndarray, *, op_types: list[str] | None,
                   percentile: float = 99.999, batch_size: int = 4, progress: bool = False):
    """Calibrate ``model_path`` on ``inputs`` [n, seq] and return ORT's ``TensorsData``.

    ``op_types``: the node types whose inputs/outputs are calibrated (None: ORT's default list).
    Raises ORT's ``ValueError`` ("... range of [-inf, inf] is not finite") when a histogram
    method meets an infinite tensor; callers turn that into a broken recipe.
    """
    calibrate_method = get_calibration_method(method)
    extra: dict = {}
    if method == "entropy":
        extra = {"num_bins": ENTROPY_NUM_BINS, "num_quantized_bins": ENTROPY_QUANTIZED_BINS}
    elif method == "percentile":
        extra = {"num_bins": HISTOGRAM_BINS, "percentile": percentile}
    elif method == "distribution":
        extra = {"num_bins": HISTOGRAM_BINS}
    reader = WindowCalibrationReader(inputs, batch_size=batch_size, progress=progress,
                                     description=f"calibrating ({method})")
    with tempfile.TemporaryDirectory(prefix="quantnorm-calib-") as tmp:
        calibrator = create_calibrator(
            Path(model_path), op_types, augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=calibrate_method, extra_options=extra,
        )
        if method == "entropy":
            calibrator.collector = fast_entropy_collector(calibrator)
        with contextlib.redirect_stdout(io.StringIO()):  # ORT prints progress lines
            calibrator.collect_data(reader)
            ranges = calibrator.compute_data()
        del calibrator  # holds an inference session on the augmented model inside tmp
    return ranges
