"""A per-token graph's one-row token graph (quantnorm.generation.one_row): what one product
computes, the products that read one input packed, and what is left alone. The deployment of it
(the generation stage, DecodeSession's routing) is tested on a zoo run in test_generation_stage.py."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_pertoken import K, N, matmul_model, run

from quantnorm.generation.decode import ONE_ROW_KEY
from quantnorm.generation.one_row import DQMM, one_row_graph, write_one_row_graph
from quantnorm.generation.residual_norms import SKIP_NORM, fuse_residual_norms
from quantnorm.quantize.pertoken import quantize_per_token


def _per_token(tmp_path, weight, shared_input=False, opset=18):
    src = matmul_model(tmp_path / "fp32.onnx", weight, shared_input, opset=opset)
    dst = tmp_path / "pertoken.onnx"
    # 7-bit weights: ORT's u8 x s8 kernel is exact with them on every CPU (test_pertoken.py's grids)
    quantize_per_token(src, dst, ["mm", "mm2"] if shared_input else ["mm"], reduce_range=True, fused=True)
    return dst


def _ort_row_rounding(x: np.ndarray) -> tuple[np.ndarray, np.float32, np.uint8]:
    """ONNX Runtime's DynamicQuantizeLinear of a tensor: uint8 over min(0, x)..max(0, x)."""
    low, high = np.float32(min(0.0, x.min())), np.float32(max(0.0, x.max()))
    scale = np.float32((high - low) / np.float32(255))
    zero = np.uint8(np.clip(np.rint(-low / scale), 0, 255))
    return np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.uint8), scale, zero


# both of the recipe's row layouts: blocked rows (opset >= 18, raised to 21) and rows flattened for
# a per-axis scale (17)
@pytest.mark.parametrize("opset", [17, 18])
def test_a_row_is_quantized_as_ort_rounds_one_tensor_and_multiplied_by_the_recipes_codes(tmp_path, opset):
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    pertoken = _per_token(tmp_path, weight, opset=opset)
    model = onnx.load(str(pertoken))
    done = one_row_graph(model)
    assert done == {"products": 1, "packed_attention_layers": 0, "packed_splits": 0, "residual_norms": 0}
    assert [n.op_type for n in model.graph.node] == [DQMM]   # the per-token quantization is gone with it
    assert {p.key: p.value for p in model.metadata_props}[ONE_ROW_KEY] == "1"
    node = model.graph.node[0]
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    codes, scales = inits[node.input[1]], inits[node.input[2]]
    assert codes.dtype == np.int8 and np.abs(codes).max() <= 63   # the recipe's own 7-bit codes, kept
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    x[0, 0, 5] = 300.0   # a large value sets the row's scale, as a massive activation would
    q, scale, zero = _ort_row_rounding(x)
    expected = (q.astype(np.int32) - int(zero)) @ codes.astype(np.int32) * (scale * scales)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    # and it is not the recipe's symmetric rounding, which the deployment scores through the cache
    symmetric = run(pertoken, x)[0]
    assert not np.array_equal(got, symmetric) and np.abs(got - symmetric).max() < 0.05 * np.abs(symmetric).max()


def test_products_that_read_one_input_run_as_one_and_give_each_its_columns(tmp_path):
    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    pertoken = _per_token(tmp_path, weight, shared_input=True)
    separate = onnx.load(str(pertoken))
    from quantnorm.generation import one_row as module

    assert module._fuse_quantize_matmul(separate.graph) == 2
    packed = tmp_path / "one_row.onnx"
    assert write_one_row_graph(pertoken, packed) == {"products": 2, "packed_attention_layers": 0, "packed_splits": 1,
                                                     "residual_norms": 0}
    graph = onnx.load(str(packed)).graph
    assert sorted(n.op_type for n in graph.node) == [DQMM, "Split"]
    assert numpy_helper.to_array(next(i for i in graph.initializer if i.name.endswith("_weights"))).shape == (K, 2 * N)
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    unpacked = ort.InferenceSession(separate.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(run(packed, x), unpacked):
        np.testing.assert_array_equal(a, b)   # one row quantized once or twice is the same row


def test_a_graph_without_per_token_products_is_left_alone(tmp_path):
    fp32 = matmul_model(tmp_path / "fp32.onnx", np.ones((K, N), np.float32))
    dst = tmp_path / "one_row.onnx"
    assert write_one_row_graph(fp32, dst) == {"products": 0, "packed_attention_layers": 0, "packed_splits": 0,
                                              "residual_norms": 0}
    assert not dst.exists()
    # a product whose weights carry a zero point (the unsigned 8-bit grid) is not rewritten either
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
         helper.make_node("MatMulIntegerToFloat", ["xq", "W", "s", "ws", "z", "wz"], ["y"], domain="com.microsoft")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
        [numpy_helper.from_array(np.full((K, N), 128, np.uint8), "W"), numpy_helper.from_array(np.float32(0.1), "s"),
         numpy_helper.from_array(np.uint8(128), "z"), numpy_helper.from_array(np.ones(N, np.float32), "ws"),
         numpy_helper.from_array(np.full(N, 128, np.uint8), "wz")])
    model = helper.make_model(graph)
    assert one_row_graph(model)["products"] == 0 and ONE_ROW_KEY not in {p.key for p in model.metadata_props}


def test_query_key_and_value_become_the_attention_operators_packed_input(tmp_path):
    """Three products reading one input, each reshaped into GroupQueryAttention's query, key and
    value: one product feeds its packed input, the reshapes gone; the same attention output."""
    heads, kv_heads, head_dim = 4, 2, 8
    rng = np.random.default_rng(2)
    widths = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    nodes, inits = [], [numpy_helper.from_array(np.array([1, 1, -1], np.int64), "shape")]
    for name, width in widths.items():
        inits += [numpy_helper.from_array(rng.integers(-63, 64, (K, width)).astype(np.int8), f"W{name}"),
                  numpy_helper.from_array((rng.random(width) * 0.01 + 0.001).astype(np.float32), f"S{name}")]
        nodes += [helper.make_node(DQMM, ["x", f"W{name}", f"S{name}"], [f"{name}_flat"], name=name, domain="com.microsoft"),
                  helper.make_node("Reshape", [f"{name}_flat", "shape"], [name])]
    nodes.append(helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"],
                                  ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=heads,
                                  kv_num_heads=kv_heads))
    cache = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, kv_heads, None, head_dim])
             for n in ("past_key", "past_value")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, K]), *cache,
                                           helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
                                           helper.make_tensor_value_info("total", TensorProto.INT32, [])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, heads * head_dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    past = rng.standard_normal((1, kv_heads, 3, head_dim)).astype(np.float32)
    feed = {"x": rng.standard_normal((1, 1, K)).astype(np.float32), "past_key": past, "past_value": past * 2,
            "seqlens_k": np.array([3], np.int32), "total": np.array(4, np.int32)}

    def attend(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["out"], feed)[0]

    before = attend(model)
    from quantnorm.generation import one_row as module

    assert module._pack_shared_inputs(model.graph) == {"attention": 1, "split": 0}
    module._drop_unused(model.graph)
    assert [n.op_type for n in model.graph.node] == [DQMM, "GroupQueryAttention"]
    assert list(model.graph.node[1].input[:3]) == [model.graph.node[0].output[0], "", ""]
    np.testing.assert_array_equal(attend(model), before)


def _residual_norm_graph(axes=(-1,), gamma_constant=True) -> onnx.ModelProto:
    """y = RMSNorm(a + b) as exported (Pow, ReduceMean, Add eps, Sqrt, Div, Mul gamma), and the sum
    read again by a second add (the next residual), both outputs of the graph."""
    d = 16
    gamma = np.linspace(0.5, 1.5, d).astype(np.float32)
    inits = [numpy_helper.from_array(np.float32(2.0), "two"), numpy_helper.from_array(np.array(axes, np.int64), "axes"),
             numpy_helper.from_array(np.float32(1e-5), "eps")] + \
        ([numpy_helper.from_array(gamma, "gamma")] if gamma_constant else [])
    nodes = [helper.make_node("Add", ["a", "b"], ["x"], name="residual"),
             helper.make_node("Pow", ["x", "two"], ["p"]), helper.make_node("ReduceMean", ["p", "axes"], ["m"], keepdims=1),
             helper.make_node("Add", ["m", "eps"], ["e"]), helper.make_node("Sqrt", ["e"], ["s"]),
             helper.make_node("Div", ["x", "s"], ["d"]), helper.make_node("Mul", ["d", "gamma"], ["y"]),
             helper.make_node("Add", ["x", "y"], ["next"])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, d]) for n in ("a", "b")]
    if not gamma_constant:
        inputs.append(helper.make_tensor_value_info("gamma", TensorProto.FLOAT, [d]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, d])
                                                   for n in ("y", "next")], inits)
    graph.value_info.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model


def test_a_residual_add_and_the_rms_norm_that_reads_it_become_one_skip_norm():
    rng = np.random.default_rng(3)
    feed = {"a": rng.standard_normal((1, 3, 16)).astype(np.float32) * 50,
            "b": rng.standard_normal((1, 3, 16)).astype(np.float32)}

    def outputs(model, extra=None):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(["y", "next"], {**feed, **(extra or {})})

    model = _residual_norm_graph()
    before = outputs(model)
    assert fuse_residual_norms(model.graph) == 1
    assert [n.op_type for n in model.graph.node] == [SKIP_NORM, "Add"]
    skip = model.graph.node[0]
    assert list(skip.input) == ["a", "b", "gamma"] and list(skip.output) == ["y", "", "", "x"]
    for fused, plain in zip(outputs(model), before):
        np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-5)
    # the last axis by its number, where the graph states the rank (the exporter's value_info)
    stated = _residual_norm_graph(axes=(2,))
    assert fuse_residual_norms(stated.graph) == 1
    unstated = _residual_norm_graph(axes=(2,))
    del unstated.graph.value_info[:]
    assert fuse_residual_norms(unstated.graph) == 0   # rank unknown: axis 2 might not be the last
    # not an RMSNorm over the last axis with a constant gamma: left as it is
    for other in (_residual_norm_graph(axes=(1,)), _residual_norm_graph(gamma_constant=False)):
        assert fuse_residual_norms(other.graph) == 0 and len(other.graph.node) == 8
