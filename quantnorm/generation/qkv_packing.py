"""A quantized with-past graph's query, key and value projections as one product.

A rewrite of a *quantized* with-past graph (the generation stage runs it after each weight-only
and per-token recipe; the cache proof then checks the graph it wrote): the passes of
``graph_passes`` run on the FP32 graph, and packing the three projections there would change
what a recipe quantizes (node names, per-tensor weight scales), so it waits for their codes.
A weight-only graph's other products that read one input become one and a ``Split`` here too
(``pack_shared_nbits``), and ``pack_products_file`` runs ``residual_norms``' fusion on the same
load of the file, so a 500 MB graph is read and written once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..fileio import atomic_path
from ..onnx_wire import write_model_streaming
from .graph_edit import _drop_unused, _insert_before, _producers_and_consumers, _replace_products, _use_microsoft_domain
from .graph_passes import GQA
from .residual_norms import fuse_residual_norms


def pack_qkv_projections(model: onnx.ModelProto) -> int:
    """Give each ``GroupQueryAttention`` node its query, key and value from one product (the
    operator's packed-QKV input: [b, s, (H + 2 KV) * d], its key and value inputs left empty);
    returns how many layers were packed.

    Matched where the node's query, key and value each come from a product of one kind through
    nothing but ``Reshape``s read by nothing else (the exporter's [b, s, H, d] view and the fuse
    pass's way back to [b, s, H * d]), and the three read the same input the same way:
    ``MatMulNBits`` (weight-only recipes) with the same K, bits, block size and accuracy level and
    no zero points, group index or bias; ``MatMulIntegerToFloat`` (per-token recipes) with the
    same quantized rows, row scales and zero point. Their weights, scales (and a per-token
    recipe's unsigned weights' zero points) are concatenated along N, so every output column is
    the same column computed by the same kernel from the same codes: exact, and a step runs one
    product and no reshapes where it ran three and six. Why: at one token per step a small
    model's step is some 25 operators per layer, and the key and value products (N = KV * d, 192
    on SmolLM2) are too narrow to keep both threads busy; a 128-token prompt of the per-token
    recipe on SmolLM2 ran 2-3% faster with them packed. A graph without the pattern is left as
    it is."""
    graph = model.graph
    producer, consumers = _producers_and_consumers(graph)
    weights = {t.name: t for t in graph.initializer}
    packed = 0
    for gqa in [n for n in graph.node if n.op_type == GQA and n.domain == "com.microsoft"]:
        if len(gqa.input) < 3 or not all(gqa.input[:3]):
            continue
        sources = [_reshaped_from(name, producer, consumers) for name in gqa.input[:3]]
        if any(s is None for s in sources):
            continue
        matmuls = [s for s, _ in sources]
        if len({m.op_type for m in matmuls}) != 1:
            continue
        pack = _PACKERS[matmuls[0].op_type]
        node = pack(matmuls, weights, f"{gqa.name}/qkv", graph)
        if node is None:
            continue
        _insert_before(graph, gqa, [node])
        gqa.input[0], gqa.input[1], gqa.input[2] = node.output[0], "", ""
        packed += 1
    if packed:
        _drop_unused(graph)
    return packed


def pack_shared_nbits(model: onnx.ModelProto) -> int:
    """The ``MatMulNBits`` products that read one input alike (same K, bits, block size and
    accuracy level; no zero points, group index or bias) as one, whose output a ``Split`` hands
    back column for column: Gemma 3's query, key and value (its per-head q/k norms keep them from
    GroupQueryAttention's packed input) and every gate/up pair. Returns how many groups were
    packed. Exact: each output column is computed from the same codes and scales by the same
    kernel, and at accuracy_level 4 the input's int8 blocks are the same whoever reads them (the
    pack quantizes them once, not two or three times). Why: a decode step of one row is some 40
    operators per layer and the narrow products (key and value: N = 256 on Gemma 3) leave a
    thread idle; one product and a Split run where two or three ran."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.input) != 3 \
                or node.input[1] not in weights or node.input[2] not in weights:
            continue
        settings = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        key = (node.input[0], tuple(sorted((k, v) for k, v in settings.items() if k != "N")))
        groups.setdefault(key, []).append(node)
    packed = 0
    for products in groups.values():
        if len(products) < 2:
            continue
        name = f"{products[0].name}/shared"
        node = _pack_nbits(products, weights, name, graph)
        if node is None:
            continue
        columns = [helper.get_attribute_value(next(a for a in p.attribute if a.name == "N")) for p in products]
        _replace_products(graph, products, node, columns)
        packed += 1
    if packed:
        _drop_unused(graph)
    return packed


def pack_products_file(path: str | Path, *, shared: bool = True, residual_norms: bool = False) -> dict:
    """``pack_qkv_projections``, then (``shared``) ``pack_shared_nbits`` and (``residual_norms``)
    ``residual_norms.fuse_residual_norms``, on the graph file at ``path``, rewritten in place
    (atomically) where any of them changed something; returns ``{"qkv_layers": ...,
    "shared_groups": ..., "residual_norms": ...}``."""
    model = onnx.load(str(path))
    done = {"qkv_layers": pack_qkv_projections(model), "shared_groups": pack_shared_nbits(model) if shared else 0,
            "residual_norms": fuse_residual_norms(model.graph) if residual_norms else 0}
    if done["residual_norms"]:
        _use_microsoft_domain(model)
    if any(done.values()):
        with atomic_path(path, ".onnx") as tmp:
            write_model_streaming(model, tmp)
    return done


def pack_qkv_file(path: str | Path) -> int:
    """``pack_qkv_projections`` alone on the graph file at ``path`` (``pack_products_file``);
    returns how many layers it packed."""
    return pack_products_file(path, shared=False)["qkv_layers"]


def _pack_nbits(matmuls: list[onnx.NodeProto], weights, name: str, graph) -> onnx.NodeProto | None:
    """One ``MatMulNBits`` for several that read one input alike (its weights are [N, blocks, bytes])."""
    settings = [{a.name: helper.get_attribute_value(a) for a in m.attribute} for m in matmuls]
    same = [{k: v for k, v in s.items() if k != "N"} for s in settings]
    if len({m.input[0] for m in matmuls}) != 1 or same.count(same[0]) != len(matmuls) \
            or any(len(m.input) != 3 or m.input[1] not in weights or m.input[2] not in weights for m in matmuls):
        return None
    codes = np.concatenate([numpy_helper.to_array(weights[m.input[1]]) for m in matmuls], axis=0)
    scales = np.concatenate([numpy_helper.to_array(weights[m.input[2]]) for m in matmuls], axis=0)
    graph.initializer.extend([numpy_helper.from_array(codes, f"{name}_packed_weights"),
                              numpy_helper.from_array(scales, f"{name}_scales")])
    return helper.make_node("MatMulNBits", [matmuls[0].input[0], f"{name}_packed_weights", f"{name}_scales"], [name],
                            name=f"{name}/MatMulNBits", domain="com.microsoft",
                            **{**settings[0], "N": sum(s["N"] for s in settings)})


def _pack_integer(matmuls: list[onnx.NodeProto], weights, name: str, graph) -> onnx.NodeProto | None:
    """One ``MatMulIntegerToFloat`` for three that read the same quantized rows, row scales and
    zero point (``quantize.pertoken``'s products; its weights are [K, N], a scale, and for
    unsigned weights a zero point, per column)."""
    inputs = [list(m.input) + [""] * (6 - len(m.input)) for m in matmuls]
    if any(m.domain != "com.microsoft" or len(m.input) > 6 for m in matmuls) \
            or len({(i[0], i[2], i[4]) for i in inputs}) != 1 \
            or any(i[1] not in weights or i[3] not in weights or (i[5] and i[5] not in weights) for i in inputs) \
            or len({bool(i[5]) for i in inputs}) != 1:
        return None
    codes = [numpy_helper.to_array(weights[i[1]]) for i in inputs]
    if any(c.ndim != 2 for c in codes) or len({c.shape[0] for c in codes}) != 1:
        return None

    def per_column(index: int) -> np.ndarray:   # a scalar (per-tensor) scale or zero point broadcast
        return np.concatenate([np.broadcast_to(numpy_helper.to_array(weights[i[index]]), (c.shape[1],))
                               for i, c in zip(inputs, codes)])
    packed = [numpy_helper.from_array(np.concatenate(codes, axis=1), f"{name}_packed_weights"),
              numpy_helper.from_array(per_column(3), f"{name}_scales")]
    if inputs[0][5]:
        packed.append(numpy_helper.from_array(per_column(5), f"{name}_zero_points"))
    graph.initializer.extend(packed)
    first = inputs[0]
    return helper.make_node("MatMulIntegerToFloat", [first[0], packed[0].name, first[2], packed[1].name, first[4],
                                                     *([packed[2].name] if first[5] else [])],
                            [name], name=f"{name}/MatMulIntegerToFloat", domain="com.microsoft")


_PACKERS = {"MatMulNBits": _pack_nbits, "MatMulIntegerToFloat": _pack_integer}


def _reshaped_from(name: str, producer, consumers) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """The product (a ``_PACKERS`` kind, all three of one kind checked by the packer) whose output
    ``name`` is, through ``Reshape``s only (each read by the next alone), and those reshapes; None
    otherwise."""
    chain = []
    node = producer.get(name)
    while node is not None and node.op_type == "Reshape" and len(consumers.get(node.input[0], [])) == 1:
        chain.append(node)
        node = producer.get(node.input[0])
    if node is None or node.op_type not in _PACKERS or node.domain != "com.microsoft" or not chain:
        return None
    return node, chain
