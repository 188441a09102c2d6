"""report.md for a Hugging Face checkpoint's results.json (``model.source = "hf:<path>"``).

Same sections as the zoo's report, with what differs for a real checkpoint: the detected
architecture, placement and norm (and the check that verified them), the token-level protocol,
encoder metrics (embedding cosine, nearest-neighbour agreement, MLM perplexity) instead of the
perplexity table for encoders, and an outlier table that names the token at each position.
``quantnorm report`` hands such a results.json here (``is_hf_results``), so it works on these
runs too. Reads only results.json.
"""

from __future__ import annotations

from pathlib import Path

from ..fileio import write_text_atomic
from ..report import (
    _fmt,
    _table,
    closing_sections,
    hardware_section,
    make_plots,
    session_and_latency,
    smoothquant_and_search,
    sqnr_tables,
    warnings_for,
)
from ..runs import REPORT_FILE


def is_hf_results(results: dict) -> bool:
    """A loaded checkpoint's results (``hf:<path>``, or a source object of kind hf/gguf/onnx),
    not a zoo model trained here."""
    source = results.get("model", {}).get("source", "")
    if isinstance(source, dict):
        return source.get("kind") in ("hf", "gguf", "onnx")
    return str(source).startswith("hf:")


def source_title(source) -> str:
    """The checkpoint's name for a title: ``hf:<path>``, or a GGUF source's file and package."""
    if isinstance(source, dict) and source.get("kind") == "onnx":
        return f"ONNX export {source.get('path')}"
    if isinstance(source, dict):
        pkg = f" from {source['package']} {source.get('package_version')}" if source.get("package") else ""
        return f"{source.get('file')}{pkg}"
    return str(source)


def source_rows(model: dict) -> list[list[str]]:
    source = model["source"]
    if not isinstance(source, dict):
        return [["checkpoint", f"`{str(source)[3:]}` ({model.get('weights')} weights, float32, eager attention)"]]
    if source.get("kind") == "onnx":
        return [["model", f"ONNX export directory `{source.get('path')}` ({source.get('file')}, "
                          f"{source.get('bytes', 0):,} bytes)"],
                ["file SHA-256", f"`{source.get('sha256')}`"],
                ["FP32 baseline", f"**{source.get('baseline')}**"]]
    pkg = (f"package {source['package']} {source.get('package_version')}" if source.get("package")
           else "not from an installed package")
    parts = f"; joined from {len(source['parts'])} parts ({', '.join(source['parts'])})" if source.get("parts") else ""
    return [["checkpoint", f"{source.get('kind', '?').upper()} file `{source.get('file')}` ({pkg}{parts})"],
            ["file SHA-256", f"`{source.get('sha256')}`"],
            ["stored as", f"{source.get('quant_type')}; FP32 baseline: **{source.get('baseline')}** (every ratio "
                          "below is against that dequantized model, not the original BF16 weights)"]]


def _agreement(detected: dict) -> str:
    if detected.get("table") is None:
        return "no architecture table for this source: the graph's answer is the placement"
    return f"{'agrees with' if detected.get('agrees') else 'differs from'} the table's {detected.get('table')}"


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.2f}%"


def render_hf(results: dict, plots: dict[str, str]) -> str:
    hw, model, data, ex = results["hardware"], results["model"], results["data"], results["export"]
    kind = model.get("kind")
    L = [f"# quantnorm report: {source_title(model['source'])} ({model['architecture']}, "
         f"{model['placement']}/{model['norm']})", ""]
    L += [f"Reproduce: `{results['command']}`  ", f"Created {results['created']} by quantnorm "
          f"{results['quantnorm_version']} (results.json schema {results['schema_version']}).", ""]
    L += hardware_section(hw)
    check = model.get("placement_check", {})
    verified = check.get("label") or ("verified on block 0" if check.get("verified")
                                      else f"NOT verified ({check.get('reason', 'mismatch')})")
    L += ["", "## Model (pretrained checkpoint, detected)", ""]
    L += _table(["what", "value"], [
        *source_rows(model),
        ["architecture", f"{model['architecture']} ({', '.join(model.get('architectures', [])) or '?'}; "
                         f"loaded as {model.get('model_class')})"],
        ["placement / norm", f"**{model['placement']} / {model['norm']}** — {model.get('rule')}"],
        ["norm formula", model.get("norm_formula")],
        ["norm modules per block", "; ".join(f"`{k}`: {v}" for k, v in model.get("norm_roles", {}).items())],
        ["final norm", f"`{model['final_norm']}`" if model.get("final_norm") else "none"],
        ["QK-norm", ", ".join(f"`{n}`" for n in model.get("qk_norm", [])) or "no"],
        ["placement check", f"{verified}: {check.get('detail', '')} (max error {_fmt(check.get('max_abs_error'), '.2g')})"],
        *([["placement from the ONNX graph", f"**{model['placement_detected'].get('placement')} / "
            f"{model['placement_detected'].get('norm')}** ({_agreement(model['placement_detected'])}): "
            f"{model['placement_detected'].get('how')}"]]
          if model.get("placement_detected") else []),
        ["layers, d_model, heads, positions", f"{model['n_layers']}, {model['d_model']}, {model['n_heads']}, {model['context']}"],
        ["parameters, vocabulary", f"{model['n_params']:,}, {model.get('vocab_size'):,}"],
        *([["encoder outputs", f"pooling {model.get('pooling')}; MLM head: {'yes' if model.get('mlm_head') else 'no'}"]]
          if kind == "encoder" else []),
    ])
    if model.get("notes"):
        L += ["", f"Notes: {model['notes']}."]
    L += ["", "## Data (token-level protocol)", ""]
    tok = data.get("tokenizer", {})
    special = ", ".join(f"{k} {v}" for k, v in data.items() if k.endswith("_token_id"))
    L += _table(["what", "value"], [
        ["corpus", f"{data['corpus']} (sha256 {data['sha256'][:16]}…, {data.get('n_bytes', 0):,} bytes)"],
        ["calibration / evaluation bytes", f"{data['calibration']} / {data['evaluation']} (disjoint; "
                                           f"train range {data['train']} unused: pretrained)"],
        ["tokenizer", f"{tok.get('class')} ({tok.get('vocab_size')} tokens); {data.get('decode')}"],
        ["tokens", f"calibration {data['n_tokens']['calibration']:,}, evaluation {data['n_tokens']['evaluation']:,}"],
        ["windows", f"{data['window']} tokens: {data.get('layout')}; {special}"],
        ["evaluation / calibration windows", f"{data.get('n_eval_windows')} ({data.get('eval_windows')}) / "
                                             f"{data.get('n_calib_windows')} ({data.get('calib_selection')})"],
    ])
    L += ["", "## Export", ""]
    norm_ops = ", ".join(f"{k}: {v}" for k, v in ex.get("norm_ops", {}).items())
    diffs = ", ".join(f"{k} {v:.2e}" for k, v in ex.get("max_abs_diff", {}).items())
    if ex.get("bound_inputs") is not None:  # an ONNX source: the user's graph, inputs bound
        bound = "; ".join(f"{k} = {v}" for k, v in ex["bound_inputs"].items()) or "none"
        L.append(f"`{ex['path']}`: the user's `model.onnx` (opset {ex['opset']}) with its optional inputs bound "
                 f"({bound}); outputs {', '.join(ex.get('outputs', []))}"
                 + (f" (dropped: {', '.join(ex['dropped_outputs'])})" if ex.get("dropped_outputs") else "")
                 + f"; parity vs {ex.get('parity_reference')} max |Δ| {diffs} on inputs {ex.get('parity_shapes')} "
                   f"(tolerance {ex.get('tolerance')}); norm ops: {norm_ops}.")
    else:
        L.append(f"`{ex['path']}` by the {ex.get('exporter')} exporter at opset {ex['opset']}; outputs "
                 f"{', '.join(ex.get('outputs', []))}; parity vs PyTorch max |Δ| {diffs} on inputs "
                 f"{ex.get('parity_shapes')} (gate: {ex.get('tolerance_rule')}, tolerance {ex.get('tolerance')}); "
                 f"norm ops: {norm_ops}.")
    failed = [a for a in ex.get("attempts", []) if a.get("status") != "ok"]
    if failed:
        L.append("Earlier attempts: " + "; ".join(f"{a['exporter']} opset {a['opset']}: {a['status']}" for a in failed) + ".")
    L += massive_section(results)
    L += fp16_section(results)
    L += ["", *recipe_section(results), *softmax_note(results)]
    L += smoothquant_and_search(results)
    L += session_and_latency(results)
    if "outliers" in results:
        L += outlier_section_hf(results)
    warn = warnings_for(results)
    if not check.get("verified", True):
        warn.insert(0, f"The detected placement did not pass its check on this checkpoint: {check}.")
    L += closing_sections(results, warn, plots)
    return "\n".join(L) + "\n"


def massive_section(results: dict, limit: int = 12) -> list[str]:
    """The first question: where the massive activations are born, and which quantized MatMul
    inputs see them, with what each recipe does to those inputs (SQNR, dB)."""
    o = results.get("outliers")
    if not o or "matmul_inputs" not in o:
        return []
    L = ["", "## Massive activations and the quantized tensors that see them", ""]
    born = o.get("massive_born", [])
    if born:
        L += ["Where they are born (the first block whose output holds a massive entry its input lacks; "
              "the sublayer with the largest output there):", ""]
        L += _table(["block", "position (token)", "channel", "value", "max/median", "block input there", "born in"], [
            [b["layer"], f"{b['position']}{_tok(b)}", b["channel"], _fmt(b["value"], ".4g"), _fmt(b.get("ratio"), ".0f"),
             _fmt(b.get("input_value"), ".3g"), f"`{b.get('born_in')}`"] for b in born[:6]])
    else:
        L.append("No massive activation (|a| > 100 and >= 1000x the median) in the residual stream.")
    static = {name: rows for name, rows in results.get("sqnr", {}).items()}
    recipes = list(static)

    def static_sqnr(modules: list[str], rows: list[dict]):
        for r in rows:
            if set(r.get("modules") or []) & set(modules):
                return r.get("sqnr_db")
        return None

    inputs = o["matmul_inputs"]
    carriers = [r for r in inputs if r.get("carries_massive")]
    others = sorted((r for r in inputs if not r.get("carries_massive")), key=lambda r: -(r.get("inf_norm") or 0))
    shown = (carriers + others)[:max(limit, len(carriers))]
    rows = []
    for r in shown:
        top = r["top"][0] if r.get("top") else {}
        fake = r.get("sqnr_db_fake", {})
        rows.append([", ".join(f"`{m}`" for m in r.get("modules", [r["tensor"]])[:3]),
                     _fmt(top.get("value"), ".4g"), f"({top.get('position')}, {top.get('channel')}){_tok(top)}",
                     _fmt(r.get("ratio"), ".0f"), "**yes**" if r.get("carries_massive") else "no",
                     _fmt(fake.get("per_token"), ".1f"), _fmt(fake.get("per_tensor_dynamic"), ".1f"),
                     *[_fmt(static_sqnr(r.get("modules", []), static[n]), ".1f") for n in recipes]])
    L += ["", f"Linear (MatMul) inputs: the {len(carriers)} that carry a massive value (their largest |a| is on a "
          "massive position and above 100), then the largest others. SQNR per token and per tensor (dynamic) by "
          "fake quantization of the probe's activations with the pertoken and ORT dynamic arithmetic; static "
          "recipes from ONNX Runtime's QDQ pairs.", ""]
    L += _table(["input of", "max a", "(position, channel) token", "max/median", "carries massive",
                 "SQNR per-token", "SQNR per-tensor dyn.", *[f"SQNR {n}" for n in recipes]], rows)
    return L


def fp16_section(results: dict) -> list[str]:
    f = results.get("fp16")
    if not f:
        return []
    L = ["", "## FP16: does it survive float16?", "", f"**{f['verdict']}.** {f['how']}; {f['n_windows']} windows of "
         f"{f['seq']} tokens.", ""]
    if f.get("fp32_overflow"):
        L += _table(["tensor (FP32 run) past 65,504", "max abs", "rows over", "positions (first)"], [
            [f"`{e['tensor']}`", _fmt(e["max_abs"], ".6g"), e["rows_over"],
             ", ".join(map(str, e["positions"])) + (" ..." if e.get("n_positions", 0) > len(e["positions"]) else "")]
            for e in f["fp32_overflow"]])
        if f.get("fp32_overflow_total", 0) > len(f["fp32_overflow"]):
            L.append(f"({f['fp32_overflow_total']} tensors in all.)")
        L.append("")
    L += _table(["forward", "status", "PPL ratio", "KL mean", "top-1"], [
        [name, v.get("status"), _fmt(v.get("ppl_ratio"), ".4f"), _fmt(v.get("kld_mean"), ".2e"),
         _pct(v.get("top1_agreement"))] for name, v in f.get("forwards", {}).items()])
    return L


def _status(r: dict) -> str:
    status = r.get("status", "ok")
    return status if status == "ok" else "**broken** (damage measured; see Warnings)" if r.get("damage") else status


def softmax_note(results: dict) -> list[str]:
    """Which recipes quantized the attention scores (softmax inputs, where HF adds the mask)."""
    parts = []
    for r in results["recipes"]:
        sm = r.get("softmax_inputs")
        if sm is None:
            continue
        parts.append(f"`{r['name']}` {sm['quantized']}" + (f" (INT8 step up to {sm['max_scale']:.3g})" if sm["quantized"] else ""))
    if not parts:
        return []
    return ["", "Softmax inputs (attention scores plus the attention mask) quantized per recipe: " + ", ".join(parts)
            + ". Weight-MatMul recipes leave them in float; a calibrated mask constant makes the INT8 step "
              "enormous (the recipe is then marked broken)."]


def _what(s: dict) -> str:
    return (f"{s.get('format', '')} {s.get('calibration') or 'dynamic'}, "
            f"{'per-channel' if s.get('per_channel') else 'per-tensor'}, {s.get('op_scope', '')} scope, "
            f"reduce_range={s.get('reduce_range')}")


def recipe_section(results: dict) -> list[str]:
    kind = results["model"].get("kind")
    rows = []
    if kind == "causal":
        L = ["## INT8 recipes (token-level accuracy on the evaluation range, vs the FP32 ONNX model, same session options)", ""]
        for r in results["recipes"]:
            a = r.get("accuracy") or r.get("damage")
            if a is None:
                rows.append([f"`{r['name']}`", _what(r.get("settings", {})), r["status"], "–", "–", "–", "–", "–", "–"])
                continue
            rows.append([f"`{r['name']}`", _what(r.get("settings", {})), _status(r),
                         _fmt(a["ppl_fp32"], ".4f"), _fmt(a["ppl_int8"], ".4f"), _fmt(a["ppl_ratio"], ".4f"),
                         f"{a['kld_mean']:.2e} / {a['kld_p99']:.2e} / {a['kld_max']:.2e}", _pct(a["top1_agreement"]),
                         _fmt(r.get("size_bytes", 0) / 1e6, ".2f", " MB")])
        L += _table(["recipe", "settings", "status", "PPL fp32 (token)", "PPL int8 (token)", "ratio",
                     "KL mean / p99 / max (nats)", "top-1", "size"], rows)
        n = next((r["accuracy"]["n_scored"] for r in results["recipes"] if r.get("accuracy")), None)
        L += ["", f"Perplexity per token over {n} scored tokens (not bits per byte: the checkpoint's own tokens)."]
        return L
    L = ["## INT8 recipes (embedding agreement on the evaluation passages, vs the FP32 ONNX model, same session options)", ""]
    mlm = any(r.get("accuracy", {}).get("mlm") for r in results["recipes"])
    for r in results["recipes"]:
        a = r.get("accuracy") or r.get("damage")
        if a is None:
            rows.append([f"`{r['name']}`", _what(r.get("settings", {})), r["status"]] + ["–"] * (7 if mlm else 5))
            continue
        row = [f"`{r['name']}`", _what(r.get("settings", {})), _status(r),
               _fmt(a["cosine_mean"], ".5f"), f"{_fmt(a['cosine_p1'], '.5f')} / {_fmt(a['cosine_min'], '.5f')}",
               _pct(a.get("nn_agreement")), _fmt(a.get("token_cosine_mean"), ".5f")]
        if mlm:
            row += [f"{_fmt(a.get('ppl_fp32'), '.3f')} → {_fmt(a.get('ppl_int8'), '.3f')} ({_fmt(a.get('ppl_ratio'), '.4f')})",
                    _pct(a.get("top1_agreement"))]
        row.append(_fmt(r.get("size_bytes", 0) / 1e6, ".2f", " MB"))
        rows.append(row)
    header = ["recipe", "settings", "status", "cosine mean", "cosine p1 / min", "NN agreement", "token cosine mean"]
    if mlm:
        header += ["MLM PPL fp32 → int8 (ratio)", "MLM top-1"]
    L += _table(header + ["size"], rows)
    n = next((r["accuracy"]["n_passages"] for r in results["recipes"] if r.get("accuracy")), None)
    L += ["", f"Cosine similarity of FP32 and INT8 sentence embeddings ({results['model'].get('pooling')} pooling) "
          f"over {n} evaluation passages; NN agreement: share of passages whose most similar other passage is the "
          f"same under both models; token cosine: last hidden state, per token."]
    return L


def _tok(entry: dict) -> str:
    token = entry.get("token")
    return f" `{token}`" if token else ""


def outlier_section_hf(results: dict) -> list[str]:
    o = results["outliers"]
    L = ["", "## Activations and outliers", "",
         f"Residual stream after the embedding and after each block, on {o.get('n_samples')} evaluation windows of "
         f"{o.get('seq_len')} tokens. Ratio = max |a| / median |a|; massive = |a| > 100 and >= 1000x the median of "
         "its window (Sun et al. 2024); kurtosis and inf-norm averaged over windows (Bondarenko et al. 2023). "
         "(position, channel) of the largest |a|, with the token at that position.", ""]
    rows = []
    for r in o.get("residual", []):
        tops = r.get("top", [])
        top = tops[0] if tops else {}
        others = "; ".join(f"{_fmt(t['value'], '.3g')} at ({t['position']}, {t['channel']}){_tok(t)}" for t in tops[1:])
        rows.append([r["layer"], _fmt(top.get("value"), ".3g"),
                     f"({top.get('position')}, {top.get('channel')}){_tok(top)}", others,
                     _fmt(r.get("median_abs"), ".3g"), _fmt(r.get("ratio"), ".1f"), _fmt(r.get("kurtosis"), ".1f"),
                     _fmt(r.get("inf_norm"), ".3g"), _fmt(r.get("rms"), ".3g")])
    L += _table(["layer", "max a", "(position, channel) token", "2nd, 3rd", "median abs", "max/median", "kurtosis",
                 "inf-norm", "RMS"], rows)
    if o.get("norm_inputs"):
        L += ["", "Post-norm model: the residual sums `x + F(x)` entering each LayerNorm (where post-LN models keep "
              "their large values):", ""]
        L += _table(["norm", "max a", "(position, channel) token", "median abs", "max/median", "kurtosis"], [
            [f"`{r['tensor']}`", _fmt(r["top"][0]["value"] if r.get("top") else None, ".3g"),
             (f"({r['top'][0]['position']}, {r['top'][0]['channel']}){_tok(r['top'][0])}" if r.get("top") else "–"),
             _fmt(r.get("median_abs"), ".3g"), _fmt(r.get("ratio"), ".1f"), _fmt(r.get("kurtosis"), ".1f")]
            for r in o["norm_inputs"]])
    summary = o.get("summary", {})
    chans = ", ".join(f"{c['channel']} ({c['layers']} layers)" for c in summary.get("channels_holding_layer_max", [])[:4])
    poss = ", ".join(f"{p['position']} ({p['layers']} layers)" for p in summary.get("positions_holding_layer_max", [])[:4])
    L += ["", f"Channels holding a layer's maximum: {chans or '–'}; positions: {poss or '–'}."]
    massive = o.get("massive", [])
    if massive:
        where = ", ".join(f"{_fmt(m['value'], '.4g')} at layer {m['layer']} ({m.get('stream')}) position "
                          f"{m['position']}{_tok(m)} channel {m['channel']}" for m in massive[:5])
        L.append(f"Massive activations: {o.get('massive_total', len(massive))} entries; largest: {where}.")
    else:
        L.append("Massive activations: none.")
    if o.get("bos_attention"):
        L.append(f"Mean attention on {o.get('attention_key', 'BOS')} per layer: "
                 + ", ".join("–" if v is None else f"{v:.2f}" for v in o["bos_attention"]) + ".")
    if o.get("sep_attention"):
        L.append("Mean attention on the last key ([SEP]) per layer: "
                 + ", ".join("–" if v is None else f"{v:.3f}" for v in o["sep_attention"]) + ".")
    return L + sqnr_tables(results)


def write_hf_report(run_dir: str | Path, results: dict) -> Path:
    run_dir = Path(run_dir)
    target = run_dir / REPORT_FILE
    write_text_atomic(target, render_hf(results, make_plots(run_dir, results)))
    return target
