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
    x = np.round(rng.normal(0, 1000, size=(16, 8))).astype(np.int64)
    x[13, 3] = 20_000  # the outlier sits in the last of 4 chunks: streaming must still see it
    tiny_buffer = 1  # bytes: one batch per collect call
    for method in ("minmax", "percentile", "entropy"):
        whole = collect_ranges(model, method, x, op_types=["MatMul"], batch_size=4)
        streamed = collect_ranges(model, method, x, op_types=["MatMul"], batch_size=4, buffer_bytes=tiny_buffer)
        if method == "minmax":
            assert _range(streamed) == _range(whole) and _range(whole)[1] == 20_000.0
        else:  # histograms are re-binned when merged: within a few bins of the one-pass range
            hi_w, hi_s = _range(whole)[1], _range(streamed)[1]
            assert abs(hi_s - hi_w) <= 0.05 * abs(hi_w) + 50, (method, hi_w, hi_s)


def test_histogram_pre_pass_takes_the_minmax_ranges_it_is_handed(tmp_path):
    """A streamed entropy/percentile calibration seeds its histograms with MinMax ranges; a run that
    already has them hands them over (``minmax=``) and gets the very ranges it would have computed."""
    model = tmp_path / "m.onnx"
    _outlier_model(model)
    rng = np.random.default_rng(1)
    x = np.round(rng.normal(0, 1000, size=(12, 8))).astype(np.int64)
    args = dict(op_types=["MatMul"], batch_size=4, buffer_bytes=1)   # 3 chunks
    extremes = collect_ranges(model, "minmax", x, **args)
    asked = []
    for method in ("percentile", "entropy"):
        own = collect_ranges(model, method, x, **args)
        handed = collect_ranges(model, method, x, minmax=lambda: asked.append(1) or extremes, **args)
        assert _range(handed) == _range(own), method
    assert len(asked) == 2


def test_sink_aware_minmax_leaves_position_0_out(tmp_path):
    model = tmp_path / "m.onnx"
    _outlier_model(model)  # the MatMul input is the ids themselves: [batch, 8 positions]
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(0, 100, size=(32, 8))).astype(np.int64)
    x[:, 0] = 25_000  # a massive value on the sink token of every window
    full = _range(collect_ranges(model, "minmax", x, op_types=["MatMul"]))
    nosink = _range(collect_ranges(model, "minmax-nosink", x, op_types=["MatMul"]))
    assert full[1] == 25_000.0
    bulk = x[:, 1:]
    assert nosink == [float(min(bulk.min(), 0)), float(max(bulk.max(), 0))]


def test_sink_aware_recipe_quantizes_a_zoo_model(tmp_path):
    import torch

    from quantnorm.export import export_onnx
    from quantnorm.models import CausalLM, ModelConfig
    from quantnorm.quantize import get_recipe, quantize

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement="pre", norm="rms", n_layers=1, d_model=16, n_heads=2, context=16)).eval()
    ids = np.random.default_rng(0).integers(0, 256, size=(8, 16))
    ids[:, 0] = 256  # BOS
    export_onnx(model, tmp_path / "fp32.onnx", ids[:2], opset=18)
    recipe = get_recipe("static-minmax-matmul-nosink")
    result = quantize(tmp_path / "fp32.onnx", recipe, ids, tmp_path / "int8.onnx", vnni=True, probe_inputs=ids[:2])
    assert result.status == "ok", result.problems
    assert result.settings["calibration_details"]["excluded_positions"] == [0]


def test_a_batch_larger_than_the_buffer_is_split(tmp_path, monkeypatch):
    """One batch's collected tensors may pass the buffer on their own (Gemma 3 with every op
    calibrated: 512 MiB of logits per 4 windows): the windows are then batched smaller, to the same ranges."""
    import quantnorm.calibration.ranges as ranges_module

    model = tmp_path / "m.onnx"
    _outlier_model(model)
    rng = np.random.default_rng(2)
    x = np.round(rng.normal(0, 1000, size=(16, 8))).astype(np.int64)
    x[13, 5] = -30_000
    sizes = []

    class Recording(ranges_module.WindowCalibrationReader):
        def __init__(self, inputs, batch_size=1, **kw):
            sizes.append(batch_size)
            super().__init__(inputs, batch_size=batch_size, **kw)

    monkeypatch.setattr(ranges_module, "WindowCalibrationReader", Recording)
    whole = collect_ranges(model, "minmax", x, op_types=["MatMul"], batch_size=8)
    assert sizes == [8]
    split = collect_ranges(model, "minmax", x, op_types=["MatMul"], batch_size=8, buffer_bytes=1)
    assert sizes[1:] == [8, 1] and _range(split) == _range(whole) and _range(whole)[0] == -30_000.0



def test_the_calibrator_collects_without_its_models_weights(tmp_path, monkeypatch):
    """ORT's calibrator keeps the augmented model, weights included (1.7 GB on Gemma 3), beside the
    session that holds them again; only the session is read while collecting."""
    from onnxruntime.quantization.calibrate import MinMaxCalibrater

    model = tmp_path / "m.onnx"
    _outlier_model(model)
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(0, 1000, size=(16, 8))).astype(np.int64)
    held = []
    original = MinMaxCalibrater.collect_data

    def spying(self, reader):
        held.append(len(self.model.graph.initializer))
        return original(self, reader)

    monkeypatch.setattr(MinMaxCalibrater, "collect_data", spying)
    ranges = collect_ranges(model, "minmax", x, op_types=["MatMul"], batch_size=4, buffer_bytes=1)
    assert held == [0] * 16  # a 1-byte buffer: one window per call
    # the ranges are the data's own: the MatMul input is the ids, its output their first 4 columns
    assert _range(ranges) == [float(x.min()), float(x.max())]
    assert _range(ranges, "logits") == [float(x[:, :4].min()), float(x[:, :4].max())]


def test_calibration_sessions_run_unoptimized_without_the_memory_pattern(tmp_path, monkeypatch):
    """The memory pattern made ORT's arena grow by a block per run on Gemma 3 (4.5 GB vs 3.0 GB
    with it off); graph optimizations stay off as ORT sets them, so every calibrated tensor exists."""
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import CalibraterBase, HistogramCalibrater, MinMaxCalibrater

    model = tmp_path / "m.onnx"
    _outlier_model(model)
    x = np.round(np.random.default_rng(4).normal(0, 1000, size=(8, 8))).astype(np.int64)
    options = []
    for cls in (MinMaxCalibrater, HistogramCalibrater):
        original = cls.collect_data

        def spying(self, reader, _original=original):
            options.append(self.infer_session.get_session_options())
            return _original(self, reader)

        monkeypatch.setattr(cls, "collect_data", spying)
    before = CalibraterBase.create_inference_session
    for method in ("minmax", "percentile"):
        collect_ranges(model, method, x, op_types=["MatMul"], batch_size=4)
    assert len(options) == 2
    assert all(not o.enable_mem_pattern for o in options)
    assert all(o.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL for o in options)
    assert CalibraterBase.create_inference_session is before  # patched only while a calibrator is made
