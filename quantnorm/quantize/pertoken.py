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

Where the graph's opset allows it (21 and later; an opset-18 to 20 graph is raised to 21, which
changes no operator these graphs hold), ``QuantizeLinear`` reads the row scales [..., 1] as
written, one block the width of a row (blocked quantization); an older graph flattens the rows to
[tokens, K] for the per-axis form and back. Same codes either way (test); the blocked form is six
to eight operators per quantized input where the flattened one is twelve: a 128-token prompt of
SmolLM2's per-token recipe took 4% less time with it (interleaved A/B on an AMX Xeon, 62.5 against
59.9 ms; ``benchmarks/prompt_floor.py`` times both layouts alone).

The activation zero point is one scalar (128), so the u8 x s8 ``MatMulInteger`` kernel runs:
ORT's CPU ``MatMulInteger`` refuses a per-row zero point, and s8 x s8 is 3.3x slower than FP32
there, while u8 x s8 runs at about 0.35x (PITFALLS.md 14). Symmetric rows around 128 use 255 of
the 256 codes.

Without VNNI, ORT's u8 x s8 kernel sums pairs of products in int16 and saturates (PITFALLS.md 2;
measured under a Haswell emulation: a worst-case row gives 8,160 for 1,032,256). Two ways out:
``q_max`` 63 (7-bit weights, ``reduce_range``: what ONNX Runtime's own quantizer does, and it
costs accuracy), or ``unsigned_weights``: the same 8-bit codes stored as ``code + 128`` (uint8)
with a zero point of 128 per column, which selects the u8 x u8 kernel; that one widens to 16 bits
before it multiplies and is exact on every CPU (same emulation: 1,032,256), so the model computes
the same integers as the u8 x s8 model does on a VNNI CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..measure.fake_quant import ACT_QMAX, ACT_ZERO_POINT, EPS, fake_quantize_rows
from ..measure.sqnr import model_by_reference
from ..onnx_wire import TensorPlace, initializer_places, write_model_streaming
from ..transforms.gptq import BLOCK, DAMP, GPTQCodes, gptq_quantize, output_error
from ..unsigned_weights import unsigned_codes

__all__ = ["ACT_QMAX", "ACT_ZERO_POINT", "EPS", "fake_quantize_rows", "quantize_per_token", "unsigned_codes",
           "weight_qmax", "weight_scales"]


def weight_scales(weight: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel INT8 weights: (W_q int8 [K, N], s_w float32 [N])."""
    weight = np.asarray(weight, dtype=np.float32)
    # A few columns at a time: the float temporaries of a 262k-wide head (670 MB each, three of
    # them at once when written whole) never exist whole.
    step = max(1, _CHUNK_ELEMENTS // max(1, weight.shape[0]))
    columns = [slice(c, c + step) for c in range(0, weight.shape[1], step)]
    amax = np.concatenate([np.abs(weight[:, cols]).max(axis=0) for cols in columns]) if weight.shape[0] else \
        np.zeros(weight.shape[1], np.float32)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    codes = np.empty(weight.shape, dtype=np.int8)
    for cols in columns:
        block = weight[:, cols] / scale[cols]
        np.rint(block, out=block)
        np.clip(block, -qmax, qmax, out=block)
        codes[:, cols] = block
    return codes, scale


_CHUNK_ELEMENTS = 1 << 22   # float32 temporaries of 16 MB


def weight_qmax(reduce_range: bool) -> int:
    """The weights' code range: 7 bits where u8 x s8 pairs summed in int16 would saturate (no VNNI)."""
    return 63 if reduce_range else 127


def quantize_per_token(src: Path, dst: Path, nodes: list[str], *, reduce_range: bool, fused: bool = False,
                       unsigned_weights: bool = False, hessians: Mapping[str, np.ndarray] | None = None,
                       calibrated_scales: dict[str, float] | None = None,
                       gptq_codes: GPTQCodes | None = None, calib_digest: str | None = None) -> dict:
    """Rewrite the MatMuls named in ``nodes`` of the model at ``src`` into per-token INT8; save to
    ``dst``. Returns what was done (for ``recipes[].settings``). ``fused``: ONNX Runtime's
    ``com.microsoft.MatMulIntegerToFloat`` instead of ``MatMulInteger`` + Cast + two Muls (same
    arithmetic; runs on ONNX Runtime only). ``unsigned_weights``: the 8-bit weight codes stored as
    ``code + 128`` with a zero point of 128 (the u8 x u8 kernel: exact without VNNI; see the module
    doc; not with ``reduce_range``). ``hessians``: activation tensor -> ``X^T X`` of the
    calibration windows; the weights that read one get GPTQ codes (``quantize.gptq``) instead of
    round-to-nearest, on the same grid. ``calibrated_scales``: activation tensor -> one scale for
    the whole tensor (calibrated offline); those inputs are quantized with it, same zero point
    and code range, instead of per row, so the integer GEMM rescales by scalars inside the kernel.
    ``gptq_codes`` with ``calib_digest`` (the calibration windows'): GPTQ codes this run already
    solved for the same weight on the same windows are read there, new ones kept there."""
    if unsigned_weights and reduce_range:
        raise ValueError("unsigned weights keep all 8 bits: reduce_range does not apply to them")
    # The graph with its weights referenced in ``src``, and each weight read from the file when
    # its MatMul is rewritten: loading the model whole held every FP32 weight for the whole
    # rewrite (1.7 GB on Gemma 3's rotated graph) beside the new INT8 codes.
    src = Path(src)
    model = model_by_reference(src)
    places = initializer_places(src)
    opset = _default_opset(model)
    if BLOCKED_FROM_OPSET > opset >= RAISABLE_FROM_OPSET and not model.functions:
        _set_default_opset(model, BLOCKED_FROM_OPSET)
        opset = BLOCKED_FROM_OPSET
    rewrite = _Rewrite(opset=opset, qmax=weight_qmax(reduce_range), fused=fused, row_dims=_row_dims(model),
                       unsigned=unsigned_weights,
                       hessians=hessians, calibrated=calibrated_scales or {},
                       new_inits=list(_shared_constants(model.graph).values()),
                       codes=gptq_codes if calib_digest is not None else None, calib_digest=calib_digest)
    initializers = {init.name: init for init in model.graph.initializer}
    wanted = set(nodes)
    for node in model.graph.node:
        if not (node.op_type == "MatMul" and node.name in wanted and node.input[1] in initializers):
            rewrite.new_nodes.append(node)
            continue
        weight = _read_weight(initializers[node.input[1]], places)
        if weight.ndim != 2:
            rewrite.new_nodes.append(node)
            continue
        rewrite.matmul(node, weight)
    weight = None   # the last FP32 weight read, let go before the save
    initializers = None
    rewrite.install(model)
    rewrite.new_nodes.clear()   # the graph holds its own copies now
    # the new weights go to the file from the rewrite's list: copied into the graph first, they
    # would be held twice
    write_model_streaming(model, dst, extra_initializers=rewrite.new_initializers(),
                          external_from=src.parent)
    del model
    rewrite.new_inits.clear()
    onnx.checker.check_model(str(dst))   # from the file: an in-memory check serializes the model once more
    return rewrite.settings()


def _read_weight(init: onnx.TensorProto, places: Mapping[str, TensorPlace]) -> np.ndarray:
    """An initializer's values: read from where its bytes lie in the file (``places``) where they
    are raw bytes of a numpy type, else from the tensor itself (small or typed-field tensors)."""
    place = places.get(init.name)
    if place is None or init.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(init)
    dtype = helper.tensor_dtype_to_np_dtype(place.data_type)
    count = int(np.prod(place.dims, dtype=np.int64))
    if count * dtype.itemsize != place.end - place.start:
        raise ValueError(f"initializer {init.name}: {place.end - place.start} bytes for {place.dims} {dtype}")
    return np.fromfile(place.file, dtype=dtype, count=count, offset=place.start).reshape(place.dims)


@dataclass
class _Rewrite:
    """The per-token rewrite of one graph, built node by node: the nodes and initializers that
    replace the graph's, and what was done (for the recipe's settings)."""

    opset: int
    qmax: int
    fused: bool
    row_dims: Mapping[str, tuple | None]   # tensor -> its leading dims as the graph states them
    unsigned: bool
    hessians: Mapping[str, np.ndarray] | None
    calibrated: dict[str, float]
    new_inits: list[onnx.TensorProto]
    codes: GPTQCodes | None = None
    calib_digest: str | None = None
    reused: int = 0   # GPTQ codes read from ``codes`` instead of solved
    new_nodes: list[onnx.NodeProto] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    error_ratios: list[float] = field(default_factory=list)   # GPTQ: its X-weighted weight error / nearest's
    row_shapes: dict[str, onnx.TensorProto] = field(default_factory=dict)   # [-1, K] per input width K
    weight_zero_points: dict[str, onnx.TensorProto] = field(default_factory=dict)   # [N] of 128 per width N
    quantized_inputs: dict[str, tuple[str, str]] = field(default_factory=dict)  # x -> (uint8, row scales)
    row_zero_points: dict[tuple, str] = field(default_factory=dict)   # leading dims -> the zero points [..., 1]

    def matmul(self, node: onnx.NodeProto, weight: np.ndarray) -> None:
        """Replace one MatMul ``x @ weight``: INT8 weights, the quantized input (once per
        activation), then the integer GEMM and its rescale."""
        x = node.input[0]
        p = node.name or f"matmul_{len(self.replaced)}"
        t = f"{p}/pertoken/"
        w_q, s_w = self._weight_codes(x, weight)
        if self.unsigned:
            w_q = unsigned_codes(w_q)
            zero_points = f"pertoken_weight_zp_{w_q.shape[1]}"
            if zero_points not in self.weight_zero_points:
                self.weight_zero_points[zero_points] = numpy_helper.from_array(
                    np.full(w_q.shape[1], ACT_ZERO_POINT, dtype=np.uint8), zero_points)
        self.new_inits += [numpy_helper.from_array(w_q, t + "W_quantized"),
                           numpy_helper.from_array(s_w, t + "W_scale")]
        if x not in self.quantized_inputs and x in self.calibrated:
            self._quantize_calibrated(x, t)
        if x not in self.quantized_inputs:
            # One quantization per activation: q/k/v (and gate/up) read the same normed tensor.
            self._quantize_rows(x, t, weight.shape[0])
        self.new_nodes += self._gemm(t, *self.quantized_inputs[x], node.output[0], weight.shape[1])
        self.replaced.append(node.name)

    def _weight_codes(self, x: str, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.hessians is None or x not in self.hessians:
            return weight_scales(weight, self.qmax)
        key = GPTQCodes.key(weight, self.qmax, self.calib_digest) if self.codes is not None else None
        known = self.codes.get(key) if key is not None else None
        if known is not None:
            w_q, s_w, ratio = known
            self.reused += 1
        else:
            w_q, s_w = gptq_quantize(weight, self.hessians[x], self.qmax)
            nearest = weight_scales(weight, self.qmax)
            ratio = output_error(weight, w_q, s_w, self.hessians[x]) / \
                max(output_error(weight, *nearest, self.hessians[x]), 1e-30)
            if key is not None:
                self.codes.put(key, w_q, s_w, ratio)
        self.error_ratios.append(ratio)
        return w_q, s_w

    def _quantize_calibrated(self, x: str, t: str) -> None:
        # One scale for every row: QuantizeLinear alone, no |x|, row max or reshapes.
        self.quantized_inputs[x] = (t + "x_quantized", t + "x_scale")
        self.new_inits.append(numpy_helper.from_array(np.asarray(self.calibrated[x], dtype=np.float32),
                                                      t + "x_scale"))
        self.new_nodes.append(helper.make_node("QuantizeLinear", [x, t + "x_scale", "pertoken_zp_u8"],
                                               [t + "x_quantized"], name=t + "QuantizeLinear"))

    def _reduce(self, op: str, x: str, out: str, name: str) -> onnx.NodeProto:
        # ReduceMax/ReduceMin take their axes as an input from opset 18, as an attribute before.
        if self.opset >= 18:
            return helper.make_node(op, [x, "pertoken_axes"], [out], name=name, keepdims=1)
        return helper.make_node(op, [x], [out], name=name, axes=[-1], keepdims=1)

    @property
    def blocked(self) -> bool:
        """Whether ``QuantizeLinear`` takes the row scales as they are (blocked quantization)."""
        return self.opset >= BLOCKED_FROM_OPSET

    def _quantize_rows(self, x: str, t: str, width: int) -> None:
        self.quantized_inputs[x] = (t + "x_quantized", t + "x_scale")
        self.new_nodes += [
            # max |x| per row as max(max x, -min x): two reads of x and no |x| written out
            # (the same value, 2x faster than Abs + ReduceMax on [8, 128, 1536], measured).
            self._reduce("ReduceMax", x, t + "row_max", t + "ReduceMax"),
            self._reduce("ReduceMin", x, t + "row_min", t + "ReduceMin"),
            helper.make_node("Neg", [t + "row_min"], [t + "row_min_neg"], name=t + "Neg"),
            helper.make_node("Max", [t + "row_max", t + "row_min_neg", "pertoken_eps"], [t + "amax_safe"],
                             name=t + "Max"),
            helper.make_node("Div", [t + "amax_safe", "pertoken_qmax"], [t + "x_scale"], name=t + "ScaleDiv"),
        ]
        if self.blocked:
            # one block per row: the scale [..., 1] as it is, and a zero point of its shape (made
            # once for all the inputs whose leading dims the graph states are the same)
            self.new_nodes.append(helper.make_node(
                "QuantizeLinear", [x, t + "x_scale", self._row_zero_points(x, t)], [t + "x_quantized"],
                name=t + "QuantizeLinear", axis=-1, block_size=width))
            return
        rows = f"pertoken_rows_{width}"
        if rows not in self.row_shapes:
            self.row_shapes[rows] = numpy_helper.from_array(np.asarray([-1, width], dtype=np.int64), rows)
        self.new_nodes += [
            # QuantizeLinear with a per-axis scale does Div, Round (half to even), +128, the
            # saturating clip and the cast in one pass; its scale must be 1-D along one axis,
            # so the rows are flattened to [tokens, K] and back. Same codes as the five-op
            # chain (test), 2-4x faster on SmolLM2's widths (576, 1536).
            helper.make_node("Shape", [x], [t + "x_shape"], name=t + "Shape"),
            helper.make_node("Reshape", [x, rows], [t + "x_rows"], name=t + "Rows"),
            helper.make_node("Reshape", [t + "x_scale", "pertoken_flat"], [t + "x_scale_rows"],
                             name=t + "ScaleRows"),
            helper.make_node("Shape", [t + "x_scale_rows"], [t + "n_rows"], name=t + "RowCount"),
            helper.make_node("Expand", ["pertoken_zp_u8", t + "n_rows"], [t + "zp_rows"], name=t + "ZeroPoints"),
            helper.make_node("QuantizeLinear", [t + "x_rows", t + "x_scale_rows", t + "zp_rows"],
                             [t + "x_quantized_rows"], name=t + "QuantizeLinear", axis=0),
            helper.make_node("Reshape", [t + "x_quantized_rows", t + "x_shape"], [t + "x_quantized"],
                             name=t + "Unrows"),
        ]

    def _row_zero_points(self, x: str, t: str) -> str:
        """The uint8 zero points [..., 1] (all 128) for ``x``'s row scales ``t + "x_scale"``: blocked
        quantization wants them the scale's shape. Inputs whose leading dims the graph states alike
        (``batch``, ``seq``) share one tensor; an input whose dims it does not state (the head's,
        after the logits' slice) gets its own."""
        dims = self.row_dims.get(x)
        if dims is not None and dims in self.row_zero_points:
            return self.row_zero_points[dims]
        name = f"pertoken_zp_rows_{len(self.row_zero_points)}" if dims is not None else t + "zp_rows"
        self.new_nodes += [
            helper.make_node("Shape", [t + "x_scale"], [name + "_shape"], name=name + "/Shape"),
            helper.make_node("Expand", ["pertoken_zp_u8", name + "_shape"], [name], name=name + "/Expand")]
        if dims is not None:
            self.row_zero_points[dims] = name
        return name

    def _gemm(self, t: str, x_q: str, x_scale: str, output: str, width: int) -> list[onnx.NodeProto]:
        weight_zp = [f"pertoken_weight_zp_{width}"] if self.unsigned else []
        if self.fused:
            # ORT's contrib op rescales inside the GEMM (a_scale [..., M, 1] broadcasts per row):
            # one pass over the output instead of three (measured 1.45x faster on a 262k-wide head).
            return [helper.make_node(
                "MatMulIntegerToFloat",
                [x_q, t + "W_quantized", x_scale, t + "W_scale", "pertoken_zp_u8", *weight_zp],
                [output], name=t + "MatMulIntegerToFloat", domain="com.microsoft")]
        return [
            helper.make_node("MatMulInteger", [x_q, t + "W_quantized", "pertoken_zp_u8", *weight_zp],
                             [t + "y_int32"], name=t + "MatMulInteger"),
            helper.make_node("Cast", [t + "y_int32"], [t + "y_float"], name=t + "CastFloat", to=TensorProto.FLOAT),
            helper.make_node("Mul", [t + "y_float", x_scale], [t + "y_rows"], name=t + "MulRows"),
            helper.make_node("Mul", [t + "y_rows", t + "W_scale"], [output], name=t + "MulCols"),
        ]

    def install(self, model: onnx.ModelProto) -> None:
        """Put the rewritten nodes into ``model``'s graph and drop the FP32 weights no node reads
        any more (their INT8 codes replace them); the new initializers stay in the rewrite
        (``new_initializers``), written beside the graph's own."""
        graph = model.graph
        still_read = {i for n in self.new_nodes for i in n.input}
        kept = [init for init in graph.initializer if init.name in still_read]
        del graph.node[:]
        graph.node.extend(self.new_nodes)
        del graph.initializer[:]
        graph.initializer.extend(kept)
        if self.fused and not any(imp.domain == "com.microsoft" for imp in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))

    def new_initializers(self) -> list[onnx.TensorProto]:
        """The initializers the rewrite adds: INT8 codes and scales, shared constants, row shapes."""
        extra = self.new_inits + list(self.row_shapes.values()) + list(self.weight_zero_points.values())
        if self.opset < 18:  # ReduceMax/ReduceMin take axes as an attribute there: nothing reads it
            extra = [i for i in extra if i.name != "pertoken_axes"]
        if self.blocked:   # the rows are never flattened
            extra = [i for i in extra if i.name != "pertoken_flat"]
        return extra

    def settings(self) -> dict:
        """What was done, for ``recipes[].settings``."""
        gptq = {} if not self.error_ratios else {"gptq": {
            "matmuls": len(self.error_ratios), "damp": DAMP, "block": BLOCK,
            "output_error_vs_nearest_median": float(np.median(self.error_ratios)),
            "output_error_vs_nearest_max": float(np.max(self.error_ratios)),
            **({"codes_reused": self.reused, "codes_reused_rule": "the codes this run solved for the same weight "
                "on the same calibration windows (its whole-window graph): the same X^T X, not solved again"}
               if self.reused else {}),
            "rule": "trace(dW^T H dW) with H = X^T X of the calibration activations, GPTQ over round-to-nearest"}}
        pair = "u8" if self.unsigned else "s8"
        calibrated_inputs = sorted(x for x in self.calibrated if x in self.quantized_inputs)
        per_tensor = {} if not calibrated_inputs else {"calibrated_scale_inputs": calibrated_inputs}
        rows = ("QuantizeLinear blocked (opset 21): one block per row, the scales [..., 1] as computed"
                if self.blocked else "QuantizeLinear per axis over the rows flattened to [tokens, K] (opset < 21)")
        return {**gptq, **per_tensor, "pertoken_matmuls": self.replaced, "weight_qmax": self.qmax,
                "activation_rows": rows,
                "weight_codes": ("uint8: the int8 code + 128, zero point 128 per column (the u8 x u8 kernel: "
                                 "exact without VNNI)" if self.unsigned else "int8, symmetric (the u8 x s8 kernel)"),
                "activation_zero_point": ACT_ZERO_POINT,
                "activation_scale": "per row: max|x| / 127 (computed at run time)",
                "kernel": (f"com.microsoft.MatMulIntegerToFloat (u8 x {pair}, rescaled in the kernel; ONNX Runtime only)"
                           if self.fused else f"MatMulInteger (u8 activations x {pair} weights, int32 accumulate) + "
                                              "float rescale (standard ONNX ops: any runtime)")}


def _shared_constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    def f(name, value):
        return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)

    def i64(name, value):
        return numpy_helper.from_array(np.asarray(value, dtype=np.int64), name)

    return {"eps": f("pertoken_eps", EPS), "qmax": f("pertoken_qmax", ACT_QMAX),
            "zp_u8": numpy_helper.from_array(np.asarray(ACT_ZERO_POINT, dtype=np.uint8), "pertoken_zp_u8"),
            "axes": i64("pertoken_axes", [-1]), "flat": i64("pertoken_flat", [-1])}


# Blocked QuantizeLinear (a scale per block along one axis, the scale's rank the input's) is
# opset 21's. Raising a graph from 18 (ReduceMax's axes an input, as the rewrite writes them) to
# 21 changes no operator's meaning: the operators revised in 19-21 gained types, or attributes
# whose defaults keep the old behaviour (Cast's saturate, Pad's wrap mode, Resize's antialias,
# AveragePool's dilations), but GroupNormalization, whose opset-18 form the ONNX checker already
# refuses as deprecated (so no graph the rewrite accepts holds it). Below 18 (the TorchScript
# exporter's 17) Reduce* and Split take other arguments: such a graph keeps its opset, and so does
# one with model-local functions (their own opset imports; quantnorm's exports have none).
BLOCKED_FROM_OPSET = 21
RAISABLE_FROM_OPSET = 18


def _set_default_opset(model: onnx.ModelProto, version: int) -> None:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = version


def _row_dims(model: onnx.ModelProto) -> dict[str, tuple | None]:
    """tensor -> its dims but the last, where the graph states every one (a number or a symbolic
    name); what ``_Rewrite`` shares row zero points by. ONNX's own shape inference fills in what
    the exporter left unstated, where it can (it knows no contrib operator's outputs)."""
    try:
        graph = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    except Exception:   # noqa: BLE001 - inference is a nicety here: the stated shapes still serve
        graph = model.graph
    dims: dict[str, tuple | None] = {}
    for info in [*graph.input, *graph.value_info]:
        shape = info.type.tensor_type.shape if info.type.HasField("tensor_type") else None
        if shape is None or not shape.dim:
            continue
        leading = tuple(d.dim_param or d.dim_value or None for d in shape.dim[:-1])
        dims[info.name] = leading if leading and None not in leading else None
    return dims


def _default_opset(model: onnx.ModelProto) -> int:
    """The default domain's opset; per-token INT8 needs 13 or later (Clip with min/max inputs,
    per-axis MatMulInteger scales broadcast as written)."""
    version = next((imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")), 0)
    if version < 13:
        raise ValueError(f"per-token INT8 needs opset >= 13, the model has {version}")
    return version
