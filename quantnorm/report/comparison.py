"""The comparison report of a sweep (``quantnorm compare DIR`` -> DIR/report.md, findings.json
and plots/*.png) and its findings file (``quantnorm findings DIR`` -> DIR/findings.md).

Reads only what the cells wrote (quantnorm.report.sweep), so both regenerate at any time, byte
for byte. The training status comes first; every table, ranking and plot after it is computed on
the trained cells only. Every figure is a mean over seeds with its 95% interval
(quantnorm.report.stats); the findings are quantnorm.report.findings'.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import results as results_file
from ..fileio import write_text_atomic
from ..results import DIVERGED, STATUSES
from ..results import STATUS_TRAINED as TRAINED
from ..runs import PLOTS_DIR, REPORT_FILE
from .claims_generation import generation_section
from .findings import (
    FINDINGS_FILE,
    FINDINGS_JSON,
    Finding,
    findings,
    findings_data,
    findings_section,
    paired,
    tuned_comparison,
)
from .markdown import table
from .plots import plot_depth_series, plot_interval_series, plot_layer_series
from .stats import Estimate, estimate
from .sweep import (
    NORM_ORDER,
    CellResult,
    Sweep,
    best_recipe,
    group_estimate,
    load_sweep,
    placements_in,
    rank,
    residual_series,
)


def _manifest_line(sweep: Sweep) -> list[str]:
    m = sweep.manifest or {}
    out = []
    commands = m.get("commands") or ([m["command"]] if m.get("command") else [])
    if len(commands) == 1:
        out.append(f"Reproduce: `{commands[0]}`  ")
    elif commands:
        out += [f"Reproduce: this directory was grown by {len(commands)} invocations; run them in this order "
                f"(each skips the cells already finished):", ""]
        out += [f"{i}. `{c}`" for i, c in enumerate(commands, 1)] + [""]
    s = m.get("settings") or {}
    if s:
        out.append(f"Settings: d_model {s.get('d_model')}, heads {s.get('heads')}, context {s.get('context')}, "
                   f"{s.get('steps')} steps x batch {s.get('batch_size')}, lr {s.get('lr')}, corpus {s.get('corpus')}.  ")
    if m.get("jobs"):
        out.append(f"Executor: {m.get('executor', 'local')}, {m['jobs']} cell(s) at a time"
                   + (" (latency and throughput measured while other cells ran)." if m["jobs"] > 1 else "."))
    return out


def status_section(sweep: Sweep) -> list[str]:
    """``## Training status``: the first thing a reader of a sweep needs to know."""
    counts = {s: sum(c.status == s for c in sweep.cells) for s in STATUSES}
    unigrams = sorted({round(c.unigram, 3) for c in sweep.cells if c.unigram is not None})
    derived = sum(c.status_derived for c in sweep.cells)
    L = ["## Training status", "",
         f"{counts[TRAINED]} of {len(sweep.cells)} cells trained, {counts['collapsed']} collapsed, "
         f"{counts[DIVERGED]} diverged. A run is *trained* when its eval bits/byte is at least "
         f"{sweep.collapse_margin:g} bits/byte below the unigram baseline (the evaluation range's bits/byte under the "
         f"training range's byte frequencies: {', '.join(f'{u:.3f}' for u in unigrams) or '?'} here), *collapsed* "
         f"when it is not (a model on the unigram plateau and one that barely left it alike), *diverged* on a NaN/inf "
         f"loss or gradient. Collapsed and diverged cells are left out of every mean, ranking, plot and finding below: "
         f"their INT8 numbers say nothing about INT8.", ""]
    if derived:
        L += [f"{derived} cells were written before training recorded its status: theirs is derived from the "
              f"corpus and byte ranges recorded in their results.json.", ""]
    rows = []
    for g, cells in sweep.groups().items():
        rows.append([sweep.label(g), len(cells), sum(c.trained for c in cells),
                     sum(c.status == "collapsed" for c in cells), sum(c.status == DIVERGED for c in cells),
                     group_estimate(cells, lambda c: c.bits_per_byte).format(".3f")])
    L += table(["setting", "cells", "trained", "collapsed", "diverged", "eval bits/byte (every cell)"], rows)
    bad = sweep.not_trained
    if bad:
        L += ["", f"Left out ({len(bad)}): " + ", ".join(
            f"`{c.name}` ({c.status}" + (f", {c.bits_per_byte:.3f}" if c.bits_per_byte is not None else "") + ")"
            for c in bad) + "."]
    return L + [""]


def lr_section(sweep: Sweep) -> list[str]:
    """The per-learning-rate table and the tuned comparison (trained view; only with an lr axis)."""
    lrs = sweep.lrs
    L = ["## Learning rate", "", "### Eval bits/byte per learning rate (trained cells)", ""]
    rows = {}
    for (p, n, d, w, lr), cells in sweep.groups().items():
        rows.setdefault((p, n, d, w), {})[lr] = group_estimate(cells, lambda c: c.bits_per_byte)
    L += table(["setting", *[f"lr {x:g}" for x in lrs]],
                [[f"{p}/{n}" + sweep.axes_label(depth=d, warmup=w), *[r[x].format(".3f") if x in r else "–"
                                                                      for x in lrs]]
                 for (p, n, d, w), r in rows.items()])
    L += ["", "### Placements at their own best learning rate", "",
          "For each seed, a placement's learning rate is the one with the lowest mean bits/byte on the *other* seeds "
          "(leave one seed out), and its bits/byte at that held-out seed is kept: choosing and comparing on the same "
          "seeds would reward seed luck. *In-sample* is the rate best on all seeds; its optimism is the bias column.",
          ""]
    for block in tuned_comparison(sweep):
        title = sweep.axes_label(norm=block["norm"], depth=block["depth"], warmup=block["warmup"]).strip()
        items = [((r["placement"],), r["placement"], "", r["held_out_est"]) for r in block["rows"]]
        by_p = {r["placement"]: r for r in block["rows"]}
        ranked = rank(items)
        best_p = ranked[0].label if ranked and ranked[0].est.mean is not None else None
        ranked_rows = []
        for r in ranked:
            row = by_p[r.label]
            vs = estimate(paired(row["held_out"], by_p[best_p]["held_out"]).values()) if best_p else None
            bias = (row["in_sample_est"].mean - row["held_out_est"].mean
                    if row["in_sample_est"].mean is not None and row["held_out_est"].mean is not None else None)
            ranked_rows.append([r.rank, r.label, "–" if row["best_lr"] is None else f"{row['best_lr']:g}",
                          ", ".join(f"seed {s}: {v:g}" for s, v in sorted(row["chosen"].items())) or "–",
                          r.est.format(".3f"), "" if r.label == best_p or vs is None else vs.format("+.3f"),
                          row["in_sample_est"].format(".3f"), "–" if bias is None else f"{bias:+.3f}"])
        L += [f"**{title or 'all cells'}**", ""]
        L += table(["rank", "placement", "best lr (all seeds)", "lr chosen for each held-out seed",
                     "bits/byte (held out)", "minus the best (paired)", "bits/byte (in-sample)", "bias"], ranked_rows) + [""]
    return L


def render(sweep: Sweep, plots: dict[str, str] | None = None) -> str:
    """The sweep's report.md: its header and training status over every cell, then the tables,
    rankings and findings over the trained cells, the plots and the cells left out."""
    full = sweep
    sweep = full.trained_view()   # every table below: trained cells only (the status section shows them all)
    groups = {g: [c for c in cells if c.trained] for g, cells in full.groups().items()}
    groups = {g: cells for g, cells in groups.items() if cells}
    L = _header(full, sweep) + status_section(full)
    L += _quality_section(sweep, groups)
    L += _recipe_sections(sweep, groups)
    L += _ranking_section(sweep, groups)
    if len(sweep.lrs) > 1:
        L += [""] + lr_section(sweep)
    layer_table = _layer_tables(sweep, groups)
    if layer_table:
        L += ["", "## Residual stream per layer", ""] + layer_table
    L += _smoothquant_section(sweep, groups)
    L += generation_section(sweep)
    L += [""] + findings_section(full, plots)
    if plots:
        L += ["## Plots", ""] + [f"![{title}]({path})" for title, path in plots.items()] + [""]
    if full.problems:
        L += ["## Cells left out", ""] + [f"- {p}" for p in full.problems] + [""]
    return "\n".join(L)


def _header(full: Sweep, sweep: Sweep) -> list[str]:
    """Title, manifest, cell counts, seeds and the hardware of the first cell with results."""
    first = next((c.results for c in full.cells if c.results), None)
    hw = results_file.section(first, "hardware") or {}
    seeds = full.seeds
    L = [f"# quantnorm sweep: {full.path.name}", ""]
    L += _manifest_line(full)
    L += [f"{len(full.cells)} finished cells ({len(sweep.cells)} trained) in {len(full.groups())} settings, seeds "
          f"{', '.join(map(str, seeds))}; {len(full.problems)} cells left out (listed at the end).  ",
          f"Hardware: {hw.get('cpu', '?')}, VNNI {hw.get('vnni')}, ONNX Runtime threads {hw.get('threads') or 'default'}, "
          f"onnxruntime {hw.get('onnxruntime')}, torch {hw.get('torch')}.", "",
          "Every figure is the mean over seeds with its 95% Student-t interval in brackets ((n=1): one seed, "
          "no interval). Rankings mark a row *not significant* when its interval overlaps the row above's.", ""]
    return L


def _quality_section(sweep: Sweep, groups: dict) -> list[str]:
    L = ["## Training and FP32 quality (trained cells)", ""]
    rows = []
    for g, cells in groups.items():
        rows.append([sweep.label(g), len(cells),
                     group_estimate(cells, lambda c: c.bits_per_byte).format(".3f"),
                     group_estimate(cells, lambda c: c.train.get("gradient_spikes")).format(".2g"),
                     group_estimate(cells, lambda c: c.train.get("tokens_per_s")).format(",.0f")])
    return L + table(["setting", "trained seeds", "eval bits/byte (PyTorch)", "gradient spikes", "train tokens/s"],
                     rows)


def _recipe_sections(sweep: Sweep, groups: dict) -> list[str]:
    """One table per INT8 recipe: PPL ratio, KL, top-1 agreement and latency per setting."""
    L: list[str] = []
    batch = None
    for name in sweep.recipes():
        L += ["", f"## INT8 recipe `{name}` (trained cells)", ""]
        rows = []
        for g, cells in groups.items():
            lat = [c.latency_ratio(name) for c in cells]
            batch = batch or next((b for _, b in lat if b), None)
            top1 = [c.accuracy(name, "top1_agreement") for c in cells]
            rows.append([sweep.label(g), estimate(c.accuracy(name, "ppl_ratio") for c in cells).format(".4f"),
                         estimate(c.accuracy(name, "kld_mean") for c in cells).format(".2e"),
                         estimate(None if t is None else 100 * t for t in top1).format(".2f", "%"),
                         estimate(r for r, _ in lat).format(".2f", "x")])
        L += table(["setting", "PPL ratio (int8/fp32)", "KL mean (nats)", "top-1 agreement",
                     f"p50 int8/fp32 (CPU, batch {batch or '?'})"], rows)
    return L


def _ranking_section(sweep: Sweep, groups: dict) -> list[str]:
    """The settings ranked by their best recipe's PPL ratio, then by FP32 bits/byte."""
    L = ["", "## Ranking (trained cells)", "", "### INT8 survival: best recipe's PPL ratio (lower is better)", ""]
    items = []
    for g, cells in groups.items():
        name, est = best_recipe(sweep, cells)
        items.append((g, sweep.label(g), name or "–", est))
    L += table(["rank", "setting", "best recipe", "PPL ratio", "vs the row above"],
                [[r.rank, r.label, f"`{r.what}`" if r.what != "–" else "–", r.est.format(".4f"),
                  "not significant" if r.not_significant else ("" if r.rank == 1 or r.est.mean is None else "separated")]
                 for r in rank(items)])
    L += ["", "### FP32 quality: eval bits/byte (lower is better)", ""]
    items = [(g, sweep.label(g), "", group_estimate(cells, lambda c: c.bits_per_byte)) for g, cells in groups.items()]
    L += table(["rank", "setting", "bits/byte", "vs the row above"],
                [[r.rank, r.label, r.est.format(".3f") if r.est.mean is not None else "diverged",
                  "not significant" if r.not_significant else ("" if r.rank == 1 or r.est.mean is None else "separated")]
                 for r in rank(items)])
    return L


def _smoothquant_section(sweep: Sweep, groups: dict) -> list[str]:
    sq = [(g, cells) for g, cells in groups.items() if any(results_file.section(c.results, "smoothquant")
                                                           for c in cells)]
    if not sq:
        return []
    L = ["", "## SmoothQuant foldability", "",
         "MatMuls whose smoothing scale folds into the preceding norm's weight vs those that need an explicit "
         "Mul (count per model).", ""]
    rows = []
    for g, cells in sq:
        sqs = [results_file.section(c.results, "smoothquant") or {} for c in cells]
        folded = estimate(len(s.get("folded") or []) for s in sqs if s)
        explicit = estimate(len(s.get("explicit_scale") or []) for s in sqs if s)
        frac = estimate(len(s.get("folded") or []) / max(1, len(s.get("folded") or []) + len(s.get("explicit_scale") or []))
                        for s in sqs if s)
        rows.append([sweep.label(g), folded.format(".3g"), explicit.format(".3g"), frac.format(".2f")])
    return L + table(["setting", "folded", "explicit scale", "folded fraction"], rows)


def _write_findings_json(sweep: Sweep, found: list[Finding]) -> Path:
    target = sweep.path / FINDINGS_JSON
    write_text_atomic(target, json.dumps(findings_data(sweep, found), indent=2) + "\n")
    return target


def write_findings(sweep_dir: str | Path, margin: float | None = None) -> tuple[Path, str]:
    """Write ``sweep_dir/findings.md`` and ``findings.json`` (the findings section of the report,
    with its plots under ``sweep_dir/plots``); returns the Markdown's path and text."""
    sweep = load_sweep(sweep_dir, margin)
    found = findings(sweep)
    text = "\n".join(findings_section(sweep, make_plots(sweep), found))
    target = Path(sweep_dir) / FINDINGS_FILE
    write_text_atomic(target, text)
    _write_findings_json(sweep, found)
    return target, text


def _layer_tables(sweep: Sweep, groups: dict) -> list[str]:
    out: list[str] = []
    for key, title, spec in (("ratio", "max/median |a| ratio", ".1f"), ("rms", "RMS", ".3g")):
        layers: list[str] = []
        for cells in groups.values():
            for c in cells:
                for lab in residual_series(c, key)[0]:
                    if lab not in layers:
                        layers.append(lab)
        if not layers:
            return out
        rows = []
        for g, cells in groups.items():
            row = [sweep.label(g)]
            for lab in layers:
                vals = []
                for c in cells:
                    labels, values = residual_series(c, key)
                    vals.append(values[labels.index(lab)] if lab in labels else None)
                row.append(estimate(vals).format(spec))
            rows.append(row)
        out += [f"### {title} of the residual stream (after the embedding, then after each block)", ""]
        out += table(["setting", *layers], rows) + [""]
    return out


def make_plots(sweep: Sweep) -> dict[str, str]:
    """The sweep's PNGs, from its trained cells only."""
    sweep = sweep.trained_view()

    out_dir = sweep.path / PLOTS_DIR
    groups = sweep.groups()
    labels = [sweep.label(g) for g in groups]
    made: dict[str, str] = {}

    def triple(e: Estimate) -> tuple:
        return (e.mean, e.lo, e.hi)

    bpb = [triple(group_estimate(cells, lambda c: c.bits_per_byte)) for cells in groups.values()]
    if any(m is not None for m, _, _ in bpb):
        path = plot_interval_series(labels, {"eval bits/byte": bpb}, out_dir / "bits_per_byte.png",
                                          "Eval bits/byte per setting (mean, 95% interval over seeds)", "bits/byte")
        made["Eval bits/byte per setting"] = str(path.relative_to(sweep.path))
    series = {name: [triple(group_estimate(cells, lambda c, n=name: c.accuracy(n, "ppl_ratio"))) for cells in groups.values()]
              for name in sweep.recipes()}
    if any(m is not None for s in series.values() for m, _, _ in s):
        path = plot_interval_series(labels, series, out_dir / "ppl_ratio.png",
                                          "INT8 PPL ratio per setting (mean, 95% interval over seeds)",
                                          "PPL(int8) / PPL(fp32)", reference=1.0)
        made["INT8 PPL ratio per setting"] = str(path.relative_to(sweep.path))
    # residual RMS: one line per placement x norm (x depth), pooled over seeds and warm-ups;
    # colour = placement, line style = norm
    pooled: dict[tuple, list[CellResult]] = {}
    for (p, n, d, _w, _lr), cells in groups.items():
        pooled.setdefault((p, n, d), []).extend(cells)
    layer_series, styles = {}, {}
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
    placements = list(dict.fromkeys(p for p, _, _ in pooled))
    norm_styles = ["-", "--", ":", "-."]
    norms = list(dict.fromkeys(n for _, n, _ in pooled))
    for (p, n, d), cells in pooled.items():
        layers: list[str] = []
        for c in cells:
            for lab in residual_series(c, "rms")[0]:
                if lab not in layers:
                    layers.append(lab)
        if not layers:
            continue
        points = []
        for lab in layers:
            vals = []
            for c in cells:
                labs, values = residual_series(c, "rms")
                vals.append(values[labs.index(lab)] if lab in labs else None)
            points.append(triple(estimate(vals)))
        label = f"{p}/{n}" + (f" L{d}" if len(sweep.depths) > 1 else "")
        layer_series[label] = (layers, points)
        styles[label] = {"color": colours[placements.index(p) % len(colours)],
                         "linestyle": norm_styles[norms.index(n) % len(norm_styles)]}
    if layer_series:
        pooled_over = "seeds and warm-ups" if len(sweep.warmups) > 1 else "seeds"
        path = plot_layer_series(layer_series, out_dir / "residual_rms.png",
                                       f"Residual-stream RMS per layer (mean, 95% interval over {pooled_over})", "RMS",
                                       styles=styles)
        made["Residual-stream RMS per layer"] = str(path.relative_to(sweep.path))
    cos_series, cos_styles = {}, {}
    for (p, n, d), cells in pooled.items():
        width = max((len(c.block_cosine or []) for c in cells), default=0)
        if not width:
            continue
        points = [triple(estimate((c.block_cosine or [])[i] if i < len(c.block_cosine or []) else None
                                  for c in cells)) for i in range(width)]
        label = f"{p}/{n}" + (f" L{d}" if len(sweep.depths) > 1 else "")
        cos_series[label] = ([str(i) for i in range(width)], points)
        cos_styles[label] = {"color": colours[placements.index(p) % len(colours)],
                             "linestyle": norm_styles[norms.index(n) % len(norm_styles)]}
    if cos_series:
        path = plot_layer_series(cos_series, out_dir / "block_cosine.png",
                                       "Cosine similarity of each block's output with its input (mean, 95% interval)",
                                       "cosine similarity", log=False, styles=cos_styles)
        made["Cosine similarity of block output and input"] = str(path.relative_to(sweep.path))
    if len(sweep.depths) > 1:
        path = _plot_perturbation_depth(sweep, out_dir / "perturbation_depth.png")
        if path is not None:
            made["Perturbation sensitivity per depth"] = str(path.relative_to(sweep.path))
    return made


def _plot_perturbation_depth(sweep: Sweep, out_png: Path) -> Path | None:
    """Relative logit change (smallest noise level) over depth, one line per placement x norm."""
    levels = sorted({lv for c in sweep.cells for lv in c.noise_levels()})
    if not levels:
        return None
    level = levels[0]
    series: dict[str, tuple[list[int], list[tuple]]] = {}
    for p in placements_in(sweep):
        for n in NORM_ORDER + tuple(sorted({c.norm for c in sweep.cells} - set(NORM_ORDER))):
            xs, points = [], []
            for d in sweep.depths:
                e = group_estimate(sweep.select(placement=p, norm=n, depth=d), lambda c: c.logit_change(level))
                if e.mean is not None:
                    xs.append(d)
                    points.append((e.mean, e.lo, e.hi))
            series[f"{p}/{n}"] = (xs, points)
    return plot_depth_series(series, sweep.depths, out_png,
                                   "Perturbation sensitivity over depth (mean, 95% interval over seeds and warm-ups)",
                                   f"relative logit change (noise {level:g})")


def write_comparison(sweep_dir: str | Path, margin: float | None = None) -> Path:
    """Write ``sweep_dir/report.md``, ``findings.json`` and ``sweep_dir/plots/*.png``; returns the report's path."""
    sweep = load_sweep(sweep_dir, margin)
    plots = make_plots(sweep)
    target = Path(sweep_dir) / REPORT_FILE
    write_text_atomic(target, render(sweep, plots))
    _write_findings_json(sweep, findings(sweep))
    return target
