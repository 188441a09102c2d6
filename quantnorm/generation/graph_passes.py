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
- ``fuse_group_query_attention``: then each layer's attention core (those matmuls, the scale, the
  mask, the softmax and the Concat of past and new keys and values) as one ONNX Runtime
  ``com.microsoft.GroupQueryAttention`` node, the graph's interface unchanged. A decode step of a
  small model runs some 35 small operators per layer around two tiny matmuls; the operator does
  them in one kernel (what it buys: ``benchmarks/attention_fusion.py``). ONNX Runtime only: the
  export's ``fuse_attention=False`` keeps standard operators.

A pass on a quantized graph lives in ``qkv_packing``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .decode import ATTENTION_MASK, LOGITS, LOGITS_TO_KEEP, POSITION_IDS
from .graph_edit import (
    _constants,
    _drop_unused,
    _insert_before,
    _int64,
    _producers_and_consumers,
    _use_microsoft_domain,
)

_HEAD_OPS = {"MatMul", "Gemm"}
_INT64_MAX = np.iinfo(np.int64).max


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


# ---------------------------------------------------------------------------------------------
# Attention as one ONNX Runtime operator

GQA = "GroupQueryAttention"
_SEQLENS_K, _TOTAL_LENGTH = "gqa/seqlens_k", "gqa/total_sequence_length"


def fuse_group_query_attention(model: onnx.ModelProto, heads: int, kv_heads: int, head_dim: int,
                               max_length: int | None = None) -> int:
    """Replace each layer's attention core, as ``attend_without_repeating_kv`` leaves it, by one
    ``com.microsoft.GroupQueryAttention`` node; returns how many layers were fused.

    Matched per layer from its ``present.{i}.key`` / ``.value`` (each ``Concat(past, new)`` on
    the length axis): Transpose(present key) -> MatMul with the query (grouped or not) -> [Mul by
    a constant scale] -> Add of a mask that is ``Where(cond, constant, constant)`` (a boolean mask
    made additive: no bias rides on it) -> Softmax -> MatMul with the present value -> Transpose
    (0, 2, 1, 3) -> Reshape to [b, s, H * d]. The operator takes the rotated query and the new
    keys and values as [b, s, heads * d], the past as it is, and writes the same present (past and
    new concatenated, not a shared buffer: the graph's interface stays the one ``decode`` feeds);
    its causal mask is the exported one for prompts of equal length (``decode``'s contract: the
    attention mask all ones), and ``seqlens_k`` is read from the attention mask as ONNX Runtime
    GenAI's builder does (its row sums less one). A layer whose chain differs (a softcap, a bias
    in the mask, another softmax axis) is left as exported; so is every layer of a graph without
    an ``attention_mask`` input. Why: a decode step ran some 35 small operators per layer around
    two tiny matmuls (rotation of the layout, the mask, two copies of the cache); the operator
    does it in one kernel. The export's parity gate checks the fused graph against PyTorch."""
    graph = model.graph
    if ATTENTION_MASK not in {i.name for i in graph.input}:
        return 0
    producer, consumers = _producers_and_consumers(graph)
    constant = _constants(graph)
    scalars = {t.name: float(numpy_helper.to_array(t).reshape(-1)[0]) for t in graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT and int(np.prod(t.dims)) == 1}
    fused = 0
    layer = 0
    caches: dict = {}   # (cos, sin) tensors -> the operator's cos and sin caches
    small = {t.name: numpy_helper.to_array(t).tolist() for t in graph.initializer
             if t.data_type == onnx.TensorProto.INT64 and len(t.dims) <= 1}
    while f"present.{layer}.key" in producer:
        match = _attention_core(layer, producer, consumers, constant, scalars, small.get, max_length)
        if match is not None:
            _install_gqa(model, layer, match, heads, kv_heads, head_dim, max_length, caches)
            fused += 1
        layer += 1
    if fused:
        _seqlens_from_mask(graph)
        _drop_unused(graph)
        _use_microsoft_domain(model)
    return fused


@dataclass
class _Rotary:
    """A layer's rotary embedding, undone: what the query and key were before it (each [b, H, s,
    d] or, ``*_bsnh``, [b, s, H, d]) and the graph's cos and sin tensors [b, s, d] it multiplied
    them by (functions of ``position_ids`` alone)."""
    query: str
    query_bsnh: bool
    key: str
    key_bsnh: bool
    cos: str
    sin: str
    query_scale: float = 1.0   # a constant the rotated query was multiplied by: the operator's then


@dataclass
class _AttentionCore:
    query: str            # rotated queries [b, H, s, d]
    new_key: str          # rotated new keys [b, KV, s, d]
    new_value: str        # new values [b, KV, s, d]
    past_key: str
    past_value: str
    scale: float
    output: str           # [b, s, H * d]
    output_node: onnx.NodeProto
    rotary: _Rotary | None = None   # the query and key before their rotary embedding, when matched


def _only(node_list: list[onnx.NodeProto] | None, op: str) -> onnx.NodeProto | None:
    found = [n for n in node_list or [] if n.op_type == op]
    return found[0] if len(found) == 1 else None


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _window(node: onnx.NodeProto | None, small, max_length: int | None) -> str | None:
    """The tensor a sliding layer's window ``Slice(x, -W, end, axis 2)`` keeps the last W
    positions of, when W >= ``max_length`` (the graph is exact only that far, so the slice keeps
    everything); None for anything else."""
    if node is None or node.op_type != "Slice" or max_length is None or len(node.input) < 4:
        return None
    starts, ends, axes = (small(i) for i in node.input[1:4])
    steps = small(node.input[4]) if len(node.input) > 4 else [1]
    if axes != [2] or steps != [1] or ends != [_INT64_MAX] or not starts or starts[0] > -max_length:
        return None
    return node.input[0]


def _present(layer: int, kind: str, producer, small, max_length) -> tuple[onnx.NodeProto, str] | None:
    """(the Concat(past, new) that makes ``present.{layer}.{kind}``, the past it reads), each
    possibly through a sliding layer's window (``_window``)."""
    node = producer.get(f"present.{layer}.{kind}")
    windowed = _window(node, small, max_length)
    if windowed is not None:
        node = producer.get(windowed)
    if node is None or node.op_type != "Concat" or len(node.input) != 2 or _attr(node, "axis") not in (2, -2):
        return None
    past = node.input[0]
    if past != f"past_key_values.{layer}.{kind}":
        past = _window(producer.get(past), small, max_length)
    return (node, past) if past == f"past_key_values.{layer}.{kind}" else None


def _attention_core(layer, producer, consumers, constant, scalars, small, max_length) -> _AttentionCore | None:
    keys, values = (_present(layer, kind, producer, small, max_length) for kind in ("key", "value"))
    if keys is None or values is None:
        return None
    (key_cat, past_key), (value_cat, past_value) = keys, values
    # scores = Q @ K^T (the key transposed, maybe scaled by a constant), grouped or not
    key_t = _only(consumers.get(key_cat.output[0]), "Transpose")
    if key_t is None or _perm(key_t) != [0, 1, 3, 2]:
        return None
    scale, key_side = 1.0, key_t
    scaled = _only(consumers.get(key_t.output[0]), "Mul")
    if scaled is not None and scaled.input[1] in scalars:
        scale *= scalars[scaled.input[1]]
        key_side = scaled
    scores = _only(consumers.get(key_side.output[0]), "MatMul")
    if scores is None or scores.input[1] != key_side.output[0]:
        return None
    query = scores.input[0]
    group_q = producer.get(query)
    if group_q is not None and group_q.name.endswith("/GroupQ"):
        query = group_q.input[0]
    node = _next(consumers, scores.output[0])
    if node is not None and node.name.endswith("/Ungroup"):
        node = _next(consumers, node.output[0])
    if node is not None and node.op_type == "Mul" and node.input[1] in scalars:
        scale *= scalars[node.input[1]]
        node = _next(consumers, node.output[0])
    if node is None or node.op_type != "Add":
        return None
    mask = producer.get(node.input[1])
    if mask is None or mask.op_type != "Where" or not all(i in constant for i in mask.input[1:]):
        return None
    softmax = _next(consumers, node.output[0])
    if softmax is None or softmax.op_type != "Softmax" or _attr(softmax, "axis", -1) not in (-1, 3):
        return None
    probabilities = _without_nan_guard(softmax.output[0], consumers, constant)
    node = _next(consumers, probabilities)
    if node is not None and node.name.endswith("/GroupP"):
        node = _next(consumers, node.output[0])
    if node is None or node.op_type != "MatMul" or node.input[1] != value_cat.output[0]:
        return None
    node = _next(consumers, node.output[0])
    if node is not None and node.name.endswith("/Ungroup"):
        node = _next(consumers, node.output[0])
    if node is None or node.op_type != "Transpose" or _perm(node) != [0, 2, 1, 3]:
        return None
    out = _next(consumers, node.output[0])
    if out is None or out.op_type != "Reshape":
        return None
    core = _AttentionCore(query, key_cat.input[1], value_cat.input[1], past_key, past_value, scale,
                          out.output[0], out)
    core.rotary = _rotary_of(core, producer, small, scalars)
    return core


def _rotary_of(core: _AttentionCore, producer, small, scalars) -> _Rotary | None:
    """The layer's rotary embedding (``_rotated``) when its query and key were rotated by the same
    cos and sin; the query may be scaled by a constant after its rotation (``query_scale``). None
    for anything else: the rotation stays in the graph."""
    query, extra = core.query, 1.0
    scaled = producer.get(query)
    if scaled is not None and scaled.op_type == "Mul" and scaled.input[1] in scalars:
        query, extra = scaled.input[0], scalars[scaled.input[1]]
    q, k = _rotated(query, producer, small), _rotated(core.new_key, producer, small)
    if q is None or k is None or q[2:] != k[2:]:
        return None
    return _Rotary(q[0], q[1], k[0], k[1], *q[2:], query_scale=extra)


_LAYOUT_OPS = {"Unsqueeze", "Transpose", "Identity"}


def _rotated(name: str, producer, small) -> tuple[str, bool, str, str] | None:
    """(x, x is [b, s, H, d], cos, sin) when ``name`` is the rotate-half rotary embedding of x:
    ``x * cos + Concat(-x[..., d/2:], x[..., :d/2]) * sin`` on the last axis, possibly transposed
    (0, 2, 1, 3) afterwards; cos and sin traced back through layout-only operators."""
    node, bsnh = producer.get(name), False
    if node is not None and node.op_type == "Transpose" and _perm(node) == [0, 2, 1, 3]:
        node, bsnh = producer.get(node.input[0]), True
    if node is None or node.op_type != "Add":
        return None
    muls = [producer.get(i) for i in node.input]
    if any(m is None or m.op_type != "Mul" for m in muls):
        return None
    for plain, rotated in (muls, muls[::-1]):
        for side in (0, 1):
            x = _rotate_half_of(producer.get(rotated.input[side]), producer, small)
            if x is not None and x in plain.input:
                cos = plain.input[1 - list(plain.input).index(x)]
                return x, bsnh, _through_layout(cos, producer), _through_layout(rotated.input[1 - side], producer)
    return None


def _rotate_half_of(node: onnx.NodeProto | None, producer, small) -> str | None:
    """x when ``node`` is ``Concat(Neg(x[..., h:]), x[..., :h])`` on the last axis, else None."""
    if node is None or node.op_type != "Concat" or len(node.input) != 2 or _attr(node, "axis") not in (-1, 3):
        return None
    neg, first = producer.get(node.input[0]), producer.get(node.input[1])
    if neg is None or neg.op_type != "Neg" or first is None:
        return None
    second = producer.get(neg.input[0])
    halves = [_last_axis_slice(n, small) for n in (first, second)]
    if None in halves or first.input[0] != second.input[0]:
        return None
    (start1, end1), (start2, end2) = halves
    return first.input[0] if start1 == 0 and end1 == start2 and end2 >= 2 * start2 > 0 else None


def _last_axis_slice(node: onnx.NodeProto | None, small) -> tuple[int, int] | None:
    if node is None or node.op_type != "Slice" or len(node.input) < 4:
        return None
    starts, ends, axes = (small(i) for i in node.input[1:4])
    steps = small(node.input[4]) if len(node.input) > 4 else [1]
    if axes not in ([-1], [3]) or steps != [1] or not starts or not ends:
        return None
    return starts[0], ends[0]


def _through_layout(name: str, producer) -> str:
    node = producer.get(name)
    while node is not None and node.op_type in _LAYOUT_OPS:
        name = node.input[0]
        node = producer.get(name)
    return name


def _position_table(model: onnx.ModelProto, name: str, positions: int) -> np.ndarray | None:
    """``name`` [1, positions, d] computed for ``position_ids`` = 0 .. positions - 1 by the graph's
    own nodes, when it depends on ``position_ids`` and constants alone (None otherwise)."""
    import onnxruntime as ort

    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    inits = {t.name: t for t in graph.initializer}
    needed, stack, feeds = [], [name], set()
    while stack:
        tensor = stack.pop()
        if tensor in inits or not tensor:
            continue
        node = producer.get(tensor)
        if node is None:
            feeds.add(tensor)
            continue
        if node not in needed:
            needed.append(node)
            stack.extend(node.input)
    if feeds != {POSITION_IDS}:
        return None
    index = {node.output[0]: i for i, node in enumerate(graph.node)}
    nodes = sorted(needed, key=lambda n: index[n.output[0]])
    used = {i for n in nodes for i in n.input}
    sub = helper.make_graph(nodes, "position_table",
                            [helper.make_tensor_value_info(POSITION_IDS, onnx.TensorProto.INT64, [1, positions])],
                            [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)],
                            [inits[i] for i in used if i in inits])
    table_model = helper.make_model(sub, opset_imports=list(model.opset_import))
    table_model.ir_version = model.ir_version
    session = ort.InferenceSession(table_model.SerializeToString(), providers=["CPUExecutionProvider"])
    table = session.run(None, {POSITION_IDS: np.arange(positions, dtype=np.int64)[None]})[0]
    return table if table.ndim == 3 and table.shape[:2] == (1, positions) else None


def _without_nan_guard(probabilities: str, consumers, constant) -> str:
    """Past scaled_dot_product_attention's guard ``Where(IsNaN(p), 0, p)`` (a row with every key
    masked), when the exporter wrote one: a causal row always sees its own key, so the fused
    operator, which has no such row, computes the same."""
    readers = consumers.get(probabilities, [])
    isnan = _only(readers, "IsNaN")
    where = _only(readers, "Where")
    if len(readers) == 2 and isnan is not None and where is not None and \
            list(where.input) == [isnan.output[0], where.input[1], probabilities] and where.input[1] in constant and \
            [n.name for n in consumers.get(isnan.output[0], [])] == [where.name]:
        return where.output[0]
    return probabilities


def _next(consumers, name: str) -> onnx.NodeProto | None:
    """The one node reading ``name`` (None when none or several do: then it is not a chain)."""
    readers = consumers.get(name, [])
    return readers[0] if len(readers) == 1 else None


def _rotary_caches(model: onnx.ModelProto, rotary: _Rotary, max_length: int | None, head_dim: int,
                   caches: dict) -> tuple[str, str] | None:
    """The operator's cos and sin caches [max_length, d / 2] for ``rotary``'s cos and sin, made
    once per pair from the graph's own nodes (``_position_table``); None when they are not
    rotate-half tables of this head size (both halves equal)."""
    key = (rotary.cos, rotary.sin)
    if key not in caches:
        caches[key] = None
        tables = [_position_table(model, name, max_length) for name in key] if max_length else [None]
        half = head_dim // 2
        if all(t is not None and t.shape[2] == head_dim and np.array_equal(t[..., :half], t[..., half:]) for t in tables):
            names = []
            for kind, table in zip(("cos", "sin"), tables):
                names.append(f"gqa/{kind}_cache_{len(caches) - 1}")
                model.graph.initializer.append(numpy_helper.from_array(
                    np.ascontiguousarray(table[0, :, :half], dtype=np.float32), names[-1]))
            caches[key] = tuple(names)
    return caches[key]


def _install_gqa(model, layer: int, core: _AttentionCore, heads: int, kv_heads: int, head_dim: int,
                 max_length: int | None, caches: dict) -> None:
    graph = model.graph
    p = f"model.layers.{layer}.self_attn/gqa"
    rotary = core.rotary
    # ONNX Runtime's CPU kernel rotates head sizes that are multiples of 16 only
    rotates = rotary is not None and head_dim % 16 == 0
    cos_sin = _rotary_caches(model, rotary, max_length, head_dim, caches) if rotates else None
    inputs = [(core.query, False, heads), (core.new_key, False, kv_heads), (core.new_value, False, kv_heads)]
    if cos_sin is not None:   # the operator rotates: it takes the query and key from before their rotation
        inputs[:2] = [(rotary.query, rotary.query_bsnh, heads), (rotary.key, rotary.key_bsnh, kv_heads)]
    new = []
    flat = []
    for role, (name, bsnh, n) in zip(("query", "key", "value"), inputs):
        if not bsnh:
            new.append(helper.make_node("Transpose", [name], [f"{p}/{role}_bsnh"], name=f"{p}/{role}_bsnh",
                                        perm=[0, 2, 1, 3]))
            name = f"{p}/{role}_bsnh"
        new.append(helper.make_node("Reshape", [name, _int64(graph, f"{p}/{role}_shape", [0, 0, n * head_dim])],
                                    [f"{p}/{role}"], name=f"{p}/{role}"))
        flat.append(f"{p}/{role}")
    rotation = {"do_rotary": 1} if cos_sin is not None else {}
    scale = core.scale * (rotary.query_scale if cos_sin is not None else 1.0)
    new.append(helper.make_node(
        GQA, [*flat, core.past_key, core.past_value, _SEQLENS_K, _TOTAL_LENGTH, *(cos_sin or ())],
        [core.output, f"present.{layer}.key", f"present.{layer}.value"], name=p, domain="com.microsoft",
        num_heads=heads, kv_num_heads=kv_heads, scale=scale, **rotation))
    _insert_before(graph, core.output_node, new)
    graph.node.remove(core.output_node)
    # the GQA node writes the present now: its Concat (or a sliding layer's window of it) goes,
    # and what read them only dies with them (_drop_unused)
    for node in [n for n in graph.node if n.op_type != GQA and
                 set(n.output) & {f"present.{layer}.key", f"present.{layer}.value"}]:
        graph.node.remove(node)


def _seqlens_from_mask(graph: onnx.GraphProto) -> None:
    """``seqlens_k`` [b] int32 (each row's mask sum less one) and ``total_sequence_length`` (the
    mask's length, int32 scalar), at the top of the graph: the mask is a graph input."""
    p = "gqa"
    nodes = [
        helper.make_node("ReduceSum", [ATTENTION_MASK, _int64(graph, f"{p}/sum_axes", [1])], [f"{p}/row_sums"],
                         name=f"{p}/RowSums", keepdims=0),
        helper.make_node("Sub", [f"{p}/row_sums", _int64(graph, f"{p}/one", 1)], [f"{p}/last_index"], name=f"{p}/LastIndex"),
        helper.make_node("Cast", [f"{p}/last_index"], [_SEQLENS_K], name=f"{p}/SeqlensK", to=onnx.TensorProto.INT32),
        helper.make_node("Shape", [ATTENTION_MASK], [f"{p}/mask_shape"], name=f"{p}/MaskShape", start=1, end=2),
        helper.make_node("Squeeze", [f"{p}/mask_shape", _int64(graph, f"{p}/axis0", [0])], [f"{p}/mask_length"],
                         name=f"{p}/MaskLength"),
        helper.make_node("Cast", [f"{p}/mask_length"], [_TOTAL_LENGTH], name=f"{p}/TotalLength", to=onnx.TensorProto.INT32),
    ]
    for offset, node in enumerate(nodes):
        graph.node.insert(offset, node)
