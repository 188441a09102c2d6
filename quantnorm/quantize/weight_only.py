"""Weight-only quantization: each weight MatMul becomes ONNX Runtime's ``com.microsoft.MatMulNBits``.

What llama.cpp (Q8_0, Q4_0) and ONNX Runtime GenAI's INT4 models deploy instead of W8A8: the
weights in 4 or 8 bits with one scale per block of ``block_size`` weights along K (per output
channel), the activations left float (``accuracy_level`` 0: the kernel dequantizes the weights)
or quantized to int8 per block along K at run time (``accuracy_level`` 4: an int8 GEMM, ORT
GenAI's CPU default).

The codes come from three roundings on the same kind of grid:

- ``nearest``: ORT's own ``MatMulNBitsQuantizer`` (``DefaultWeightOnlyQuantConfig``). Symmetric:
  per block and column ``s = w* / qmin`` where ``w*`` is the weight of largest magnitude (so the
  scale carries its sign and ``w*`` gets the code ``qmin``, -8 or -128), codes in
  ``[qmin, -qmin - 1]``, stored as ``code - qmin`` (no zero-point input: the default zero point).
  Asymmetric (``-asym``): the block's min..max on the unsigned codes, a uint8 zero point per block;
- ``gptq``: GPTQ's error-compensating rounding (``transforms.gptq``) against ``X^T X`` of the
  calibration windows, on that same grid (scales from the weights, only the codes differ), packed
  here in ORT's layout (a test checks the packing against ORT's round-to-nearest, code for code);
- ``hqq``: ORT's HQQ quantizer (4 bits; uint4 codes with a float scale and zero point per block).

The LM head (the weight MatMul the ``logits`` output is computed from) is quantized or kept
float as the recipe says; the embedding is a Gather, float unless the recipe's name ends ``-emb8``
(``quantize.embedding``, after this module, for every kind of recipe).
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ConfigError, QuantnormError
from ..measure.block_sqnr import activation_block_sqnr
from ..onnx_wire import write_model_streaming
from ..transforms.gptq import DAMP, collect_hessians, gptq_block_codes
from .recipes import Recipe

LOGITS = "logits"


def quantize_weight_only(pre_path, q_path, recipe: Recipe, to_quantize: list[str], calib_inputs) -> dict:
    """Quantize the weight MatMuls named in ``to_quantize`` of the model at ``pre_path`` (the LM
    head left out where the recipe keeps it float) into ``q_path``. Returns what was done, for
    ``recipes[].settings``."""
    model = onnx.load(str(pre_path))
    head = head_matmuls(model.graph, to_quantize)
    if not recipe.quantize_head:
        to_quantize = [n for n in to_quantize if n not in set(head)]
        if not to_quantize:
            raise ConfigError(f"recipe {recipe.name}: nothing is left to quantize once the LM head is kept float")
    done: dict = {"head_nodes": head or "none found (no weight MatMul computes a 'logits' output)"}
    if recipe.weight_rounding == "gptq":
        done.update(_gptq(model, pre_path, recipe, to_quantize, calib_inputs))
    else:
        wanted = set(to_quantize)
        keep = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in wanted]
        model = _ort_quantizer(model, recipe, keep)
    replaced = [n.name for n in model.graph.node if n.op_type == "MatMulNBits"]
    if len(replaced) != len(to_quantize):
        left = sorted(set(to_quantize) - {n.removesuffix(f"_Q{recipe.weight_bits}") for n in replaced})
        raise ConfigError(f"recipe {recipe.name}: {len(left)} weight MatMul(s) could not become MatMulNBits "
                          f"(a weight that is not 2-D?): {', '.join(left[:5])}")
    write_model_streaming(model, q_path)
    return {**done, "quantized_nodes": to_quantize, "matmulnbits_nodes": len(replaced)}


BLOCK_SQNR_WINDOWS = 8


def activation_blocks(pre_path, recipe: Recipe, nodes: list[str], calib_inputs, cache) -> dict | None:
    """accuracy_level 4 only: the per-block int8 SQNR of the quantized MatMuls' inputs on the first
    calibration windows (``measure.block_sqnr``), once per FP32 model, block size and node set in a
    run (``cache``: the run's ``PreprocessCache``, whose ``ranges`` keeps computed results)."""
    if recipe.accuracy_level != 4:
        return None
    if calib_inputs is None or len(calib_inputs) == 0:
        return {"status": "not measured: no calibration windows were given"}
    windows = np.ascontiguousarray(np.asarray(calib_inputs, dtype=np.int64)[:BLOCK_SQNR_WINDOWS])
    key = ("block-sqnr", str(pre_path), recipe.block_size, tuple(nodes), hashlib.sha256(windows.tobytes()).hexdigest())
    try:
        return {"status": "measured", **cache.ranges(key, lambda: activation_block_sqnr(pre_path, windows,
                                                                                         recipe.block_size, nodes))}
    except QuantnormError as exc:
        return {"status": f"not measured: {' '.join(str(exc).split())[:300]}"}


def head_matmuls(graph: onnx.GraphProto, weight_matmuls: list[str]) -> list[str]:
    """The weight MatMuls that compute the ``logits`` output: walking back from it, the first
    weight MatMul on each path (a softcap, a bias or a reshape may sit after the head). None when
    the graph has no ``logits`` output (an encoder's embeddings)."""
    if LOGITS not in {o.name for o in graph.output}:
        return []
    producer = {o: n for n in graph.node for o in n.output}
    weights = set(weight_matmuls)
    found, seen, todo = [], set(), deque([LOGITS])
    while todo:
        node = producer.get(todo.popleft())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type == "MatMul" and node.name in weights:
            found.append(node.name)
            continue
        todo.extend(node.input)
    order = {n.name: i for i, n in enumerate(graph.node)}
    return sorted(found, key=order.get)


def _ort_quantizer(model: onnx.ModelProto, recipe: Recipe, keep: list[str]) -> onnx.ModelProto:
    """ORT's MatMulNBitsQuantizer (round-to-nearest or HQQ) on every MatMul but those in ``keep``."""
    root = logging.getLogger()
    saved = root.handlers[:]
    # Imported with a handler in place: the module calls logging.basicConfig(level=INFO) on import,
    # which would set the root logger to INFO for the rest of the process.
    root.handlers = saved or [logging.NullHandler()]
    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            HQQWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )

        if recipe.weight_rounding == "hqq":
            config = HQQWeightOnlyQuantConfig(block_size=recipe.block_size, bits=recipe.weight_bits)
        else:
            config = DefaultWeightOnlyQuantConfig(block_size=recipe.block_size, is_symmetric=recipe.weight_symmetric,
                                                  accuracy_level=recipe.accuracy_level, bits=recipe.weight_bits)
        quantizer = MatMulNBitsQuantizer(model, algo_config=config, nodes_to_exclude=keep)
        quantizer.process()
        return quantizer.model.model
    finally:
        quiet.setLevel(level)
        root.handlers = saved


def _gptq(model: onnx.ModelProto, pre_path, recipe: Recipe, nodes: list[str], calib_inputs) -> dict:
    """GPTQ codes on ORT's symmetric block grid, written as MatMulNBits nodes in ``model``."""
    if calib_inputs is None or len(calib_inputs) == 0:
        raise ConfigError(f"recipe {recipe.name}: GPTQ rounding needs calibration windows (got none)")
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    wanted = set(nodes)
    matmuls = [n for n in graph.node if n.name in wanted and n.op_type == "MatMul" and n.input[1] in inits]
    hessians, rows = collect_hessians(pre_path, sorted({n.input[0] for n in matmuls}), calib_inputs)
    new_nodes, new_inits = [], []
    for node in graph.node:
        if node.name not in wanted or node.op_type != "MatMul":
            new_nodes.append(node)
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        if weight.ndim != 2:
            new_nodes.append(node)
            continue
        codes, scales = gptq_block_codes(weight, hessians[node.input[0]], recipe.weight_bits, recipe.block_size)
        packed, scales = pack_nbits(codes, scales, recipe.weight_bits, recipe.block_size)
        b, s = f"{node.input[1]}_Q{recipe.weight_bits}", f"{node.input[1]}_scales"
        new_inits += [numpy_helper.from_array(packed, b), numpy_helper.from_array(scales, s)]
        new_nodes.append(matmul_nbits(node, b, s, weight.shape, recipe))
    still_read = {i for n in new_nodes for i in n.input}
    kept = [i for i in graph.initializer if i.name in still_read]
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    if not any(imp.domain == "com.microsoft" for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {"gptq": {"damp": DAMP, "calibration_positions": rows, "grid": "ORT's symmetric block grid (scales from "
                     "the weights), codes by GPTQ against X^T X of the calibration windows"}}


def matmul_nbits(node: onnx.NodeProto, b: str, scales: str, shape: tuple[int, int], recipe: Recipe) -> onnx.NodeProto:
    """The MatMulNBits node that replaces ``node`` (named as ORT's quantizer names it)."""
    extra = {"accuracy_level": recipe.accuracy_level} if recipe.accuracy_level else {}
    return helper.make_node("MatMulNBits", [node.input[0], b, scales], [node.output[0]],
                            name=f"{node.name}_Q{recipe.weight_bits}", domain="com.microsoft",
                            K=int(shape[0]), N=int(shape[1]), bits=recipe.weight_bits,
                            block_size=recipe.block_size, **extra)


def pack_nbits(codes: np.ndarray, scales: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' B and scales from signed ``codes`` [K, N] and ``scales`` [K / block, N]:
    B uint8 [N, blocks, block * bits / 8] (code - qmin; two 4-bit codes a byte, the first in the
    low nibble; the rows that pad K to whole blocks stored as 0, as ORT's quantizer leaves them),
    scales float32 [N, blocks]."""
    k_dim, n_dim = codes.shape
    blocks = -(-k_dim // block)
    padded = np.zeros((blocks * block, n_dim), dtype=np.int16)
    padded[:k_dim] = codes.astype(np.int16) + (1 << (bits - 1))
    stored = padded.T.reshape(n_dim, blocks, block).astype(np.uint8)
    if bits == 4:
        stored = stored[..., 0::2] | (stored[..., 1::2] << 4)
    return np.ascontiguousarray(stored), np.ascontiguousarray(scales.T.astype(np.float32))
