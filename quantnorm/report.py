"""results.json -> report.md (+ PNG plots). Reads only results.json, so `quantnorm report` can
regenerate the report of any run, and every number in it was measured by the run that wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import plots
from .errors import QuantnormError, RunDirError
from .fileio import write_text_atomic
from .runs import PLOTS_DIR, REPORT_FILE, RESULTS_FILE
from .train_status import TRAINED, status_from_results

SUPPORTED_SCHEMA = 1


def load_results(path: str | Path) -> dict:
    """Read a results.json (or the one inside a run directory) and check its schema version."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{path} not found: run `quantnorm evaluate` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{path} is not valid JSON ({exc}); re-run `quantnorm evaluate`") from None
    if not isinstance(results, dict) or "schema_version" not in results:
        raise RunDirError(f"{path} is not a quantnorm results.json (no schema_version)")
    if results["schema_version"] != SUPPORTED_SCHEMA:
        raise RunDirError(f"{path} has schema_version {results['schema_version']}; this quantnorm reads "
                          f"{SUPPORTED_SCHEMA} (use the quantnorm version that wrote it)")
    return results


def _fmt(value, spec: str = ".4g", unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:{spec}}{unit}"
    return f"{value}{unit}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _short_provider(provider: str) -> str:
    return provider.replace("ExecutionProvider", "")


def hardware_section(hw: dict) -> list[str]:
    return ["## Hardware and versions", ""] + _table(["what", "value"], [
        ["CPU", hw.get("cpu")], ["ISA flags", ", ".join(hw.get("cpu_flags", []))], ["VNNI", hw.get("vnni")],
        ["threads", hw.get("threads") or "ORT default"], ["GPU", hw.get("gpu") or "none"],
        ["providers available", ", ".join(hw.get("providers_available", []))],
        ["onnxruntime / torch / onnx", f"{hw.get('onnxruntime')} / {hw.get('torch')} / {hw.get('onnx')}"],
    ])


def warnings_for(results: dict) -> list[str]:
    out: list[str] = []
    hw = results.get("hardware", {})
    if hw.get("vnni") is False:
        out.append("This CPU has no VNNI: ONNX Runtime's u8s8 INT8 kernels can saturate (AVX2 path), so recipes "
                   "use 7-bit weights (`reduce_range`) where set to auto; accuracy was measured under the same "
                   "session options as deployment.")
    for r in results.get("recipes", []):
        if r.get("status", "ok") != "ok":
            out.append(f"Recipe `{r['name']}` is **{r['status']}**.")
    for row in results.get("latency", []):
        if row.get("simulated_int8"):
            out.append(f"{_short_provider(row['provider'])} ran `{row['variant']}` as simulated quantization "
                       f"(QDQ nodes, float math): {row.get('note', '')}")
    seen = set()
    for row in results.get("latency", []):
        if row["status"] != "measured" and row["provider"] not in seen:
            seen.add(row["provider"])
            out.append(f"{_short_provider(row['provider'])}: {row['status']}.")
    return out


def training_status_line(results: dict) -> list[str]:
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


def render(results: dict, plots: dict[str, str]) -> str:
    hw, model, data, train = results["hardware"], results["model"], results["data"], results.get("train", {})
    L: list[str] = [f"# quantnorm report: {model['placement']}/{model['norm']}", ""]
    L += training_status_line(results)
    L += [f"Reproduce: `{results['command']}`  ", f"Created {results['created']} by quantnorm "
          f"{results['quantnorm_version']} (results.json schema {results['schema_version']}).", ""]
    L += hardware_section(hw)
    L += ["", "## Model and data", ""]
    L += _table(["what", "value"], [
        ["placement / norm", f"{model['placement']} / {model['norm']}"],
        ["layers, d_model, heads, context", f"{model['n_layers']}, {model['d_model']}, {model['n_heads']}, {model['context']}"],
        ["parameters", f"{model['n_params']:,}"],
        ["corpus", f"{data['corpus']} (sha256 {data['sha256'][:16]}…, {data.get('n_bytes', '?'):,} bytes)"],
        ["train / calibration / evaluation bytes", f"{data['train']} / {data['calibration']} / {data['evaluation']}"],
        ["protocol", f"BOS={data['bos']}, window {data['window']}, scored_from {data['scored_from']}, "
                     f"{data.get('n_eval_windows', '?')} evaluation windows, {data.get('n_calib_windows', '?')} calibration windows"],
    ])
    L += ["", "## Training", ""]
    if train.get("diverged"):
        L.append(f"Diverged at step {train.get('diverged_at')}.")
    else:
        L += _table(["steps", "final train loss (nats)", "eval bits/byte (PyTorch)", "gradient spikes", "tokens/s", "wall"], [[
            train.get("steps"), _fmt(train.get("final_train_loss"), ".3f"), _fmt(train.get("eval_bits_per_byte"), ".3f"),
            train.get("gradient_spikes"), _fmt(train.get("tokens_per_s"), ",.0f"), _fmt(train.get("wall_s"), ".0f", " s")]])
    ex = results["export"]
    L += ["", "## Export", ""]
    norm_ops = ", ".join(f"{k}: {v}" for k, v in ex.get("norm_ops", {}).items())
    L.append(f"`{ex['path']}` at opset {ex['opset']}; parity vs PyTorch max |Δlogit| = {ex['max_abs_logit_diff']:.2e} "
             f"(tolerance {ex.get('tolerance', '?')}); norm ops: {norm_ops}.")
    L += ["", "## INT8 recipes (accuracy on the evaluation range, vs the FP32 ONNX model, same session options)", ""]
    rows = []
    for r in results["recipes"]:
        a = r.get("accuracy")
        s = r.get("settings", {})
        what = f"{s.get('format', '')} {s.get('calibration') or 'dynamic'}, " \
               f"{'per-channel' if s.get('per_channel') else 'per-tensor'}, reduce_range={s.get('reduce_range')}"
        if a is None:
            rows.append([f"`{r['name']}`", what, r["status"], "–", "–", "–", "–", "–", "–"])
        else:
            rows.append([f"`{r['name']}`", what, r.get("status", "ok"), _fmt(a["ppl_fp32"], ".4f"), _fmt(a["ppl_int8"], ".4f"),
                         _fmt(a["ppl_ratio"], ".4f"), f"{a['kld_mean']:.2e} / {a['kld_p99']:.2e} / {a['kld_max']:.2e}",
                         _fmt(100 * a["top1_agreement"], ".2f", "%"), _fmt(r.get("size_bytes", 0) / 1e6, ".2f", " MB")])
    L += _table(["recipe", "settings", "status", "PPL fp32", "PPL int8", "ratio", "KL mean / p99 / max (nats)",
                 "top-1", "size"], rows)
    L += session_and_latency(results)
    if "outliers" in results:
        L += outlier_section(results)
    L += smoothquant_and_search(results)
    if "diagnostics" in results:
        L += diagnostics_section(results["diagnostics"])
    L += closing_sections(results, warnings_for(results), plots)
    return "\n".join(L) + "\n"


def closing_sections(results: dict, warn: list[str], plots: dict[str, str]) -> list[str]:
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


def session_and_latency(results: dict) -> list[str]:
    """The ONNX Runtime session the recipes ran in, then the latency section."""
    session = results["recipes"][0].get("session", {}) if results["recipes"] else {}
    return ["", f"Session: {session.get('provider')} with {session.get('graph_optimization_level')}.",
            "", "## Latency", "", *latency_section(results)]


def smoothquant_and_search(results: dict) -> list[str]:
    """The SmoothQuant and accuracy-aware search sections, for the runs that have them."""
    L: list[str] = []
    if "smoothquant" in results:
        L += smoothquant_section(results["smoothquant"])
    if "search" in results:
        L += search_section(results["search"])
    return L


def latency_section(results: dict) -> list[str]:
    """One table per provider; a provider that was not measured says why and shows no number."""
    L: list[str] = []
    by_provider: dict[str, list[dict]] = {}
    for row in results.get("latency", []):
        by_provider.setdefault(row["provider"], []).append(row)
    for provider, rows in by_provider.items():
        L += [f"### {_short_provider(provider)}", ""]
        measured = [r for r in rows if r["status"] == "measured"]
        if not measured:
            L += [f"{rows[0]['status']}.", ""]
            continue
        fp32 = {r["batch"]: r for r in measured if r["variant"] == "fp32"}
        table = []
        for r in rows:
            if r["status"] != "measured":
                table.append([f"`{r['variant']}`", r["batch"], r["seq"], r["status"], "", "", "", "", ""])
                continue
            base = fp32.get(r["batch"])
            ratio = r["p50_ms"] / base["p50_ms"] if base else None
            nodes = ", ".join(f"{_short_provider(k)} {v}" for k, v in (r.get("node_providers") or {}).items())
            table.append([f"`{r['variant']}`", r["batch"], r["seq"], _fmt(r["p50_ms"], ".2f"), _fmt(r["p90_ms"], ".2f"),
                          _fmt(r["p99_ms"], ".2f"), _fmt(r["tokens_per_s"], ",.0f"), _fmt(ratio, ".2f", "x"),
                          nodes + (" (simulated INT8)" if r.get("simulated_int8") else "")])
        L += _table(["variant", "batch", "seq", "p50 ms", "p90 ms", "p99 ms", "tokens/s", "p50 vs fp32", "nodes per provider"],
                    table)
        L.append("")
    return L


def outlier_section(results: dict) -> list[str]:
    o = results["outliers"]
    L = ["", "## Activations and outliers", "",
         "Residual stream after the embedding and after each block, on evaluation windows. Ratio = max |a| / "
         "median |a|; massive = |a| > 100 and >= 1000x the median (Sun et al. 2024); kurtosis and inf-norm "
         "averaged over windows (Bondarenko et al. 2023).", ""]
    rows = []
    for r in o.get("residual", []):
        top = r["top"][0] if r.get("top") else {}
        rows.append([r["layer"], _fmt(top.get("value"), ".3g"), f"({top.get('position')}, {top.get('channel')})",
                     _fmt(r.get("median_abs"), ".3g"), _fmt(r.get("ratio"), ".1f"), _fmt(r.get("kurtosis"), ".1f"),
                     _fmt(r.get("inf_norm"), ".3g"), _fmt(r.get("rms"), ".3g")])
    L += _table(["layer", "max a", "(position, channel)", "median abs", "max/median", "kurtosis", "inf-norm", "RMS"], rows)
    massive = o.get("massive", [])
    L += ["", f"Massive activations: {len(massive) if massive else 'none'}."]
    if o.get("bos_attention"):
        L.append("Mean attention on BOS per layer (queries after position 0): "
                 + ", ".join(f"{v:.2f}" for v in o["bos_attention"]) + ".")
    return L + sqnr_tables(results)


def sqnr_tables(results: dict) -> list[str]:
    """Per static recipe: the rank correlation of outlier figures with SQNR and the worst tensors."""
    L: list[str] = []
    for recipe, summary in results.get("sqnr_summary", {}).items():
        feeds = {r["tensor"]: ", ".join(r.get("modules", [])) for r in results.get("sqnr", {}).get(recipe, [])}
        L += ["", f"### Per-tensor SQNR, `{recipe}`", "",
              f"Spearman rank correlation with SQNR: ratio {_fmt(summary.get('spearman_ratio_sqnr'), '.2f')}, "
              f"kurtosis {_fmt(summary.get('spearman_kurtosis_sqnr'), '.2f')} (negative: bigger outliers, lower SQNR).", ""]
        L += _table(["worst tensor", "feeds", "SQNR dB", "max/median", "kurtosis", "inf-norm"], [
            [f"`{w['tensor']}`", feeds.get(w["tensor"], ""), _fmt(w.get("sqnr_db"), ".1f"), _fmt(w.get("ratio"), ".1f"),
             _fmt(w.get("kurtosis"), ".1f"), _fmt(w.get("inf_norm"), ".3g")] for w in summary.get("worst", [])])
    return L


def smoothquant_section(sq: dict) -> list[str]:
    L = ["", f"## SmoothQuant (alpha {sq.get('alpha')})", "", sq.get("statement", ""), ""]
    L += _table(["MatMuls", "kind", "reads", "why", "max/median channel ratio before → after"], [
        [", ".join(g["matmuls"]), g["kind"], g.get("source") or "–", g.get("reason", ""),
         f"{_fmt(g.get('channel_ratio_before'), '.1f')} → {_fmt(g.get('channel_ratio_after'), '.1f')}"]
        for g in sq.get("groups", [])])
    ratio = sq.get("fp32_latency_ratio")
    L += ["", f"Folded: {len(sq.get('folded', []))} MatMuls (no runtime cost); explicit per-channel scale: "
              f"{len(sq.get('explicit_scale', []))} (a Mul each). Smoothed FP32 vs original FP32 p50 on the CPU: "
              f"{_fmt(ratio, '.3f', 'x')}. Max |Δlogit| of the smoothed ONNX model vs the original: "
              f"{_fmt(sq.get('onnx_vs_original_max_abs_logit_diff'), '.1e')}"
              + (f" ({sq['parity_rule']})." if sq.get("parity_rule") else ".")]
    return L


def search_section(search: dict) -> list[str]:
    chosen = search.get("chosen")
    verdict = (f"picked `{chosen['name']}` ({search['pick']})" if chosen else
               "no recipe met the target; the best trial is reported")
    L = ["", "## Accuracy-aware search", "",
         f"Target PPL ratio{' over tokens' if search.get('level') == 'token' else ''} <= "
         f"{search['target_max_ppl_ratio']} (tuner: {search.get('tuner')}; metric "
         f"{search.get('metric')}; trials on {search['eval_windows']} evaluation windows; stopped by "
         f"{search['stopped_by']}): {verdict}.", ""]
    L += _table(["#", "trial", "phase", "PPL ratio", "KL mean", "top-1", "p50 ms", "passed"], [
        [t["index"], f"`{t['name']}`", t["phase"], _fmt(t.get("ppl_ratio"), ".4f"), _fmt(t.get("kld_mean"), ".2e"),
         _fmt(None if t.get("top1_agreement") is None else 100 * t["top1_agreement"], ".2f", "%"),
         _fmt(t.get("latency_p50_ms"), ".2f"), "yes" if t.get("passed") else "no"]
        for t in search.get("trials", [])])
    return L


def diagnostics_section(d: dict) -> list[str]:
    L = ["", "## Diagnostics", "",
         "Perturbation sensitivity: Gaussian noise of the given size relative to each parameter's RMS, "
         "added to every parameter; relative change of the logits on evaluation windows (Liu et al. 2020).", ""]
    L += _table(["relative noise", "relative logit change", "std"], [
        [f"{r['relative_noise']:g}", _fmt(r["relative_logit_change"], ".4g"), _fmt(r["std"], ".2g")]
        for r in d.get("perturbation", [])])
    if d.get("block_cosine"):
        L += ["", "Cosine similarity of each block's output with its input (per token, mean): "
              + ", ".join(f"{v:.3f}" for v in d["block_cosine"]) + "."]
    return L


def make_plots(run_dir: Path, results: dict) -> dict[str, str]:
    """Render the report's plots into run_dir/plots; returns {title: relative path}."""
    out_dir = run_dir / PLOTS_DIR
    made: dict[str, str] = {}
    # encoders (Hugging Face) have accuracy without a perplexity ratio: nothing to plot there
    ok = [r for r in results["recipes"] if r.get("accuracy", {}).get("ppl_ratio") is not None]
    if ok:
        path = plots.plot_recipe_tradeoff(ok, results.get("latency", []), out_dir / "recipes.png",
                                          "INT8 recipes: accuracy vs latency (CPU)")
        made["INT8 recipes: PPL ratio and latency"] = str(path.relative_to(run_dir))
    if "outliers" in results and results["outliers"].get("residual"):
        path = plots.plot_layer_outliers(results["outliers"]["residual"], out_dir / "residual_outliers.png",
                                         "Residual stream: max and median |a| per layer")
        made["Residual stream per layer"] = str(path.relative_to(run_dir))
    if "outliers" in results and (out_dir / "heatmap.png").is_file():  # drawn by evaluate, which holds the model
        made[f"|a| over (position, channel), layer {results['outliers'].get('heatmap_layer')}"] = f"{PLOTS_DIR}/heatmap.png"
    for recipe, rows in results.get("sqnr", {}).items():
        points = [r for r in rows if r.get("modules")]  # weight-MatMul inputs (see evaluate.measure_outliers)
        if points:
            path = plots.plot_sqnr_vs_outlier(points, out_dir / f"sqnr.{recipe}.png", f"SQNR vs outlier ratio, {recipe}")
            made[f"SQNR vs max/median ratio ({recipe})"] = str(path.relative_to(run_dir))
    return made


def write_report(run_dir: str | Path, results: dict | None = None) -> Path:
    """report.md of a zoo run (a Hugging Face run's is ``quantnorm.hf.report.write_hf_report``;
    ``quantnorm report`` picks between them, so that this stage never imports a model source)."""
    run_dir = Path(run_dir)
    results = results if results is not None else load_results(run_dir)
    plots = make_plots(run_dir, results)
    target = run_dir / REPORT_FILE
    write_text_atomic(target, render(results, plots))
    return target
