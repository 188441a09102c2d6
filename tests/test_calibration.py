"""Calibration windows, the data reader, and the calibration methods (entropy in particular)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod

from quantnorm.calibration import CALIBRATION_METHODS, WindowCalibrationReader, calibration_windows
from quantnorm.calibration.entropy import entropy_threshold, smooth
from quantnorm.calibration.ranges import collect_ranges
from quantnorm.data import BOS
from quantnorm.errors import ConfigError


def corpus_with_fence(n_bytes: int, calib: tuple[int, int]) -> np.ndarray:
    """Bytes 0xFF outside the calibration range, 0..99 inside: a leak shows as 0xFF."""
    b = np.full(n_bytes, 0xFF, dtype=np.uint8)
    b[calib[0]:calib[1]] = np.arange(calib[1] - calib[0]) % 100
    return b


def test_methods_table():
    assert set(CALIBRATION_METHODS) == {"minmax", "minmax-nosink", "entropy", "percentile", "distribution"}
    assert CALIBRATION_METHODS["entropy"] is CalibrationMethod.Entropy


def test_windows_layout_and_evenly_spaced_selection():
    calib = (1000, 1000 + 10 * 16 + 7)  # 10 whole 16-byte windows and a 7-byte tail
    b = corpus_with_fence(2000, calib)
    x = calibration_windows(b, calib, window=16, n_samples=5)
    assert x.shape == (5, 16) and x.dtype == np.int64
    assert np.all(x[:, 0] == BOS)
    # windows k = floor(i*10/5) = 0, 2, 4, 6, 8 of the range; input = [BOS] + b[s : s+15]
    starts = calib[0] + 16 * np.array([0, 2, 4, 6, 8])
    for row, s in zip(x, starts):
        assert np.array_equal(row[1:], b[s:s + 15])
    assert not np.any(x == 0xFF), "a calibration window read bytes outside the calibration range"

    x3 = calibration_windows(b, calib, window=16, n_samples=3)  # k = 0, 3, 6
    assert np.array_equal(x3[:, 1], b[calib[0] + 16 * np.array([0, 3, 6])])
    # Deterministic, and all windows when asked for all of them (no duplicates).
    assert np.array_equal(x3, calibration_windows(b, calib, 16, 3))
    all10 = calibration_windows(b, calib, 16, 10)
    assert len({tuple(r) for r in all10}) == 10


def test_windows_sample_count_errors_name_the_maximum():
    calib = (100, 100 + 4 * 8)
    b = corpus_with_fence(400, calib)
    with pytest.raises(ConfigError, match=r"between 1 and 4"):
        calibration_windows(b, calib, 8, 5)
    with pytest.raises(ConfigError, match=r"between 1 and 4"):
        calibration_windows(b, calib, 8, 0)
    with pytest.raises(ConfigError, match="holds no"):
        calibration_windows(b, (100, 105), 8, 1)
    with pytest.raises(ConfigError, match="not inside the corpus"):
        calibration_windows(b, (300, 500), 8, 1)


def test_reader_batches_rewinds_and_ranges():
    x = np.arange(7 * 4).reshape(7, 4)
    reader = WindowCalibrationReader(x, batch_size=3)
    assert isinstance(reader, CalibrationDataReader)
    assert len(reader) == 3
    batches = list(reader)
    assert [b["input_ids"].shape for b in batches] == [(3, 4), (3, 4), (1, 4)]
    assert all(b["input_ids"].dtype == np.int64 for b in batches)
    assert np.array_equal(np.concatenate([b["input_ids"] for b in batches]), x)
    assert reader.get_next() is None
    reader.rewind()
    assert np.array_equal(reader.get_next()["input_ids"], x[:3])
    reader.set_range(1, 2)
    assert [b["input_ids"][0, 0] for b in reader] == [12]
    with pytest.raises(ConfigError):
        WindowCalibrationReader(x, batch_size=0)
    with pytest.raises(ConfigError):
        WindowCalibrationReader(np.zeros((0, 4)))


def test_entropy_threshold_clips_outliers_and_keeps_the_bulk():
    rng = np.random.default_rng(0)
    bulk = rng.normal(size=100_000)
    x = np.concatenate([bulk, [40.0, -35.0]])
    t = np.abs(x).max()
    hist, edges = np.histogram(x, 2048, range=(-t, t))
    low, high = entropy_threshold(hist, edges)
    assert 3.0 < high < 10.0 and -10.0 < low < -3.0, (low, high)  # outliers cut, bulk (|x| < 4.5) kept
    # The coarse-to-fine search finds what trying every window finds.
    assert entropy_threshold(hist, edges, coarse_candidates=10_000) == (low, high)
    # Nothing to clip in a uniform histogram: the whole range is kept.
    u = rng.uniform(-1, 1, size=50_000)
    hist_u, edges_u = np.histogram(u, 2048, range=(-1, 1))
    low_u, high_u = entropy_threshold(hist_u, edges_u)
    assert high_u > 0.95 and low_u < -0.95


def test_smooth_moves_mass_to_zero_bins():
    p = np.array([0.0, 5.0, 0.0, 5.0])
    s = smooth(p)
    assert np.all(s > 0) and s.sum() == pytest.approx(p.sum())
    assert smooth(np.zeros(3)) is None


def _outlier_model(path) -> None:
    """input_ids [B, T] int64 -> Cast -> MatMul(W[T, 4]) -> logits: the MatMul input is the ids."""
    t = 8
    w = numpy_helper.from_array(np.eye(t, 4, dtype=np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["xf"], to=TensorProto.FLOAT, name="cast"),
         helper.make_node("MatMul", ["xf", "W"], ["logits"], name="mm")],
        "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", t])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 4])], [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(path))


def test_entropy_ranges_clip_what_minmax_keeps(tmp_path):
    model = tmp_path / "m.onnx"
    _outlier_model(model)
    rng = np.random.default_rng(0)
    # The "ids" are just numbers here: a Gaussian bulk (sd 1000) and one outlier at 20000.
    x = np.round(rng.normal(0, 1000, size=(512, 8))).astype(np.int64)
    x[5, 3] = 20_000
    minmax = collect_ranges(model, "minmax", x, op_types=["MatMul"])
    entropy = collect_ranges(model, "entropy", x, op_types=["MatMul"])
    def high(ranges):
        return float(np.ravel(ranges["xf"].range_value[1])[0])

    assert high(minmax) == 20_000.0
    # ORT's "distribution" gives INT8 the symmetric range [-max|x|, max|x|].
    distribution = collect_ranges(model, "distribution", x, op_types=["MatMul"])
    assert [float(np.ravel(v)[0]) for v in distribution["xf"].range_value] == [-20_000.0, 20_000.0]
    assert 3_899.0 <= high(entropy) <= 10_000.0, high(entropy)  # outlier clipped (7129 seen), bulk kept


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile", "minmax-nosink"])
def test_inputs_only_calibration_skips_the_outputs_and_keeps_every_input_range(tmp_path, method):
    """Matmul-scope recipes keep MatMul outputs in float, so only the inputs are calibrated: the
    logits are left out (the largest tensor of an LM) and each input's range is unchanged."""
    model = tmp_path / "m.onnx"
    _outlier_model(model)
    x = np.round(np.random.default_rng(1).normal(0, 1000, size=(64, 8))).astype(np.int64)
    both = collect_ranges(model, method, x, op_types=["MatMul"])
    inputs = collect_ranges(model, method, x, op_types=["MatMul"], inputs_only=True)
    assert set(both.data) == {"xf", "logits"} and set(inputs.data) == {"xf"}
    assert [float(np.ravel(v)[0]) for v in inputs["xf"].range_value] == \
        [float(np.ravel(v)[0]) for v in both["xf"].range_value]
