"""Per-token dynamic INT8 written with standard ONNX operators (W8A8, any ONNX runtime).

Why: a static activation scale, and ONNX Runtime's own ``dynamic`` recipe, are one number per
tensor. Where one token's MatMul input is thousands of times larger than the rest (the massive
activation on the first token of SmolLM2 and Gemma 3), that token sets the step for every other
token, and they round to zero (PITFALLS.md 15). A scale per row (LLM.int8()'s vector-wise and
ZeroQuant's token-wise activation quantization) confines the damage to the row that holds it.

Each MatMul ``Y = X @ W`` whose ``W`` is a weight initializer ([K, N]) becomes

    s_x  = max(ReduceMax(X), -ReduceMin(X), eps) / 127 (row-wise)        [..., 1]   per token
    X_q  = QuantizeLinear(X, s_x, 128) = saturate_uint8(round(X / s_x) + 128)       zero point 128
    W_q  = round(W / s_w), s_w = max|W[:, n]| / q_max                    [K, N] int8 per output channel
    Y    = Cast<float>(MatMulInteger(X_q, W_q, 128)) * s_x * s_w

The activation zero point is one scalar (128), so the u8 x s8 ``MatMulInteger`` kernel runs:
ORT's CPU ``MatMulInteger`` refuses a per-row zero point, and s8 x s8 is 3.3x slower than FP32
there, while u8 x s8 runs at about 0.35x (PITFALLS.md 14). Symmetric rows around 128 use 255 of
the 256 codes. ``q_max`` is 63 (7-bit weights) where the CPU lacks VNNI: u8 x s8 pairs summed in
int16 saturate otherwise (PITFALLS.md 2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..measure.fake_quant import ACT_QMAX, ACT_ZERO_POINT, EPS, fake_quantize_rows
from ..transforms.gptq import BLOCK, DAMP, gptq_quantize, output_error

__all__ = ["ACT_QMAX", "ACT_ZERO_POINT", "EPS", "fake_quantize_rows", "quantize_per_token", "weight_scales"]


def weight_scales(weight: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel INT8 weights: (W_q int8 [K, N], s_w float32 [N])."""
    weight = np.asarray(weight, dtype=np.float32)
    amax = np.abs(weight).max(axis=0)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    q = np.clip(np.rint(weight / scale), -qmax, qmax).astype(np.int8)
    return q, scale


def quantize_per_token(src: Path, dst: Path, nodes: list[str], *, reduce_range: bool, fused: bool = False,
                       hessians: dict[str, np.ndarray] | None = None,
                       calibrated_scales: dict[str, float] | None = None) -> dict:
    """Rewrite the MatMuls named in ``nodes`` of the model at ``src`` into per-token INT8; save to
    ``dst``. Returns what was done (for ``recipes[].settings``). ``fused``: ONNX Runtime's
    ``com.microsoft.MatMulIntegerToFloat`` instead of ``MatMulInteger`` + Cast + two Muls (same
    arithmetic; runs on ONNX Runtime only). ``hessians``: activation tensor -> ``X^T X`` of the
    calibration windows; the weights that read one get GPTQ codes (``quantize.gptq``) instead of
    round-to-nearest, on the same grid. ``calibrated_scales``: activation tensor -> one scale for
    the whole tensor (calibrated offline); those inputs are quantized with it, same zero point
    and code range, instead of per row, so the integer GEMM rescales by scalars inside the kernel."""
    model = onnx.load(str(src))
    graph = model.graph
    opset = _default_opset(model)
    qmax = 63 if reduce_range else 127

    def reduce(op: str, x: str, out: str, name: str) -> onnx.NodeProto:
        # ReduceMax/ReduceMin take their axes as an input from opset 18, as an attribute before.
        if opset >= 18:
            return helper.make_node(op, [x, "pertoken_axes"], [out], name=name, keepdims=1)
        return helper.make_node(op, [x], [out], name=name, axes=[-1], keepdims=1)

    initializers = {init.name: init for init in graph.initializer}
    wanted = set(nodes)
    shared = _shared_constants(graph)
    new_nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = [shared["eps"], shared["qmax"], shared["zp_u8"], shared["axes"],
                                         shared["flat"]]
    calibrated = calibrated_scales or {}
    replaced: list[str] = []
    error_ratios: list[float] = []   # GPTQ: its X-weighted weight error / round-to-nearest's, per MatMul
    row_shapes: dict[str, onnx.TensorProto] = {}   # [-1, K] per input width K: the rows QuantizeLinear reads
    quantized_inputs: dict[str, tuple[str, str]] = {}  # activation -> (its uint8 tensor, its row scales)
    for node in graph.node:
        if not (node.op_type == "MatMul" and node.name in wanted and node.input[1] in initializers):
            new_nodes.append(node)
            continue
        x, w_name = node.input[0], node.input[1]
        weight = numpy_helper.to_array(initializers[w_name])
        if weight.ndim != 2:
            new_nodes.append(node)
            continue
        p = node.name or f"matmul_{len(replaced)}"
        if hessians is not None and x in hessians:
            w_q, s_w = gptq_quantize(weight, hessians[x], qmax)
            nearest = weight_scales(weight, qmax)
            error_ratios.append(output_error(weight, w_q, s_w, hessians[x]) /
                                max(output_error(weight, *nearest, hessians[x]), 1e-30))
        else:
            w_q, s_w = weight_scales(weight, qmax)
        new_inits += [numpy_helper.from_array(w_q, f"{p}/pertoken/W_quantized"),
                      numpy_helper.from_array(s_w, f"{p}/pertoken/W_scale")]
        t = f"{p}/pertoken/"
        if x not in quantized_inputs and x in calibrated:
            # One scale for every row: QuantizeLinear alone, no |x|, row max or reshapes.
            quantized_inputs[x] = (t + "x_quantized", t + "x_scale")
            new_inits.append(numpy_helper.from_array(np.asarray(calibrated[x], dtype=np.float32), t + "x_scale"))
            new_nodes.append(helper.make_node("QuantizeLinear", [x, t + "x_scale", "pertoken_zp_u8"],
                                              [t + "x_quantized"], name=t + "QuantizeLinear"))
        if x not in quantized_inputs:
            # One quantization per activation: q/k/v (and gate/up) read the same normed tensor.
            quantized_inputs[x] = (t + "x_quantized", t + "x_scale")
            if f"pertoken_rows_{weight.shape[0]}" not in row_shapes:
                row_shapes[f"pertoken_rows_{weight.shape[0]}"] = numpy_helper.from_array(
                    np.asarray([-1, weight.shape[0]], dtype=np.int64), f"pertoken_rows_{weight.shape[0]}")
            new_nodes += [
                # max |x| per row as max(max x, -min x): two reads of x and no |x| written out
                # (the same value, 2x faster than Abs + ReduceMax on [8, 128, 1536], measured).
                reduce("ReduceMax", x, t + "row_max", t + "ReduceMax"),
                reduce("ReduceMin", x, t + "row_min", t + "ReduceMin"),
                helper.make_node("Neg", [t + "row_min"], [t + "row_min_neg"], name=t + "Neg"),
                helper.make_node("Max", [t + "row_max", t + "row_min_neg", "pertoken_eps"], [t + "amax_safe"],
                                 name=t + "Max"),
                helper.make_node("Div", [t + "amax_safe", "pertoken_qmax"], [t + "x_scale"], name=t + "ScaleDiv"),
                # QuantizeLinear with a per-axis scale does Div, Round (half to even), +128, the
                # saturating clip and the cast in one pass; its scale must be 1-D along one axis,
                # so the rows are flattened to [tokens, K] and back. Same codes as the five-op
                # chain (test), 2-4x faster on SmolLM2's widths (576, 1536).
                helper.make_node("Shape", [x], [t + "x_shape"], name=t + "Shape"),
                helper.make_node("Reshape", [x, f"pertoken_rows_{weight.shape[0]}"], [t + "x_rows"], name=t + "Rows"),
                helper.make_node("Reshape", [t + "x_scale", "pertoken_flat"], [t + "x_scale_rows"],
                                 name=t + "ScaleRows"),
                helper.make_node("Shape", [t + "x_scale_rows"], [t + "n_rows"], name=t + "RowCount"),
                helper.make_node("Expand", ["pertoken_zp_u8", t + "n_rows"], [t + "zp_rows"], name=t + "ZeroPoints"),
                helper.make_node("QuantizeLinear", [t + "x_rows", t + "x_scale_rows", t + "zp_rows"],
                                 [t + "x_quantized_rows"], name=t + "QuantizeLinear", axis=0),
                helper.make_node("Reshape", [t + "x_quantized_rows", t + "x_shape"], [t + "x_quantized"],
                                 name=t + "Unrows"),
            ]
        x_q, x_scale = quantized_inputs[x]
        if fused:
            # ORT's contrib op rescales inside the GEMM (a_scale [..., M, 1] broadcasts per row):
            # one pass over the output instead of three (measured 1.45x faster on a 262k-wide head).
            new_nodes.append(helper.make_node(
                "MatMulIntegerToFloat", [x_q, f"{p}/pertoken/W_quantized", x_scale, f"{p}/pertoken/W_scale",
                                         "pertoken_zp_u8"], [node.output[0]], name=t + "MatMulIntegerToFloat",
                domain="com.microsoft"))
            replaced.append(node.name)
            continue
        new_nodes += [
            helper.make_node("MatMulInteger", [x_q, f"{p}/pertoken/W_quantized", "pertoken_zp_u8"],
                             [t + "y_int32"], name=t + "MatMulInteger"),
            helper.make_node("Cast", [t + "y_int32"], [t + "y_float"], name=t + "CastFloat", to=TensorProto.FLOAT),
            helper.make_node("Mul", [t + "y_float", x_scale], [t + "y_rows"], name=t + "MulRows"),
            helper.make_node("Mul", [t + "y_rows", f"{p}/pertoken/W_scale"], [node.output[0]], name=t + "MulCols"),
        ]
        replaced.append(node.name)
    # FP32 weights that no node reads any more are dropped (the INT8 copy replaces them).
    still_read = {i for n in new_nodes for i in n.input}
    kept = [init for init in graph.initializer if init.name in still_read]
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits + list(row_shapes.values()))
    if opset < 18:  # the axes initializer is read by no node
        kept_inits = [i for i in graph.initializer if i.name != "pertoken_axes"]
        del graph.initializer[:]
        graph.initializer.extend(kept_inits)
    if fused and not any(imp.domain == "com.microsoft" for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.checker.check_model(model)
    onnx.save(model, str(dst))
    gptq = {} if not error_ratios else {"gptq": {
        "matmuls": len(error_ratios), "damp": DAMP, "block": BLOCK,
        "output_error_vs_nearest_median": float(np.median(error_ratios)),
        "output_error_vs_nearest_max": float(np.max(error_ratios)),
        "rule": "trace(dW^T H dW) with H = X^T X of the calibration activations, GPTQ over round-to-nearest"}}
    calibrated_inputs = sorted(x for x in calibrated if x in quantized_inputs)
    per_tensor = {} if not calibrated_inputs else {"calibrated_scale_inputs": calibrated_inputs}
    return {**gptq, **per_tensor, "pertoken_matmuls": replaced, "weight_qmax": qmax, "activation_zero_point": ACT_ZERO_POINT,
            "activation_scale": "per row: max|x| / 127 (computed at run time)",
            "kernel": ("com.microsoft.MatMulIntegerToFloat (u8 x s8, rescaled in the kernel; ONNX Runtime only)"
                       if fused else "MatMulInteger (u8 activations x s8 weights, int32 accumulate) + float rescale "
                                     "(standard ONNX ops: any runtime)")}


def _shared_constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    def f(name, value):
        return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)

    def i64(name, value):
        return numpy_helper.from_array(np.asarray(value, dtype=np.int64), name)

    return {"eps": f("pertoken_eps", EPS), "qmax": f("pertoken_qmax", ACT_QMAX),
            "zp_u8": numpy_helper.from_array(np.asarray(ACT_ZERO_POINT, dtype=np.uint8), "pertoken_zp_u8"),
            "axes": i64("pertoken_axes", [-1]), "flat": i64("pertoken_flat", [-1])}


def _default_opset(model: onnx.ModelProto) -> int:
    """The default domain's opset; per-token INT8 needs 13 or later (Clip with min/max inputs,
    per-axis MatMulInteger scales broadcast as written)."""
    version = next((imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")), 0)
    if version < 13:
        raise ValueError(f"per-token INT8 needs opset >= 13, the model has {version}")
    return version
