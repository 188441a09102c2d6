"""A weight-only with-past graph's query, key and value projections as one ``MatMulNBits``.

The one rewrite of a *quantized* with-past graph (the generation stage runs it after each
weight-only recipe; the cache proof then checks the graph it wrote): the passes of
``graph_passes`` run on the FP32 graph, and packing the three projections there would change
what a recipe quantizes (node names, per-tensor weight scales), so it waits for their codes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..fileio import atomic_path
from ..onnx_wire import write_model_streaming
from .graph_passes import GQA, _drop_unused, _insert_before


def pack_qkv_projections(model: onnx.ModelProto) -> int:
    """Give each ``GroupQueryAttention`` node its query, key and value from one ``MatMulNBits``
    (the operator's packed-QKV input: [b, s, (H + 2 KV) * d], its key and value inputs left
    empty); returns how many layers were packed.

    Matched where the node's query, key and value each come from a ``MatMulNBits`` through
    nothing but ``Reshape``s read by nothing else (the exporter's [b, s, H, d] view and the fuse
    pass's way back to [b, s, H * d]), the three read the same input with the same K, bits, block
    size and accuracy level, and carry no zero points, group index or bias. Their packed weights
    and scales are concatenated along N, so every output column is the same column computed by
    the same kernel (the same codes and scales): exact, and a decode step runs one matrix product
    and no reshapes where it ran three and six. Why: at one token per step a small model's step
    is some 25 operators per layer, and the key and value products (N = KV * d, 192 on SmolLM2)
    are too narrow to keep both threads busy. Run on a quantized with-past graph (the weight-only
    recipes' ``MatMulNBits``); a graph without the pattern is left as it is."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    weights = {t.name: t for t in graph.initializer}
    packed = 0
    for gqa in [n for n in graph.node if n.op_type == GQA and n.domain == "com.microsoft"]:
        if len(gqa.input) < 3 or not all(gqa.input[:3]):
            continue
        sources = [_reshaped_from(name, producer, consumers) for name in gqa.input[:3]]
        if any(s is None for s in sources):
            continue
        matmuls = [s for s, _ in sources]
        settings = [{a.name: helper.get_attribute_value(a) for a in m.attribute} for m in matmuls]
        same = [{k: v for k, v in s.items() if k != "N"} for s in settings]
        if len({m.input[0] for m in matmuls}) != 1 or same.count(same[0]) != 3 \
                or any(len(m.input) != 3 or m.input[1] not in weights or m.input[2] not in weights for m in matmuls):
            continue
        name = f"{gqa.name}/qkv"
        codes = np.concatenate([numpy_helper.to_array(weights[m.input[1]]) for m in matmuls], axis=0)
        scales = np.concatenate([numpy_helper.to_array(weights[m.input[2]]) for m in matmuls], axis=0)
        graph.initializer.extend([numpy_helper.from_array(codes, f"{name}_packed_weights"),
                                  numpy_helper.from_array(scales, f"{name}_scales")])
        _insert_before(graph, gqa, [helper.make_node(
            "MatMulNBits", [matmuls[0].input[0], f"{name}_packed_weights", f"{name}_scales"], [name],
            name=f"{name}/MatMulNBits", domain="com.microsoft", **{**settings[0], "N": sum(s["N"] for s in settings)})])
        gqa.input[0], gqa.input[1], gqa.input[2] = name, "", ""
        packed += 1
    if packed:
        _drop_unused(graph)
    return packed


def pack_qkv_file(path: str | Path) -> int:
    """``pack_qkv_projections`` on the graph file at ``path``, rewritten in place (atomically)
    where it packed a layer; returns how many layers it packed."""
    model = onnx.load(str(path))
    packed = pack_qkv_projections(model)
    if packed:
        with atomic_path(path, ".onnx") as tmp:
            write_model_streaming(model, tmp)
    return packed


def _reshaped_from(name: str, producer, consumers) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """The ``MatMulNBits`` whose output ``name`` is, through ``Reshape``s only (each read by the
    next alone), and those reshapes; None otherwise."""
    chain = []
    node = producer.get(name)
    while node is not None and node.op_type == "Reshape" and len(consumers.get(node.input[0], [])) == 1:
        chain.append(node)
        node = producer.get(node.input[0])
    if node is None or node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or not chain:
        return None
    return node, chain
