"""What a per-row activation scale costs in ONNX Runtime's fused INT8 GEMM, and the row max.

    python benchmarks/pertoken_kernel.py [--threads 2] [--iters 30]

Prints one table. ``com.microsoft.MatMulIntegerToFloat`` folds a scalar activation scale (and the
per-column weight scales) into the GEMM's output processor, while a per-row scale ``[M, 1]`` is
applied afterwards in a second pass over the whole output. That pass is why the calnorm recipes
give the norm outputs one calibrated scale (quantnorm/quantize/recipes.py, NORM_INPUT_SCALES). The
shapes are SmolLM2-135M's at batch 8 x 128 tokens: q/o (576 -> 576), gate/up (576 -> 1536), down
(1536 -> 576), k/v (576 -> 192), the head (576 -> 49,152). The second table is the per-row max |x|
of the per-token quantizer: ``ReduceMax(Abs(x))`` against ``max(ReduceMax(x), -ReduceMin(x))``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = [("q, o", 576, 576), ("gate, up", 576, 1536), ("down", 1536, 576), ("k, v", 576, 192),
          ("head", 576, 49152)]
ROWS = 8 * 128


def session(nodes, inputs, output_type, inits, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", output_type, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # ORT 1.31 refuses onnx 1.23's default IR version (PITFALLS.md 14)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def p50_ms(sess, feed, iters: int) -> float:
    for _ in range(3):
        sess.run(None, feed)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def gemm(k: int, n: int, per_row: bool, threads: int, iters: int) -> float:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-127, 128, size=(k, n), dtype=np.int8), "W"),
             numpy_helper.from_array(rng.random(n).astype(np.float32) * 0.01, "w_scale"),
             numpy_helper.from_array(np.array(128, np.uint8), "zp")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.UINT8, [ROWS, k])]
    feed = {"x": rng.integers(0, 256, size=(ROWS, k), dtype=np.uint8)}
    if per_row:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [ROWS, 1]))
        feed["s"] = rng.random((ROWS, 1)).astype(np.float32)
    else:
        inits.append(numpy_helper.from_array(np.array(0.01, np.float32), "s"))
    node = helper.make_node("MatMulIntegerToFloat", ["x", "W", "s", "w_scale", "zp"], ["y"], domain="com.microsoft")
    return p50_ms(session([node], inputs, TensorProto.FLOAT, inits, threads), feed, iters)


def row_max(k: int, fused: bool, threads: int, iters: int) -> float:
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    if fused:
        nodes = [helper.make_node("ReduceMax", ["x", "axes"], ["hi"], keepdims=1),
                 helper.make_node("ReduceMin", ["x", "axes"], ["lo"], keepdims=1),
                 helper.make_node("Neg", ["lo"], ["neg"]), helper.make_node("Max", ["hi", "neg"], ["y"])]
    else:
        nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("ReduceMax", ["a", "axes"], ["y"], keepdims=1)]
    x = np.random.default_rng(0).standard_normal((8, 128, k)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 128, k])]
    return p50_ms(session(nodes, inputs, TensorProto.FLOAT, [axes], threads), {"x": x}, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--iters", type=int, default=30, help="timed runs per cell (p50 reported)")
    opts = parser.parse_args()
    print(f"onnxruntime {ort.__version__}, {opts.threads} threads, {ROWS} rows (batch 8 x 128), p50 of {opts.iters}")
    print()
    print("| Linear | K x N | scalar scale ms | per-row scale ms | per-row / scalar |")
    print("|---|---|---|---|---|")
    for name, k, n in SHAPES:
        scalar = gemm(k, n, False, opts.threads, opts.iters)
        per_row = gemm(k, n, True, opts.threads, opts.iters)
        print(f"| {name} | {k} x {n} | {scalar:.2f} | {per_row:.2f} | {per_row / scalar:.2f} |")
    print()
    print("| row max |x| of [8, 128, K] | Abs + ReduceMax ms | ReduceMax, ReduceMin ms |")
    print("|---|---|---|")
    for k in (576, 1536):
        print(f"| K = {k} | {row_max(k, False, opts.threads, opts.iters):.3f} | {row_max(k, True, opts.threads, opts.iters):.3f} |")


if __name__ == "__main__":
    main()
