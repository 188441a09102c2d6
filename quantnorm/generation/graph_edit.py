"""Small edits of an ONNX graph that the generation package's rewrites share.

Who writes and reads each tensor, which tensors are constant, an int64 initializer, nodes put
in place of others and nodes nothing reads dropped: the rewrites of the exported FP32 graph
(``graph_passes``) and of quantized graphs (``qkv_packing``, ``one_row``, ``residual_norms``) are
built from these.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _constants(graph: onnx.GraphProto) -> set[str]:
    """Names of tensors that hold the same value on every run: initializers that are not inputs,
    and the outputs of nodes that read only those (a tied head's ``Transpose`` of the embedding)."""
    constant = {t.name for t in graph.initializer} - {i.name for i in graph.input}
    for node in graph.node:   # topological order: a node's inputs come before it
        if node.op_type == "Constant" or (node.input and all(not i or i in constant for i in node.input)):
            constant.update(node.output)
    return constant


def _producers_and_consumers(graph: onnx.GraphProto) -> tuple[dict[str, onnx.NodeProto],
                                                                dict[str, list[onnx.NodeProto]]]:
    """tensor -> the node that writes it, and tensor -> the nodes that read it (in graph order)."""
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return producer, consumers


def _int64(graph: onnx.GraphProto, name: str, values) -> str:
    graph.initializer.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
    return name


def _insert_before(graph: onnx.GraphProto, node: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
    at = list(graph.node).index(node)
    for offset, added in enumerate(new):
        graph.node.insert(at + offset, added)


def _replace_products(graph: onnx.GraphProto, products: list[onnx.NodeProto], packed: onnx.NodeProto,
                      columns: list[int] | None) -> None:
    """Put ``packed`` (one product computing ``products``' columns side by side) where the first
    of them stood and remove them; with ``columns`` (each product's width, in their order) a
    ``Split`` after it hands each product's output back, else ``packed``'s output already has a
    reader of its own (an attention node's packed input)."""
    new = [packed]
    if columns is not None:
        name = packed.output[0]
        new.append(helper.make_node("Split", [name, _int64(graph, f"{name}_columns", columns)],
                                    [p.output[0] for p in products], name=f"{name}/Split", axis=-1))
    first = min(products, key=list(graph.node).index)
    _insert_before(graph, first, new)
    for p in products:
        graph.node.remove(p)


def _drop_unused(graph: onnx.GraphProto) -> None:
    """Remove nodes (and then initializers) nothing reads any more: the repeat_kv chains."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for node in graph.node for i in node.input} | outputs
        dead = [node for node in graph.node if not any(o in read for o in node.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    read = {i for node in graph.node for i in node.input} | outputs | {i.name for i in graph.input}
    for index in reversed(range(len(graph.initializer))):   # in place: no copy of the weights
        if graph.initializer[index].name not in read:
            del graph.initializer[index]


def _use_microsoft_domain(model: onnx.ModelProto) -> None:
    """Declare ONNX Runtime's ``com.microsoft`` operator set where a rewrite put one of its
    operators into a graph that had none."""
    if not any(imp.domain == "com.microsoft" for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
