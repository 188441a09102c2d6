"""Signed 8-bit weight codes stored as unsigned ones, for a CPU without VNNI: the same integers.

ONNX Runtime's x64 kernels for u8 activations x s8 weights multiply with ``vpmaddubsw``, which
adds each pair of products in int16 and saturates on a CPU without VNNI (PITFALLS.md 2); VNNI's
``vpdpbusd`` adds them in int32. A model quantized on a VNNI CPU with all 8 bits of its weights
(the per-token recipes, and the ONNX Runtime quantizer's where ``reduce_range`` resolved off)
therefore computes other numbers on an AVX2-only CPU: SmolLM2's per-token graph KL 0.0032 ->
0.0397, Gemma 3's 0.0019 -> 0.0172 under a Haswell emulation (reports/vs-llamacpp/*/kernel_parity.txt).

Stored as ``code + 128`` with the zero point moved by 128 too, the weights select the u8 x u8
kernel, which widens to 16 bits before it multiplies and is exact on every CPU. ``(x - zx)(w - zw)``
is unchanged, so the rewritten model computes, on any CPU, the integers the signed one computes
on a VNNI CPU. Only weights read by an integer product whose activations are uint8 are rewritten
(s8 x s8 products and weight-only blocks run other kernels), and only where a code is past +-64
(7-bit codes, ``reduce_range``, cannot saturate: they keep the faster u8 x s8 kernel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .onnx_wire import onnx_nodes, raw_initializers

if TYPE_CHECKING:
    import onnx

# onnx.TensorProto's data types, without importing onnx (~1 s: measure.sessions imports this
# module, and the gate imports measure.sessions without onnx)
_UINT8, _INT8 = 2, 3

__all__ = ["SIGNED_WEIGHT_OPS", "WeightSlot", "has_signed_weight_ops", "signed_weight_slots", "to_unsigned",
           "unsigned_codes"]

ZERO_POINT_SHIFT = 128

# op type -> (weight input, its scale's input or None, its zero point's input); the activations'
# type is read per node. A zero point added where there was none takes the scale's shape.
_INTEGER_PRODUCTS = {
    "MatMulInteger": (1, None, 3),          # A, B, a_zero_point, b_zero_point
    "MatMulIntegerToFloat": (1, 3, 5),      # com.microsoft: A, B, a_scale, b_scale, a_zero_point, b_zero_point
    "DynamicQuantizeMatMul": (1, 2, 3),     # com.microsoft: A float (quantized to u8 inside), B, b_scale, b_zero_point
    "QLinearMatMul": (3, 4, 5),             # a, a_scale, a_zero_point, b, b_scale, b_zero_point
}
SIGNED_WEIGHT_OPS = frozenset({*_INTEGER_PRODUCTS, "DequantizeLinear"})


def unsigned_codes(codes: np.ndarray) -> np.ndarray:
    """int8 weight codes as the u8 x u8 kernel reads them: ``code + 128``."""
    return (codes.astype(np.int16) + ZERO_POINT_SHIFT).astype(np.uint8)


@dataclass(frozen=True)
class WeightSlot:
    """One node input that reads int8 weight codes against uint8 activations."""
    node: int          # index in graph.node
    weight: int         # the input index of the codes
    scale: int | None   # the input index of their scale (None: the op has none)
    zero_point: int     # the input index of their zero point (may be absent: 0)


# Codes within +-64 cannot saturate: 2 * 255 * 64 = 32,640 fits int16 (ONNX Runtime's quantizer
# keeps 7-bit weights without VNNI for this reason: reduce_range).
SAFE_CODE = 64


def _codes_past_safe(codes: np.ndarray) -> bool:
    return codes.size > 0 and (int(codes.min()) < -SAFE_CODE or int(codes.max()) > SAFE_CODE)


def has_signed_weight_ops(path: str | os.PathLike) -> bool:
    """Whether a node of the file that may multiply uint8 activations reads int8 weight codes past
    +-64: the nodes and the codes read from the file as it lies (no weight is parsed or copied),
    so a session of a file that needs no rewrite never loads it twice. Codes in a typed field
    instead of raw bytes are not read (every writer here stores raw bytes)."""
    weight_inputs = {inputs[_INTEGER_PRODUCTS[op][0] if op in _INTEGER_PRODUCTS else 0]
                     for op, inputs, _ in onnx_nodes(path) if op in SIGNED_WEIGHT_OPS}
    with raw_initializers(path) as found:
        return any(data_type == _INT8 and _codes_past_safe(np.frombuffer(view, np.int8))
                   for name, (_, data_type, view) in found.items() if name in weight_inputs)


def _8bit_tensors(graph: onnx.GraphProto) -> tuple[dict[str, int], dict[str, int]]:
    """(initializer name -> data type, tensor name -> data type of the initializers, graph inputs
    and the 8-bit tensors the graph's nodes make): what an integer product's activations are."""
    inits = {i.name: i.data_type for i in graph.initializer}
    made = {**inits, **{i.name: i.type.tensor_type.elem_type for i in graph.input if i.type.HasField("tensor_type")}}
    for node in graph.node:
        if node.op_type == "DynamicQuantizeLinear":
            made[node.output[0]] = _UINT8
        elif node.op_type == "QuantizeLinear":
            zp = node.input[2] if len(node.input) > 2 and node.input[2] else None
            made[node.output[0]] = inits.get(zp, _UINT8) if zp else _UINT8
        elif node.op_type in ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten") and node.input[0] in made:
            made[node.output[0]] = made[node.input[0]]
    return inits, made


def _uint8_activations(node: onnx.NodeProto, inits: dict[str, int], made: dict[str, int]) -> bool:
    if node.op_type == "DynamicQuantizeMatMul":
        return True
    if node.op_type == "QLinearMatMul":
        return inits.get(node.input[2]) == _UINT8
    if node.op_type in ("MatMulInteger", "MatMulIntegerToFloat"):
        return made.get(node.input[0]) == _UINT8
    return False


def _at_risk(init: onnx.TensorProto) -> bool:
    from onnx import numpy_helper

    return _codes_past_safe(numpy_helper.to_array(init))


def signed_weight_slots(model: onnx.ModelProto) -> list[WeightSlot]:
    """The inputs that read int8 weight initializers against uint8 activations, with codes past
    +-64 (where a pair of products can pass int16): an integer product's weights, or a
    DequantizeLinear's codes where the MatMul or Gemm it feeds (as B) multiplies a tensor
    dequantized from uint8 (the Q/DQ pair ONNX Runtime fuses into u8 x s8)."""
    graph = model.graph
    protos = {i.name: i for i in graph.initializer}
    inits, made = _8bit_tensors(graph)
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, k))
    slots = []
    for index, node in enumerate(graph.node):
        if node.op_type in _INTEGER_PRODUCTS:
            weight, scale, zero_point = _INTEGER_PRODUCTS[node.op_type]
            if inits.get(node.input[weight]) == _INT8 and _uint8_activations(node, inits, made) and \
                    _at_risk(protos[node.input[weight]]):
                slots.append(WeightSlot(index, weight, scale, zero_point))
        elif node.op_type == "DequantizeLinear" and inits.get(node.input[0]) == _INT8 and _at_risk(protos[node.input[0]]):
            for user, k in consumers.get(node.output[0], []):
                if user.op_type not in ("MatMul", "Gemm") or k != 1:
                    continue
                other = producers.get(user.input[0])
                if other is not None and other.op_type == "DequantizeLinear" and \
                        made.get(other.input[0]) == _UINT8:
                    slots.append(WeightSlot(index, 0, 1, 2))
                    break
    return slots


def to_unsigned(model: onnx.ModelProto) -> int:
    """Rewrite ``model`` in place: each slot's codes as uint8 ``code + 128`` and its zero point
    moved by 128 (a new one of 128 where it had none). An initializer also read elsewhere is
    copied rather than changed. Returns how many slots were rewritten."""
    from onnx import numpy_helper

    graph = model.graph
    slots = signed_weight_slots(model)
    if not slots:
        return 0
    inits = {i.name: i for i in graph.initializer}
    slot_reads = {(s.node, s.weight) for s in slots} | {(s.node, s.zero_point) for s in slots}
    readers: dict[str, int] = {}
    for n, node in enumerate(graph.node):
        for k, name in enumerate(node.input):
            if name and (n, k) not in slot_reads:
                readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    done: dict[str, str] = {}
    added: list[onnx.TensorProto] = []

    def shifted(name: str, values: np.ndarray) -> str:
        if name in done:
            return done[name]
        new = numpy_helper.from_array(unsigned_codes(values), name)
        if readers.get(name) or name in outputs:   # read as int8 elsewhere too: a copy
            new.name = f"{name}_u8"
            added.append(new)
        else:
            inits[name].CopyFrom(new)
        done[name] = new.name
        return new.name

    for slot in slots:
        node = graph.node[slot.node]
        codes_name = node.input[slot.weight]
        scale_name = node.input[slot.scale] if slot.scale is not None else None
        node.input[slot.weight] = shifted(codes_name, numpy_helper.to_array(inits[codes_name]))
        while len(node.input) <= slot.zero_point:
            node.input.append("")
        zp_name = node.input[slot.zero_point]
        if zp_name:
            node.input[slot.zero_point] = shifted(zp_name, numpy_helper.to_array(inits[zp_name]))
        else:   # absent: 0, of the scale's shape (per tensor or per output column / axis)
            shape = numpy_helper.to_array(inits[scale_name]).shape if scale_name in inits else ()
            name = f"{codes_name}_zero_point_u8"
            if name not in done:
                added.append(numpy_helper.from_array(np.full(shape, ZERO_POINT_SHIFT, np.uint8), name))
                done[name] = name
            node.input[slot.zero_point] = name
    graph.initializer.extend(added)
    return len(slots)
