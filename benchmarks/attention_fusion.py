"""What ONNX Runtime's GroupQueryAttention buys a decode step: the same checkpoint's with-past graph
exported with its attention as exported and fused, quantized alike, timed side by side, the fused
one with and without a cache buffer shared by past and present.

    python benchmarks/attention_fusion.py runs/<a quantnorm evaluate --model run> \
        [--recipes pertoken-fused,wo-int8-b32-acc4] [--threads 2] [--rounds 3] [--prompt 128] [--new 128]

The positional argument is a run directory of ``quantnorm evaluate --model`` (its ``checkpoint/``,
the Hugging Face directory a GGUF was dequantized into) or a Hugging Face checkpoint directory.
The with-past graph is exported twice through the generation stage's exporter
(``export_with_past``): ``fuse_attention=False`` (standard ONNX operators, as exported) and the
default (each layer's attention core one ``com.microsoft.GroupQueryAttention`` node); each export
passes the parity gate against PyTorch. Both are quantized with each recipe by the stage's own
``quantize`` (recipes that need no torch transform and no calibration: per-token INT8 and
weight-only 8-bit with int8 activations), then every graph decodes a 128-token prompt and 128 new
tokens at batch 1 in ``--rounds`` interleaved rounds (``decode_speed``; each row keeps its best
round: a neighbour's load only slows a round down). A fused graph is timed twice: with a fresh
present written each step, and with one cache buffer per layer bound as both past and present,
which the operator appends to in place (``DecodeSession``'s shared cache, the default); a
quantized recipe's fused graph a third time with its query, key and value projections packed
into one product (``qkv_packing``, as the generation stage writes it). Prints the
CPU, its ISA flags, the threads, and per graph its node count, prompt and generation tokens/s,
and generation against the same recipe as exported.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from quantnorm.errors import QuantnormError
from quantnorm.generation import HFWithPast, export_with_past
from quantnorm.generation.qkv_packing import pack_qkv_file
from quantnorm.generation.speed import decode_speed
from quantnorm.hardware import cpu_flags, cpu_has_vnni, cpu_model
from quantnorm.measure.sessions import SessionSpec
from quantnorm.quantize.ort_backend import quantize
from quantnorm.quantize.recipes import get_recipe

ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def checkpoint_dir(path: Path) -> Path:
    for candidate in (path / "checkpoint", path):
        if (candidate / "config.json").is_file():
            return candidate
    fail(f"{path} is neither a quantnorm evaluate --model run (no checkpoint/config.json) nor a Hugging Face "
         f"checkpoint (no config.json); run `quantnorm evaluate --model ...` first")


def node_count(path: Path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a quantnorm evaluate --model run directory, or a HF checkpoint")
    parser.add_argument("--recipes", default="pertoken-fused,wo-int8-b32-acc4",
                        help="recipes applied to both graphs (no torch transform, no calibration)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every session")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (best kept per row)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (batch 1)")
    parser.add_argument("--new", type=int, default=128, help="generated tokens")
    args = parser.parse_args()
    recipes = {}
    for name in [r for r in args.recipes.split(",") if r]:
        try:
            recipes[name] = get_recipe(name)
        except QuantnormError as exc:
            fail(str(exc))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(args.run), dtype="float32").eval()
    wrapper = HFWithPast(model)
    rng = np.random.default_rng(0)
    parity = rng.integers(0, wrapper.vocab_size, size=(2, 16), dtype=np.int64)
    windows = rng.integers(0, wrapper.vocab_size, size=(4, 64), dtype=np.int64)
    prompts = rng.integers(0, wrapper.vocab_size, size=(1, args.prompt), dtype=np.int64)
    graphs: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="attention-fusion-") as tmp:
        for form, fuse in (("as exported", False), ("fused", True)):
            path = Path(tmp) / f"fp32.{'fused' if fuse else 'plain'}.past.onnx"
            result = export_with_past(wrapper, path, parity, fuse_attention=fuse)
            print(f"export {form}: {result.to_dict()['attention']}; parity max |diff| "
                  f"{max(result.max_abs_diff.values()):.2e}", flush=True)
            graphs[f"fp32 ({form})"] = path
            for name, recipe in recipes.items():
                q = quantize(path, recipe, windows, path.with_name(f"{name}.{path.name}"),
                             vnni=cpu_has_vnni(), probe_inputs=windows[:1], diagnostics=False)
                if q.status != "ok":
                    fail(f"{name} on the {form} graph: {q.status} {q.problems}")
                graphs[f"{name} ({form})"] = q.path
                if fuse:   # the generation stage's next pass: q, k and v from one MatMulNBits
                    packed = q.path.with_name(f"packed.{q.path.name}")
                    shutil.copyfile(q.path, packed)
                    if pack_qkv_file(packed):
                        graphs[f"{name} (fused, packed qkv)"] = packed
        del model, wrapper
        spec = SessionSpec(threads=args.threads)
        # the fused graph twice: a fresh present each step, and one buffer the operator appends to
        timed = {}
        for key, path in graphs.items():
            if key.endswith("(fused, packed qkv)"):
                timed[key.replace("packed qkv)", "packed qkv, shared buffer)")] = (path, True)
            elif key.endswith("(fused)"):
                timed[key.replace("(fused)", "(fused, present per step)")] = (path, False)
                timed[key.replace("(fused)", "(fused, shared buffer)")] = (path, True)
            else:
                timed[key] = (path, False)
        rows: dict[str, list[dict]] = {key: [] for key in timed}
        for _ in range(args.rounds):
            for key, (path, shared) in timed.items():
                rows[key].append(decode_speed(path, prompts, new_tokens=args.new, spec=spec, rounds=1,
                                              shared_cache=shared))
        best = {key: max(runs, key=lambda r: r["gen_tokens_per_s"]) for key, runs in rows.items()}
        flags = [f for f in ISA if f in cpu_flags()]
        print(f"\nCPU: {cpu_model()}; ISA: {', '.join(flags)}; threads: {args.threads}; batch 1, "
              f"{args.prompt}-token prompt, {args.new} new tokens; best of {args.rounds} interleaved rounds\n")
        print(f"{'graph':<48} {'nodes':>6} {'prompt tok/s':>12} {'gen tok/s':>10} {'gen / as exported':>18}  cache")
        for key, (path, _) in timed.items():
            row = best[key]
            base = key.split(" (")[0] + " (as exported)"
            ratio = f"{row['gen_tokens_per_s'] / best[base]['gen_tokens_per_s']:.3f}x" if base != key else ""
            print(f"{key:<48} {node_count(path):>6} {row['prompt_tokens_per_s']:>12,.0f} "
                  f"{row['gen_tokens_per_s']:>10,.1f} {ratio:>18}  {row['cache']}")


if __name__ == "__main__":
    main()
