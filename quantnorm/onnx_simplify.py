"""Graph passes every exported model gets before its parity check: the same function in fewer
nodes, in the forms ONNX Runtime's own fusions recognise.

Why: at batch 1 a decode step runs thousands of small nodes, and each costs ONNX Runtime a few
microseconds whatever its size; on a 135M-parameter model that overhead is as large as the
weight GEMMs (``../shared/PITFALLS.md``; the issue-33 profiles). Three passes, each exact or
within a rounding of the float result, and each applied to the FP32 graph too, so the FP32
baseline and every INT8 recipe get the same graph:

- ``share_identical_initializers``: initializers with the same type, shape and bytes become one
  (the online rotation gives every Linear its own copy of the same Hadamard factors; q, k and v
  read one normed tensor, so their rotations are the same computation);
- ``merge_common_subexpressions``: a node that repeats an earlier node's op, attributes and
  inputs is dropped and its outputs read from the earlier one. After the first pass the q/k/v
  (and gate/up) rotations collapse into one, and so does the per-token quantization of the
  tensor they all read (``quantize.pertoken`` quantizes each input tensor once);
- ``rmsnorm_as_division``: the exporter writes RMSNorm as ``x * Reciprocal(Sqrt(mean(x^2) + eps))``;
  ONNX Runtime fuses ``Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul(weight)`` into one
  ``SimplifiedLayerNormalization`` when the graph is loaded, and only in the ``Div`` form.
  The saved graph stays standard ONNX (``onnx.checker`` passes); the fusion happens in the session.

Graph inputs and outputs (an overridable initializer such as ``logits_to_keep``) are never merged, and nodes
that draw random numbers or hold subgraphs are never merged.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import onnx

_RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                         "Multinomial", "Bernoulli", "Dropout"})


def simplify(model: onnx.ModelProto) -> dict[str, int]:
    """All three passes on ``model`` in place; returns what each did (counts)."""
    shared = share_identical_initializers(model)
    merged = merge_common_subexpressions(model)
    divided = rmsnorm_as_division(model)
    return {"initializers_shared": shared, "nodes_merged": merged, "rmsnorms_as_division": divided}


def _tensor_bytes(init: onnx.TensorProto) -> bytes:
    """The values as stored (raw bytes; otherwise the typed fields, or where external data lives),
    without the name."""
    if init.HasField("raw_data"):
        return init.raw_data
    unnamed = onnx.TensorProto()
    unnamed.CopyFrom(init)
    unnamed.name = ""
    return unnamed.SerializeToString(deterministic=True)


def share_identical_initializers(model: onnx.ModelProto) -> int:
    """Initializers equal in type, shape and bytes become the first of them; returns how many went."""
    graph = model.graph
    # an overridable initializer is an input (a feed may change it); one returned as an output keeps its name
    fixed = {value.name for value in [*graph.input, *graph.output]}
    by_layout: dict[tuple, list[onnx.TensorProto]] = defaultdict(list)
    for init in graph.initializer:
        if init.name not in fixed:
            by_layout[(init.data_type, tuple(init.dims))].append(init)
    rename: dict[str, str] = {}
    for group in by_layout.values():
        if len(group) < 2:
            continue   # the common case: hash nothing
        first_of: dict[str, str] = {}
        for init in group:
            digest = hashlib.sha256(_tensor_bytes(init)).hexdigest()
            if digest in first_of:
                rename[init.name] = first_of[digest]
            else:
                first_of[digest] = init.name
    if not rename:
        return 0
    # deleted where they stand: re-adding the kept ones would copy every weight (1.7 GB at once on Gemma 3)
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name in rename:
            del graph.initializer[i]
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    return len(rename)


def _mergeable(node: onnx.NodeProto) -> bool:
    return (node.op_type not in _RANDOM_OPS and len(node.output) > 0
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute))


def merge_common_subexpressions(model: onnx.ModelProto) -> int:
    """Drop each node that repeats an earlier one (op, domain, attributes, inputs) and read its
    outputs from the earlier node (the graph is in topological order, as ONNX requires); returns
    how many nodes went. A node producing a graph output is kept."""
    graph = model.graph
    graph_outputs = {value.name for value in graph.output}
    alias: dict[str, str] = {}
    first: dict[tuple, onnx.NodeProto] = {}
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in alias:
                node.input[i] = alias[name]
        if _mergeable(node):
            key = (node.domain, node.op_type, tuple(node.input), len(node.output),
                   tuple(a.SerializeToString(deterministic=True) for a in node.attribute))
            earlier = first.get(key)
            if earlier is not None and not graph_outputs.intersection(node.output):
                for mine, theirs in zip(node.output, earlier.output):
                    if mine:
                        alias[mine] = theirs
                continue
            first.setdefault(key, node)
        kept.append(node)
    merged = len(graph.node) - len(kept)
    if merged:
        del graph.node[:]
        graph.node.extend(kept)
    return merged


def rmsnorm_as_division(model: onnx.ModelProto) -> int:
    """``Mul(x, Reciprocal(Sqrt(s)))`` -> ``Div(x, Sqrt(s))`` where the Reciprocal's only reader is
    that Mul (the form ONNX Runtime's SimplifiedLayerNormalization fusion matches); returns how
    many were rewritten. One rounding instead of two: within an ulp of the exported value."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    graph_outputs = {value.name for value in graph.output}
    dropped: set[int] = set()
    for recip in graph.node:
        if recip.op_type != "Reciprocal" or recip.domain not in ("", "ai.onnx"):
            continue
        sqrt = producer.get(recip.input[0])
        users = readers.get(recip.output[0], [])
        if (sqrt is None or sqrt.op_type != "Sqrt" or len(users) != 1 or users[0].op_type != "Mul"
                or recip.output[0] in graph_outputs):
            continue
        mul = users[0]
        others = [name for name in mul.input if name != recip.output[0]]
        if len(others) != 1:
            continue   # Mul(r, r): not a norm
        mul.op_type = "Div"
        del mul.input[:]
        mul.input.extend([others[0], sqrt.output[0]])
        dropped.add(id(recip))
    if dropped:
        kept = [node for node in graph.node if id(node) not in dropped]
        del graph.node[:]
        graph.node.extend(kept)
    return len(dropped)
