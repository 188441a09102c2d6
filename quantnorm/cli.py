"""The ``quantnorm`` command line: parse, call the library, print. Nothing here computes.

Every error a user can fix becomes one line on stderr and exit code 2 (tracebacks with --debug).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import traceback
from dataclasses import replace
from pathlib import Path

import click

from . import __version__
from .cli_flags import _csv, _float_csv, _int_csv, _threshold, evaluate_config, evaluate_options
from .data import BUILTIN_PYDOC, DataConfig, evaluation_windows, prepare_data
from .errors import QuantnormError
from .evaluate import ensure_trained
from .evaluate import evaluate as run_evaluate
from .export import export_onnx, write_onnx_dir
from .fileio import write_json_atomic
from .gate import error_dict, run_baseline_gate, run_gate, write_error_outputs, write_outputs
from .generation.bundle import write_bundle
from .generation.speed import decode_bench, decode_table
from .measure.latency import bench_rounds
from .measure.sessions import SessionSpec, listed_providers, resolve_providers, short_provider
from .models import NORMS, PLACEMENTS, ModelConfig
from .policy import resolve_policy, with_baseline_flags
from .portable import PKG_PREFIX, portable_args, resolve_arg
from .quantize import DEFAULT_RECIPES, MASSIVE_DEFAULT_RECIPES, RECIPES
from .report import write_comparison, write_findings, write_report
from .report.terminal import summary_lines, summary_lines_model
from .results import load as load_results
from .runs import FP32_ONNX_FILE, check_out_dir, open_run_dir
from .sources import open_model  # imports no transformers until a checkpoint is loaded
from .sweep import SweepConfig, read_cell_config, run_sweep
from .train import RunConfig, TrainConfig, default_warmup, load_model
from .train import train as run_training

DEFAULT_MODEL = ModelConfig()
DEFAULT_TRAIN = TrainConfig()


# The training flags a sweep shares across its cells; the others (placement, norm, layers, warm-up,
# seed) are its axes, spelled in the plural.
SWEEP_TRAINING_FLAGS = ("--d-model", "--heads", "--context", "--steps", "--batch-size", "--lr", "--corpus")




def training_options(required: bool, only: tuple[str, ...] | None = None):
    """The flags that define a trained model (shared by ``train`` and ``evaluate``; ``sweep`` takes
    those in ``only``)."""
    t = DEFAULT_TRAIN
    options = [
        click.option("--placement", type=click.Choice(list(PLACEMENTS)), required=required,
                     help="Where the norm sits: post, pre, peri, deepnorm (DeepNet) or residual (ResiDual)."),
        click.option("--norm", type=click.Choice(list(NORMS)), required=required,
                     help="Which norm: layer (LayerNorm) or rms (RMSNorm)."),
        click.option("--layers", type=int, default=DEFAULT_MODEL.n_layers, show_default=True, help="Number of blocks."),
        click.option("--d-model", type=int, default=DEFAULT_MODEL.d_model, show_default=True, help="Hidden size."),
        click.option("--heads", type=int, default=DEFAULT_MODEL.n_heads, show_default=True,
                     help="Attention heads (must divide --d-model)."),
        click.option("--context", type=int, default=DEFAULT_MODEL.context, show_default=True,
                     help="Context length in bytes; also the evaluation window."),
        click.option("--steps", type=int, default=t.steps, show_default=True, help="Training steps."),
        click.option("--batch-size", type=int, default=t.batch_size, show_default=True, help="Windows per step."),
        click.option("--lr", type=float, default=t.lr, show_default=True, help="Peak learning rate (AdamW)."),
        click.option("--warmup", type=int, default=None,
                     help=f"Linear warm-up steps before cosine decay (0 = none). "
                          f"[default: {t.warmup}, or steps/4 when training is shorter than {4 * t.warmup} steps]"),
        click.option("--seed", type=int, default=t.seed, show_default=True, help="Seed for weights and batches."),
        click.option("--corpus", type=str, default=BUILTIN_PYDOC, show_default=True,
                     help="Training text: a file, a directory of files, or builtin:pydoc (CPython's docs)."),
    ]
    flags = ["--placement", "--norm", "--layers", "--d-model", "--heads", "--context", "--steps", "--batch-size", "--lr",
             "--warmup", "--seed", "--corpus"]
    if only is not None:
        options = [option for flag, option in zip(flags, options, strict=True) if flag in only]

    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def build_run_config(placement, norm, layers, d_model, heads, context, steps, batch_size, lr, warmup, seed, corpus):
    if warmup is None:
        warmup = default_warmup(steps)
    return RunConfig(
        model=ModelConfig(placement=placement, norm=norm, n_layers=layers, d_model=d_model, n_heads=heads, context=context),
        train=TrainConfig(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, seed=seed),
        data=DataConfig(corpus=corpus),
    )


def default_run_dir(run) -> Path:
    m, t = run.model, run.train
    return Path("runs") / f"{m.placement}-{m.norm}-L{m.n_layers}-d{m.d_model}-s{t.steps}-w{t.warmup}-seed{t.seed}"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="quantnorm")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """quantnorm: does a Transformer's normalization placement survive INT8 deployment?

    Train models that differ only in where the norm sits (post, pre, peri, deepnorm, residual)
    and which norm it is (layer, rms); export to ONNX; quantize to INT8; measure accuracy,
    latency and outliers; write a report; gate a CI deployment on the result.
    """
    ctx.obj = {"debug": debug}


@cli.command()
@training_options(required=True)
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run directory to write (default: runs/<placement>-<norm>-...).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train(out, quiet, **flags):
    """Train one model and write its checkpoint, config and per-step log.

    Example: quantnorm train --placement pre --norm rms --steps 400
    """
    run = build_run_config(**flags)
    out = check_out_dir(out or default_run_dir(run))
    result = run_training(run, out, progress=not quiet)
    if result.diverged:
        click.echo(f"{out}: diverged at step {result.diverged_at} (recorded in train.json)")
    else:
        click.echo(f"{out}: {result.steps} steps, train loss {result.final_train_loss:.3f} nats, "
                   f"eval {result.eval_bits_per_byte:.3f} bits/byte, {result.tokens_per_s:,.0f} tokens/s, "
                   f"{result.wall_s:.0f} s")




def _given_flags(ctx: click.Context, exempt: tuple[str, ...]) -> list[str]:
    """The options given on the command line (not left at their defaults), as their flags."""
    return [next((o for o in p.opts if o.startswith("--")), p.name) for p in ctx.command.params
            if p.name not in exempt and ctx.get_parameter_source(p.name) not in (None, click.core.ParameterSource.DEFAULT)]


_invocation: list[str] | None = None  # the arguments main() was given (None: sys.argv)


def _command_line() -> str:
    """The command as the user typed it (recorded in results.json, sweep.json and reports), with
    absolute paths made portable: relative to the working directory, or ``pkg:<dist>==<version>/...``
    inside an installed package (quantnorm/portable.py). A recorded command names no machine."""

    args = sys.argv[1:] if _invocation is None else _invocation
    return "quantnorm " + " ".join(shlex.quote(a) for a in portable_args(args))


def _resolve_packaged(argv: list[str]) -> list[str]:
    """``pkg:<dist>==<version>/<path>`` arguments (as recorded commands write packaged files) ->
    the path on this machine, so a recorded command reruns as it stands."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
        if value.startswith(PKG_PREFIX):
            value = resolve_arg(value)
        out.append(f"{flag}{eq}{value}" if eq else value)
    return out


@cli.command()
@training_options(required=False)
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Evaluate this trained run directory instead of training one (no training flags then).")
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="Evaluate a local model: a Hugging Face directory (config.json, safetensors, tokenizer; needs "
                   "quantnorm[hf]), an ONNX export directory (model.onnx + config.json + tokenizer, the layout "
                   "Optimum writes; use_cache=False; needs quantnorm[hf]) or a GGUF file (FILE.gguf, or the first part FILE.gguf.part00 of a split one; "
                   "dequantized to FP32 once and cached in the run directory; needs quantnorm[gguf]). --context is "
                   "then the window in tokens and --corpus the text.")
@click.option("--eval-tokens", type=click.IntRange(min=2), default=None,
              help="With --model: the evaluation budget in tokens (whole windows of --context tokens from the "
                   "evaluation range). [default: 128 windows, fewer where the vocabulary is large (windows x tokens x "
                   "vocabulary within 2^31 logits): 64 windows, 8,192 tokens, for Gemma 3's 262k vocabulary]")
@click.option("--allow-pickle", is_flag=True,
              help="With --model: allow loading pickled pytorch_model.bin weights (unpickling can run code).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run directory (default: runs/<placement>-<norm>-...). Reused when it holds a checkpoint of the same config.")
@evaluate_options
@click.option("--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Train and evaluate from one JSON file holding the run and evaluate configurations "
                   "({\"run\": ..., \"evaluate\": ...}, as a sweep writes each cell's cell.json) instead of "
                   "training and evaluate flags (only --out and --quiet may be given beside it).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def evaluate(checkpoint, out, config_file, quiet, **flags):
    """Train (or reuse) a model, export it, quantize it with each recipe, measure accuracy and
    latency, and write results.json and report.md into the run directory.

    Example: quantnorm evaluate --placement pre --norm rms
    """
    model_path, allow_pickle = flags.pop("model", None), flags.pop("allow_pickle", False)
    cfg = evaluate_config(flags, progress=not quiet, with_model=model_path is not None)
    file_run = None
    if config_file is not None:  # a sweep cell, or its rerun: both configurations from the file, no flags
        given = _given_flags(click.get_current_context(), exempt=("config_file", "out", "quiet"))
        if given:
            raise click.UsageError(f"--config holds the whole configuration: drop {', '.join(given)}")
        file_run, cfg = read_cell_config(config_file)
        if quiet:
            cfg = replace(cfg, progress=False)
    if model_path is not None:  # a checkpoint or an exported graph: the source is chosen by what the path holds
        if checkpoint is not None:
            raise click.UsageError("give either --model (a checkpoint or ONNX export) or --checkpoint (a trained run), "
                                   "not both")
        if flags.get("placement") is not None or flags.get("norm") is not None:
            raise click.UsageError("--placement/--norm are detected from the model with --model; leave them out")
        source = open_model(model_path, window=int(flags.get("context") or 128), corpus=flags.get("corpus"),
                            eval_tokens=flags.get("eval_tokens"), out=out, allow_pickle=allow_pickle,
                            progress=not quiet)
        results = run_evaluate(source, cfg, command=_command_line())
        click.echo(summary_lines_model(results, source.run_dir))
        return
    if flags.pop("eval_tokens", None) is not None:
        raise click.UsageError("--eval-tokens applies to --model checkpoints; a zoo run scores its whole evaluation range")
    if checkpoint is not None:
        run_dir = open_run_dir(checkpoint)
    else:
        if file_run is None and (flags["placement"] is None or flags["norm"] is None):
            raise click.UsageError("give --placement and --norm (to train a model), --checkpoint RUN_DIR or --config FILE")
        run = file_run or build_run_config(**flags)
        out = out or default_run_dir(run)
        run_dir = ensure_trained(run, out, prepare_data(run.data, run.model.context), progress=cfg.progress)
    results = run_evaluate(run_dir, cfg, command=_command_line())
    click.echo(summary_lines(results, run_dir.path))


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset (18 or later).")
@click.option("--onnx-dir", type=click.Path(path_type=Path), default=None,
              help="Also write an ONNX export directory (model.onnx, config.json, a byte tokenizer: the layout "
                   "Optimum writes) that `quantnorm evaluate --model DIR` reads; needs quantnorm[hf].")
def export(run_dir, opset, onnx_dir):
    """Export a trained run to RUN_DIR/model.fp32.onnx with a parity check against PyTorch."""
    run = open_run_dir(run_dir)
    model, cfg = load_model(run)
    data = prepare_data(cfg.data, cfg.model.context)
    inputs, _ = evaluation_windows(data.tokens, data.splits.evaluation, data.window)
    result = export_onnx(model, run.file(FP32_ONNX_FILE), inputs[:4], opset=opset)
    click.echo(f"{result.path}: opset {result.opset}, max |delta logit| {result.max_abs_logit_diff:.2e}, "
               f"norm ops {result.norm_ops}")
    if onnx_dir is not None:
        written = write_onnx_dir(result.path, cfg.model, onnx_dir,
                                 placement_note={"placement": cfg.model.placement, "norm": cfg.model.norm})
        click.echo(f"{written}: ONNX export directory (evaluate it with quantnorm evaluate --model {written})")


@cli.command()
@click.argument("models", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--providers", default=None, help="Comma-separated: cpu, cuda, tensorrt. [default: all listed]")
@click.option("--batches", default="1,8", show_default=True, help="Batch sizes.")
@click.option("--seq", type=int, default=128, show_default=True, help="Sequence length.")
@click.option("--iters", type=int, default=30, show_default=True, help="Timed runs per cell.")
@click.option("--warmup", type=int, default=5, show_default=True, help="Untimed warm-up runs per cell.")
@click.option("--threads", type=int, default=None, help="Intra-op threads. [default: ORT's]")
@click.option("--opt-level", default="all", show_default=True, help="Graph optimization: disable, basic, extended, all.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Time every cell this many times, interleaved across the models, and keep each cell's "
                   "lowest p50 (a neighbour's load only adds time; the note lists every round).")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Also write the rows as JSON.")
@click.option("--decode", is_flag=True,
              help="Time generation instead (with-past graphs, e.g. a run's model.*.past.onnx): a --seq-token prompt, "
                   "then --new-tokens greedy tokens one step at a time with the KV cache kept in ONNX Runtime; prints "
                   "prompt and generation tokens/s, per-token p50/p90, peak memory, and what a step reads whole (step "
                   "MB) and the rate it streams it at (GB/s).")
@click.option("--new-tokens", type=click.IntRange(min=2), default=128, show_default=True,
              help="--decode: tokens generated after the prompt.")
@click.option("--prompt-model", type=click.Path(path_type=Path), default=None,
              help="--decode: a with-past graph that runs every step of more than one row (the prompt) beside "
                   "each MODEL, which runs the one-row steps: a run's split (W+prefill-P: MODEL W's graph, this "
                   "P's) or one-row deployment (P+one-row: MODEL the .one-row.past.onnx, this P's .past.onnx).")
def bench(models, providers, batches, seq, iters, warmup, threads, opt_level, rounds, json_out, decode, new_tokens,
          prompt_model):
    """Latency of ONNX models (p50/p90/p99, tokens/s) per execution provider and batch size, or
    with --decode their generation speed (prompt and generation tokens/s)."""
    if not models:
        raise click.UsageError("give at least one .onnx file")
    for path in models:
        if not path.is_file():
            raise click.BadParameter(f"{path} is not a file", param_hint="MODELS")
    if prompt_model is not None and not decode:
        raise click.UsageError("--prompt-model pairs graphs for --decode: add --decode")
    if prompt_model is not None and not prompt_model.is_file():
        raise click.BadParameter(f"{prompt_model} is not a file", param_hint="--prompt-model")
    names = resolve_providers(_csv(providers)) if providers else listed_providers()
    variants = {path.name: path for path in models}
    if decode:
        specs = [SessionSpec(provider=n, threads=threads, graph_optimization_level=opt_level) for n in names]
        rows = decode_bench(variants, specs, list(_int_csv(batches, "--batches")), prompt_tokens=seq,
                            new_tokens=new_tokens, rounds=rounds, prompt_path=prompt_model)
        click.echo("\n".join(decode_table(rows)))
        if json_out:
            write_json_atomic(json_out, rows)
        return
    rows = bench_rounds(variants, names, list(_int_csv(batches, "--batches")), seq, rounds=rounds, threads=threads,
                        graph_optimization_level=opt_level, warmup=warmup, iters=iters, progress=True)
    click.echo(f"{'model':<40} {'provider':<10} {'batch':>5} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'tokens/s':>11}")
    for r in rows:
        short = short_provider(r.provider)
        if r.measured:
            click.echo(f"{r.variant:<40} {short:<10} {r.batch:>5} {r.p50_ms:>9.2f} {r.p90_ms:>9.2f} {r.p99_ms:>9.2f} "
                       f"{r.tokens_per_s:>11,.0f}")
        else:
            click.echo(f"{r.variant:<40} {short:<10} {r.batch:>5} {r.status}")
    if json_out:
        write_json_atomic(json_out, [r.to_dict() for r in rows])


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def report(run_dir):
    """Regenerate RUN_DIR/report.md and its plots from RUN_DIR/results.json."""
    click.echo(str(write_report(run_dir, load_results(run_dir))))


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--recipe", required=True,
              help="Whose with-past model: a recipe the run measured generation for, auto (the search's pick of "
                   "--recipes auto), fp32, or a split deployment W+prefill-P (evaluate --prefill-recipe: both "
                   "graphs, as GenAI's decoder-pipeline).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The bundle directory (new or empty).")
@click.option("--force", is_flag=True, help="Replace an earlier bundle at --out.")
@click.option("--int8-weights", type=click.Choice(["as-quantized", "unsigned"]), default="as-quantized",
              show_default=True,
              help="unsigned: store int8 weight codes (per-token recipes quantized on a VNNI CPU) as uint8, code + 128, "
                   "exact on CPUs without VNNI too, where ONNX Runtime's u8 x s8 kernel saturates; slower on VNNI CPUs "
                   "(the u8 x u8 kernel). as-quantized: the codes as the run wrote them.")
def bundle(run_dir, recipe, out, force, int8_weights):
    """Bundle a run's with-past (KV cache) model for ONNX Runtime GenAI: model.onnx, genai_config.json,
    the checkpoint's config, generation config and tokenizer, and the run's report.md and results.json.
    Load it with onnxruntime_genai.Model(OUT). Needs a run of a checkpoint (--model) with generation."""
    made = write_bundle(run_dir, recipe, out, force=force, unsigned_int8=int8_weights == "unsigned")
    click.echo(f"{made.path}: {made.name}, {len(made.files)} files (onnxruntime_genai.Model({str(made.path)!r}))")
    if made.int8_weights:
        click.echo(f"weights: {made.int8_weights}")


@cli.command()
def recipes():
    """List the INT8 recipes and which ones evaluate runs by default."""
    width = max(map(len, RECIPES))
    for name, recipe in RECIPES.items():
        mark = "*" if name in DEFAULT_RECIPES else "m" if name in MASSIVE_DEFAULT_RECIPES else " "
        click.echo(f"{mark} {name:<{width}} {recipe.describe()}")
    click.echo("(* = in the default set; m = the default set instead when evaluate's probe finds massive "
               "activations in a language model; weight-only recipes also by any name of the form "
               "[rotated-|online-rotated-|block-rotated-|stream-block-rotated-]wo-int<4|8>-b<block>"
               "[-asym][-acc4][-gptq|-hqq][-fphead]; any integer "
               "recipe with its token embedding stored in int8 blocks too as NAME-emb8)")


@cli.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--policy", type=click.Path(path_type=Path), default=None,
              help="TOML policy file ([gate] table; see examples/gate-policy.toml). Flags override it.")
@_threshold("--max-ppl-ratio", "Max INT8/FP32 perplexity ratio.")
@_threshold("--max-kld", "Max mean KL(FP32 || INT8) in nats.")
@_threshold("--max-kld-p99", "Max 99th-percentile KL in nats.")
@_threshold("--min-top1", "Min top-1 agreement, a fraction.")
@_threshold("--min-gen-speed-ratio", "Min generation tokens/s of INT8 / FP32 (same provider and batch).")
@_threshold("--min-gen-tokens-per-s", "Min generation tokens/s of the recipe (every measured decode row).")
@_threshold("--min-gen-agreement", "Min share of greedy tokens identical to FP32's before the first divergence.")
@_threshold("--max-latency-ratio", "Max INT8 p50 / FP32 p50 latency (same provider and batch).")
@click.option("--require-provider", multiple=True,
              help="Provider that must have measured latency (cpu, cuda, tensorrt); repeat or comma-separate.")
@click.option("--recipe", "recipes", multiple=True,
              help="Recipe that must pass; repeat or comma-separate. [default: at least one recipe must pass]")
@click.option("--summary", type=click.Path(path_type=Path), default=None,
              help="Also append the Markdown verdict to this file (e.g. \"$GITHUB_STEP_SUMMARY\").")
@click.option("--junit", type=click.Path(path_type=Path), default=None,
              help="Write JUnit XML here (one testcase per run x recipe x check).")
@click.option("--baseline", "baselines", multiple=True, type=click.Path(path_type=Path),
              help="Compare with this run (results.json, run or sweep directory; e.g. main's): regressions fail.")
@click.option("--abs-tol", multiple=True, metavar="CHECK=X", help="Baseline: absolute tolerance of a check "
              "(ppl_ratio, kld_mean, top1_agreement, generation_agreement, size_bytes, latency [ms]). Repeatable.")
@click.option("--rel-tol", multiple=True, metavar="CHECK=X", help="Baseline: relative tolerance (0.25 = 25%).")
@click.option("--same-hardware", is_flag=True, help="Baseline: latency from other hardware fails (not 'not comparable').")
@click.option("--github-summary", is_flag=True, help="Append the verdict to $GITHUB_STEP_SUMMARY (cut at 1 MiB).")
@click.option("--json", "json_out", default=None, metavar="FILE", help="Write the verdict as JSON to this file ('-': stdout).")
@click.pass_context
def gate(ctx, inputs, policy, require_provider, recipes, summary, junit, baselines, abs_tol, rel_tol, same_hardware,
         github_summary, json_out, **thresholds):
    """Gate deployment on INPUTS (results.json files, run directories or sweep directories).

    Prints a Markdown verdict table; its first line says PASS or FAIL and why. Exit code 0: every
    run passes; 1: a check fails (a missing or unmeasured number fails; with --baseline, a regression);
    2: an input or the policy cannot be read.

    Example: quantnorm gate runs/pr --baseline runs/main --policy examples/gate-policy.toml --junit gate.xml
    """
    outputs = dict(summary=summary, junit=junit, github_summary=github_summary, json_out=json_out)
    try:
        pol = resolve_policy(policy, **thresholds, require_provider=tuple(_csv(",".join(require_provider)) or ()) or None,
                             recipes=tuple(_csv(",".join(recipes)) or ()) or None)
        pol = with_baseline_flags(pol, abs_tol, rel_tol, same_hardware)
        result = run_baseline_gate(inputs, baselines, pol) if baselines else run_gate(inputs, pol)
    except QuantnormError as exc:  # fail closed in the CI artifacts too; main() prints it, exit 2
        write_error_outputs(str(exc), **outputs)
        if json_out == "-":  # a script reading stdout gets the ERROR verdict, not nothing
            click.echo(json.dumps(error_dict(str(exc))))
        raise
    click.echo(json.dumps(result.to_dict(), indent=2) if json_out == "-" else result.markdown(), nl=json_out == "-")
    write_outputs(result, **outputs)
    if not result.passed:
        ctx.exit(1)


@cli.command()
@click.option("--placements", default=",".join(PLACEMENTS), show_default=True,
              help="Comma-separated placements (axis).")
@click.option("--norms", default=",".join(NORMS), show_default=True, help="Comma-separated norms (axis).")
@click.option("--seeds", type=int, default=3, show_default=True, help="Number of seeds per setting (seeds 0..N-1).")
@click.option("--warmups", default=None,
              help="Comma-separated warm-up steps (axis), e.g. 0,30. [default: the rule of `quantnorm train`]")
@click.option("--depths", default=str(DEFAULT_MODEL.n_layers), show_default=True,
              help="Comma-separated numbers of blocks (axis).")
@training_options(required=False, only=SWEEP_TRAINING_FLAGS)
@click.option("--lrs", default=None,
              help="Comma-separated peak learning rates (axis), e.g. 1e-3,3e-3: the report compares each placement "
                   "at its own best rate, chosen on held-out seeds. [default: --lr for every cell]")
@evaluate_options
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Sweep directory: one run directory per cell, sweep.json, report.md. Run again to resume.")
@click.option("--jobs", type=int, default=None,
              help="Cells at a time. [default: local: max(1, cores // 2); ray: as many as the cluster schedules]")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: subprocesses on this machine; ray: Ray tasks (pip install 'quantnorm[ray]').")
@click.option("--ray-address", default=None,
              help="Ray cluster address (e.g. ray://head:10001 or auto). [default: start a local Ray instance]")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def sweep(ctx, placements, norms, seeds, warmups, depths, d_model, heads, context, steps, batch_size, lr, lrs, corpus,
          out, jobs, executor, ray_address, quiet, **flags):
    """Train and evaluate every placement x norm (x warm-up x depth) x seed, each cell in its own
    process; resumable (finished cells are skipped); then write OUT/report.md with intervals,
    a ranking and findings. Exit code 1 when a cell failed (the others still run). Every
    evaluate flag applies to every cell.

    Example: quantnorm sweep --placements post,pre,peri --norms layer,rms --seeds 3 --warmups 0,30 --out sweeps/a
    """
    if executor != "ray" and ray_address:
        raise click.UsageError("--ray-address needs --executor ray")
    cfg = SweepConfig(
        placements=tuple(_csv(placements)), norms=tuple(_csv(norms)), seeds=seeds,
        warmups=_int_csv(warmups, "--warmups") if warmups is not None else None,
        depths=_int_csv(depths, "--depths"), lrs=_float_csv(lrs, "--lrs") if lrs is not None else None,
        d_model=d_model, heads=heads, context=context, steps=steps,
        batch_size=batch_size, lr=lr, corpus=corpus,
        # cells write logs, not progress bars, and compare the same recipes (no probe-picked set)
        evaluate=evaluate_config(flags, progress=False, generation_default=False, probe_picks_recipes=False),
    )
    outcome = run_sweep(cfg, out, jobs=jobs, executor=executor, ray_address=ray_address, progress=not quiet,
                        command=_command_line(), echo=click.echo)
    counts = ", ".join(f"{v} {k}" for k, v in outcome.counts().items())
    click.echo(f"{outcome.out_dir}: {len(outcome.cells)} cells ({counts})")
    if outcome.report is not None:
        click.echo(f"report: {outcome.report}")
    for failed in outcome.failed:
        last = failed.log_tail[-1] if failed.log_tail else "no output"
        click.echo(f"failed: {failed.cell.name} (exit code {failed.rc}): {last} "
                   f"[{outcome.out_dir / failed.cell.name / 'evaluate.log'}]", err=True)
    if outcome.failed:
        ctx.exit(1)


_MARGIN_HELP = ("Bits/byte below the unigram baseline a cell must reach to count as trained (the others are left "
                "out of every effect). [default: each run's recorded margin, else 0.8]")


@cli.command()
@click.argument("sweep_dir", type=click.Path(path_type=Path))
@click.option("--collapse-margin", type=float, default=None, help=_MARGIN_HELP)
def compare(sweep_dir, collapse_margin):
    """Regenerate SWEEP_DIR/report.md, findings.json and plots from its cells' results.json
    (SWEEP_DIR/<cell>/ or, in a published copy, SWEEP_DIR/cells/<cell>/)."""
    click.echo(str(write_comparison(sweep_dir, collapse_margin)))


@cli.command()
@click.argument("sweep_dir", type=click.Path(path_type=Path))
@click.option("--collapse-margin", type=float, default=None, help=_MARGIN_HELP)
def findings(sweep_dir, collapse_margin):
    """Print the findings section (Markdown: a verdict per claim of shared CLAIMS.md) of SWEEP_DIR
    and write it to SWEEP_DIR/findings.md and findings.json (the same section as in SWEEP_DIR/report.md)."""
    _, text = write_findings(sweep_dir, collapse_margin)
    click.echo(text)


class Terminated(BaseException):
    """SIGTERM, turned into an exception so that every ``finally`` and context manager on the way
    out runs (atomic writes drop their temporary files, the FP32 outputs cache its folder). A
    BaseException, like KeyboardInterrupt: no ``except Exception`` on the way swallows it."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _send_again(signum: int) -> None:
    """Deliver ``signum`` to this process again, if its raising handler is still the one installed."""
    raising = _raise_terminated if signum == signal.SIGTERM else signal.default_int_handler
    if signal.getsignal(signum) is raising:
        os.kill(os.getpid(), signum)


@contextlib.contextmanager
def _sigterm_raises():
    """While inside, on the main thread: SIGTERM raises ``Terminated`` (restored on the way out), and
    a SIGTERM or Ctrl-C whose exception Python dropped is delivered again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    passed_on = sys.unraisablehook

    def hook(unraisable):
        signum = (signal.SIGTERM if isinstance(unraisable.exc_value, Terminated) else
                  signal.SIGINT if isinstance(unraisable.exc_value, KeyboardInterrupt) else None)
        if signum is None:
            passed_on(unraisable)
            return
        # Python drops an exception raised in a finalizer or a weakref or gc callback (it only
        # prints "Exception ignored in"), so a signal whose handler ran there would be lost and the
        # run would go on to the end. Sent again a moment later, it lands in ordinary code.
        timer = threading.Timer(0.01, _send_again, (signum,))
        timer.daemon = True
        timer.start()

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = passed_on
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: one-line errors and exit code 2 for anything a user can fix."""
    with _sigterm_raises():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    global _invocation
    argv = sys.argv[1:] if argv is None else list(argv)
    _invocation = argv
    debug = "--debug" in argv
    try:
        result = cli.main(args=_resolve_packaged(argv), prog_name="quantnorm", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        return 130
    except click.ClickException as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {exc.format_message()}", err=True)
        return 2
    except QuantnormError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {exc}", err=True)
        return 2
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return 130
    except Terminated:
        click.echo("error: terminated (SIGTERM); nothing half-written was left", err=True)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
