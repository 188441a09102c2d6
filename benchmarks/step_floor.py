"""What one generation step (one row, batch 1) costs at least with ONNX Runtime's CPU kernels.

    python benchmarks/step_floor.py [--model smollm2|gemma3] [--cache 192] [--blocks 32,128]
                                    [--threads 2] [--iters 30] [--llamacpp-gen-tps TPS]

A decode step of one row is, per layer, its weight products, attention over the cache, and small
float work besides (norms, the online Hadamard, the activation, adds, reshapes), then the LM head.
This times the products and the attention on the checkpoint's shapes alone, as the two 8-bit
deployments run them, and sums them over the layers:

- ``one-row``: ``com.microsoft.DynamicQuantizeMatMul`` (the row quantized to uint8 over its
  min..max, int8 weights with a scale per column), the products that read one input packed
  (q, k, v; gate, up), as ``generation/one_row.py`` writes the per-token recipe's token graph;
- ``weight-only bB``: ``com.microsoft.MatMulNBits`` with 8-bit codes, blocks of B (``--blocks``)
  with a float scale each, accuracy_level 4 (int8 activations per block), packed the same way, as
  the ``wo-int8-bB-acc4`` recipes deploy (the block is a kernel setting as much as a format one:
  a block of 128 runs its int8 dot products four times as long between float rescales).

Each product runs over as many weights of its own as the model has layers (one session, one run
each: a weight timed alone stays in the cache, a model's come from memory); the head once. p50 of
``--iters`` runs. The attention is ``com.microsoft.GroupQueryAttention`` at one new token against
a cache of ``--cache`` tokens in one shared buffer, with its rotary embedding (what the with-past
graph deploys). The sum is a floor under any graph of these operators on this CPU: the graph adds
its small operators and ONNX Runtime's own time per node. MB and GB/s: the weight bytes a kernel
reads (codes and scales) and the rate it streams them at. With ``--llamacpp-gen-tps`` (llama.cpp
Q8_0's generation tokens/s on this machine, ``benchmarks/vs_llamacpp.py``) it prints the step time
the issue's goal (as fast as Q8_0) allows against each floor.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pertoken_kernel import p50_ms  # noqa: E402  (benchmarks/: the script's own folder)
from prompt_floor import ISA, MODELS, Shapes, floor_arguments, parse_floor_arguments, session  # noqa: E402

from quantnorm.hardware import cpu_flags, cpu_model  # noqa: E402


def products(m: Shapes) -> list[tuple[str, int, int]]:
    """One layer's weight products as deployed, packed where they read one input: (name, K, N)."""
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    return [("q, k, v packed", m.hidden, qkv), ("o", m.heads * m.head_dim, m.hidden),
            ("gate, up packed", m.hidden, 2 * m.intermediate), ("down", m.intermediate, m.hidden)]


def product(kind: str, k: int, n: int, threads: int, iters: int, copies: int = 1) -> tuple[float, int]:
    """One row [1, 1, k] by ``copies`` weights [k, n] of their own in one run, ``kind`` "one-row"
    or "weight-only b<B>": (ms per product, weight bytes per product)."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    for i in range(copies):
        if kind == "one-row":
            inits += [numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), f"W{i}"),
                      numpy_helper.from_array(rng.random(n, dtype=np.float32) * 0.01, f"ws{i}")]
            nodes.append(helper.make_node("DynamicQuantizeMatMul", ["x", f"W{i}", f"ws{i}"], [f"y{i}"],
                                          domain="com.microsoft"))
        else:
            block = int(kind.rsplit(" b", 1)[1])
            blocks = -(-k // block)   # a last block K does not fill is padded, as ORT's quantizer pads it
            inits += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block), dtype=np.uint8), f"W{i}"),
                      numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) * 0.01, f"ws{i}")]
            nodes.append(helper.make_node("MatMulNBits", ["x", f"W{i}", f"ws{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=k, N=n, bits=8, block_size=block, accuracy_level=4))
    weight_bytes = sum(len(t.raw_data) for t in inits) // copies
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])]
    sess = session(nodes, inputs, inits, threads, outputs=[n.output[0] for n in nodes])
    x = rng.standard_normal((1, 1, k), dtype=np.float32)
    return p50_ms(sess, {"x": x}, iters) / copies, weight_bytes


def one_row_attention(m: Shapes, cache: int, threads: int, iters: int) -> float:
    """One layer's ``GroupQueryAttention`` for one new token after ``cache - 1`` in a shared buffer
    of ``cache`` positions."""
    rng = np.random.default_rng(0)
    h, kv, d = m.heads, m.kv_heads, m.head_dim
    vi, f32 = helper.make_tensor_value_info, TensorProto.FLOAT
    q, k, v = (rng.standard_normal((1, 1, n * d), dtype=np.float32) for n in (h, kv, kv))
    past = rng.standard_normal((1, kv, cache, d), dtype=np.float32)
    table = rng.random((cache, d // 2), dtype=np.float32)
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "lens", "total", "cos", "sin"],
                            ["y", "pko", "pvo"], domain="com.microsoft", num_heads=h, kv_num_heads=kv,
                            do_rotary=1, scale=d ** -0.5)
    feed = {"q": q, "k": k, "v": v, "pk": past, "pv": past.copy(), "lens": np.array([cache - 1], np.int32),
            "total": np.array(cache, np.int32)}
    inputs = [vi("q", f32, q.shape), vi("k", f32, k.shape), vi("v", f32, v.shape), vi("pk", f32, past.shape),
              vi("pv", f32, past.shape), vi("lens", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])]
    inits = [numpy_helper.from_array(table, "cos"), numpy_helper.from_array(table, "sin")]
    return p50_ms(session([node], inputs, inits, threads), feed, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    floor_arguments(parser, ("--cache", 192, "tokens in the cache the step attends to (default 192: the middle "
                                             "of a 128-token prompt's 128 new tokens)"),
                    ("--llamacpp-gen-tps", "llama.cpp Q8_0's generation tokens/s on this machine: print the step "
                                           "time it takes"))
    parser.add_argument("--blocks", default="32,128",
                        help="the weight-only recipes' blocks to time, comma-separated powers of two >= 16 "
                             "(default 32,128)")
    opts = parse_floor_arguments(parser, "--cache", "--llamacpp-gen-tps")
    try:
        blocks = [int(b) for b in opts.blocks.split(",")]
    except ValueError:
        blocks = []
    if not blocks or any(b < 16 or b & (b - 1) for b in blocks):
        parser.error(f"--blocks {opts.blocks!r}: give powers of two >= 16, comma-separated (e.g. 32,128)")
    kinds = ["one-row", *(f"weight-only b{b}" for b in blocks)]
    m = MODELS[opts.model]
    flags = set(cpu_flags())
    print(f"CPU: {cpu_model()} ({', '.join(f for f in ISA if f in flags) or 'none of ' + '/'.join(ISA)}); "
          f"onnxruntime {ort.__version__}, {opts.threads} threads; {opts.model}: {m.layers} layers, vocabulary "
          f"{m.vocab:,}, one row against a cache of {opts.cache}; p50 of {opts.iters} runs per kernel")
    attention_ms = one_row_attention(m, opts.cache, opts.threads, opts.iters) * m.layers
    floors = {}
    for kind in kinds:
        print(f"\n| {kind} product (one row; {m.layers} weights each) | K x N | per layer ms | x layers ms | MB | GB/s |")
        print("|---|---|---|---|---|---|")
        total_ms = total_bytes = 0.0
        for name, k, n in products(m):
            ms, size = product(kind, k, n, opts.threads, opts.iters, copies=m.layers)
            total_ms, total_bytes = total_ms + ms * m.layers, total_bytes + size * m.layers
            print(f"| {name} | {k} x {n} | {ms:.3f} | {ms * m.layers:.2f} | {size * m.layers / 1e6:.1f} | "
                  f"{size / ms / 1e6:.1f} |")
        head_ms, head_bytes = product(kind, m.hidden, m.vocab, opts.threads, opts.iters)
        print(f"| LM head | {m.hidden} x {m.vocab} | | {head_ms:.2f} | {head_bytes / 1e6:.1f} | "
              f"{head_bytes / head_ms / 1e6:.1f} |")
        total_ms, total_bytes = total_ms + head_ms, total_bytes + head_bytes
        print(f"| all products | | | **{total_ms:.2f}** | {total_bytes / 1e6:.1f} | {total_bytes / total_ms / 1e6:.1f} |")
        floors[kind] = total_ms + attention_ms
    print(f"\nGroupQueryAttention, one row against {opts.cache}: {attention_ms / m.layers:.3f} ms a layer, "
          f"{attention_ms:.2f} ms x {m.layers} layers")
    for kind in kinds:
        print(f"floor, {kind}: products + attention = {floors[kind]:.2f} ms a step "
              f"({1e3 / floors[kind]:,.1f} tokens/s at most), before norms, the online Hadamard, the activation, "
              "the adds and ONNX Runtime's time per node")
    if opts.llamacpp_gen_tps:
        allowed = 1e3 / opts.llamacpp_gen_tps
        for kind in kinds:
            print(f"llama.cpp's {opts.llamacpp_gen_tps:,.1f} generation tokens/s is {allowed:.2f} ms a step: the "
                  f"{kind} floor is {floors[kind] / allowed:.2f}x that "
                  f"({'within' if floors[kind] <= allowed else 'over'} it)")


if __name__ == "__main__":
    main()
