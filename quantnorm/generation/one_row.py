"""A per-token recipe's with-past graph rewritten for steps of one row: its token graph.

Per-token dynamic INT8 (``quantize.pertoken``) writes each quantized MatMul input's row-wise
scale with standard operators, six to twelve of them per input (ReduceMax, ReduceMin, Max, Div,
and what gives ``QuantizeLinear`` one scale and zero point per row), then
``MatMulIntegerToFloat`` with a scale per row. A prompt needs them: its rows differ. A decode step
at batch 1 is one row, and there a scale per row *is* one scale per tensor, which ONNX Runtime
computes in one operator: ``com.microsoft.DynamicQuantizeMatMul`` (asymmetric uint8 over the row's
min..max, then the u8 x s8 GEMM with the weights' per-channel scales). On SmolLM2 at one token
per step the graph ONNX Runtime runs has 435 operators where the per-token one has 1,225 (this
module's rewrites together), and its integer GEMM runs with a scalar activation scale
(``benchmarks/pertoken_kernel.py``: the per-row scale is a second pass over the output).

The rewrite keeps each recipe's codes and scales; it changes how a row is rounded, from
symmetric (``max |x| / 127``, 255 codes) to ONNX Runtime's asymmetric (``(max - min) / 255``
with a zero point, 256 codes), so it is not the recipe's graph bit for bit: the deployment that
uses it is scored through the cache (cache proof, generation agreement), not taken on trust. The
projections that read one input (query, key and value; gate and up) become one product: the
query, key and value as ``GroupQueryAttention``'s packed input, the others split after it. Each
residual add with the RMSNorm that reads it (Add, then Pow, ReduceMean, Add, Sqrt, Div, Mul as
exported) becomes one ``com.microsoft.SkipSimplifiedLayerNormalization``, whose fourth output is
the sum the next residual add reads: ONNX Runtime fuses the norm alone at load but leaves the add
beside it, and at one row a step's small operators are a good part of its time (60 fewer on
SmolLM2, 4-5% more tokens/s in an interleaved A/B on the Xeon).

The graph is marked ``quantnorm.one_row`` in its metadata: ``DecodeSession`` runs it only for a
step of one row and sends every other step (a prompt, a batch of several sequences, where one
scale per tensor would no longer be per token) to the recipe's own graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..fileio import atomic_path
from ..onnx_wire import write_model_streaming
from .decode import ONE_ROW_KEY
from .graph_edit import _drop_unused, _producers_and_consumers, _replace_products, _use_microsoft_domain
from .graph_passes import GQA
from .residual_norms import fuse_residual_norms

DQMM = "DynamicQuantizeMatMul"


def one_row_graph(model: onnx.ModelProto) -> dict:
    """Rewrite a per-token with-past graph in place (see the module doc); returns what was done.
    A graph without per-token products is left as it is (``products`` 0)."""
    graph = model.graph
    products = _fuse_quantize_matmul(graph)
    packed = _pack_shared_inputs(graph) if products else {"attention": 0, "split": 0}
    norms = fuse_residual_norms(graph) if products else 0
    if products:
        _drop_unused(graph)
        _use_microsoft_domain(model)
        kept = [(p.key, p.value) for p in model.metadata_props if p.key != ONE_ROW_KEY]
        onnx.helper.set_model_props(model, {**dict(kept), ONE_ROW_KEY: "1"})
    return {"products": products, "packed_attention_layers": packed["attention"], "packed_splits": packed["split"],
            "residual_norms": norms}


def write_one_row_graph(src: str | Path, dst: str | Path) -> dict:
    """``one_row_graph`` of the graph file ``src``, written to ``dst`` (atomically) where it found
    per-token products; returns what was done."""
    model = onnx.load(str(src))
    done = one_row_graph(model)
    if done["products"]:
        with atomic_path(dst, ".onnx") as tmp:
            write_model_streaming(model, tmp)
    return done


def _quantized_from(name: str, producer) -> str | None:
    """The float tensor a per-token ``x_quantized`` was computed from: the ``QuantizeLinear``'s
    input where it quantizes blocks of a row, or, where the rows were flattened for a per-axis
    scale, through the Reshape back from rows, the ``QuantizeLinear`` and the Reshape to rows
    (``quantize.pertoken``'s two layouts)."""
    node = producer.get(name)
    if node is not None and node.op_type == "QuantizeLinear" and any(a.name == "block_size" and a.i > 0
                                                                     for a in node.attribute):
        return node.input[0]
    if node is None or node.op_type != "Reshape":
        return None
    node = producer.get(node.input[0])
    rows = producer.get(node.input[0]) if node is not None and node.op_type == "QuantizeLinear" else None
    return rows.input[0] if rows is not None and rows.op_type == "Reshape" else None


def _fuse_quantize_matmul(graph: onnx.GraphProto) -> int:
    """Each ``MatMulIntegerToFloat`` fed by a per-token quantization, with int8 weights and no
    weight zero point, as ``DynamicQuantizeMatMul`` of the float input."""
    producer, _ = _producers_and_consumers(graph)
    weights = {t.name: t for t in graph.initializer}
    fused = 0
    for node in list(graph.node):
        if node.op_type != "MatMulIntegerToFloat" or node.domain != "com.microsoft" or len(node.input) < 4:
            continue
        source = _quantized_from(node.input[0], producer)
        codes = weights.get(node.input[1])
        if source is None or codes is None or codes.data_type != onnx.TensorProto.INT8 or node.input[3] not in weights \
                or (len(node.input) > 5 and node.input[5]) or (len(node.input) > 6 and node.input[6]):
            continue
        at = list(graph.node).index(node)
        graph.node.remove(node)
        graph.node.insert(at, helper.make_node(DQMM, [source, node.input[1], node.input[3]], list(node.output),
                                               name=f"{node.name}/one_row", domain="com.microsoft"))
        fused += 1
    return fused


def _through_reshapes(name: str, consumers) -> tuple[onnx.NodeProto | None, str]:
    """The one node that reads ``name`` past a chain of Reshapes (each read by the next alone), and
    the tensor it reads."""
    while True:
        readers = consumers.get(name, [])
        if len(readers) != 1:
            return None, name
        if readers[0].op_type != "Reshape":
            return readers[0], name
        name = readers[0].output[0]


def _pack_shared_inputs(graph: onnx.GraphProto) -> dict:
    """The ``DynamicQuantizeMatMul``s that read one input as one (weights concatenated along N):
    where they are an attention node's query, key and value (through Reshapes only), its packed
    input; else a ``Split`` gives each its columns back. Exact: one row quantized once or three
    times is the same row."""
    _, consumers = _producers_and_consumers(graph)
    weights = {t.name: t for t in graph.initializer}
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type == DQMM and node.input[1] in weights and node.input[2] in weights:
            groups.setdefault(node.input[0], []).append(node)
    done = {"attention": 0, "split": 0}
    for source, products in groups.items():
        if len(products) < 2:
            continue
        readers = [_through_reshapes(p.output[0], consumers) for p in products]
        attention = readers[0][0]
        if len(products) == 3 and attention is not None and attention.op_type == GQA and \
                all(r[0] is attention for r in readers) and len(attention.input) >= 3 and \
                set(attention.input[:3]) == {r[1] for r in readers}:
            order = [products[[r[1] for r in readers].index(attention.input[k])] for k in range(3)]
        else:
            attention, order = None, products
        codes = [numpy_helper.to_array(weights[p.input[1]]) for p in order]
        scales = [np.broadcast_to(numpy_helper.to_array(weights[p.input[2]]).astype(np.float32), (c.shape[1],))
                  for p, c in zip(order, codes)]
        name = f"{order[0].name}/packed"
        graph.initializer.extend([numpy_helper.from_array(np.concatenate(codes, axis=1), f"{name}_weights"),
                                  numpy_helper.from_array(np.concatenate(scales), f"{name}_scales")])
        packed = helper.make_node(DQMM, [source, f"{name}_weights", f"{name}_scales"], [name], name=name,
                                  domain="com.microsoft")
        if attention is not None:
            attention.input[0], attention.input[1], attention.input[2] = name, "", ""
            done["attention"] += 1
        else:
            done["split"] += 1
        _replace_products(graph, order, packed, None if attention is not None else [c.shape[1] for c in codes])
    return done
