"""int8 weight codes run as uint8 on a CPU without VNNI (quantnorm.unsigned_weights, make_session).

ORT's AVX2 u8 x s8 kernel sums pairs of products in int16 and saturates; with VNNI it does not
(PITFALLS.md 2). A model quantized on a VNNI CPU keeps int8 codes, so every CPU session on a CPU
without VNNI runs them stored unsigned: the same integers on the u8 x u8 kernel, exact everywhere.
The tests check exactness against integer arithmetic done in numpy (CPU-independent), and what
the file as written does on this CPU's kind (exact with VNNI, saturated without)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantnorm.hardware import cpu_has_vnni
from quantnorm.measure import sessions
from quantnorm.measure.sessions import SessionSpec, make_session
from quantnorm.unsigned_weights import has_signed_weight_ops, signed_weight_slots, to_unsigned

K, N = 64, 8


def _save(path, nodes, inputs, outputs, inits, *, ms=False):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def _matmul_integer(path, weight: np.ndarray, a_zero_point: int):
    """y = (a - a_zp) @ (W - 0), u8 x s8 (the b zero point left out: 0)."""
    return _save(path, [helper.make_node("MatMulInteger", ["a", "W", "a_zp"], ["y"])],
                 [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, K])],
                 [helper.make_tensor_value_info("y", TensorProto.INT32, [None, N])],
                 [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(np.uint8(a_zero_point), "a_zp")])


def _raw(path, feed):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def test_the_worst_case_row_is_exact_through_make_session_on_every_cpu(tmp_path, monkeypatch):
    """All-255 activations against all-127 weights: every pair of products is 64,770 > 32,767."""
    a = np.full((2, K), 255, np.uint8)
    path = _matmul_integer(tmp_path / "signed.onnx", np.full((K, N), 127, np.int8), a_zero_point=0)
    exact = a.astype(np.int64) @ np.full((K, N), 127, np.int64)      # 2,072,640 each
    as_written = _raw(path, {"a": a})
    if cpu_has_vnni():   # vpdpbusd adds in int32
        np.testing.assert_array_equal(as_written, exact)
    else:                # vpmaddubsw saturates each pair at 32,767 (the reason this module exists)
        assert (as_written < exact).all()
    np.testing.assert_array_equal(make_session(path, SessionSpec()).run(None, {"a": a})[0], exact)
    # the rewrite itself, taken on this CPU whatever it has
    monkeypatch.setattr(sessions, "cpu_has_vnni", lambda: False)
    np.testing.assert_array_equal(make_session(path, SessionSpec()).run(None, {"a": a})[0], exact)
    model = onnx.load(str(path))
    assert to_unsigned(model) == 1
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = model.graph.node[0]
    assert weights[node.input[1]].dtype == np.uint8 and (weights[node.input[1]] == 255).all()
    assert weights[node.input[3]] == 128   # the zero point it had not: 0, moved by 128


def test_the_file_as_written_is_what_exact_int8_false_runs(tmp_path):
    a = np.full((1, K), 255, np.uint8)
    path = _matmul_integer(tmp_path / "signed.onnx", np.full((K, N), 127, np.int8), a_zero_point=0)
    np.testing.assert_array_equal(make_session(path, SessionSpec(), exact_int8=False).run(None, {"a": a})[0],
                                  _raw(path, {"a": a}))


def _dynamic_uint8(x):
    """DynamicQuantizeLinear in numpy: (codes, scale, zero point)."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = np.float32((hi - lo) / 255)
    zp = np.clip(np.rint(-lo / scale), 0, 255)
    return np.clip(np.rint(x / scale) + zp, 0, 255), scale, zp


def _products(rng, x):
    """One model per kind of node that multiplies uint8 activations by int8 weights (8-bit codes:
    pairs of products pass int16), and what it computes, in exact integers then float."""
    w = rng.integers(-127, 128, (K, N)).astype(np.int8)
    w_scale = (rng.random(N) * 0.01 + 0.001).astype(np.float32)
    w_zp = rng.integers(-3, 4, N).astype(np.int8)
    x_q, x_scale, x_zp = _dynamic_uint8(x)
    dynamic = ((x_q - x_zp) @ (w.astype(np.float64) - w_zp)) * x_scale * w_scale
    fixed_q = np.clip(np.rint(x / 0.05) + 128, 0, 255)   # QuantizeLinear at scale 0.05, zero point 128
    inits = lambda **arrays: [numpy_helper.from_array(np.asarray(v), k) for k, v in arrays.items()]  # noqa: E731
    quantize_x = [helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_scale", "x_zp"])]
    yield "MatMulInteger", [*quantize_x, helper.make_node("MatMulInteger", ["x_q", "W", "x_zp", "W_zp"], ["acc"]),
                            helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
                            helper.make_node("Mul", ["accf", "x_scale"], ["y0"]),
                            helper.make_node("Mul", ["y0", "W_scale"], ["y"])], \
        inits(W=w, W_zp=w_zp, W_scale=w_scale), False, dynamic
    yield "MatMulIntegerToFloat", [*quantize_x, helper.make_node(
        "MatMulIntegerToFloat", ["x_q", "W", "x_scale", "W_scale", "x_zp", "W_zp"], ["y"], domain="com.microsoft")], \
        inits(W=w, W_scale=w_scale, W_zp=w_zp), True, dynamic
    yield "DynamicQuantizeMatMul", [helper.make_node(
        "DynamicQuantizeMatMul", ["x", "W", "W_scale", "W_zp"], ["y"], domain="com.microsoft")], \
        inits(W=w, W_scale=w_scale, W_zp=w_zp), True, dynamic
    y_q = np.clip(np.rint(((fixed_q - 128) @ (w.astype(np.float64) - 2)) * 0.05 * 0.01 / 0.2) + 128, 0, 255)
    yield "QLinearMatMul", [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"]),
        helper.make_node("QLinearMatMul", ["x_q", "x_scale", "x_zp", "W", "W_scale1", "W_zp1", "y_scale", "y_zp"],
                         ["y_q"]),
        helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zp"], ["y"])], \
        inits(W=w, W_scale1=np.float32(0.01), W_zp1=np.int8(2), x_scale=np.float32(0.05),
              x_zp=np.uint8(128), y_scale=np.float32(0.2), y_zp=np.uint8(128)), False, (y_q - 128) * 0.2
    yield "QDQ", [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["W", "W_scale"], ["W_dq"], axis=1),
        helper.make_node("MatMul", ["x_dq", "W_dq"], ["y"])], \
        inits(W=w, W_scale=w_scale, x_scale=np.float32(0.05), x_zp=np.uint8(128)), False, \
        ((fixed_q - 128) @ w.astype(np.float64)) * 0.05 * w_scale


@pytest.mark.parametrize("kind", ["MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul",
                                  "QDQ"])
def test_every_integer_product_is_found_and_computes_its_integers(tmp_path, kind, monkeypatch):
    """Each kind rewritten computes the exact integer product on every CPU (the file as written
    does too, with VNNI); 7-bit codes are left as they are (they cannot saturate)."""
    x = np.random.default_rng(1).standard_normal((5, K)).astype(np.float32) * 3
    _, nodes, inits, ms, exact = next(p for p in _products(np.random.default_rng(0), x) if p[0] == kind)
    io = ([helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])])
    path = _save(tmp_path / "m.onnx", nodes, *io, inits, ms=ms)
    assert has_signed_weight_ops(path)
    model = onnx.load(str(path))
    assert len(signed_weight_slots(model)) == 1 and to_unsigned(model) == 1
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert weights["W"].dtype == np.uint8 and not any(v.dtype == np.int8 for v in weights.values())
    tolerance = {"rtol": 1e-5, "atol": 0.21 if kind == "QLinearMatMul" else 1e-5}   # one output step there
    if cpu_has_vnni():
        np.testing.assert_allclose(_raw(path, {"x": x}), exact, **tolerance)
    monkeypatch.setattr(sessions, "cpu_has_vnni", lambda: False)
    np.testing.assert_allclose(make_session(path, SessionSpec()).run(None, {"x": x})[0], exact, **tolerance)
    seven_bit = [i if i.name != "W" else numpy_helper.from_array(numpy_helper.to_array(i) // 2, "W") for i in inits]
    assert signed_weight_slots(onnx.load(str(_save(tmp_path / "7.onnx", nodes, *io, seven_bit, ms=ms)))) == []


def test_int8_activations_and_weights_read_elsewhere_are_left_or_copied(tmp_path):
    """s8 x s8 (a QInt8 activation) is another kernel: left as is. A weight also read by a
    Gather (a tied embedding) keeps its int8 copy for that reader."""
    w = (np.arange(K * N) % 255 - 127).reshape(K, N).astype(np.int8)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])
    rows = helper.make_tensor_value_info("rows", TensorProto.INT8, [None, N])
    signed = _save(tmp_path / "s8s8.onnx", [
        helper.make_node("QuantizeLinear", ["x", "s", "zp_s8"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "s", "zp_s8"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["W", "s"], ["W_dq"]),
        helper.make_node("MatMul", ["x_dq", "W_dq"], ["y"])], [x], [y],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.float32(0.1), "s"),
         numpy_helper.from_array(np.int8(0), "zp_s8")])
    assert to_unsigned(onnx.load(str(signed))) == 0
    shared = onnx.load(str(_save(tmp_path / "tied.onnx", [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "s", "zp"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["W", "s"], ["W_dq"]),
        helper.make_node("MatMul", ["x_dq", "W_dq"], ["y"]),
        helper.make_node("Gather", ["W", "ids"], ["rows"])], [x, ids], [y, rows],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.float32(0.1), "s"),
         numpy_helper.from_array(np.uint8(128), "zp")])))
    assert to_unsigned(shared) == 1
    weights = {i.name: numpy_helper.to_array(i) for i in shared.graph.initializer}
    gather = next(n for n in shared.graph.node if n.op_type == "Gather")
    dq = next(n for n in shared.graph.node if n.op_type == "DequantizeLinear" and n.input[0] != "x_q")
    assert weights[gather.input[0]].dtype == np.int8 and weights[dq.input[0]].dtype == np.uint8


def test_a_per_token_model_quantized_for_vnni_runs_the_unsigned_model_s_integers(tmp_path, monkeypatch):
    """The per-token recipe writes int8 codes on a VNNI CPU and uint8 ones without VNNI: rewritten,
    the first computes the second's numbers on every CPU."""
    from test_pertoken import K as PK
    from test_pertoken import matmul_model

    from quantnorm.quantize import get_recipe, quantize

    rng = np.random.default_rng(0)
    fp32 = matmul_model(tmp_path / "fp32.onnx", (rng.standard_normal((PK, 96)) * 0.1).astype(np.float32),
                        shared_input=True)
    x = rng.standard_normal((2, 16, PK)).astype(np.float32)
    recipe = get_recipe("pertoken-fused")
    for_vnni = quantize(fp32, recipe, x, tmp_path / "vnni.onnx", vnni=True, probe_inputs=x[:1])
    for_avx2 = quantize(fp32, recipe, x, tmp_path / "avx2.onnx", vnni=False, probe_inputs=x[:1])
    assert for_vnni.settings["weight_codes"].startswith("int8") and for_avx2.settings["weight_codes"].startswith("uint8")
    assert len(signed_weight_slots(onnx.load(str(for_vnni.path)))) == 2
    assert not has_signed_weight_ops(fp32) and signed_weight_slots(onnx.load(str(for_avx2.path))) == []
    monkeypatch.setattr(sessions, "cpu_has_vnni", lambda: False)
    spec = SessionSpec(threads=1)
    for got, want in zip(make_session(for_vnni.path, spec).run(None, {"x": x}),
                         make_session(for_avx2.path, spec).run(None, {"x": x})):
        np.testing.assert_array_equal(got, want)


def test_hardware_says_so_without_vnni(monkeypatch):
    monkeypatch.setattr(sessions, "cpu_has_vnni", lambda: False)
    assert sessions.hardware_info(1, probe_providers=False)["int8_weights"] == sessions.UNSIGNED_AT_LOAD
    monkeypatch.setattr(sessions, "cpu_has_vnni", lambda: True)
    assert "int8_weights" not in sessions.hardware_info(1, probe_providers=False)


def test_the_run_report_says_so_without_vnni(monkeypatch):
    from quantnorm.report.sections import hardware

    monkeypatch.setattr(sessions, "cpu_has_vnni", lambda: False)
    lines = "\n".join(hardware({"hardware": sessions.hardware_info(1, probe_providers=False)}))
    assert f"| int8 weights | {sessions.UNSIGNED_AT_LOAD} |" in lines
    monkeypatch.setattr(sessions, "cpu_has_vnni", lambda: True)
    assert "int8 weights" not in "\n".join(hardware({"hardware": sessions.hardware_info(1, probe_providers=False)}))


def test_a_model_past_the_in_memory_limit_loads_from_a_temporary_copy_that_goes(tmp_path, monkeypatch):
    import tempfile

    a = np.full((2, K), 255, np.uint8)
    path = _matmul_integer(tmp_path / "signed.onnx", np.full((K, N), 127, np.int8), a_zero_point=0)
    monkeypatch.setattr(sessions, "cpu_has_vnni", lambda: False)
    monkeypatch.setattr(sessions, "INT8_REWRITE_IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    saved = []
    save = sessions.save_onnx
    monkeypatch.setattr(sessions, "save_onnx", lambda model, to: saved.append(to) or save(model, to))
    session = make_session(path, SessionSpec())
    assert len(saved) == 1 and saved[0].parent.parent == tmp_path / "tmp"
    np.testing.assert_array_equal(session.run(None, {"a": a})[0], a.astype(np.int64) @ np.full((K, N), 127))
    assert list((tmp_path / "tmp").iterdir()) == []   # the copy is gone once the session holds the weights
