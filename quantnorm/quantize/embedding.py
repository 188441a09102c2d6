"""The token embedding in 8 bits: ONNX Runtime's ``com.microsoft.GatherBlockQuantized``.

Every weight quantizer here takes MatMuls, so the embedding table (a ``Gather`` of a float
initializer by the token ids) stays float32 in every INT8 graph: Gemma 3's 262,144 x 640 table
is 671 MB of a 940 MB INT8 file, and a split deployment holds it twice. llama.cpp stores it as
Q8_0. A recipe named ``<recipe>-emb8`` (``Recipe.embedding_bits = 8``) stores it as int8 codes
with one float32 scale per block of ``EMBEDDING_BLOCK`` along the hidden axis (Q8_0's grid:
``s = max|w| / 127`` over the block, codes ``round(w / s)`` in [-127, 127]), 1.125 bytes a
weight instead of 4. A step gathers only its tokens' rows, so decode speed does not change; what
changes is the file, the resident memory and, by the rounding, the accuracy (measured like every
recipe's).

The codes are stored as uint8 ``code + 128`` with no zero-point input: GatherBlockQuantized's
default zero point for uint8 data is 128, which makes the grid symmetric (the test checks the
operator against this module's dequantization, value for value).

The table is left float, with the reason in the recipe's settings, where it is not a Gather of a
float initializer by a graph input, where another node reads the same table (a head tied to it
and kept float: quantizing a copy would add bytes), or where the hidden size is not a whole
number of blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..onnx_wire import write_model_streaming

EMBEDDING_BLOCK = 32
_ROWS_AT_ONCE = 8192   # rows quantized per slice: Gemma 3's table never has a float64 copy in whole


def token_embedding(graph: onnx.GraphProto) -> tuple[onnx.NodeProto | None, str]:
    """(the Gather that reads the token embedding table, "") or (None, why there is none to
    quantize): a Gather on axis 0 of a rank-2 float32 initializer by a graph input."""
    inits = {t.name: t for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for node in graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        table = inits.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table is None or node.input[1] not in inputs or axis != 0 or len(table.dims) != 2:
            continue
        if table.data_type != onnx.TensorProto.FLOAT:
            return None, f"the embedding table {table.name} is not float32"
        if readers[node.input[0]] > 1:
            return None, (f"the embedding table {table.name} is also read by another node (a head tied to it and "
                          "kept float): quantizing a copy would add bytes")
        if table.dims[1] % EMBEDDING_BLOCK:
            return None, f"the hidden size {table.dims[1]} is not a whole number of blocks of {EMBEDDING_BLOCK}"
        return node, ""
    return None, "no Gather of a float initializer by a graph input (no token embedding table) in the graph"


def embedding_codes(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [V, D], scales float32 [V, D / EMBEDDING_BLOCK]) on Q8_0's symmetric grid."""
    vocab, hidden = table.shape
    codes = np.empty((vocab, hidden), np.int8)
    scales = np.empty((vocab, hidden // EMBEDDING_BLOCK), np.float32)
    for start in range(0, vocab, _ROWS_AT_ONCE):
        blocks = table[start:start + _ROWS_AT_ONCE].astype(np.float32).reshape(-1, hidden // EMBEDDING_BLOCK,
                                                                                EMBEDDING_BLOCK)
        scale = np.abs(blocks).max(axis=-1) / 127.0
        safe = np.where(scale > 0, scale, 1.0)
        codes[start:start + len(blocks)] = np.clip(np.rint(blocks / safe[..., None]), -127, 127).reshape(
            len(blocks), hidden)
        scales[start:start + len(blocks)] = scale
    return codes, scales


def dequantized(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 table the codes stand for (what GatherBlockQuantized returns for each row)."""
    vocab, hidden = codes.shape
    blocks = codes.astype(np.float32).reshape(vocab, -1, EMBEDDING_BLOCK) * scales[..., None]
    return blocks.reshape(vocab, hidden)


def quantize_embedding(path: str | Path) -> dict:
    """The token embedding of the ONNX model at ``path`` in 8 bits, rewritten in place. Returns
    the recipe's ``embedding`` settings: what was stored, or why the table stayed float."""
    path = Path(path)
    model = onnx.load(str(path))
    graph = model.graph
    node, why = token_embedding(graph)
    if node is None:
        return {"dtype": "float32", "why": why}
    table_proto = next(t for t in graph.initializer if t.name == node.input[0])
    table = numpy_helper.to_array(table_proto)
    codes, scales = embedding_codes(table)
    data_name, scale_name = f"{table_proto.name}_Q8", f"{table_proto.name}_embedding_scales"
    stored = (codes.view(np.uint8) ^ np.uint8(0x80))   # code + 128: the operator's default zero point
    keep = [t for t in graph.initializer if t.name != table_proto.name]
    del graph.initializer[:]
    graph.initializer.extend(keep + [numpy_helper.from_array(stored, data_name),
                                     numpy_helper.from_array(scales, scale_name)])
    quantized = helper.make_node("GatherBlockQuantized", [data_name, node.input[1], scale_name], list(node.output),
                                 name=f"{node.name or 'embedding'}_Q8", domain="com.microsoft", bits=8,
                                 block_size=EMBEDDING_BLOCK, gather_axis=0, quantize_axis=1)
    at = list(graph.node).index(node)
    graph.node.remove(node)
    graph.node.insert(at, quantized)
    if not any(imp.domain == "com.microsoft" for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    write_model_streaming(model, path)
    return {"dtype": "int8", "op": "com.microsoft.GatherBlockQuantized", "table": table_proto.name,
            "shape": list(table.shape), "block_size": EMBEDDING_BLOCK,
            "grid": "symmetric, one float32 scale per block (max |w| / 127), uint8 code + 128",
            "bytes_float32": int(table.nbytes), "bytes_int8": int(stored.nbytes + scales.nbytes)}
