"""Sections of a run report (report.md): those every run has, and those of a zoo model trained here.

Each section is ``fn(results) -> list[str]`` (Markdown lines; [] when the run has nothing for
it), so quantnorm.report.run can list them in a table per model source. The sections of a
pretrained checkpoint (Hugging Face, GGUF, ONNX export) are in quantnorm.report.checkpoint.
"""

from __future__ import annotations

from .. import results as results_file
from ..errors import QuantnormError
from ..measure.sessions import short_provider
from ..results import STATUS_TRAINED as TRAINED
from ..results import status_from_results
from .markdown import fmt, table

# ------------------------------------------------------------------------------ every run


def reproduce(results: dict) -> list[str]:
    """The command that wrote the run, and which quantnorm and schema."""
    return [f"Reproduce: `{results['command']}`  ", f"Created {results['created']} by quantnorm "
            f"{results['quantnorm_version']} (results.json schema {results['schema_version']}).", ""]


def hardware(results: dict) -> list[str]:
    hw = results["hardware"]
    return ["## Hardware and versions", ""] + table(["what", "value"], [
        ["CPU", hw.get("cpu")], *([["CPU family", hw["cpu_id"]]] if hw.get("cpu_id") else []),
        *([["caches (one core's view)", hw["cpu_caches"]]] if hw.get("cpu_caches") else []),
        ["ISA flags", ", ".join(hw.get("cpu_flags", []))], ["VNNI", hw.get("vnni")],
        ["threads", hw.get("threads") or "ORT default"], ["GPU", hw.get("gpu") or "none"],
        ["providers available", ", ".join(hw.get("providers_available", []))],
        ["onnxruntime / torch / onnx", f"{hw.get('onnxruntime')} / {hw.get('torch')} / {hw.get('onnx')}"],
        *([["int8 weights", hw["int8_weights"]]] if hw.get("int8_weights") else []),
    ])


def warnings_for(results: dict) -> list[str]:
    out: list[str] = []
    hw = results_file.section(results, "hardware") or {}
    if hw.get("vnni") is False:
        out.append("This CPU has no VNNI: ONNX Runtime's u8s8 INT8 kernels can saturate (AVX2 path), so where "
                   "`reduce_range` is auto the per-token recipes store their 8-bit weight codes as uint8 (the u8u8 "
                   "kernel, exact here: the same integers a VNNI CPU computes) and ONNX Runtime's quantizer "
                   "uses 7-bit weights; a model quantized on a VNNI CPU with 8-bit int8 codes runs here with them "
                   "stored as uint8 (`quantnorm.unsigned_weights`: the same integers); accuracy was measured under the same "
                   "session options as deployment.")
    for r in results_file.recipes(results):
        if not r.ok:
            out.append(f"Recipe `{r.name}` is **{r.status}**.")
    rows = results_file.latency_rows(results)
    for row in rows:
        if row.row.get("simulated_int8"):
            out.append(f"{short_provider(row.provider)} ran `{row.variant}` as simulated quantization "
                       f"(QDQ nodes, float math): {row.row.get('note', '')}")
    seen = set()
    for row in rows:
        if not row.measured and row.provider not in seen:
            seen.add(row.provider)
            out.append(f"{short_provider(row.provider)}: {row.status}.")
    return out


def session_and_latency(results: dict) -> list[str]:
    """The ONNX Runtime session the recipes ran in, then the latency section."""
    recipes = results_file.recipes(results)
    session = recipes[0].entry.get("session", {}) if recipes else {}
    return ["", f"Session: {session.get('provider')} with {session.get('graph_optimization_level')}.",
            "", "## Latency", "", *latency_tables(results)]


def latency_tables(results: dict) -> list[str]:
    """One table per provider; a provider that was not measured says why and shows no number."""
    L: list[str] = []
    by_provider: dict[str, list[results_file.LatencyRow]] = {}
    for row in results_file.latency_rows(results):
        by_provider.setdefault(row.provider, []).append(row)
    for provider, rows in by_provider.items():
        L += [f"### {short_provider(provider)}", ""]
        measured = [r for r in rows if r.measured]
        if not measured:
            L += [f"{rows[0].status}.", ""]
            continue
        fp32 = {r.batch: r for r in measured if r.variant == results_file.FP32_VARIANT}
        lines = []
        for r in rows:
            if not r.measured:
                lines.append([f"`{r.variant}`", r.batch, r.seq, r.status, "", "", "", "", ""])
                continue
            base = fp32.get(r.batch)
            ratio = r.p50_ms / base.p50_ms if base else None
            nodes = ", ".join(f"{short_provider(k)} {v}" for k, v in (r.row.get("node_providers") or {}).items())
            lines.append([f"`{r.variant}`", r.batch, r.seq, fmt(r.p50_ms, ".2f"), fmt(r.row["p90_ms"], ".2f"),
                          fmt(r.row["p99_ms"], ".2f"), fmt(r.row["tokens_per_s"], ",.0f"), fmt(ratio, ".2f", "x"),
                          nodes + (" (simulated INT8)" if r.row.get("simulated_int8") else "")])
        L += table(["variant", "batch", "seq", "p50 ms", "p90 ms", "p99 ms", "tokens/s", "p50 vs fp32",
                    "nodes per provider"], lines)
        L.append("")
        L += kernel_time_table(provider, measured)
    return L


# ORT op types by what they do in a quantized transformer (contrib ops included).
INTEGER_GEMMS = {"MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul", "QGemm",
                 "ConvInteger", "QLinearConv", "QAttention", "MatMulNBits"}
FLOAT_GEMMS = {"MatMul", "FusedMatMul", "Gemm", "Conv", "FusedConv", "Attention", "MultiHeadAttention",
               "GroupQueryAttention"}
QUANTIZE_OPS = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}


def kernel_time_split(op_ms: dict[str, float]) -> dict[str, float]:
    """A profiled run's kernel milliseconds: integer GEMMs, float GEMMs (attention's products, an
    online rotation, any MatMul left in float), (de)quantization, everything else."""
    split = {"integer GEMMs": 0.0, "float GEMMs": 0.0, "(de)quantize": 0.0, "other": 0.0}
    for op, ms in op_ms.items():
        key = ("integer GEMMs" if op in INTEGER_GEMMS else "float GEMMs" if op in FLOAT_GEMMS
               else "(de)quantize" if op in QUANTIZE_OPS else "other")
        split[key] += ms
    return split


def kernel_time_table(provider: str, measured: list) -> list[str]:
    """Where each variant's time goes inside ORT, from one warm profiled run of its first batch."""
    lines = []
    for r in measured:
        op_ms = (r.row.get("op_ms") or {}).get(provider)
        if not op_ms:
            continue
        total = sum(op_ms.values())
        split = kernel_time_split(op_ms)
        top = ", ".join(f"{op} {ms:.0f}" for op, ms in list(op_ms.items())[:4])
        lines.append([f"`{r.variant}`", r.batch, fmt(total, ".1f"),
                      *[f"{ms:.1f} ({ms / total:.0%})" if total else "–" for ms in split.values()], top])
    if not lines:
        return []
    return ["Kernel time per kind of op in one warm profiled run of the first batch (ORT's profiler; not a timed "
            "run, and the profiler adds a little per node). INT8 speeds up only the integer GEMMs' share: the "
            "float work around them runs as in FP32.", "",
            *table(["variant", "batch", "kernel ms", "integer GEMMs", "float GEMMs", "(de)quantize", "other",
                    "largest op types (ms)"], lines), ""]


def sqnr_tables(results: dict) -> list[str]:
    """Per static recipe: the rank correlation of outlier figures with SQNR and the worst tensors."""
    L: list[str] = []
    for recipe, summary in (results_file.section(results, "sqnr_summary") or {}).items():
        feeds = {r["tensor"]: ", ".join(r.get("modules", [])) for r in results.get("sqnr", {}).get(recipe, [])}
        L += ["", f"### Per-tensor SQNR, `{recipe}`", "",
              f"Spearman rank correlation with SQNR: ratio {fmt(summary.get('spearman_ratio_sqnr'), '.2f')}, "
              f"kurtosis {fmt(summary.get('spearman_kurtosis_sqnr'), '.2f')} (negative: bigger outliers, lower SQNR).",
              ""]
        L += table(["worst tensor", "feeds", "SQNR dB", "max/median", "kurtosis", "inf-norm"], [
            [f"`{w['tensor']}`", feeds.get(w["tensor"], ""), fmt(w.get("sqnr_db"), ".1f"), fmt(w.get("ratio"), ".1f"),
             fmt(w.get("kurtosis"), ".1f"), fmt(w.get("inf_norm"), ".3g")] for w in summary.get("worst", [])])
    return L


def smoothquant(results: dict) -> list[str]:
    sq = results_file.section(results, "smoothquant")
    if sq is None:
        return []
    L = ["", f"## SmoothQuant (alpha {sq.get('alpha')})", "", sq.get("statement", ""), ""]
    L += table(["MatMuls", "kind", "reads", "why", "max/median channel ratio before → after"], [
        [", ".join(g["matmuls"]), g["kind"], g.get("source") or "–", g.get("reason", ""),
         f"{fmt(g.get('channel_ratio_before'), '.1f')} → {fmt(g.get('channel_ratio_after'), '.1f')}"]
        for g in sq.get("groups", [])])
    ratio = sq.get("fp32_latency_ratio")
    L += ["", f"Folded: {len(sq.get('folded', []))} MatMuls (no runtime cost); explicit per-channel scale: "
              f"{len(sq.get('explicit_scale', []))} (a Mul each). Smoothed FP32 vs original FP32 p50 on the CPU: "
              f"{fmt(ratio, '.3f', 'x')}. Max |Δlogit| of the smoothed ONNX model vs the original: "
              f"{fmt(sq.get('onnx_vs_original_max_abs_logit_diff'), '.1e')}"
              + (f" ({sq['parity_rule']})." if sq.get("parity_rule") else ".")]
    per_alpha = sq.get("per_alpha") or []
    if len(per_alpha) > 1:   # several migration strengths: what each one bought
        by_alpha = {}
        for r in results.get("recipes", []):
            alpha = (r.get("settings") or {}).get("smoothquant_alpha")
            if alpha is not None and r.get("accuracy"):
                by_alpha.setdefault(float(alpha), []).append(r)
        L += ["", "Per alpha (the largest explicit-scale channel ratio after smoothing; the recipes run on each):", ""]
        rows = []
        for e in per_alpha:
            after = max((g.get("channel_ratio_after") or 0 for g in e.get("groups", [])), default=None)
            for r in by_alpha.get(float(e["alpha"]), [None]):
                acc = (r or {}).get("accuracy") or {}
                rows.append([f"{e['alpha']:g}", f"`{r['name']}`" if r else "–", fmt(after, ".1f"),
                             fmt(acc.get("ppl_ratio"), ".4f"), fmt(acc.get("kld_mean"), ".3g"),
                             fmt(None if acc.get("top1_agreement") is None else 100 * acc["top1_agreement"], ".1f",
                                 "%")])
        L += table(["alpha", "recipe", "max channel ratio after", "PPL ratio", "KL mean", "top-1"], rows)
    return L


def search(results: dict) -> list[str]:
    found = results_file.section(results, "search")
    if found is None:
        return []
    chosen = found.get("chosen")
    verdict = (f"picked `{chosen['name']}` ({found['pick']})" if chosen else
               "no recipe met the target; the best trial is reported")
    L = ["", "## Accuracy-aware search", "",
         f"Target PPL ratio{' over tokens' if found.get('level') == 'token' else ''} <= "
         f"{found['target_max_ppl_ratio']} (tuner: {found.get('tuner')}; metric "
         f"{found.get('metric')}; trials on {found['eval_windows']} evaluation windows; stopped by "
         f"{found['stopped_by']}): {verdict}.", ""]
    trials = found.get("trials", [])
    timed = any(t.get("seconds") is not None for t in trials)   # runs before per-trial times have none

    def passed(t: dict) -> str:
        if t.get("passed"):
            return "yes"
        return f"no (screened out on {t['screened_windows']} windows)" if t.get("screened_windows") else "no"
    L += table(["#", "trial", "phase", "PPL ratio", "KL mean", "top-1", "p50 ms", "passed", *(["s"] if timed else [])], [
        [t["index"], f"`{t['name']}`", t["phase"], fmt(t.get("ppl_ratio"), ".4f"), fmt(t.get("kld_mean"), ".2e"),
         fmt(None if t.get("top1_agreement") is None else 100 * t["top1_agreement"], ".2f", "%"),
         fmt(t.get("latency_p50_ms"), ".2f"), passed(t), *([fmt(t.get("seconds"), ".0f")] if timed else [])]
        for t in trials])
    if any(t.get("screened_windows") for t in trials):
        L += ["", "A screened-out trial missed the policy by 4x on that many of its evaluation windows, evenly spaced (its numbers are "
                  "theirs): it was neither timed nor scored on the rest."]
    if found.get("order", "registry") != "registry":
        L += ["", f"Order of the space: {found['order']}" + (
            " (the recipes that survive them first, the fastest kernels first among them; per-tensor "
            "activations last)." if found["order"].startswith("probe") else ".")]
    pruned = found.get("pruned") or []
    if pruned:
        L += ["", f"Not tried ({len(pruned)}: a passing trial already decides the fastest pick):", ""]
        L += [f"- `{p['recipe']}`: {p['why']}" for p in pruned]
    return L


def closing(results: dict, warn: list[str], plots: dict[str, str]) -> list[str]:
    """Warnings, plots and where the time went: the end of every run report."""
    L: list[str] = []
    if warn:
        L += ["", "## Warnings", ""] + [f"- {w}" for w in warn]
    if plots:
        L += ["", "## Plots", ""] + [f"![{title}]({path})" for title, path in plots.items()]
    if "stage_seconds" in results:
        L += ["", "## Where the time went", "",
              ", ".join(f"{k} {v:.1f} s" for k, v in results["stage_seconds"].items()) + "."]
    return L


# ------------------------------------------------------------------------------ a zoo model trained here


def zoo_title(results: dict) -> str:
    model = results["model"]
    return f"{model['placement']}/{model['norm']}"


def training_status(results: dict) -> list[str]:
    """The first thing to know about a trained model: did it learn anything (quantnorm.train_status)?"""
    train = results.get("train")
    if not isinstance(train, dict) or train.get("pretrained") is True:
        return []   # a pretrained checkpoint was not trained here
    try:
        st = status_from_results(train, results.get("data"))
    except QuantnormError as exc:
        return [f"**Training status: unknown** ({exc}).", ""]
    if st.status == TRAINED:
        return [f"**Training status: trained** ({st.eval_bits_per_byte:.3f} bits/byte, "
                f"{st.unigram_bits_per_byte - st.eval_bits_per_byte:.2f} below the unigram baseline "
                f"{st.unigram_bits_per_byte:.3f}; margin {st.collapse_margin:g}).", ""]
    if st.unigram_bits_per_byte is None:
        return ["**Training status: diverged**: there is no model to deploy.", ""]
    return [f"**Training status: {st.status}** ({st.eval_bits_per_byte:.3f} bits/byte vs the unigram baseline "
            f"{st.unigram_bits_per_byte:.3f}; a trained model is at least {st.collapse_margin:g} below it): the "
            f"model learned little beyond byte frequencies, so the INT8 numbers below say nothing about INT8.", ""]


def zoo_model_and_data(results: dict) -> list[str]:
    model, data = results["model"], results["data"]
    return ["", "## Model and data", ""] + table(["what", "value"], [
        ["placement / norm", f"{model['placement']} / {model['norm']}"],
        ["layers, d_model, heads, context",
         f"{model['n_layers']}, {model['d_model']}, {model['n_heads']}, {model['context']}"],
        ["parameters", f"{model['n_params']:,}"],
        ["corpus", f"{data['corpus']} (sha256 {data['sha256'][:16]}…, {data.get('n_bytes', '?'):,} bytes)"],
        ["train / calibration / evaluation bytes", f"{data['train']} / {data['calibration']} / {data['evaluation']}"],
        ["protocol", f"BOS={data['bos']}, window {data['window']}, scored_from {data['scored_from']}, "
                     f"{data.get('n_eval_windows', '?')} evaluation windows, {data.get('n_calib_windows', '?')} "
                     f"calibration windows"],
    ])


def zoo_training(results: dict) -> list[str]:
    train = results.get("train", {})
    L = ["", "## Training", ""]
    if train.get("diverged"):
        L.append(f"Diverged at step {train.get('diverged_at')}.")
        return L
    return L + table(["steps", "final train loss (nats)", "eval bits/byte (PyTorch)", "gradient spikes", "tokens/s",
                      "wall"], [[
                          train.get("steps"), fmt(train.get("final_train_loss"), ".3f"),
                          fmt(train.get("eval_bits_per_byte"), ".3f"), train.get("gradient_spikes"),
                          fmt(train.get("tokens_per_s"), ",.0f"), fmt(train.get("wall_s"), ".0f", " s")]])


def zoo_export(results: dict) -> list[str]:
    ex = results["export"]
    norm_ops = ", ".join(f"{k}: {v}" for k, v in ex.get("norm_ops", {}).items())
    return ["", "## Export", "",
            f"`{ex['path']}` at opset {ex['opset']}; parity vs PyTorch max |Δlogit| = {ex['max_abs_logit_diff']:.2e} "
            f"(tolerance {ex.get('tolerance', '?')}); norm ops: {norm_ops}."]


def weight_only_what(s: dict) -> str | None:
    """The settings column of a weight-only (MatMulNBits) recipe; None for any other recipe."""
    if s.get("format") != "MatMulNBits":
        return None
    return (f"MatMulNBits int{s.get('bits')} block {s.get('block_size')}, accuracy_level {s.get('accuracy_level')}, "
            f"{s.get('weight_rounding')}, head {s.get('head')}")


# what a weight-only recipe at accuracy_level 4 shares with its level-0 twin: the same weights
TWIN_KEYS = ("bits", "block_size", "weight_rounding", "head", "rotation", "excluded_nodes")


def level0_twin(recipes: list[results_file.Recipe], recipe: results_file.Recipe) -> results_file.Recipe | None:
    """The scored level-0 weight-only recipe with ``recipe``'s weights (None when the run has none)."""
    return next((t for t in recipes if t.settings.get("format") == "MatMulNBits"
                 and t.settings.get("accuracy_level") == 0 and t.accuracy
                 and all(t.settings.get(k) == recipe.settings.get(k) for k in TWIN_KEYS)), None)


def accuracy_level_4(results: dict) -> list[str]:
    """Each weight-only recipe at accuracy_level 4 with its per-block input measurement
    (``settings.activation_blocks``): what the int8 inputs lose, at the MatMul inputs the probe
    marks as carrying a massive activation and at the others, beside its KL and its level-0 twin's."""
    recipes = [r for r in results_file.recipes(results) if r.settings.get("format") == "MatMulNBits"]
    rows = []
    for r in recipes:
        blocks = r.settings.get("activation_blocks")
        if r.settings.get("accuracy_level") != 4 or not blocks:
            continue
        if blocks.get("status") != "measured":
            rows.append([f"`{r.name}`", r.settings.get("block_size"), blocks.get("status"), "", "", "", ""])
            continue
        twin = level0_twin(recipes, r)
        c, o = blocks["summary"]["carriers"], blocks["summary"]["others"]
        rows.append([f"`{r.name}`", blocks["block_size"],
                     f"{c['inputs']}: {fmt(c['median_output_db'], '.1f')} / {fmt(c['min_max_row_rest_db'], '.1f')}",
                     f"{o['inputs']}: {fmt(o['median_output_db'], '.1f')} / {fmt(o['median_rest_db'], '.1f')} / "
                     f"{fmt(o['min_max_row_rest_db'], '.1f')}",
                     f"{r.accuracy['kld_mean']:.2e}" if r.accuracy else r.status,
                     f"{twin.accuracy['kld_mean']:.2e} (`{twin.name}`)" if twin else "–",
                     f"{fmt(100 * r.accuracy['top1_agreement'], '.2f', '%')}" if r.accuracy else "–"])
    if not rows:
        return []
    return ["", "### accuracy_level 4: the int8 inputs per block", "",
            "Each MatMulNBits input quantized to int8 per row and per block along K, as ONNX Runtime's CPU kernel does "
            "at accuracy_level 4, measured in numpy on calibration windows with float weights (dB). Carriers: the "
            "inputs the graph probe finds carrying a massive activation; the output SQNR is of x @ W; the rest SQNR "
            "is of the values that are not their block's largest |a|, and of the row holding the tensor's largest "
            "|a| (near 0 dB: that row's other values in the block round to zero).", "",
            *table(["recipe", "block", "carriers: median output / worst max-row rest",
                    "others: median output / median rest / worst max-row rest", "KL mean", "KL mean at level 0",
                    "top-1"], rows)]


def zoo_recipes(results: dict) -> list[str]:
    L = ["", "## INT8 recipes (accuracy on the evaluation range, vs the FP32 ONNX model, same session options)", ""]
    rows = []
    for r in results_file.recipes(results):
        s, a = r.settings, r.accuracy
        what = weight_only_what(s) or f"{s.get('format', '')} {s.get('calibration') or 'dynamic'}, " \
            f"{'per-channel' if s.get('per_channel') else 'per-tensor'}, reduce_range={s.get('reduce_range')}"
        if a is None:
            rows.append([f"`{r.name}`", what, r.status, "–", "–", "–", "–", "–", "–"])
        else:
            rows.append([f"`{r.name}`", what, r.status, fmt(a["ppl_fp32"], ".4f"), fmt(a["ppl_int8"], ".4f"),
                         fmt(a["ppl_ratio"], ".4f"), f"{a['kld_mean']:.2e} / {a['kld_p99']:.2e} / {a['kld_max']:.2e}",
                         fmt(100 * a["top1_agreement"], ".2f", "%"),
                         fmt(r.entry.get("size_bytes", 0) / 1e6, ".2f", " MB")])
    return L + table(["recipe", "settings", "status", "PPL fp32", "PPL int8", "ratio", "KL mean / p99 / max (nats)",
                      "top-1", "size"], rows)


def zoo_outliers(results: dict) -> list[str]:
    o = results_file.outliers(results)
    if o is None:
        return []
    L = ["", "## Activations and outliers", "",
         "Residual stream after the embedding and after each block, on evaluation windows. Ratio = max |a| / "
         "median |a|; massive = |a| > 100 and >= 1000x the median (Sun et al. 2024); kurtosis and inf-norm "
         "averaged over windows (Bondarenko et al. 2023).", ""]
    rows = []
    for r in o.get("residual", []):
        top = r["top"][0] if r.get("top") else {}
        rows.append([r["layer"], fmt(top.get("value"), ".3g"), f"({top.get('position')}, {top.get('channel')})",
                     fmt(r.get("median_abs"), ".3g"), fmt(r.get("ratio"), ".1f"), fmt(r.get("kurtosis"), ".1f"),
                     fmt(r.get("inf_norm"), ".3g"), fmt(r.get("rms"), ".3g")])
    L += table(["layer", "max a", "(position, channel)", "median abs", "max/median", "kurtosis", "inf-norm", "RMS"],
               rows)
    massive = o.get("massive", [])
    L += ["", f"Massive activations: {len(massive) if massive else 'none'}."]
    if o.get("bos_attention"):
        L.append("Mean attention on BOS per layer (queries after position 0): "
                 + ", ".join(f"{v:.2f}" for v in o["bos_attention"]) + ".")
    return L + sqnr_tables(results)


def zoo_diagnostics(results: dict) -> list[str]:
    d = results_file.section(results, "diagnostics")
    if d is None:
        return []
    L = ["", "## Diagnostics", "",
         "Perturbation sensitivity: Gaussian noise of the given size relative to each parameter's RMS, "
         "added to every parameter; relative change of the logits on evaluation windows (Liu et al. 2020).", ""]
    L += table(["relative noise", "relative logit change", "std"], [
        [f"{r['relative_noise']:g}", fmt(r["relative_logit_change"], ".4g"), fmt(r["std"], ".2g")]
        for r in d.get("perturbation", [])])
    if d.get("block_cosine"):
        L += ["", "Cosine similarity of each block's output with its input (per token, mean): "
              + ", ".join(f"{v:.3f}" for v in d["block_cosine"]) + "."]
    return L
