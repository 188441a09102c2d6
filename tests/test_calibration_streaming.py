"""Calibration streams: batches are folded into the ranges in bounded chunks (PITFALLS.md 11)."""

import numpy as np
from test_calibration import _outlier_model

from quantnorm.calibration.ranges import collect_ranges


def _range(ranges, name="xf"):
    return [float(np.ravel(v)[0]) for v in ranges[name].range_value]


def test_chunked_calibration_matches_one_pass(tmp_path):
    model = tmp_path / "m.onnx"
    _outlier_model(model)
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(0, 1000, size=(64, 8))).astype(np.int64)
    x[37, 3] = 20_000  # the outlier sits in a late chunk: streaming must still see it
    tiny_buffer = 1  # bytes: one batch per collect call
    for method in ("minmax", "percentile", "entropy"):
        whole = collect_ranges(model, method, x, op_types=["MatMul"], batch_size=4)
        streamed = collect_ranges(model, method, x, op_types=["MatMul"], batch_size=4, buffer_bytes=tiny_buffer)
        if method == "minmax":
            assert _range(streamed) == _range(whole) and _range(whole)[1] == 20_000.0
        else:  # histograms are re-binned when merged: within a few bins of the one-pass range
            hi_w, hi_s = _range(whole)[1], _range(streamed)[1]
            assert abs(hi_s - hi_w) <= 0.05 * abs(hi_w) + 50, (method, hi_w, hi_s)
