"""Sections of the run report of a pretrained checkpoint: a Hugging Face directory
(``model.source = "hf:<path>"``), a GGUF file or an ONNX export directory (a source object of
kind gguf / onnx).

What differs from a zoo run: the detected architecture, placement and norm (and the check that
verified them, or the ONNX graph they were read from), the token-level protocol, encoder metrics
(embedding cosine, nearest-neighbour agreement, MLM perplexity) instead of the perplexity table
for encoders, the massive activations and the MatMul inputs that carry them, the FP16 check, and
an outlier table that names the token at each position. Each section is ``fn(results) ->
list[str]``; quantnorm.report.run lists them per source kind.
"""

from __future__ import annotations

from .. import results as results_file
from .markdown import fmt, pct, table, token_suffix
from .sections import sqnr_tables, warnings_for, weight_only_what


def title(results: dict) -> str:
    """The checkpoint's name, architecture and placement: ``hf:<path>``, a GGUF file and its
    package, or an ONNX export directory."""
    model = results["model"]
    source = model["source"]
    if results_file.source_kind(results) == results_file.ONNX:
        name = f"ONNX export {source.get('path')}"
    elif isinstance(source, dict):
        pkg = f" from {source['package']} {source.get('package_version')}" if source.get("package") else ""
        name = f"{source.get('file')}{pkg}"
    else:
        name = str(source)
    return f"{name} ({model.get('architecture')}, {model.get('placement')}/{model.get('norm')})"


def _source_rows(results: dict) -> list[list[str]]:
    model = results["model"]
    source = model["source"]
    kind = results_file.source_kind(results)
    if kind == results_file.ONNX:
        rows = [["checkpoint", f"ONNX export directory `{source.get('path')}` ({source.get('file')}, "
                               f"{_count(source.get('bytes'))} bytes; a graph without its PyTorch module: the "
                               f"SmoothQuant and rotation recipes are not applicable)"]]
        if source.get("sha256"):
            rows.append(["model.onnx SHA-256", f"`{source['sha256']}`"])
        if source.get("baseline"):
            rows.append(["FP32 baseline", f"**{source['baseline']}**"])
        return rows
    if not isinstance(source, dict):
        return [["checkpoint", f"`{str(source)[len(results_file.HF_PREFIX):]}` ({model.get('weights')} weights, "
                               f"float32, eager attention)"]]
    pkg = (f"package {source['package']} {source.get('package_version')}" if source.get("package")
           else "not from an installed package")
    parts = f"; joined from {len(source['parts'])} parts ({', '.join(source['parts'])})" if source.get("parts") else ""
    return [["checkpoint", f"{source.get('kind', '?').upper()} file `{source.get('file')}` ({pkg}{parts})"],
            ["file SHA-256", f"`{source.get('sha256')}`"],
            ["stored as", f"{source.get('quant_type')}; FP32 baseline: **{source.get('baseline')}** (every ratio "
                          "below is against that dequantized model, not the original BF16 weights)"]]


def _final_norm(model: dict) -> str:
    """The table's final norm module, else (outside the table) what the graph shows."""
    if model.get("final_norm"):
        return f"`{model['final_norm']}`"
    if model.get("placement_check", {}).get("check") == "none" and (model.get("placement_detected") or {}).get(
            "final_norm"):
        return "yes (read from the graph)"
    return "none"


def _graph_placement_row(model: dict) -> list[list[str]]:
    detected = model.get("placement_detected")
    if not detected:
        return []
    if detected.get("table") is None:
        agreement = "no architecture table for this source: the graph's answer is the placement"
    else:
        agreement = f"{'agrees with' if detected.get('agrees') else 'differs from'} the table's {detected.get('table')}"
    return [["placement from the ONNX graph", f"**{detected.get('placement')} / {detected.get('norm')}** "
                                              f"({agreement}): {detected.get('how')}"]]


def _count(value) -> str:
    """An integer with thousands separators; anything else (a missing count) as fmt writes it."""
    return f"{value:,}" if isinstance(value, int) else fmt(value)


def _size_rows(model: dict) -> list[list[str]]:
    rows = [["layers, d_model, heads, positions", f"{model.get('n_layers')}, {model.get('d_model')}, "
                                                  f"{model.get('n_heads')}, {model.get('context')}"],
            ["parameters, vocabulary", f"{_count(model.get('n_params'))}, {_count(model.get('vocab_size'))}"]]
    if results_file.ENCODER == model.get("kind"):
        rows.append(["encoder outputs", f"pooling {model.get('pooling')}; MLM head: "
                                        f"{'yes' if model.get('mlm_head') else 'no'}"])
    return rows


def model_loaded(results: dict) -> list[str]:
    """A checkpoint loaded into PyTorch (HF directory, GGUF file): the architecture table's
    placement and norm, and the check on block 0 that verified them."""
    model = results["model"]
    check = model.get("placement_check", {})
    verified = "verified on block 0" if check.get("verified") else f"NOT verified ({check.get('reason', 'mismatch')})"
    check_row = (f"{verified}: {check.get('detail', '')} (max error {fmt(check.get('max_abs_error'), '.2g')})"
                 if check.get("check") != "none" else f"none: {check.get('reason')}")  # outside the table
    L = ["", "## Model (pretrained checkpoint, detected)", ""]
    L += table(["what", "value"], [
        *_source_rows(results),
        ["architecture", f"{model['architecture']} ({', '.join(model.get('architectures', [])) or '?'}; "
                         f"loaded as {model.get('model_class')})"],
        ["placement / norm", f"**{model['placement']} / {model['norm']}** — {model.get('rule')}"],
        *([["placement detected from", model["detected_from"]]] if check.get("check") == "none" else []),
        ["norm formula", model.get("norm_formula")],
        ["norm modules per block", "; ".join(f"`{k}`: {v}" for k, v in model.get("norm_roles", {}).items())
         or "not named (outside the loader table)"],
        ["final norm", _final_norm(model)],
        ["QK-norm", ", ".join(f"`{n}`" for n in model.get("qk_norm", [])) or "no"],
        ["placement check", check_row],
        *_graph_placement_row(model),
        *_size_rows(model),
    ])
    if model.get("notes"):
        L += ["", f"Notes: {model['notes']}."]
    return L


def model_onnx(results: dict) -> list[str]:
    """An ONNX export directory: there is no PyTorch module, so placement and norm come from the
    graph alone (where the normalization ops sit relative to the residual Adds)."""
    model = results["model"]
    L = ["", "## Model (ONNX export, detected on the graph)", ""]
    L += table(["what", "value"], [
        *_source_rows(results),
        ["architecture", f"{model.get('architecture')} ({', '.join(model.get('architectures', [])) or '?'})"],
        ["placement / norm", f"**{model.get('placement')} / {model.get('norm')}** — read off the ONNX graph"],
        *_graph_placement_row(model),
        *_size_rows(model),
    ])
    if model.get("notes"):
        L += ["", f"Notes: {model['notes']}."]
    return L


def data(results: dict) -> list[str]:
    """The token-level protocol: the checkpoint's tokenizer over the byte ranges of the corpus."""
    d = results["data"]
    tok = d.get("tokenizer", {})
    n_tokens = d.get("n_tokens", {})
    special = ", ".join(f"{k} {v}" for k, v in d.items() if k.endswith("_token_id"))
    return ["", "## Data (token-level protocol)", ""] + table(["what", "value"], [
        ["corpus", f"{d['corpus']} (sha256 {d['sha256'][:16]}…, {d.get('n_bytes', 0):,} bytes)"],
        ["calibration / evaluation bytes", f"{d['calibration']} / {d['evaluation']} (disjoint; "
                                           f"train range {d.get('train')} unused: pretrained)"],
        ["tokenizer", f"{tok.get('class')} ({tok.get('vocab_size')} tokens); {d.get('decode')}"],
        ["tokens", f"calibration {_count(n_tokens.get('calibration'))}, "
                   f"evaluation {_count(n_tokens.get('evaluation'))}"],
        ["windows", f"{d.get('window')} tokens: {d.get('layout')}; {special}"],
        ["evaluation / calibration windows", f"{d.get('n_eval_windows')} ({d.get('eval_windows')}) / "
                                             f"{d.get('n_calib_windows')} ({d.get('calib_selection')})"],
    ])


def _norm_ops(ex: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in ex.get("norm_ops", {}).items())


def export_checked(results: dict) -> list[str]:
    """The export quantnorm made from the PyTorch module, with its parity check."""
    ex = results["export"]
    diffs = ", ".join(f"{k} {v:.2e}" for k, v in ex.get("max_abs_diff", {}).items())
    L = ["", "## Export", "",
         f"`{ex['path']}` by the {ex.get('exporter')} exporter at opset {ex['opset']}; outputs "
         f"{', '.join(ex.get('outputs', []))}; parity vs PyTorch max |Δ| {diffs} on inputs "
         f"{ex.get('parity_shapes')} (gate: {ex.get('tolerance_rule')}, tolerance {ex.get('tolerance')}); "
         f"norm ops: {_norm_ops(ex)}."]
    failed = [a for a in ex.get("attempts", []) if a.get("status") != "ok"]
    if failed:
        L.append("Earlier attempts: " + "; ".join(f"{a['exporter']} opset {a['opset']}: {a['status']}"
                                                 for a in failed) + ".")
    return L


def export_given(results: dict) -> list[str]:
    """An ONNX source's graph with its optional inputs bound (every window is full length), checked
    against the original graph fed the same values (the FP32 baseline every ratio is against)."""
    ex = results_file.section(results, "export") or {}
    bound = "; ".join(f"{k} = {v}" for k, v in (ex.get("bound_inputs") or {}).items()) or "none"
    diffs = ", ".join(f"{k} {v:.2e}" for k, v in (ex.get("max_abs_diff") or {}).items())
    dropped = f" (dropped: {', '.join(ex['dropped_outputs'])})" if ex.get("dropped_outputs") else ""
    return ["", "## Export", "",
            f"`{ex.get('path')}`: the user's `model.onnx` (opset {ex.get('opset')}) with its optional inputs bound "
            f"({bound}); outputs {', '.join(ex.get('outputs', [])) or '?'}{dropped}; parity vs "
            f"{ex.get('parity_reference')}: max |Δ| {diffs or '?'} on inputs {ex.get('parity_shapes')} (tolerance "
            f"{ex.get('tolerance')}); norm ops: {_norm_ops(ex)}."]


def warnings(results: dict) -> list[str]:
    """The run's warnings, the failed placement check first (it casts doubt on every section)."""
    warn = warnings_for(results)
    check = results["model"].get("placement_check", {})
    if not check.get("verified", True):
        warn.insert(0, f"The detected placement did not pass its check on this checkpoint: {check}.")
    return warn


def massive(results: dict, limit: int = 12) -> list[str]:
    """The first question: where the massive activations are born, and which quantized MatMul
    inputs see them, with what each recipe does to those inputs (SQNR, dB)."""
    o = results_file.outliers(results)
    if not o or "matmul_inputs" not in o:
        return []
    L = ["", "## Massive activations and the quantized tensors that see them", ""]
    born = o.get("massive_born", [])
    if born:
        L += ["Where they are born (the first block whose output holds a massive entry its input lacks; "
              "the sublayer with the largest output there):", ""]
        L += table(["block", "position (token)", "channel", "value", "max/median", "block input there", "born in"], [
            [b["layer"], f"{b['position']}{token_suffix(b)}", b["channel"], fmt(b["value"], ".4g"), fmt(b.get("ratio"), ".0f"),
             fmt(b.get("input_value"), ".3g"), f"`{b.get('born_in')}`"] for b in born[:6]])
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
                     fmt(top.get("value"), ".4g"), f"({top.get('position')}, {top.get('channel')}){token_suffix(top)}",
                     fmt(r.get("ratio"), ".0f"), "**yes**" if r.get("carries_massive") else "no",
                     fmt(fake.get("per_token"), ".1f"), fmt(fake.get("per_tensor_dynamic"), ".1f"),
                     *[fmt(static_sqnr(r.get("modules", []), static[n]), ".1f") for n in recipes]])
    L += ["", f"Linear (MatMul) inputs: the {len(carriers)} that carry a massive value (their largest |a| is on a "
          "massive position and above 100), then the largest others. SQNR per token and per tensor (dynamic) by "
          "fake quantization of the probe's activations with the pertoken and ORT dynamic arithmetic; static "
          "recipes from ONNX Runtime's QDQ pairs.", ""]
    L += table(["input of", "max a", "(position, channel) token", "max/median", "carries massive",
                 "SQNR per-token", "SQNR per-tensor dyn.", *[f"SQNR {n}" for n in recipes]], rows)
    return L


def fp16(results: dict) -> list[str]:
    f = results_file.section(results, "fp16")
    if not f:
        return []
    L = ["", "## FP16: does it survive float16?", "", f"**{f['verdict']}.** {f['how']}; {f['n_windows']} windows of "
         f"{f['seq']} tokens.", ""]
    if f.get("fp32_overflow"):
        L += table(["tensor (FP32 run) past 65,504", "max abs", "rows over", "positions (first)"], [
            [f"`{e['tensor']}`", fmt(e["max_abs"], ".6g"), e["rows_over"],
             ", ".join(map(str, e["positions"])) + (" ..." if e.get("n_positions", 0) > len(e["positions"]) else "")]
            for e in f["fp32_overflow"]])
        if f.get("fp32_overflow_total", 0) > len(f["fp32_overflow"]):
            L.append(f"({f['fp32_overflow_total']} tensors in all.)")
        L.append("")
    L += table(["forward", "status", "PPL ratio", "KL mean", "top-1"], [
        [name, v.get("status"), fmt(v.get("ppl_ratio"), ".4f"), fmt(v.get("kld_mean"), ".2e"),
         pct(v.get("top1_agreement"))] for name, v in f.get("forwards", {}).items()])
    return L


def _status(r: results_file.Recipe) -> str:
    if r.ok:
        return r.status
    return "**broken** (damage measured; see Warnings)" if r.damage else r.status


def _softmax_note(results: dict) -> list[str]:
    """Which recipes quantized the attention scores (softmax inputs, where HF adds the mask)."""
    parts = []
    for r in results_file.recipes(results):
        sm = r.entry.get("softmax_inputs")
        if sm is None:
            continue
        parts.append(f"`{r.name}` {sm['quantized']}"
                     + (f" (INT8 step up to {sm['max_scale']:.3g})" if sm["quantized"] else ""))
    if not parts:
        return []
    return ["", "Softmax inputs (attention scores plus the attention mask) quantized per recipe: " + ", ".join(parts)
            + ". Weight-MatMul recipes leave them in float; a calibrated mask constant makes the INT8 step "
              "enormous (the recipe is then marked broken)."]


def _what(s: dict) -> str:
    return weight_only_what(s) or (f"{s.get('format', '')} {s.get('calibration') or 'dynamic'}, "
            f"{'per-channel' if s.get('per_channel') else 'per-tensor'}, {s.get('op_scope', '')} scope, "
            f"reduce_range={s.get('reduce_range')}")


def _size(r: results_file.Recipe) -> str:
    return fmt(r.entry.get("size_bytes", 0) / 1e6, ".2f", " MB")


def _causal_recipes(results: dict) -> list[str]:
    L = ["## INT8 recipes (token-level accuracy on the evaluation range, vs the FP32 ONNX model, same session "
         "options)", ""]
    rows = []
    for r in results_file.recipes(results):
        a = r.accuracy or r.damage
        if a is None:
            rows.append([f"`{r.name}`", _what(r.settings), r.status, "–", "–", "–", "–", "–", "–"])
            continue
        rows.append([f"`{r.name}`", _what(r.settings), _status(r),
                     fmt(a["ppl_fp32"], ".4f"), fmt(a["ppl_int8"], ".4f"), fmt(a["ppl_ratio"], ".4f"),
                     f"{a['kld_mean']:.2e} / {a['kld_p99']:.2e} / {a['kld_max']:.2e}", pct(a["top1_agreement"]),
                     _size(r)])
    L += table(["recipe", "settings", "status", "PPL fp32 (token)", "PPL int8 (token)", "ratio",
                "KL mean / p99 / max (nats)", "top-1", "size"], rows)
    n = next((r.accuracy["n_scored"] for r in results_file.recipes(results) if r.accuracy), None)
    L += ["", f"Perplexity per token over {n} scored tokens (not bits per byte: the checkpoint's own tokens)."]
    return L


def _encoder_recipes(results: dict) -> list[str]:
    L = ["## INT8 recipes (embedding agreement on the evaluation passages, vs the FP32 ONNX model, same session "
         "options)", ""]
    rows = []
    mlm = any(r.metric("mlm") for r in results_file.recipes(results))
    for r in results_file.recipes(results):
        a = r.accuracy or r.damage
        if a is None:
            rows.append([f"`{r.name}`", _what(r.settings), r.status] + ["–"] * (7 if mlm else 5))
            continue
        row = [f"`{r.name}`", _what(r.settings), _status(r),
               fmt(a["cosine_mean"], ".5f"), f"{fmt(a['cosine_p1'], '.5f')} / {fmt(a['cosine_min'], '.5f')}",
               pct(a.get("nn_agreement")), fmt(a.get("token_cosine_mean"), ".5f")]
        if mlm:
            row += [f"{fmt(a.get('ppl_fp32'), '.3f')} → {fmt(a.get('ppl_int8'), '.3f')} "
                    f"({fmt(a.get('ppl_ratio'), '.4f')})", pct(a.get("top1_agreement"))]
        row.append(_size(r))
        rows.append(row)
    header = ["recipe", "settings", "status", "cosine mean", "cosine p1 / min", "NN agreement", "token cosine mean"]
    if mlm:
        header += ["MLM PPL fp32 → int8 (ratio)", "MLM top-1"]
    L += table(header + ["size"], rows)
    n = next((r.accuracy["n_passages"] for r in results_file.recipes(results) if r.accuracy), None)
    L += ["", f"Cosine similarity of FP32 and INT8 sentence embeddings ({results['model'].get('pooling')} pooling) "
          f"over {n} evaluation passages; NN agreement: share of passages whose most similar other passage is the "
          f"same under both models; token cosine: last hidden state, per token."]
    return L


def recipes(results: dict) -> list[str]:
    """The recipe table by the kind of model (perplexity for a causal LM, embedding agreement for an
    encoder), then which recipes quantized the softmax inputs."""
    by_kind = _causal_recipes if results_file.model_kind(results) == results_file.CAUSAL else _encoder_recipes
    return ["", *by_kind(results), *_softmax_note(results)]


def outliers(results: dict) -> list[str]:
    o = results_file.outliers(results)
    if o is None:
        return []
    L = ["", "## Activations and outliers", "",
         f"Residual stream after the embedding and after each block, on {o.get('n_samples')} evaluation windows of "
         f"{o.get('seq_len')} tokens. Ratio = max |a| / median |a|; massive = |a| > 100 and >= 1000x the median of "
         "its window (Sun et al. 2024); kurtosis and inf-norm averaged over windows (Bondarenko et al. 2023). "
         "(position, channel) of the largest |a|, with the token at that position.", ""]
    rows = []
    for r in o.get("residual", []):
        tops = r.get("top", [])
        top = tops[0] if tops else {}
        others = "; ".join(f"{fmt(t['value'], '.3g')} at ({t['position']}, {t['channel']}){token_suffix(t)}" for t in tops[1:])
        rows.append([r["layer"], fmt(top.get("value"), ".3g"),
                     f"({top.get('position')}, {top.get('channel')}){token_suffix(top)}", others,
                     fmt(r.get("median_abs"), ".3g"), fmt(r.get("ratio"), ".1f"), fmt(r.get("kurtosis"), ".1f"),
                     fmt(r.get("inf_norm"), ".3g"), fmt(r.get("rms"), ".3g")])
    L += table(["layer", "max a", "(position, channel) token", "2nd, 3rd", "median abs", "max/median", "kurtosis",
                 "inf-norm", "RMS"], rows)
    if o.get("norm_inputs"):
        L += ["", "Post-norm model: the residual sums `x + F(x)` entering each LayerNorm (where post-LN models keep "
              "their large values):", ""]
        L += table(["norm", "max a", "(position, channel) token", "median abs", "max/median", "kurtosis"], [
            [f"`{r['tensor']}`", fmt(r["top"][0]["value"] if r.get("top") else None, ".3g"),
             (f"({r['top'][0]['position']}, {r['top'][0]['channel']}){token_suffix(r['top'][0])}" if r.get("top") else "–"),
             fmt(r.get("median_abs"), ".3g"), fmt(r.get("ratio"), ".1f"), fmt(r.get("kurtosis"), ".1f")]
            for r in o["norm_inputs"]])
    summary = o.get("summary", {})
    chans = ", ".join(f"{c['channel']} ({c['layers']} layers)" for c in summary.get("channels_holding_layer_max", [])[:4])
    poss = ", ".join(f"{p['position']} ({p['layers']} layers)" for p in summary.get("positions_holding_layer_max", [])[:4])
    L += ["", f"Channels holding a layer's maximum: {chans or '–'}; positions: {poss or '–'}."]
    massive = o.get("massive", [])
    if massive:
        where = ", ".join(f"{fmt(m['value'], '.4g')} at layer {m['layer']} ({m.get('stream')}) position "
                          f"{m['position']}{token_suffix(m)} channel {m['channel']}" for m in massive[:5])
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
