"""The run report's generation section: each recipe as deployed to generate (KV cache).

Reads ``results["generation"]`` through ``results.generation_models``: decode speed per provider
(prompt and generation tokens/s, per-token p50/p90, peak memory, the ratio to FP32 at the same
batch), where a one-token step's time goes (batch 1: kernel time per kind of op and the rate the
step streams its weights at, beside llama.cpp's rows of the same run), generation agreement with FP32's greedy tokens, the cache proof per model, and a plot of
per-token latency against position. A run without the section (older runs, ``--no-generation``)
gets no lines; an encoder gets the sentence that says why it has none.
"""

from __future__ import annotations

from pathlib import Path

from .. import results as results_file
from ..measure.sessions import CPU, short_provider
from .markdown import fmt, pct, table
from .plots import plot_token_latency
from .sections import kernel_time_split

PLOT_FILE = "token_latency.png"


def generation(results: dict) -> list[str]:
    section = results_file.section(results, "generation")
    if section is None:
        return []
    L = ["", "## Generation (KV cache)", ""]
    if section.get("status") != results_file.MEASURED:
        return L + [f"{section.get('status')}.", ""]
    s = section.get("settings") or {}
    export = section.get("export") or {}
    steps = len(export.get("max_abs_diff") or {}) - 1
    attention = f"; attention {export['attention']}" if export.get("attention") else ""
    how = (f"exported with a KV cache ({export.get('n_layers')} layers x {export.get('kv_heads')} key/value heads x "
           f"{export.get('head_dim')}{attention}; parity with PyTorch's own cache at the prompt and {steps} decode "
           f"steps)" if steps >= 0 else f"with a KV cache as given ({export.get('exporter')}; checked by the cache proof below)")
    L += [f"Each model runs as deployed to generate: the graph {how}, every recipe "
          f"quantized again on it from the same calibration windows, the cache {s.get('cache')}. "
          f"Decode speed: a {s.get('prompt_tokens')}-token prompt, then {s.get('new_tokens')} greedy tokens one "
          f"step at a time, median of {s.get('rounds')} rounds after a warm-up, threads "
          f"{s.get('threads') or 'ORT default'} (the CPU is the hardware section's).", ""]
    models = results_file.generation_models(results)
    pairs = [m.entry["split"] for m in models if m.ok and isinstance(m.entry.get("split"), dict)]
    if pairs:
        L += [f"Split deployments (`--prefill-recipe {pairs[0].get('prompt')}`): `W+prefill-P` runs each prompt "
              "through P's with-past graph and the new tokens through W's, one cache between them; both graphs are "
              "held (its memory and size are both files'), and its cache check is the pair through the cache "
              "against W's graph scored whole.", ""]
    rewritten = [m for m in models if m.ok and (m.entry.get("packed_shared_groups") or m.entry.get("fused_residual_norms"))]
    if rewritten:
        counts = "; ".join(f"`{m.name}`: packed groups {m.entry.get('packed_shared_groups', 0)}, "
                           f"fused norms {m.entry.get('fused_residual_norms', 0)}" for m in rewritten)
        L += ["Weight-only and FP32 graphs as they run (rewritten after every quantizer has read the FP32 graph, "
              "exact but for the fused norm's float rounding, which each row's cache check covers): the "
              "`MatMulNBits` that read one input alike packed as one product and a `Split`, and each residual add "
              f"fused with the RMSNorm that reads it (`SkipSimplifiedLayerNormalization`): {counts}.", ""]
    one_row = [m.name for m in models if m.ok and isinstance(m.entry.get("one_row"), dict)]
    if one_row:
        L += ["One-row token graphs (`P+one-row`, each per-token recipe P): a decode step of one row runs P's "
              "products as ONNX Runtime's `DynamicQuantizeMatMul` (one row's scale is its tensor's; asymmetric "
              "uint8 where P rounds symmetric) with the products that read one input packed and each residual add "
              "fused with its norm; prompts and steps "
              "of several rows (batch > 1) run P's own graph. Its accuracy is P's whole-window accuracy; what "
              "the other rounding costs is its cache check (P's graph scored whole against the pair through the "
              "cache, at batch 1) and its generation agreement beside P's.", ""]
    L += _speed_tables(models)
    L += _step_tables(models, results_file.engine_rows(results))
    L += _agreement_table(models, s)
    skipped = [m for m in models if not m.ok]
    if skipped:
        L += ["Not on the with-past graph:", ""] + [f"- `{m.name}`: {m.status}" for m in skipped] + [""]
    return L


def _speed_tables(models: list) -> list[str]:
    by_provider: dict[str, list[tuple]] = {}
    for m in models:
        for row in m.decode:
            by_provider.setdefault(row.get("provider"), []).append((m.name, row))
    L: list[str] = []
    for provider, rows in by_provider.items():
        L += [f"### Decode speed, {short_provider(provider)}", ""]
        measured = [(n, r) for n, r in rows if r.get("status") == results_file.MEASURED]
        if not measured:
            L += [f"{rows[0][1].get('status')}.", ""]
            continue
        fp32 = {r["batch"]: r for n, r in measured if n == results_file.FP32_VARIANT}
        lines = []
        for name, r in rows:
            if r.get("status") != results_file.MEASURED:
                lines.append([f"`{name}`", r.get("batch"), r.get("status"), "", "", "", "", "", ""])
                continue
            base = fp32.get(r["batch"])
            ratio = r["gen_tokens_per_s"] / base["gen_tokens_per_s"] if base else None
            lines.append([f"`{name}`", r["batch"], fmt(r["prompt_tokens_per_s"], ",.0f"),
                          fmt(r["gen_tokens_per_s"], ",.1f"), fmt(ratio, ".2f", "x"), fmt(r["token_ms_p50"], ".2f"),
                          fmt(r["token_ms_p90"], ".2f"), fmt(r["peak_rss_mb"], ",.0f"), fmt(r["rss_increase_mb"], ",.0f")])
        L += table(["model", "batch", "prompt tok/s", "generation tok/s", "generation vs fp32", "token p50 ms",
                    "token p90 ms", "peak RSS MiB", "RSS added MiB"], lines)
        L.append("")
    return L


def _step_tables(models: list, engines: list[dict]) -> list[str]:
    """Per provider, where a one-token step's time goes (batch 1 rows with a ``step_profile``)."""
    by_provider: dict[str, list] = {}
    for m in models:
        for row in m.decode:
            if row.get("status") == results_file.MEASURED and isinstance(row.get("step_profile"), dict):
                by_provider.setdefault(row.get("provider"), []).append((m.name, row))
    L: list[str] = []
    for provider, rows in by_provider.items():
        lines = []
        for name, row in rows:
            profile = row["step_profile"]
            op_ms, total = profile.get("op_ms") or {}, profile.get("kernel_ms") or 0.0
            split = kernel_time_split(op_ms)
            streamed = profile.get("weight_bytes", 0) * row["gen_tokens_per_s"] / row["batch"]
            top = ", ".join(f"{op} {ms:.2f}" for op, ms in list(op_ms.items())[:4])
            lines.append([f"`{name}`", fmt(row["token_ms_p50"], ".2f"), _megabytes(profile.get("weight_bytes", 0)),
                          fmt(streamed / 1e9, ".1f"), profile.get("nodes"), fmt(total, ".2f"),
                          *[f"{ms:.2f} ({ms / total:.0%})" if total else "–" for ms in split.values()], top])
        if provider == CPU:   # llama.cpp runs on the CPU: its file is what its step reads (see the note)
            for e in engines:
                speed = e.get("speed") or {}
                if e.get("status") == results_file.OK and speed.get("gen_tok_s") and e.get("size_bytes"):
                    lines.append([f"{e['engine']} {e['format']}", fmt(speed.get("token_ms_p50"), ".2f"),
                                  _megabytes(e["size_bytes"]), fmt(e["size_bytes"] * speed["gen_tok_s"] / 1e9, ".1f"),
                                  "", "not profiled", "", "", "", "", ""])
        L += [f"### Where a one-token step's time goes, {short_provider(provider)} (batch 1)", "",
              f"One session per model under ORT's profiler, {rows[0][1]['step_profile'].get('steps')} one-token steps "
              "after the prompt, averaged per step (not a timed run: the profiler adds a little per node). Weights "
              "read: every initializer the step reads whole (the token table and the rotary caches, read a row at a "
              "time, left out); streamed = that x the timed generation tokens/s. Where that is near what the "
              "machine's memory delivers, a step is bound by reading its weights and only fewer bytes make it faster; "
              "the kernels other than the weight GEMMs are what a step spends besides. llama.cpp rows: its GGUF "
              "file's size x its generation tokens/s (a tied head reads the token table whole, so the file is about "
              "what a step reads; not profiled).", "",
              *table(["model", "token p50 ms", "weights read MB", "streamed GB/s", "nodes", "kernel ms",
                      "integer GEMMs", "float GEMMs", "(de)quantize", "other", "largest op types (ms)"], lines), ""]
    return L


def _megabytes(size: int) -> str:
    mb = size / 1e6
    return f"{mb:,.0f}" if mb >= 10 else f"{mb:.2g}"


def _agreement_table(models: list, settings: dict) -> list[str]:
    lines = []
    for m in models:
        check = m.cache_check or {}
        cache = fmt(check.get("relative_diff"), ".1e") + ("" if check.get("ok", True) else " (not exact)")
        a = m.agreement
        if m.name == results_file.FP32_VARIANT:
            lines.append([f"`{m.name}`", "reference", "", "", "", "", cache])
        elif m.ok and a:
            lines.append([f"`{m.name}`", pct(a["identical_before_divergence"]),
                          f"{a['first_divergence_mean']:.1f} / {a['new_tokens']}",
                          f"{a['identical_prompts']} / {a['prompts']}", fmt(a["kl_mean"], ".2e"),
                          pct(a["top1_along_fp32"]), cache])
    if len(lines) <= 1:
        return []
    return [f"### Generation agreement ({settings.get('agreement_prompts')} prompts of "
            f"{settings.get('agreement_prompt_tokens')} tokens from the evaluation split, "
            f"{settings.get('agreement_new_tokens')} greedy tokens each)", "",
            "Identical before divergence: the share of generated tokens before each prompt's first token that "
            "differs from FP32's. KL and top-1 are taken along FP32's own continuation (both models "
            "teacher-forced on it). Cache check: |NLL through the cache - NLL of whole windows| / NLL "
            "(per-tensor dynamic scales differ between a prompt and one row, so those are not exact).", "",
            *table(["recipe", "identical before divergence", "first divergence (mean)", "identical prompts",
                    "KL mean along fp32", "top-1 along fp32", "cache check"], lines), ""]


def plot(run_dir: Path, results: dict, out_dir: Path) -> dict[str, str]:
    """Per-token latency against position, batch 1 on the CPU: {title: relative path} or {}."""
    series = {}
    start = None
    for m in results_file.generation_models(results):
        for row in m.decode:
            if row.get("provider") == CPU and row.get("batch") == 1 and row.get("per_position_ms"):
                series[m.name] = row["per_position_ms"]
                start = row["prompt_tokens"] + 1
    if not series:
        return {}
    path = plot_token_latency(series, out_dir / PLOT_FILE, "Decode: per-token latency by position (CPU, batch 1)",
                              start=start)
    return {"Per-token decode latency by position": str(path.relative_to(run_dir))}
