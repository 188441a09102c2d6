"""ORT's quantizer and calibrators on models loaded without copies on disk (calibration.shape_infer),
and the percentile collector's equal-bin counting (calibration.ranges.UniformAbsHistogramCollector)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.calibrate import HistogramCollector
from onnxruntime.quantization.quant_utils import load_model_with_shape_infer

from quantnorm.calibration.ranges import UniformAbsHistogramCollector, collect_ranges, seed_histograms
from quantnorm.calibration.shape_infer import load_with_shape_infer

VOCAB, D, HIDDEN = 64, 32, 48


def _model(path):
    """ids -> Gather(embedding) -> MatMul -> Relu -> MatMul: weights of 8, 6 and 1.5 KB (all referenced)."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(size=(VOCAB, D)).astype(np.float32), "embedding"),
               numpy_helper.from_array(rng.normal(size=(D, HIDDEN)).astype(np.float32), "w1"),
               numpy_helper.from_array(rng.normal(size=(HIDDEN, 8)).astype(np.float32), "w2")]
    weights[0].raw_data = (np.asarray(numpy_helper.to_array(weights[0])) * 10).astype(np.float32).tobytes()
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["x"]),
             helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(path))
    return path


def test_the_fast_loader_is_orts_loader_without_the_disk_copies(tmp_path):
    path = _model(tmp_path / "m.onnx")
    ours, theirs = load_with_shape_infer(path), load_model_with_shape_infer(path)
    assert {(v.name, v.type.tensor_type.elem_type) for v in ours.graph.value_info} == \
        {(v.name, v.type.tensor_type.elem_type) for v in theirs.graph.value_info}
    assert {p.key: p.value for p in ours.metadata_props} == {p.key: p.value for p in theirs.metadata_props}
    for a, b in zip(ours.graph.initializer, theirs.graph.initializer, strict=True):
        assert a.name == b.name and a.data_location == TensorProto.DEFAULT
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    referenced = load_with_shape_infer(path, weights=False)
    assert all(i.data_location == TensorProto.EXTERNAL and not i.raw_data for i in referenced.graph.initializer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_calibration_on_referenced_weights_matches_a_copy_and_leaves_no_file(tmp_path, monkeypatch, method):
    """The augmented model saved beside the model (weights referenced) calibrates to the very
    ranges of the copy in a temporary directory (what happens where nothing can be written
    beside the model), and is gone afterwards."""
    import quantnorm.calibration.shape_infer as shape_infer

    path = _model(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, size=(16, 8))
    args = dict(op_types=["MatMul"], batch_size=4, buffer_bytes=1)   # streamed: the histograms are seeded
    beside = collect_ranges(path, method, x, **args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]

    def refuse(*a, **k):
        raise PermissionError("read-only directory")

    monkeypatch.setattr(shape_infer.tempfile, "mkstemp", refuse)
    copied = collect_ranges(path, method, x, **args)
    assert set(beside.data) == set(copied.data) == {"x", "h", "r", "logits"}
    for name in beside.data:
        assert [float(np.ravel(v)[0]) for v in beside[name].range_value] == \
            [float(np.ravel(v)[0]) for v in copied[name].range_value], (method, name)


def _collector(cls):
    return cls(method="percentile", symmetric=True, num_bins=2048, num_quantized_bins=128, percentile=99.99,
               scenario="same")


class _Extremes:
    def __init__(self, data):
        self.data = data


class _Range:
    def __init__(self, lo, hi):
        self.range_value = (np.float32(lo), np.float32(hi))


@pytest.mark.parametrize("seeded", [True, False])
def test_equal_bin_counting_gives_orts_percentile_histograms(seeded, monkeypatch):
    """Same counts, edges and extremes as ORT's own collector, chunk after chunk: on histograms
    seeded with the final range, on ones ORT started from a first chunk, with values on the edges,
    a chunk that widens the range (ORT's code runs) and one with a NaN (ORT's code runs)."""
    rng = np.random.default_rng(2)
    chunks = [rng.normal(0, 3, size=(4, 8, 16)).astype(np.float32) for _ in range(4)]
    top = float(max(np.abs(c).max() for c in chunks))
    chunks[1].flat[:3] = [top, -top, 0.0]
    widening = rng.normal(0, 3, size=(2, 8, 16)).astype(np.float32)
    widening.flat[0] = 2.5 * top
    with_nan = chunks[2].copy()
    with_nan.flat[5] = np.nan
    ours, theirs = _collector(UniformAbsHistogramCollector), _collector(HistogramCollector)
    fallbacks = []
    original = HistogramCollector.collect_absolute_value

    def counting(self, name_to_arr):
        if self is ours:
            fallbacks.append(1)
        return original(self, name_to_arr)

    monkeypatch.setattr(HistogramCollector, "collect_absolute_value", counting)
    if seeded:
        extremes = _Extremes({"t": _Range(-top, top)})
        for collector in (ours, theirs):
            seed_histograms(type("C", (), {"collector": collector})(), extremes)
    for chunk in [*chunks, widening, with_nan]:
        ours.collect({"t": [chunk]})
        theirs.collect({"t": [chunk]})
        (h1, e1, lo1, hi1), (h2, e2, lo2, hi2) = ours.histogram_dict["t"], theirs.histogram_dict["t"]
        np.testing.assert_array_equal(h1, h2)
        np.testing.assert_array_equal(e1, e2)
        assert (float(lo1), float(hi1)) == (float(lo2), float(hi2))
    # seeded: numpy's equal-bin path counted the four chunks within the range, ORT's code the other
    # two; started by ORT, the edges begin at the first chunk's smallest |x|, not 0: ORT's code throughout
    assert len(fallbacks) == (2 if seeded else 6)
    mine, orts = ours.compute_collection_result()["t"], theirs.compute_collection_result()["t"]
    assert len(mine) == len(orts)
    for a, b in zip(mine, orts):
        np.testing.assert_array_equal(a, b)
