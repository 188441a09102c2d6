"""The flags ``evaluate`` and ``sweep`` share (what to deploy and measure) and the
EvaluateConfig they make, with the small parsers every command uses. Nothing here runs anything."""

from __future__ import annotations

from pathlib import Path

import click

from .config import LLAMACPP_DEFAULT_TYPES, EvaluateConfig
from .policy import DEFAULT_POLICY, resolve_policy
from .quantize import DEFAULT_RECIPES

# --model's default --latency-budget: a checkpoint's runs take seconds each on a CPU, so this
# still gives its slowest cell (a few-hundred-million-parameter FP32 model at batch 8) the minimum
# of timed runs (measure.latency.MIN_TIMED_RUNS) and its faster INT8 cells more; twice this made
# latency one of the largest stages of such a model's evaluate.
MODEL_LATENCY_BUDGET_S = 10.0


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _int_csv(value: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _csv(value))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=flag) from None


def _float_csv(value: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in _csv(value))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}", param_hint=flag) from None


def _threshold(flag: str, what: str):  # a policy threshold; not given (None): the policy file's or the default
    default = getattr(DEFAULT_POLICY, flag[2:].replace("-", "_"))
    return click.option(flag, type=float, default=None, help=f"{what} [default: {default if default else 'off'}]")


# Generation's settings beside --generation: the decode-speed rows, agreement, the split deployment.
GENERATION_OPTIONS = [
    click.option("--gen-batches", default="1,4", show_default=True,
                 help="Generation: batch sizes of the decode-speed rows."),
    click.option("--gen-tokens", default="128,128", show_default=True,
                 help="Generation: prompt tokens and new tokens of the decode-speed rows (cut to the model's "
                      "positions when they do not fit)."),
    click.option("--agreement", default="16,64", show_default=True,
                 help="Generation agreement: prompts (from the evaluation split) and greedy new tokens each."),
    click.option("--prefill-recipe", default=None, metavar="RECIPE",
                 help="Generation: also deploy each weight-only recipe of the run split in two graphs: the "
                      "prompt through RECIPE's with-past graph (per-token INT8: an integer GEMM, fast at many "
                      "rows), the new tokens through the weight-only graph (fast at one row), one cache "
                      "between them. A row per pair, named WEIGHT_ONLY+prefill-RECIPE: cache check, "
                      "agreement and decode speed as deployed, the size of both files (`quantnorm bundle` "
                      "writes the pair as ONNX Runtime GenAI's decoder-pipeline). RECIPE must be among "
                      "--recipes. [default: none]"),
]


def evaluate_options(func):
    """The flags of an EvaluateConfig, shared by ``evaluate`` and ``sweep`` (a sweep hands every cell
    the one configuration they build); ``evaluate_config`` turns them into it."""
    options = [
        click.option("--recipes", default=None,
                     help="Comma-separated INT8 recipes (see `quantnorm recipes`), or `auto` for the accuracy-aware "
                          "search (may be combined with names). A SmoothQuant recipe takes an alpha as "
                          "NAME@ALPHA (smoothquant@0.7), several side by side. [default: the default set (`quantnorm "
                          "recipes` marks it), or, when the FP32 probe finds massive activations, the recipes that "
                          "survive them: pertoken-fused, wo-int8-b32-acc4, online-rotated-pertoken-fused-gptq]"),
        click.option("--sq-alpha", type=float, default=None,
                     help="SmoothQuant migration strength alpha in [0, 1] for the smoothquant recipe (not for "
                          "smoothquant@ALPHA names, which keep theirs). [default: 0.5]"),
        click.option("--policy", "policy_file", type=click.Path(path_type=Path), default=None,
                     help="--recipes auto: the acceptance policy file `quantnorm gate --policy` takes (TOML); the "
                          "flags below override it. [default: the gate's defaults]"),
        _threshold("--max-ppl-ratio", "--recipes auto: the INT8/FP32 perplexity ratio a model must reach."),
        _threshold("--min-top1", "--recipes auto: the least top-1 agreement with FP32 (0: any)."),
        _threshold("--max-kld", "--recipes auto: the largest mean KL divergence from FP32, in nats."),
        click.option("--search-space", default=None,
                     help="With --recipes auto: the comma-separated recipes the search tries, in order "
                          "(weight-MatMul recipes only, weight-only ones included). [default: every INT8 "
                          "weight-MatMul recipe of `quantnorm recipes` but the weight-only ones]"),
        click.option("--search-pick", type=click.Choice(["fastest", "first"]), default="fastest", show_default=True,
                     help="--recipes auto: keep the fastest passing model (CPU p50, batch 8) or the first one found."),
        click.option("--search-budget", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="--recipes auto: minutes of search; no trial starts after them (the trials that ran are "
                          "still compared and the fastest passing one kept; the report says the budget stopped "
                          "it). Trials are screened either way: one that misses the policy by 4x on 8 of its "
                          "windows is neither timed nor scored further. [default: no limit]"),
        click.option("--providers", default=None,
                     help="Comma-separated execution providers for latency: cpu, cuda, tensorrt. "
                          "[default: all this onnxruntime lists; unusable ones are reported as not measured]"),
        click.option("--calib-samples", type=int, default=64, show_default=True,
                     help="Calibration windows (taken evenly from the calibration range only)."),
        click.option("--exclude", multiple=True,
                     help="Keep matching nodes in FP32 in every recipe (mixed precision); a node name or an fnmatch "
                          "pattern such as 'head/*' or 'blocks.*.mlp.down/*'. Repeatable."),
        click.option("--opset", type=int, default=18, show_default=True,
                     help="ONNX opset (18: RMSNorm decomposed; 23: native RMSNormalization)."),
        click.option("--opt-level", default="all", show_default=True,
                     help="ONNX Runtime graph optimization for accuracy and latency: disable, basic, extended, all."),
        click.option("--threads", type=int, default=None,
                     help="Intra-op threads for ONNX Runtime (in a sweep: per cell, torch's too). [default: ORT's; "
                          "in a sweep: the cores divided by --jobs]"),
        click.option("--batches", default="1,8", show_default=True, help="Latency batch sizes (sequence = context)."),
        click.option("--iters", type=int, default=30, show_default=True,
                     help="Timed runs per latency cell (after warm-up)."),
        click.option("--latency-budget", type=click.FloatRange(min=0), default=None,
                     help="Seconds of timed runs per latency cell: a cell stops before --iters once its runs "
                          "add up to this (5 runs at least; the report gives each cell's count). 0: no budget, "
                          "all --iters runs.  [default: 10 with --model, else no budget]"),
        click.option("--generation/--no-generation", default=None,
                     help="Causal models: export each recipe with a KV cache and measure generation as deployed: "
                          "prompt and generation tokens/s, per-token p50/p90, peak memory, and greedy generations "
                          "against FP32's. [default: on for evaluate, off for sweep]"),
        *GENERATION_OPTIONS,
        click.option("--engines", default=None,
                     help="Comma-separated other inference engines to measure beside the recipes, on the same "
                          "checkpoint, windows and threads, scored against the same FP32 model: llamacpp "
                          "(llama.cpp's own quantizations of a GGUF --model; needs quantnorm[llamacpp]). Each "
                          "format is a row: PPL ratio, KL, top-1, generation agreement, prompt and generation "
                          "tokens/s, size; an engine that cannot run here says why. [default: none]"),
        click.option("--llamacpp-types", default=",".join(LLAMACPP_DEFAULT_TYPES), show_default=True,
                     help="With --engines llamacpp: the llama.cpp types made from the GGUF with llama.cpp's own "
                          "quantizer (F32 is its dequantization, the FP32 baseline's weights; also F16, BF16, "
                          "Q6_K, Q5_K_M, Q5_K_S, Q5_0, Q5_1, Q4_K_S, Q4_1, IQ4_NL, IQ4_XS, Q3_K_L/M/S, Q2_K)."),
        click.option("--no-outliers", is_flag=True,
                     help="Skip the activation probe and per-tensor SQNR (a sweep's residual-growth and outlier "
                          "findings need them)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def evaluate_config(flags: dict, progress: bool, *, with_model: bool = False,
                    generation_default: bool = True, probe_picks_recipes: bool = True) -> EvaluateConfig:
    """The EvaluateConfig of the ``evaluate_options`` flags, which it pops off ``flags`` (the
    command's keyword arguments): validated here, before anything runs. ``with_model``: evaluate
    was given ``--model`` (a checkpoint: the latency cells get a time budget by default).
    ``probe_picks_recipes``: without --recipes, the probe may swap the default set (not in a sweep,
    whose cells compare the same recipes)."""
    f = {name: flags.pop(name) for name in EVALUATE_FLAGS}
    policy = resolve_policy(f["policy_file"], max_ppl_ratio=f["max_ppl_ratio"], min_top1=f["min_top1"],
                            max_kld=f["max_kld"])
    return EvaluateConfig(
        recipes=tuple(_csv(f["recipes"])) if f["recipes"] else DEFAULT_RECIPES, probe_picks_recipes=probe_picks_recipes and not f["recipes"],
        providers=tuple(_csv(f["providers"])) if f["providers"] else None,
        calib_samples=f["calib_samples"], opset=f["opset"], graph_optimization_level=f["opt_level"],
        threads=f["threads"], latency_batches=_int_csv(f["batches"], "--batches"), latency_iters=f["iters"],
        latency_seconds=(MODEL_LATENCY_BUDGET_S if with_model else None) if f["latency_budget"] is None
        else (f["latency_budget"] or None),
        outliers=not f["no_outliers"], progress=progress, sq_alpha=f["sq_alpha"], max_ppl_ratio=policy.max_ppl_ratio,
        min_top1=policy.min_top1, max_kld=policy.max_kld, max_kld_p99=policy.max_kld_p99, search_pick=f["search_pick"],
        search_space=tuple(_csv(f["search_space"])) if f["search_space"] else None, search_budget_min=f["search_budget"],
        exclude=tuple(f["exclude"]),
        **generation_fields(f, generation_default),
        engines=tuple(_csv(f["engines"]) or ()), llamacpp_types=tuple(_csv(f["llamacpp_types"]) or ()),
    )


def generation_fields(f: dict, default: bool) -> dict:
    prompt_new = _int_csv(f["gen_tokens"], "--gen-tokens")
    agreement = _int_csv(f["agreement"], "--agreement")
    for flag, pair in (("--gen-tokens", prompt_new), ("--agreement", agreement)):
        if len(pair) != 2:
            raise click.BadParameter(f"expected two comma-separated integers, got {','.join(map(str, pair))}",
                                     param_hint=flag)
    return {"generation": default if f["generation"] is None else f["generation"],
            "gen_batches": _int_csv(f["gen_batches"], "--gen-batches"), "gen_prompt_tokens": prompt_new[0],
            "gen_new_tokens": prompt_new[1], "agreement_prompts": agreement[0], "agreement_new_tokens": agreement[1],
            "gen_prefill_recipe": f["prefill_recipe"] or None}


# The parameter names evaluate_options adds, read off a command it decorates (one list, not two).
EVALUATE_FLAGS = tuple(p.name for p in click.command()(evaluate_options(lambda **_: None)).params)
