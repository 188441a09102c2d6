"""The graph passes every export gets (quantnorm/onnx_simplify.py): same outputs, fewer nodes,
RMSNorm in the form ONNX Runtime fuses, graph inputs untouched."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantnorm.onnx_simplify import (
    merge_common_subexpressions,
    rmsnorm_as_division,
    rmsnorm_before_transpose,
    share_identical_initializers,
    simplify,
    tanh_gelu_in_fused_order,
)

D = 8


def _run(model: onnx.ModelProto, feeds: dict, optimized: str | None = None,
         level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = level
    if optimized:
        options.optimized_model_filepath = optimized
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _two_projections_of_one_input(overridable_shift: bool = False) -> onnx.ModelProto:
    """y1 = (x H1) W1, y2 = (x H2) W2 with H1 == H2 stored twice (as the online rotation writes q and
    k), plus ``shift``, an initializer that is also a graph input (as ``logits_to_keep``), equal in
    value to another initializer."""
    rng = np.random.default_rng(0)
    hadamard = np.where(rng.random((D, D)) < 0.5, -1.0, 1.0).astype(np.float32)
    inits = [numpy_helper.from_array(hadamard, "q.H"), numpy_helper.from_array(hadamard.copy(), "k.H"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "q.W"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "k.W"),
             numpy_helper.from_array(np.zeros(D, np.float32), "zeros"),
             numpy_helper.from_array(np.zeros(D, np.float32), "shift")]
    nodes = [helper.make_node("MatMul", ["x", "q.H"], ["xq"], name="q.online_hadamard/MatMul"),
             helper.make_node("MatMul", ["x", "k.H"], ["xk"], name="k.online_hadamard/MatMul"),
             helper.make_node("MatMul", ["xq", "q.W"], ["yq0"], name="q/MatMul"),
             helper.make_node("MatMul", ["xk", "k.W"], ["yk0"], name="k/MatMul"),
             helper.make_node("Add", ["yq0", "zeros"], ["y1"], name="q/Add"),
             helper.make_node("Add", ["yk0", "shift"], ["y2"], name="k/Add")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, D])
    shift = helper.make_tensor_value_info("shift", TensorProto.FLOAT, [D])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, D]) for n in ("y1", "y2")]
    graph = helper.make_graph(nodes, "g", [x, shift] if overridable_shift else [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_equal_initializers_become_one_and_the_repeated_rotation_is_computed_once():
    model = _two_projections_of_one_input()
    x = np.random.default_rng(1).standard_normal((2, D)).astype(np.float32)
    before = _run(model, {"x": x})
    done = simplify(model)
    onnx.checker.check_model(model)
    assert done["initializers_shared"] == 2   # k.H -> q.H, shift -> zeros
    assert done["nodes_merged"] == 1           # k's rotation reads q's
    rotations = [n for n in model.graph.node if "online_hadamard" in n.name]
    assert [n.name for n in rotations] == ["q.online_hadamard/MatMul"]
    readers = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[0] == "xq"]
    assert sorted(n.name for n in readers) == ["k/MatMul", "q/MatMul"]
    after = _run(model, {"x": x})
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_an_initializer_a_feed_may_override_is_never_merged():
    model = _two_projections_of_one_input(overridable_shift=True)
    assert share_identical_initializers(model) == 1   # only the two Hadamards
    assert {i.name for i in model.graph.initializer} >= {"shift", "zeros"}
    x = np.ones((2, D), np.float32)
    y1, y2 = _run(model, {"x": x, "shift": np.zeros(D, np.float32)})
    z1, z2 = _run(model, {"x": x, "shift": np.full(D, 5.0, np.float32)})
    np.testing.assert_array_equal(z1, y1)                 # the feed still lands on k only
    np.testing.assert_allclose(z2 - y2, 5.0, rtol=1e-4)


def test_nodes_that_differ_in_an_attribute_or_produce_a_graph_output_are_kept():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, D])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "b", "c")]
    nodes = [helper.make_node("Softmax", ["x"], ["a"], axis=-1), helper.make_node("Softmax", ["x"], ["b"], axis=0),
             helper.make_node("Softmax", ["x"], ["c"], axis=-1)]   # repeats a, but c is an output
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outs), opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    assert merge_common_subexpressions(model) == 0 and len(model.graph.node) == 3


def _rmsnorm_graph() -> onnx.ModelProto:
    """The exporter's RMSNorm: x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2)) + eps)) * weight."""
    inits = [numpy_helper.from_array(np.asarray(2.0, np.float32), "two"),
             numpy_helper.from_array(np.asarray([-1], np.int64), "axes"),
             numpy_helper.from_array(np.asarray(1e-6, np.float32), "eps"),
             numpy_helper.from_array(np.linspace(0.5, 1.5, D).astype(np.float32), "weight")]
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"], name="norm/Pow"),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="norm/ReduceMean", keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["var"], name="norm/Add"),
             helper.make_node("Sqrt", ["var"], ["rms"], name="norm/Sqrt"),
             helper.make_node("Reciprocal", ["rms"], ["inv"], name="norm/Reciprocal"),
             helper.make_node("Mul", ["x", "inv"], ["normed"], name="norm/Mul"),
             helper.make_node("Mul", ["weight", "normed"], ["y"], name="norm/Mul_1")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, D])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, D])
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_rmsnorm_becomes_a_division_that_onnx_runtime_fuses_into_one_node(tmp_path):
    model = _rmsnorm_graph()
    x = np.random.default_rng(2).standard_normal((2, 3, D)).astype(np.float32) * 3
    (before,) = _run(model, {"x": x}, str(tmp_path / "before.onnx"))
    assert rmsnorm_as_division(model) == 1
    onnx.checker.check_model(model)   # still standard ONNX: the fusion happens in the session
    assert "Reciprocal" not in {n.op_type for n in model.graph.node}
    (after,) = _run(model, {"x": x}, str(tmp_path / "after.onnx"))
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)
    fused = {n.op_type for n in onnx.load(str(tmp_path / "after.onnx")).graph.node}
    unfused = {n.op_type for n in onnx.load(str(tmp_path / "before.onnx")).graph.node}
    assert fused == {"SimplifiedLayerNormalization"} and "SimplifiedLayerNormalization" not in unfused


@pytest.mark.parametrize("reader", ["Add", "two readers"])
def test_a_reciprocal_that_is_not_a_norms_scale_is_left_alone(reader):
    model = _rmsnorm_graph()
    nodes = model.graph.node
    if reader == "Add":
        nodes[5].op_type = "Add"
    else:
        nodes.append(helper.make_node("Mul", ["inv", "inv"], ["inv2"], name="other"))
        model.graph.output.append(helper.make_tensor_value_info("inv2", TensorProto.FLOAT, None))
    assert rmsnorm_as_division(model) == 0


def _op_types(path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def _transposed_norm_graph(perm=(0, 2, 1, 3), axis: int = -1, third_reader: bool = False) -> onnx.ModelProto:
    """Gemma 3's k norm as exported: the heads transposed [b, s, h, d] -> [b, h, s, d], then RMSNorm
    in Div form over ``axis`` with a weight of d values, read on by a Transpose back."""
    inits = [numpy_helper.from_array(np.asarray(2.0, np.float32), "two"),
             numpy_helper.from_array(np.asarray([axis], np.int64), "axes"),
             numpy_helper.from_array(np.asarray(1e-6, np.float32), "eps"),
             numpy_helper.from_array(np.linspace(0.5, 1.5, D).astype(np.float32), "weight")]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], name="attn/Transpose", perm=list(perm)),
             helper.make_node("Pow", ["xt", "two"], ["sq"], name="k_norm/Pow"),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="k_norm/ReduceMean", keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["var"], name="k_norm/Add"),
             helper.make_node("Sqrt", ["var"], ["rms"], name="k_norm/Sqrt"),
             helper.make_node("Div", ["xt", "rms"], ["normed"], name="k_norm/Div"),
             helper.make_node("Mul", ["normed", "weight"], ["k"], name="k_norm/Mul"),
             helper.make_node("Transpose", ["k"], ["y"], name="attn/Transpose_back", perm=list(perm))]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 2, D])]
    if third_reader:
        nodes.append(helper.make_node("Neg", ["xt"], ["xt_neg"], name="other"))
        outputs.append(helper.make_tensor_value_info("xt_neg", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 2, D])
    return helper.make_model(helper.make_graph(nodes, "g", [x], outputs, inits),
                             opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_a_norm_read_through_a_transpose_is_computed_first_and_onnx_runtime_fuses_it(tmp_path):
    model = _transposed_norm_graph()
    x = np.random.default_rng(3).standard_normal((2, 3, 2, D)).astype(np.float32) * 3
    _run(model, {"x": x}, str(tmp_path / "before.onnx"))
    # why the pass exists: ORT cancels the Transposes itself, but the axes it then writes stop its norm fusion
    assert _op_types(tmp_path / "before.onnx") == ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"]
    (plain,) = _run(model, {"x": x}, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert rmsnorm_before_transpose(model) == 1
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Transpose",
                                                     "Transpose"]
    (moved,) = _run(model, {"x": x}, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_array_equal(moved, plain)   # the same arithmetic, laid out afterwards
    (fused,) = _run(model, {"x": x}, str(tmp_path / "after.onnx"))
    np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-6)
    assert _op_types(tmp_path / "after.onnx") == ["SimplifiedLayerNormalization"]   # and the Transposes cancel


@pytest.mark.parametrize("case", ["last axis moves", "other axis reduced", "third reader"])
def test_a_transpose_the_norm_does_not_commute_with_stays(case):
    model = _transposed_norm_graph(perm=(0, 1, 3, 2) if case == "last axis moves" else (0, 2, 1, 3),
                                   axis=1 if case == "other axis reduced" else -1, third_reader=case == "third reader")
    before = model.SerializeToString()
    assert rmsnorm_before_transpose(model) == 0
    assert model.SerializeToString() == before


def _tanh_gelu_graph(half_read_twice: bool = False) -> onnx.ModelProto:
    """GELU's tanh form as torch's exporter writes it: x * (0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))))."""
    consts = {"three": 3.0, "c": 0.044715, "k": float(np.sqrt(2 / np.pi)), "one": 1.0, "half": 0.5}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in consts.items()]
    nodes = [helper.make_node("Pow", ["x", "three"], ["cube"], name="act/Pow"),
             helper.make_node("Mul", ["c", "cube"], ["cc"], name="act/Mul"),
             helper.make_node("Add", ["x", "cc"], ["inner"], name="act/Add"),
             helper.make_node("Mul", ["k", "inner"], ["arg"], name="act/Mul_1"),
             helper.make_node("Tanh", ["arg"], ["t"], name="act/Tanh"),
             helper.make_node("Add", ["t", "one"], ["onep"], name="act/Add_1"),
             helper.make_node("Mul", ["half", "onep"], ["h"], name="act/Mul_2"),
             helper.make_node("Mul", ["x", "h"], ["gelu"], name="act/Mul_3"),
             helper.make_node("Neg", ["gelu"], ["y"], name="next")]   # ORT fuses no GELU that is a graph output
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", D])]
    if half_read_twice:
        nodes.append(helper.make_node("Neg", ["h"], ["h_neg"], name="other"))
        outputs.append(helper.make_tensor_value_info("h_neg", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", D])
    return helper.make_model(helper.make_graph(nodes, "g", [x], outputs, inits),
                             opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_tanh_gelu_is_reordered_into_the_form_onnx_runtime_fuses(tmp_path):
    model = _tanh_gelu_graph()
    x = np.random.default_rng(4).standard_normal((5, D)).astype(np.float32) * 4
    (plain,) = _run(model, {"x": x}, str(tmp_path / "before.onnx"))
    assert "FastGelu" not in _op_types(tmp_path / "before.onnx")   # why the pass exists
    (unfused,) = _run(model, {"x": x}, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert tanh_gelu_in_fused_order(model) == 1
    onnx.checker.check_model(model)
    (reordered,) = _run(model, {"x": x}, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_array_equal(reordered, unfused)   # halving first: the same product
    (fused,) = _run(model, {"x": x}, str(tmp_path / "after.onnx"))
    np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-6)
    assert _op_types(tmp_path / "after.onnx") == ["FastGelu", "Neg"]


def test_a_half_read_elsewhere_is_left_alone():
    model = _tanh_gelu_graph(half_read_twice=True)
    before = model.SerializeToString()
    assert tanh_gelu_in_fused_order(model) == 0
    assert model.SerializeToString() == before
