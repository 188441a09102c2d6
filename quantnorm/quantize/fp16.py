"""FP16 variant of an FP32 ONNX model: every float32 tensor inside the graph becomes float16,
while the graph's inputs and outputs keep their float32 types (the caller's feeds and the
logits stay float32, so the accuracy code reads every variant the same way).

Our own small pass instead of ``onnxconverter_common.float16``: that would be one more
dependency (and one more wheel to carry to an offline GPU node) for about a hundred lines, and
this pass keeps what it converts visible.
What the pass does, in order:

- local functions are inlined first (the pass then sees every node);
- float32 initializers, ``Constant`` values, ``ConstantOfShape`` values and ``Cast(to=FLOAT)``
  become float16, also inside subgraphs (If/Loop bodies);
- a float32 graph input gets a ``Cast`` to float16 in front of its consumers, a float32 graph
  output is produced by a ``Cast`` back to float32;
- ``value_info`` types are switched to float16, so shape inference and ORT agree.

Values outside the float16 range are clipped to +-65504 when weights are converted (a weight
that large is a bug anyway); *activations* are not: a model whose activations pass 65504
(Gemma 3's massive activations, PITFALLS.md 15) produces inf, which the accuracy check reports.
Note that ORT's CPU provider computes many float16 ops in float32 (PITFALLS.md 13): an overflow
shows only on a GPU. Everything float becomes float16, the position arithmetic too: a
``Cast(to=FLOAT)`` of integer positions (rotary embeddings) turns into float16, exact up to 2048
and coarser past it; a tiny Llama exported by the dynamo exporter kept max |delta logit| 3.5e-4
at 64 tokens on the CPU provider.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, inliner, numpy_helper

from ..errors import QuantizeError
from ..fileio import atomic_path
from ..measure.fp16_check import FP16_MAX
from ..onnx_wire import write_model_streaming


def _to_fp16_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    values = numpy_helper.to_array(tensor).astype(np.float32)
    values = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16)
    out = numpy_helper.from_array(values, tensor.name)
    return out


def _convert_graph(graph: onnx.GraphProto) -> None:
    """Convert one graph's internals in place (inputs/outputs of a subgraph included: a subgraph's
    values flow from its parent, which is float16 now)."""
    for i, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            graph.initializer[i].CopyFrom(_to_fp16_tensor(init))
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type in ("Constant", "ConstantOfShape") and attr.name == "value" \
                    and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(_to_fp16_tensor(attr.t))
            elif node.op_type == "Constant" and attr.name == "value_float":
                # A scalar float attribute cannot hold float16: replace it by a float16 tensor.
                value = np.float16(np.clip(attr.f, -FP16_MAX, FP16_MAX))
                node.attribute.remove(attr)
                node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.array(value))))
                break
            elif node.op_type == "Constant" and attr.name == "value_floats":
                values = np.clip(np.array(attr.floats, dtype=np.float32), -FP16_MAX, FP16_MAX).astype(np.float16)
                node.attribute.remove(attr)
                node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(values)))
                break
            elif node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.FLOAT16
            elif attr.type == onnx.AttributeProto.GRAPH:
                _convert_graph(attr.g)
                _retype(attr.g.input)
                _retype(attr.g.output)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _convert_graph(sub)
                    _retype(sub.input)
                    _retype(sub.output)
    _retype(graph.value_info)


def _retype(values) -> None:
    for value in values:
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type == TensorProto.FLOAT:
            tensor_type.elem_type = TensorProto.FLOAT16


def to_fp16_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float16 copy of ``model`` with float32 graph inputs and outputs (see the module doc)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())  # never touch the caller's copy
    if model.functions:
        model = inliner.inline_local_functions(model)
    graph = model.graph
    _convert_graph(graph)

    taken = {name for node in graph.node for name in (*node.input, *node.output)}
    taken |= {i.name for i in graph.input} | {o.name for o in graph.output}

    def fresh(base: str) -> str:
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        return name

    head: list[onnx.NodeProto] = []
    for value in graph.input:
        if value.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        half = fresh(f"{value.name}_fp16")
        for node in graph.node:
            node.input[:] = [half if name == value.name else name for name in node.input]
        head.append(helper.make_node("Cast", [value.name], [half], name=fresh(f"cast_in/{value.name}"),
                                     to=TensorProto.FLOAT16))
    tail: list[onnx.NodeProto] = []
    for value in graph.output:
        # Outputs were retyped by nothing above (graph.output is not value_info): they stay float32.
        if value.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        half = fresh(f"{value.name}_fp16")
        for node in graph.node:
            node.output[:] = [half if name == value.name else name for name in node.output]
            node.input[:] = [half if name == value.name else name for name in node.input]
        tail.append(helper.make_node("Cast", [half], [value.name], name=fresh(f"cast_out/{value.name}"),
                                     to=TensorProto.FLOAT))
    nodes = head + list(graph.node) + tail
    del graph.node[:]
    graph.node.extend(nodes)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise QuantizeError(f"the float16 copy fails onnx.checker: {' '.join(str(exc).split())[:300]}") from exc
    return model


def convert_fp16(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write the float16 variant of the ONNX model at ``src`` to ``dst`` (atomically); return ``dst``."""
    src, dst = Path(src), Path(dst)
    try:
        model = onnx.load(str(src))
    except Exception as exc:
        raise QuantizeError(f"cannot read ONNX model {src}: {' '.join(str(exc).split())[:200]}") from exc
    half = to_fp16_model(model)
    with atomic_path(dst, suffix=".onnx") as tmp:
        write_model_streaming(half, tmp)
    return dst
