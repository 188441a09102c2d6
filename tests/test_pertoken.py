"""Per-token dynamic INT8 in standard ONNX ops (quantnorm.quantize.pertoken)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantnorm.errors import ConfigError
from quantnorm.hardware import cpu_has_vnni
from quantnorm.quantize import get_recipe, quantize
from quantnorm.quantize.pertoken import fake_quantize_rows, quantize_per_token, weight_scales
from quantnorm.quantize.recipes import Recipe

K, N = 64, 96


def matmul_model(path, weight, shared_input=False, opset=18):
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, N])]
    if shared_input:  # a second MatMul reading the same activation (q/k/v do)
        nodes.append(helper.make_node("MatMul", ["x", "W2"], ["y2"], name="mm2"))
        outputs.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [None, None, N]))
    inits = [numpy_helper.from_array(weight, "W")] + ([numpy_helper.from_array(weight * 2, "W2")] if shared_input else [])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, K])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9  # ORT 1.31 refuses onnx 1.23's default IR version (PITFALLS.md 14)
    onnx.save(model, str(path))
    return path


def run(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.fixture()
def planted():
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    x = rng.standard_normal((2, 32, K)).astype(np.float32)
    x[:, 0, 5] = 25_000.0  # a massive activation on the first token, one channel
    return weight, x


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# 8-bit signed weights are exact only with VNNI: ORT's AVX2 u8 x s8 kernel (vpmaddubsw) saturates the
# int16 sum of each pair of products, 255 * 127 * 2 > 32767 (PITFALLS.md 2; measured: all-255 x all-127
# over K=64 gave 1,048,544 for 2,072,640). The same 8-bit codes stored unsigned (code + 128, zero point
# 128) run the u8 x u8 kernel, exact on every CPU; 7-bit codes are exact everywhere too. So every
# machine tests the grids it can deploy, and the signed 8-bit grid where this CPU has VNNI (not a skip:
# CI refuses skips that are not about a GPU, tests/conftest.py). A grid: (reduce_range, unsigned).
WEIGHT_GRIDS = ([pytest.param((True, False), id="7-bit"), pytest.param((False, True), id="8-bit-unsigned")]
                + ([pytest.param((False, False), id="8-bit")] if cpu_has_vnni() else []))


def test_the_grids_tested_include_the_one_this_cpu_deploys():
    settings = get_recipe("pertoken-fused").settings(vnni=cpu_has_vnni())
    deployed = (settings["reduce_range"], settings["unsigned_pertoken_weights"])
    # per-token INT8 keeps all 8 bits on every CPU: signed with VNNI, unsigned without
    assert deployed == (False, not cpu_has_vnni()) and deployed in [p.values[0] for p in WEIGHT_GRIDS]
    assert get_recipe("pertoken-fused").settings(vnni=False)["unsigned_pertoken_weights"] is True
    assert get_recipe("static-minmax-matmul").settings(vnni=False)["reduce_range"] is True   # ORT's quantizer


@pytest.mark.parametrize("grid", WEIGHT_GRIDS)
def test_graph_matches_the_numpy_reference(tmp_path, planted, grid):
    reduce_range, unsigned = grid
    weight, x = planted
    src = matmul_model(tmp_path / "mm.onnx", weight)
    info = quantize_per_token(src, tmp_path / "pt.onnx", ["mm"], reduce_range=reduce_range, unsigned_weights=unsigned)
    qmax = 63 if reduce_range else 127
    assert info["pertoken_matmuls"] == ["mm"] and info["weight_qmax"] == qmax
    assert info["weight_codes"].startswith("uint8" if unsigned else "int8")
    w_q, s_w = weight_scales(weight, qmax)
    expected = fake_quantize_rows(x) @ (w_q.astype(np.float32) * s_w)
    got = run(tmp_path / "pt.onnx", x)[0]
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())
    model = onnx.load(str(tmp_path / "pt.onnx"))
    ops = {n.op_type for n in model.graph.node}
    assert "MatMulInteger" in ops and "MatMul" not in ops and "DynamicQuantizeLinear" not in ops
    # the one QuantizeLinear is per row (one block the width of a row), never per tensor: the
    # opset-18 graph is raised to 21 for it
    (ql,) = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    attrs = {a.name: a.i for a in ql.attribute}
    assert attrs == {"axis": -1, "block_size": K} and ql.input[1].endswith("x_scale")
    assert [i.version for i in model.opset_import if i.domain == ""] == [21] and "blocked" in info["activation_rows"]


GEMM_OPS = {"MatMulInteger", "Cast", "Mul"}


def test_rows_flattened_for_per_axis_scales_give_the_same_codes_as_blocked_rows(tmp_path, planted):
    # opset 17 cannot be raised (ReduceMax's axes moved to an input at 18): the rows are flattened
    # to [tokens, K] for a per-axis scale and back; the codes, hence the outputs, are the same
    weight, x = planted
    outputs = {}
    for opset in (17, 18):
        src = matmul_model(tmp_path / f"mm{opset}.onnx", weight, opset=opset)
        info = quantize_per_token(src, tmp_path / f"pt{opset}.onnx", ["mm"], reduce_range=True)
        outputs[opset] = run(tmp_path / f"pt{opset}.onnx", x)[0]
        model = onnx.load(str(tmp_path / f"pt{opset}.onnx"))
        (ql,) = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
        blocked = {a.name: a.i for a in ql.attribute}.get("block_size")
        assert (blocked == K) == (opset == 18) and ("flattened" in info["activation_rows"]) == (opset == 17)
        # the scale (5 operators), the zero points (2) and QuantizeLinear, or 6 more to flatten
        assert sum(n.op_type not in GEMM_OPS for n in model.graph.node) == (8 if opset == 18 else 12)
    np.testing.assert_array_equal(outputs[17], outputs[18])


def test_inputs_of_one_stated_row_shape_share_their_zero_points(tmp_path, planted):
    # q/k/v's input and o's: both [batch, seq, K] as the graph states them: one zero-point tensor
    weight, x = planted
    square = (np.random.default_rng(1).standard_normal((N, N)) * 0.1).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="mm2")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", N])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(square, "W2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, str(tmp_path / "two.onnx"))
    quantize_per_token(tmp_path / "two.onnx", tmp_path / "pt.onnx", ["mm", "mm2"], reduce_range=True)
    nodes = onnx.load(str(tmp_path / "pt.onnx")).graph.node
    assert sum(n.op_type == "Expand" for n in nodes) == 1    # shape inference states r as [batch, seq, N]
    zero_points = {n.input[2] for n in nodes if n.op_type == "QuantizeLinear"}
    assert len(zero_points) == 1
    expected = np.maximum(fake_quantize_rows(x) @ (weight_scales(weight, 63)[0] * weight_scales(weight, 63)[1]), 0)
    got = run(tmp_path / "pt.onnx", x)[0]
    w2 = weight_scales(square, 63)
    assert np.allclose(got, fake_quantize_rows(expected) @ (w2[0].astype(np.float32) * w2[1]), rtol=1e-3,
                       atol=1e-3 * np.abs(got).max())


@pytest.mark.parametrize("grid", WEIGHT_GRIDS)
def test_a_massive_token_breaks_per_tensor_scales_not_per_token(tmp_path, planted, grid):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    reduce_range, unsigned = grid

    weight, x = planted
    src = matmul_model(tmp_path / "mm.onnx", weight)
    reference = x @ weight
    quantize_dynamic(str(src), str(tmp_path / "dyn.onnx"), weight_type=QuantType.QInt8, per_channel=True,
                     reduce_range=reduce_range)
    # measured on VNNI: per-token 0.0086 (8-bit) and 0.0134 (7-bit) on the other tokens
    quantize_per_token(src, tmp_path / "pt.onnx", ["mm"], reduce_range=reduce_range, unsigned_weights=unsigned)
    others = (slice(None), slice(1, None))
    per_tensor_err = rel(run(tmp_path / "dyn.onnx", x)[0][others], reference[others])
    per_token_err = rel(run(tmp_path / "pt.onnx", x)[0][others], reference[others])
    assert per_tensor_err > 0.5     # the other tokens round to (almost) nothing
    assert per_token_err < 0.02     # each row has its own step
    massive_row = (slice(None), 0)
    assert rel(run(tmp_path / "pt.onnx", x)[0][massive_row], reference[massive_row]) < 0.05


def test_one_quantization_per_shared_input_and_reduce_range(tmp_path, planted):
    weight, x = planted
    src = matmul_model(tmp_path / "mm.onnx", weight, shared_input=True)
    info = quantize_per_token(src, tmp_path / "pt.onnx", ["mm", "mm2"], reduce_range=True)
    model = onnx.load(str(tmp_path / "pt.onnx"))
    assert info["weight_qmax"] == 63
    assert sum(n.op_type == "ReduceMax" for n in model.graph.node) == 1
    assert sum(n.op_type == "MatMulInteger" for n in model.graph.node) == 2
    assert {i.name for i in model.graph.initializer}.isdisjoint({"W", "W2"})  # FP32 weights dropped
    y, y2 = run(tmp_path / "pt.onnx", x)
    assert rel(y2, 2 * (x @ weight)) < 0.05 and rel(y, x @ weight) < 0.05


def test_recipe_validation():
    recipe = get_recipe("pertoken")
    assert recipe.mode == "pertoken" and recipe.calibration is None
    assert recipe.settings(vnni=True)["format"].startswith("per-token")
    with pytest.raises(ConfigError, match="per-channel"):
        Recipe("bad", "pertoken", None, False, "matmul", False, "auto")
    with pytest.raises(ConfigError, match="calibration"):
        Recipe("bad", "pertoken", "minmax", True, "matmul", False, "auto")


def test_quantize_runs_the_recipe_and_checks_the_model(tmp_path, planted):
    weight, x = planted
    src = matmul_model(tmp_path / "mm.onnx", weight)
    probe = np.zeros((1, 4), dtype=np.int64)  # unused by this float-input graph's sanity run
    result = quantize(src, get_recipe("pertoken"), None, tmp_path / "out.onnx", vnni=True, probe_inputs=probe)
    assert result.path.is_file() and result.settings["quantized_nodes"] == ["mm"]
    assert result.settings["pertoken_matmuls"] == ["mm"]


def test_zoo_pipeline_runs_pertoken_and_says_rotation_does_not_apply(tmp_path, capsys):
    import json

    from quantnorm.cli import main

    out = tmp_path / "run"
    argv = ["evaluate", "--placement", "pre", "--norm", "rms", "--layers", "1", "--d-model", "16", "--heads", "2",
            "--context", "16", "--steps", "3", "--recipes", "pertoken,rotated-pertoken", "--calib-samples", "4",
            "--batches", "1", "--iters", "2", "--providers", "cpu", "--threads", "1", "--no-outliers", "--quiet",
            "--no-generation", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    recipes = {r["name"]: r for r in json.loads((out / "results.json").read_text())["recipes"]}
    acc = recipes["pertoken"]["accuracy"]
    assert recipes["pertoken"]["status"] == "ok" and 0 < acc["kld_mean"] < 0.05, acc   # INT8, close to FP32
    assert recipes["rotated-pertoken"]["status"].startswith("not applicable: ")
    assert "accuracy" not in recipes["rotated-pertoken"]


def test_fused_kernel_computes_the_same(tmp_path, planted):
    weight, x = planted
    src = matmul_model(tmp_path / "mm.onnx", weight)
    quantize_per_token(src, tmp_path / "plain.onnx", ["mm"], reduce_range=False)
    info = quantize_per_token(src, tmp_path / "fused.onnx", ["mm"], reduce_range=False, fused=True)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "fused.onnx")).graph.node}
    assert "MatMulIntegerToFloat" in ops and "MatMulInteger" not in ops and "ONNX Runtime" in info["kernel"]
    plain, fused = run(tmp_path / "plain.onnx", x)[0], run(tmp_path / "fused.onnx", x)[0]
    assert np.allclose(plain, fused, rtol=1e-5, atol=1e-4 * np.abs(plain).max())
    assert get_recipe("pertoken-fused").settings(vnni=True)["pertoken_kernel"] == "ort-fused"


def norm_and_raw_model(path, weight, vocab=50):
    """ids -> embedding x; ``mm`` reads RMSNorm(x) (the decomposed form the exporter writes at opset
    18), ``raw`` reads x itself: one norm output and one plain activation."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((vocab, K)).astype(np.float32)
    table[3, 7] = 400.0  # one token with a large channel: the norm output's rows still have RMS 1
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["x"], name="embed"),
        helper.make_node("Pow", ["x", "two"], ["x2"], name="norm/Pow"),
        helper.make_node("ReduceMean", ["x2", "axes"], ["ms"], name="norm/ReduceMean", keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["ms_eps"], name="norm/Add"),
        helper.make_node("Sqrt", ["ms_eps"], ["rms"], name="norm/Sqrt"),
        helper.make_node("Reciprocal", ["rms"], ["inv"], name="norm/Reciprocal"),
        helper.make_node("Mul", ["x", "inv"], ["normed"], name="norm/Mul"),
        helper.make_node("MatMul", ["normed", "W"], ["y"], name="mm"),
        helper.make_node("MatMul", ["x", "W2"], ["y2"], name="raw"),
    ]
    inits = [numpy_helper.from_array(table, "E"), numpy_helper.from_array(weight, "W"),
             numpy_helper.from_array(weight * 2, "W2"), numpy_helper.from_array(np.float32(2.0), "two"),
             numpy_helper.from_array(np.asarray([-1], dtype=np.int64), "axes"),
             numpy_helper.from_array(np.float32(1e-6), "eps")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, None, N]) for n in ("y", "y2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, None])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, str(path))
    table_normed = table / np.sqrt((table ** 2).mean(-1, keepdims=True) + 1e-6)
    return path, table, table_normed


# CPU-dependent: signed 8-bit weights (vnni=True) are exact only on a CPU with VNNI; without it ORT's
# u8s8 kernel saturates (PITFALLS.md 2), which is why a per-token recipe stores its codes unsigned
# there (the u8u8 kernel, exact everywhere). So the unsigned path runs on every CPU and the signed
# one where this CPU really has VNNI; both compute the same 8-bit codes.
@pytest.mark.parametrize("vnni", sorted({False, cpu_has_vnni()}))
def test_calibrated_norm_inputs_get_one_scale_and_the_rest_stay_per_token(tmp_path, planted, vnni):
    """The calnorm recipes: a MatMul reading a norm output is quantized with one scale from the
    calibration windows (MSE clip / 127, zero point 128); any other input keeps its per-row scale."""
    weight, _ = planted
    src, table, table_normed = norm_and_raw_model(tmp_path / "nm.onnx", weight)
    rng = np.random.default_rng(2)
    calib = rng.integers(0, 50, size=(4, 8), dtype=np.int64)
    ids = rng.integers(0, 50, size=(2, 8), dtype=np.int64)
    ids[:, 0] = 3
    recipe = get_recipe("rotated-pertoken-fused-calnorm")
    result = quantize(src, recipe, calib, tmp_path / "q.onnx", vnni=vnni, probe_inputs=ids)
    assert result.ok, result.problems
    assert result.settings["reduce_range"] is False and result.settings["unsigned_pertoken_weights"] is (not vnni)
    found = result.settings["norm_input_scales"]["tensors"]
    assert list(found) == ["normed"] and found["normed"]["norm"] == "rms"
    assert np.isclose(found["normed"]["max_abs"], np.abs(table_normed[calib]).max(), rtol=1e-5)
    assert 0 < found["normed"]["clip"] <= found["normed"]["max_abs"]
    assert result.settings["calibrated_scale_inputs"] == ["normed"]
    nodes = onnx.load(str(tmp_path / "q.onnx")).graph.node
    quantizers = {n.input[0]: n for n in nodes if n.op_type == "QuantizeLinear"}
    assert not [a for a in quantizers["normed"].attribute if a.name == "axis"]   # per tensor
    assert sum(n.op_type == "ReduceMax" for n in nodes) == 1                       # only x's rows
    # The numpy reference: one step for every row of the norm output, saturating codes.
    scale = np.float32(found["normed"]["clip"] / 127)
    codes = np.clip(np.rint(table_normed[ids] / scale) + 128, 0, 255) - 128
    w_q, s_w = weight_scales(weight, 127)
    expected = (codes * scale) @ (w_q.astype(np.float32) * s_w)
    got = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})
    assert np.allclose(got[0], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # The plain activation (a 400 channel on token 3) keeps its own step per row.
    reference2 = table[ids] @ (weight * 2)
    assert rel(got[1], reference2) < 0.05


def test_calibrated_norm_inputs_need_the_stream_rotation():
    with pytest.raises(ConfigError, match="rotated stream"):
        Recipe("bad", "pertoken", None, True, "matmul", False, "auto", norm_inputs="calibrated")
    with pytest.raises(ConfigError, match="norm_inputs"):
        Recipe("bad", "pertoken", None, True, "matmul", False, "auto", rotation="hadamard", norm_inputs="max")
    settings = get_recipe("rotated-pertoken-fused-calnorm-gptq").settings(vnni=True)
    assert settings["norm_inputs"] == "calibrated" and settings["weight_rounding"] == "gptq"
    assert "one calibrated scale per tensor" in get_recipe("rotated-pertoken-fused-calnorm").describe()


def _true_mse(x, clip):
    step = clip / 127
    return float(((np.clip(np.rint(x / step), -128, 127) * step - x) ** 2).mean())


@pytest.mark.parametrize("shape", ["gaussian", "uniform"])
def test_mse_clip_is_the_clip_of_least_squared_error(shape):
    from quantnorm.transforms.gptq import ABS_HISTOGRAM_BINS, mse_clip

    rng = np.random.default_rng(3)
    x = rng.standard_normal(200_000) if shape == "gaussian" else rng.uniform(-3, 3, 200_000)
    top = 8.0
    counts = np.bincount(np.minimum((np.abs(x) * (ABS_HISTOGRAM_BINS / top)).astype(int), ABS_HISTOGRAM_BINS - 1),
                         minlength=ABS_HISTOGRAM_BINS)
    clip = mse_clip(counts, top, 127)
    grid = np.linspace(0.5, np.abs(x).max(), 400)
    best = min(_true_mse(x, c) for c in grid)
    assert _true_mse(x, clip) <= best * 1.03
    if shape == "gaussian":   # the rare tail is clipped: a finer step for everything else
        assert clip < 0.9 * np.abs(x).max()
    else:                     # nothing to gain from clipping a bounded, flat distribution
        assert clip > 0.97 * np.abs(x).max()


def test_weight_codes_made_a_few_columns_at_a_time_equal_the_whole_array_formula():
    from quantnorm.quantize.pertoken import weight_scales

    rng = np.random.default_rng(7)
    weight = rng.standard_normal((64, 70_001)).astype(np.float32)   # past one chunk of columns
    weight[:, 5] = 0.0                                               # an all-zero column: scale 1
    for qmax in (127, 63):
        amax = np.abs(weight).max(axis=0)
        scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
        codes, got = weight_scales(weight, qmax)
        np.testing.assert_array_equal(got, scale)
        np.testing.assert_array_equal(codes, np.clip(np.rint(weight / scale), -qmax, qmax).astype(np.int8))
