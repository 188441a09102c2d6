"""A run's pick, bundled and generated from in ONNX Runtime GenAI, token for token against quantnorm.

    python tools/bundle_check.py runs/real-models/gemma3 [--recipe auto] [--new-tokens 32]

Bundles ``--recipe`` of the run (``quantnorm bundle``, into a temporary directory), loads the
bundle with ``onnxruntime_genai.Model``, encodes each prompt with the bundle's own tokenizer
(``og.Tokenizer``), generates greedily with ``og.Generator`` and compares the tokens with
quantnorm's own decode loop on the same with-past graph (a split deployment's two graphs, each in
its phase; cut after an end-of-sequence token, where the runtime stops). Writes ``bundle_check.json`` into the run directory (what
tools/publish_real_models.py quotes) and prints one line per prompt. Exit 0 when every prompt's
tokens are identical, 1 when one differs, 2 on bad input.

Needs the ortgenai extra: ``pip install --no-deps onnxruntime-genai==0.18.0``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from quantnorm.errors import QuantnormError
from quantnorm.fileio import write_json_atomic
from quantnorm.generation import DecodeSession, greedy_decode
from quantnorm.generation.bundle import MODEL_FILE, PROMPT_MODEL_FILE, write_bundle

# Two prompts a small instruction-tuned or base model continues with text of its own.
PROMPTS = ("The three most common uses of a hash table are", "def fibonacci(n):\n    \"\"\"Return the n-th")
OUT_FILE = "bundle_check.json"


def eos_ids(bundle: Path) -> set[int]:
    """The end-of-sequence ids the runtime stops at (genai_config.json's, as the bundle wrote it)."""
    eos = json.loads((bundle / "genai_config.json").read_text())["model"]["eos_token_id"]
    return set(eos) if isinstance(eos, list) else {int(eos)}


def genai_greedy(og, model, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """The runtime's greedy tokens after ``prompt`` and its wall time (prompt + generation)."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
    started = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    seconds = time.perf_counter() - started
    return [int(t) for t in generator.get_sequence(0)][len(prompt):], seconds


def quantnorm_greedy(bundle: Path, prompt: list[int], new_tokens: int, stop: set[int], threads: int) -> list[int]:
    """quantnorm's decode loop on the bundle's graph (a split bundle's: the prompt on prompt.onnx,
    each new token on model.onnx, as the runtime's pipeline runs them)."""
    split = (bundle / PROMPT_MODEL_FILE).is_file()
    runner = DecodeSession(bundle / MODEL_FILE, threads=threads,
                           prompt_model=bundle / PROMPT_MODEL_FILE if split else None)
    tokens = [int(t) for t in greedy_decode(runner, np.array([prompt]), new_tokens)[0]]
    end = next((i for i, t in enumerate(tokens) if t in stop), None)
    return tokens if end is None else tokens[:end + 1]


def check(run_dir: Path, recipe: str, new_tokens: int, threads: int) -> dict:
    import onnxruntime_genai as og

    with tempfile.TemporaryDirectory(prefix="bundle-check-") as tmp:
        bundle = write_bundle(run_dir, recipe, Path(tmp) / "bundle")
        model = og.Model(str(bundle.path))
        tokenizer = og.Tokenizer(model)
        stop = eos_ids(bundle.path)
        rows = []
        for text in PROMPTS:
            prompt = [int(t) for t in tokenizer.encode(text)]
            ours = quantnorm_greedy(bundle.path, prompt, new_tokens, stop, threads)
            theirs, seconds = genai_greedy(og, model, prompt, new_tokens)
            rows.append({"prompt": text, "prompt_tokens": len(prompt), "tokens_genai": theirs,
                         "tokens_quantnorm": ours, "identical": theirs == ours,
                         "text_genai": tokenizer.decode(np.array(theirs, dtype=np.int32)),
                         "genai_seconds": round(seconds, 3)})
        return {"run": run_dir.name, "recipe": recipe, "bundled": bundle.name,
                "runtime": f"onnxruntime-genai {version('onnxruntime-genai')}", "new_tokens": new_tokens,
                "command": f"python tools/bundle_check.py RUN --recipe {recipe} --new-tokens {new_tokens}",
                "prompts": rows, "identical": all(r["identical"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory of `quantnorm evaluate --model` with generation")
    parser.add_argument("--recipe", default="auto", help="a recipe with a with-past graph, auto or fp32 (default auto)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    parser.add_argument("--threads", type=int, default=2, help="quantnorm's decode threads (default 2)")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        print("error: --new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        print("error: onnxruntime-genai is not installed: pip install --no-deps onnxruntime-genai==0.18.0",
              file=sys.stderr)
        return 2
    try:
        result = check(args.run_dir, args.recipe, args.new_tokens, args.threads)
    except QuantnormError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_json_atomic(args.run_dir / OUT_FILE, result)
    for row in result["prompts"]:
        print(f"{'identical' if row['identical'] else 'DIFFERENT'}: {row['prompt']!r} -> "
              f"{len(row['tokens_genai'])} tokens in {result['runtime']}: {row['text_genai']!r}")
    print(f"{result['bundled']}: {'every prompt identical' if result['identical'] else 'tokens differ'} "
          f"({args.run_dir / OUT_FILE})")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
