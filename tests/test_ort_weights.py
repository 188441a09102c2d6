"""ORT's per-channel weight quantization vectorized (quantize.ort_weights) and its dynamic
quantizer's shape inference in memory (calibration.shape_infer.infer_shapes_in_memory): both must
give ORT's own results to the byte."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
from onnxruntime.quantization.calibrate import CalibrationDataReader
from onnxruntime.quantization.quant_utils import compute_data_quant_params, quantize_nparray

import quantnorm.quantize.ort_weights as ort_weights
from quantnorm.calibration.shape_infer import infer_shapes_in_memory, ort_loads_fast
from quantnorm.quantize.ort_weights import channel_codes, channel_params, ort_quantizes_weights_fast


def _weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, size=(1, shape[1]))).astype(np.float32)
    w[:, 1] = 0.0                 # a dead channel: ORT gives it scale 1 and zero point 0
    w[:, 2] = np.abs(w[:, 2])     # one sign only: the range still takes 0 in
    w[:, 3] = 1e-42               # a subnormal range: below float32's tiny, so degenerate too
    return w


@pytest.mark.parametrize("quant_type", [TensorProto.INT8, TensorProto.UINT8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_channel_params_and_codes_are_orts_channel_loop(quant_type, symmetric, reduce_range, axis):
    w = _weights((40, 24))
    zero_points, scales = channel_params(w, axis, quant_type, symmetric, reduce_range)
    codes = channel_codes(w, axis, quant_type, zero_points, scales)
    for c in range(w.shape[axis]):
        channel = w.take(c, axis).ravel()
        zp, scale = compute_data_quant_params(channel, quant_type, symmetric, reduce_range=reduce_range)
        assert zero_points[c].dtype == zp.dtype and zero_points[c] == zp
        assert scales[c].dtype == scale.dtype and scales[c].tobytes() == np.asarray(scale).tobytes()
        assert codes.take(c, axis).ravel().tobytes() == quantize_nparray(quant_type, channel, scale, zp).tobytes()


def test_a_range_that_is_not_finite_is_left_to_ort():
    w = _weights((8, 6))
    w[0, 4] = np.inf
    assert channel_params(w, 1, TensorProto.INT8, True, False) is None


VOCAB, D, HIDDEN = 50, 32, 48


def _model(path):
    """ids -> Gather -> MatMul -> Relu -> MatMul -> Gemm: weights of 6, 6 and 1.5 KB and a Gemm
    (the dynamic quantizer turns it into a MatMul and infers shapes again)."""
    weights = [numpy_helper.from_array(_weights((VOCAB, D), 1), "embedding"),
               numpy_helper.from_array(_weights((D, HIDDEN), 2), "w1"),
               numpy_helper.from_array(_weights((HIDDEN, 8), 3), "w2"),
               numpy_helper.from_array(_weights((8, 8), 4), "w3"),
               numpy_helper.from_array(np.arange(8, dtype=np.float32), "b3"),
               numpy_helper.from_array(np.asarray([-1, 8], dtype=np.int64), "rows")]
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["x"]),
             helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"]),
             helper.make_node("Reshape", ["y", "rows"], ["y2"]),
             helper.make_node("Gemm", ["y2", "w3", "b3"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 8])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(path))
    return path


class _Reader(CalibrationDataReader):
    def __init__(self):
        rng = np.random.default_rng(5)
        self.batches = iter([{"input_ids": rng.integers(0, VOCAB, size=(2, 7))} for _ in range(3)])

    def get_next(self):
        return next(self.batches, None)


def _spy(monkeypatch):
    calls = []
    original = ort_weights.channel_params

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(ort_weights, "channel_params", counting)
    return calls


def _same_model(a_path, b_path):
    a, b = onnx.load(str(a_path)), onnx.load(str(b_path))
    assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node]
    assert [i.SerializeToString() for i in a.graph.initializer] == [i.SerializeToString() for i in b.graph.initializer]


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("reduce_range", [False, True])
def test_static_qdq_models_are_orts_to_the_byte(tmp_path, monkeypatch, per_channel, reduce_range):
    src = _model(tmp_path / "m.onnx")
    args = dict(quant_format=QuantFormat.QDQ, per_channel=per_channel, reduce_range=reduce_range,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
                extra_options={"WeightSymmetric": True})
    quantize_static(str(src), str(tmp_path / "ort.onnx"), _Reader(), **args)
    calls = _spy(monkeypatch)
    with ort_quantizes_weights_fast():
        quantize_static(str(src), str(tmp_path / "fast.onnx"), _Reader(), **args)
    assert len(calls) == (3 if per_channel else 0)   # w1, w2, w3 per channel; per-tensor weights stay ORT's
    _same_model(tmp_path / "ort.onnx", tmp_path / "fast.onnx")


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("weight_type", [QuantType.QInt8, QuantType.QUInt8])
def test_dynamic_models_are_orts_to_the_byte(tmp_path, monkeypatch, per_channel, weight_type):
    src = _model(tmp_path / "m.onnx")
    args = dict(per_channel=per_channel, reduce_range=False, weight_type=weight_type,
                op_types_to_quantize=["MatMul", "Gemm"])
    quantize_dynamic(str(src), str(tmp_path / "ort.onnx"), **args)
    calls = _spy(monkeypatch)
    with ort_quantizes_weights_fast(), ort_loads_fast():
        quantize_dynamic(str(src), str(tmp_path / "fast.onnx"), **args)
    assert len(calls) == (3 if per_channel else 0)
    _same_model(tmp_path / "ort.onnx", tmp_path / "fast.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.onnx", "m.onnx", "ort.onnx"]


def test_the_patches_are_undone(tmp_path):
    from onnxruntime.quantization import base_quantizer, onnx_quantizer, qdq_quantizer
    before = (qdq_quantizer.QDQQuantizer._calc_initializer_quant_params,
              base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl,
              qdq_quantizer.quantize_onnx_initializer, onnx_quantizer.quantize_onnx_initializer,
              onnx_quantizer.save_and_reload_model_with_shape_infer)
    with pytest.raises(RuntimeError), ort_quantizes_weights_fast(), ort_loads_fast():
        raise RuntimeError("a quantizer failed")
    assert before == (qdq_quantizer.QDQQuantizer._calc_initializer_quant_params,
                      base_quantizer.BaseQuantizer.quantize_weight_per_channel_impl,
                      qdq_quantizer.quantize_onnx_initializer, onnx_quantizer.quantize_onnx_initializer,
                      onnx_quantizer.save_and_reload_model_with_shape_infer)


def test_shape_inference_in_memory_is_orts_save_and_reload(tmp_path):
    from onnxruntime.quantization.quant_utils import save_and_reload_model_with_shape_infer

    model = onnx.load(str(_model(tmp_path / "m.onnx")))
    # a shape onnx's inference cannot derive (ORT's symbolic pre-processing writes such entries)
    model.graph.node[2].op_type, model.graph.node[2].domain = "Gelu", "com.microsoft"
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    model.graph.value_info.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, ["b", "s", HIDDEN]))
    theirs = save_and_reload_model_with_shape_infer(model)
    weights_before = [i.SerializeToString() for i in model.graph.initializer]
    ours = infer_shapes_in_memory(model)
    assert ours is model
    assert [v.SerializeToString() for v in ours.graph.value_info] == [v.SerializeToString() for v in theirs.graph.value_info]
    assert sorted(v.name for v in ours.graph.value_info) == ["h", "r", "x", "y", "y2"]
    assert {p.key: p.value for p in ours.metadata_props} == {p.key: p.value for p in theirs.metadata_props}
    assert [i.SerializeToString() for i in ours.graph.initializer] == weights_before
