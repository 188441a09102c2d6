"""Rewrites of a freshly exported with-past graph that make generation cheaper and compute the same.

Each pass edits an ``onnx.ModelProto`` in place, changes nothing where its pattern is not found
(it returns how many places it rewrote), and is checked afterwards by the export's parity gate
against PyTorch, step by step with the cache. They run on the FP32 graph before any recipe
quantizes it, so FP32 and every INT8 recipe run the same attention and head.

- ``add_logits_to_keep``: the optional ``logits_to_keep`` input (decode.py), a ``Slice`` in
  front of the head, so a prompt step that needs one position's logits runs the head on one row
  (on Gemma 3's 262,144-token vocabulary the head is most of a prefill's work).
- ``attend_without_repeating_kv``: grouped-query attention as exported repeats each key/value
  head for the query heads that share it (transformers' ``repeat_kv``: Unsqueeze, Expand,
  Reshape), copying the whole cache ``heads / kv_heads`` times per layer and step. Folding the
  query heads that share a key head into the rows of one matmul instead reads the cache as it
  is: Q [b, H, s, d] -> [b, KV, H/KV * s, d]; scores [b, KV, H/KV * s, L] -> [b, H, s, L] for the
  mask and softmax; probabilities back to [b, KV, H/KV * s, L] times V [b, KV, L, d]; out to
  [b, H, s, d]. Same products, same sums, no copies of the cache.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .decode import LOGITS, LOGITS_TO_KEEP

_HEAD_OPS = {"MatMul", "Gemm"}
_INT64_MAX = np.iinfo(np.int64).max


def _constants(graph: onnx.GraphProto) -> set[str]:
    """Names of tensors that hold the same value on every run: initializers that are not inputs,
    and the outputs of nodes that read only those (a tied head's ``Transpose`` of the embedding)."""
    constant = {t.name for t in graph.initializer} - {i.name for i in graph.input}
    for node in graph.node:   # topological order: a node's inputs come before it
        if node.op_type == "Constant" or (node.input and all(not i or i in constant for i in node.input)):
            constant.update(node.output)
    return constant


def _int64(graph: onnx.GraphProto, name: str, values) -> str:
    graph.initializer.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
    return name


def _insert_before(graph: onnx.GraphProto, node: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
    at = list(graph.node).index(node)
    for offset, added in enumerate(new):
        graph.node.insert(at + offset, added)


def add_logits_to_keep(model: onnx.ModelProto) -> bool:
    """Give the graph the optional ``logits_to_keep`` input (see the module doc). The head is the
    first MatMul (or Gemm) with a constant weight met walking back from ``logits`` through nodes
    with one varying input (a logit softcap, a cast); positions are independent from there on, so
    the kept rows' logits are the whole step's. False, and nothing changed, where no such head is
    found or the graph has the input already."""
    graph = model.graph
    if any(i.name == LOGITS_TO_KEEP for i in graph.input):
        return False
    producer = {out: node for node in graph.node for out in node.output}
    constant = _constants(graph)
    node = producer.get(LOGITS)
    while node is not None and node.op_type not in _HEAD_OPS:
        varying = [i for i in node.input if i and i not in constant]
        node = producer.get(varying[0]) if len(varying) == 1 else None
    if node is None or len(node.input) < 2 or node.input[0] in constant or node.input[1] not in constant:
        return False
    hidden = node.input[0]
    kept = f"{hidden}/last_positions"
    prefix = f"{node.name or 'head'}/keep_logits"
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.int64), LOGITS_TO_KEEP))
    graph.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, onnx.TensorProto.INT64, [1]))
    _insert_before(graph, node, [
        helper.make_node("Neg", [LOGITS_TO_KEEP], [f"{prefix}/starts"], name=f"{prefix}/Neg"),
        helper.make_node("Slice", [hidden, f"{prefix}/starts", _int64(graph, f"{prefix}/ends", [_INT64_MAX]),
                                   _int64(graph, f"{prefix}/axes", [1])], [kept], name=f"{prefix}/Slice")])
    node.input[0] = kept
    for value in graph.output:
        if value.name == LOGITS:
            value.type.tensor_type.shape.dim[1].dim_param = "kept positions"
    return True


def _repeated(node: onnx.NodeProto | None, producer: dict, attrs) -> str | None:
    """The keys or values [b, KV, L, d] that ``node`` (the Reshape ending transformers'
    ``repeat_kv``) repeats: Reshape <- Expand <- Unsqueeze(axes [2]) <- them (the present, or a
    sliding layer's window of it); None for anything else."""
    if node is None or node.op_type != "Reshape":
        return None
    expand = producer.get(node.input[0])
    if expand is None or expand.op_type != "Expand":
        return None
    unsqueeze = producer.get(expand.input[0])
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.input) < 2 or \
            attrs(unsqueeze.input[1]) != [2]:
        return None
    return unsqueeze.input[0]


def attend_without_repeating_kv(model: onnx.ModelProto, heads: int, kv_heads: int, head_dim: int) -> int:
    """Rewrite each layer's two attention matmuls to read the cache without repeating it (see the
    module doc); returns how many layers were rewritten (0 when ``heads == kv_heads``: nothing is
    repeated). Only the two forms the exporter writes are rewritten (``_transposed_key``: eager
    attention's and scaled_dot_product_attention's key transpose; ``MatMul(P, repeat_kv(V))``);
    any other attention is left as exported."""
    if heads == kv_heads or heads % kv_heads:
        return 0
    graph = model.graph
    small = {t.name: numpy_helper.to_array(t).tolist() for t in graph.initializer
             if t.data_type == onnx.TensorProto.INT64 and len(t.dims) <= 1}
    producer = {out: node for node in graph.node for out in node.output}
    rewritten = 0
    scalars = {t.name for t in graph.initializer if not t.dims and t.data_type == onnx.TensorProto.FLOAT}
    for node in list(graph.node):
        if node.op_type != "MatMul":
            continue
        key, scale = _transposed_key(node.input[1], producer, small.get, scalars)
        if key is not None:
            _grouped_scores(graph, node, key, scale, kv_heads, heads, head_dim)
            rewritten += 1
            continue
        value = _repeated(producer.get(node.input[1]), producer, small.get)
        if value is not None:
            _grouped_values(graph, node, value, kv_heads, heads, head_dim)
    _drop_unused(graph)
    return rewritten


def _perm(node: onnx.NodeProto) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), [])


def _transposed_key(name: str, producer: dict, attrs, scalars: set[str]) -> tuple[str | None, str | None]:
    """(the keys [b, KV, L, d], a constant scalar they are scaled by or None) when ``name`` is the
    repeated keys transposed to [b, H, d, L]: ``Transpose(perm 0,1,3,2)`` as eager attention
    exports it, or ``Reshape(Transpose(perm 0,2,1)(Reshape(.)))`` as the exporter decomposes
    scaled_dot_product_attention's, either optionally times a constant scalar (its sqrt(scale))."""
    node, scale = producer.get(name), None
    if node is not None and node.op_type == "Mul":
        if node.input[1] in scalars:
            node, scale = producer.get(node.input[0]), node.input[1]
        else:
            return None, None
    if node is None:
        return None, None
    if node.op_type == "Transpose" and _perm(node) == [0, 1, 3, 2]:
        return _repeated(producer.get(node.input[0]), producer, attrs), scale
    if node.op_type == "Reshape":
        transpose = producer.get(node.input[0])
        if transpose is not None and transpose.op_type == "Transpose" and _perm(transpose) == [0, 2, 1]:
            flat = producer.get(transpose.input[0])
            if flat is not None and flat.op_type == "Reshape":
                return _repeated(producer.get(flat.input[0]), producer, attrs), scale
    return None, None


def _grouped_scores(graph, matmul, key: str, scale: str | None, kv_heads: int, heads: int, head_dim: int) -> None:
    """scores [b, H, s, L] = Reshape(MatMul(Reshape(Q, [b, KV, -1, d]), Transpose(K) [* scale]))."""
    p = matmul.name or matmul.output[0]
    q, scores = matmul.input[0], matmul.output[0]
    key_t = f"{p}/key_t"
    new = [helper.make_node("Reshape", [q, _int64(graph, f"{p}/grouped_q_shape", [0, kv_heads, -1, head_dim])],
                            [f"{p}/grouped_q"], name=f"{p}/GroupQ"),
           helper.make_node("Transpose", [key], [key_t], name=f"{p}/KeyT", perm=[0, 1, 3, 2])]
    if scale is not None:
        new.append(helper.make_node("Mul", [key_t, scale], [f"{p}/key_t_scaled"], name=f"{p}/KeyScale"))
        key_t = f"{p}/key_t_scaled"
    new += [helper.make_node("MatMul", [f"{p}/grouped_q", key_t], [f"{p}/grouped_scores"], name=f"{p}/Grouped"),
           helper.make_node("Reshape", [f"{p}/grouped_scores", _int64(graph, f"{p}/scores_shape", [0, heads, -1, 0])],
                            [scores], name=f"{p}/Ungroup")]
    _insert_before(graph, matmul, new)
    graph.node.remove(matmul)


def _grouped_values(graph, matmul, value: str, kv_heads: int, heads: int, head_dim: int) -> None:
    """out [b, H, s, d] = Reshape(MatMul(Reshape(P, [b, KV, -1, L]), V))."""
    p = matmul.name or matmul.output[0]
    probs, out = matmul.input[0], matmul.output[0]
    new = [helper.make_node("Reshape", [probs, _int64(graph, f"{p}/grouped_p_shape", [0, kv_heads, -1, 0])],
                            [f"{p}/grouped_p"], name=f"{p}/GroupP"),
           helper.make_node("MatMul", [f"{p}/grouped_p", value], [f"{p}/grouped_out"], name=f"{p}/Grouped"),
           helper.make_node("Reshape", [f"{p}/grouped_out", _int64(graph, f"{p}/out_shape", [0, heads, -1, head_dim])],
                            [out], name=f"{p}/Ungroup")]
    _insert_before(graph, matmul, new)
    graph.node.remove(matmul)


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
