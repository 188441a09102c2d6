"""Graph passes every exported model gets before its parity check: the same function in fewer
nodes, in the forms ONNX Runtime's own fusions recognise.

Why: at batch 1 a decode step runs thousands of small nodes, and each costs ONNX Runtime a few
microseconds whatever its size; on a 135M-parameter model that overhead is as large as the
weight GEMMs (``../shared/PITFALLS.md``; the issue-33 profiles). Five passes, each exact or
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
- ``rmsnorm_before_transpose``: a norm over the last axis of a ``Transpose`` that keeps the last
  axis (Gemma 3's q and k norms read the heads transposed) is computed on the Transpose's input
  and transposed after. Exact. Without it ONNX Runtime's transpose optimizer moves the Transpose
  itself and rewrites the ReduceMean's axes as a positive number, which its norm fusion then
  refuses (it needs the input's rank, unknown there): 36 norms of six nodes each left unfused on
  Gemma 3;
- ``tanh_gelu_in_fused_order``: the exporter writes GELU's tanh form as ``x * (0.5 * (1 + tanh(.)))``;
  ONNX Runtime fuses it into one ``FastGelu`` only as ``(0.5 * x) * (1 + tanh(.))``. The same
  product (halving is exact in float): one node instead of nine per layer on Gemma 3.

Graph inputs and outputs (an overridable initializer such as ``logits_to_keep``) are never merged, and nodes
that draw random numbers or hold subgraphs are never merged.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np
import onnx
from onnx import numpy_helper

_RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                         "Multinomial", "Bernoulli", "Dropout"})


def simplify(model: onnx.ModelProto) -> dict[str, int]:
    """All five passes on ``model`` in place, in this order; returns what each did (counts)."""
    shared = share_identical_initializers(model)
    merged = merge_common_subexpressions(model)
    divided = rmsnorm_as_division(model)
    moved = rmsnorm_before_transpose(model)
    gelus = tanh_gelu_in_fused_order(model)
    return {"initializers_shared": shared, "nodes_merged": merged, "rmsnorms_as_division": divided,
            "rmsnorms_before_transpose": moved, "tanh_gelus_in_fused_order": gelus}


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
    readers = _readers(graph)
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


def _readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    return readers


def _constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers (not graph inputs) and ``Constant`` outputs of at most 16 values, as arrays:
    the scalars and axes the passes below read."""
    inputs = {value.name for value in graph.input}
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer
              if init.name not in inputs and int(np.prod(init.dims)) <= 16 and not init.data_location}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def _other_input(node: onnx.NodeProto, name: str) -> str | None:
    """The input of a two-input node that is not ``name`` (None where ``name`` is not one of them)."""
    if len(node.input) != 2 or name not in node.input:
        return None
    return node.input[1] if node.input[0] == name else node.input[0]


def _is_scalar(values: dict, name: str | None, expected: float) -> bool:
    value = values.get(name) if name else None
    return value is not None and value.size == 1 and float(value.reshape(-1)[0]) == expected


def _only_reader(readers: dict, name: str, op_type: str) -> onnx.NodeProto | None:
    users = readers.get(name, [])
    return users[0] if len(users) == 1 and users[0].op_type == op_type else None


def _reduced_axes(node: onnx.NodeProto, values: dict) -> list[int] | None:
    """A ReduceMean's axes (its input from opset 18, its attribute before), None where not constant."""
    if len(node.input) > 1 and node.input[1]:
        axes = values.get(node.input[1])
        return None if axes is None else [int(a) for a in axes.reshape(-1)]
    attr = next((a for a in node.attribute if a.name == "axes"), None)
    return None if attr is None else list(attr.ints)


def _norm_on(x: str, readers: dict, values: dict, ranks: dict[str, int], last_axis: int) -> tuple | None:
    """The RMSNorm in Div form reading ``x``: (Pow, Div, the norm's last node: its weight's Mul where
    the weight is a constant of at most one axis (``ranks``: each initializer's), else the Div), or
    None. The ReduceMean must reduce ``x``'s last axis alone (``-1`` or ``last_axis``), keeping it."""
    users = readers.get(x, [])
    pows = [n for n in users if n.op_type == "Pow" and n.input[0] == x and _is_scalar(values, n.input[1], 2.0)]
    divs = [n for n in users if n.op_type == "Div" and n.input[0] == x]
    if len(users) != 2 or len(pows) != 1 or len(divs) != 1:
        return None
    mean = _only_reader(readers, pows[0].output[0], "ReduceMean")
    keepdims = next((a.i for a in mean.attribute if a.name == "keepdims"), 1) if mean is not None else 0
    if mean is None or keepdims != 1 or _reduced_axes(mean, values) not in ([-1], [last_axis]):
        return None
    add = _only_reader(readers, mean.output[0], "Add")
    sqrt = _only_reader(readers, add.output[0], "Sqrt") if add is not None else None
    div = divs[0]
    if sqrt is None or div.input[1] != sqrt.output[0]:
        return None
    mul = _only_reader(readers, div.output[0], "Mul")
    weight = _other_input(mul, div.output[0]) if mul is not None else None
    return pows[0], div, mul if weight is not None and ranks.get(weight, 2) <= 1 else div


def rmsnorm_before_transpose(model: onnx.ModelProto) -> int:
    """``norm(Transpose(x))`` -> ``Transpose(norm(x))`` where the Transpose keeps the last axis in
    place, the norm (``rmsnorm_as_division``'s form) reduces that axis, and the Transpose's only
    readers are the norm's Pow and Div; returns how many moved. Exact: the same arithmetic on
    the same values, laid out afterwards."""
    graph = model.graph
    readers = _readers(graph)
    values = _constant_values(graph)
    ranks = {init.name: len(init.dims) for init in graph.initializer}
    ranks.update({name: value.ndim for name, value in values.items()})
    graph_outputs = {value.name for value in graph.output}
    moved: list[tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]] = []
    for transpose in graph.node:
        if transpose.op_type != "Transpose" or transpose.output[0] in graph_outputs:
            continue
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
        if not perm or perm[-1] != len(perm) - 1:
            continue
        norm = _norm_on(transpose.output[0], readers, values, ranks, len(perm) - 1)
        if norm is None:
            continue
        pow_node, div, last = norm
        pow_node.input[0] = div.input[0] = transpose.input[0]
        after = onnx.helper.make_node("Transpose", [f"{last.output[0]}/before_transpose"], [last.output[0]],
                                      name=f"{last.name}/Transpose", perm=perm)
        last.output[0] = after.input[0]
        moved.append((transpose, last, after))
    if moved:
        dropped = {id(transpose) for transpose, _, _ in moved}
        after_of = {id(last): after for _, last, after in moved}
        kept = []
        for node in graph.node:
            if id(node) not in dropped:
                kept.append(node)
                if id(node) in after_of:
                    kept.append(after_of[id(node)])
        del graph.node[:]
        graph.node.extend(kept)
    return len(moved)


def tanh_gelu_in_fused_order(model: onnx.ModelProto) -> int:
    """``Mul(x, Mul(0.5, Add(Tanh(.), 1)))`` -> ``Mul(Mul(0.5, x), Add(Tanh(.), 1))`` where each
    intermediate has that one reader; returns how many were rewritten. Exact: halving commutes with
    the rounding of the product."""
    graph = model.graph
    readers = _readers(graph)
    values = _constant_values(graph)
    graph_outputs = {value.name for value in graph.output}
    moves: dict[int, onnx.NodeProto] = {}   # the outer Mul -> the half, computed just before it
    for tanh in graph.node:
        if tanh.op_type != "Tanh":
            continue
        one_plus = _only_reader(readers, tanh.output[0], "Add")
        if one_plus is None or not _is_scalar(values, _other_input(one_plus, tanh.output[0]), 1.0):
            continue
        half = _only_reader(readers, one_plus.output[0], "Mul")
        scale = _other_input(half, one_plus.output[0]) if half is not None else None
        if half is None or not _is_scalar(values, scale, 0.5) or half.output[0] in graph_outputs:
            continue
        outer = _only_reader(readers, half.output[0], "Mul")
        x = _other_input(outer, half.output[0]) if outer is not None else None
        if outer is None or x is None or x == half.output[0]:
            continue
        half.input[:] = [scale, x]                                  # 0.5 * x
        outer.input[:] = [half.output[0], one_plus.output[0]]       # (0.5 * x) * (1 + tanh)
        moves[id(outer)] = half
    if moves:
        halves = {id(half) for half in moves.values()}
        kept = []
        for node in graph.node:   # the half now reads x: placed right before its reader, after x
            if id(node) in halves:
                continue
            if id(node) in moves:
                kept.append(moves[id(node)])
            kept.append(node)
        del graph.node[:]
        graph.node.extend(kept)
    return len(moves)
