"""results.json -> report.md (+ PNG plots) of one run: a zoo model, a Hugging Face directory, a
GGUF file or an ONNX export directory.

Reads only results.json, so `quantnorm report` can regenerate the report of any run, and every
number in it was measured by the run that wrote it. Which sections a report has, and in which
order, is a table by source kind (:data:`RUN_REPORTS`); a new source is one new row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import results as results_file
from ..fileio import write_text_atomic
from ..runs import PLOTS_DIR, REPORT_FILE
from . import checkpoint, engines, generation, sections, verdict
from .plots import plot_layer_outliers, plot_recipe_tradeoff, plot_sqnr_vs_outlier

Section = Callable[[dict], list[str]]


@dataclass(frozen=True)
class RunReport:
    """What the report of one kind of run holds: its title (after "quantnorm report: "), its
    sections in order, and its warnings (listed at the end, before the plots)."""

    title: Callable[[dict], str]
    sections: tuple[Section, ...]
    warnings: Callable[[dict], list[str]]


ZOO_REPORT = RunReport(sections.zoo_title, (
    sections.training_status, verdict.verdict, sections.reproduce, sections.hardware, sections.zoo_model_and_data,
    sections.zoo_training, sections.zoo_export, sections.zoo_recipes, sections.accuracy_level_4,
    sections.session_and_latency,
    generation.generation, engines.engines, sections.zoo_outliers, sections.smoothquant, sections.search,
    sections.zoo_diagnostics,
), sections.warnings_for)

# A checkpoint loaded into PyTorch (HF directory, GGUF file): detected placement verified on the
# module, exported here with a parity check.
LOADED_REPORT = RunReport(checkpoint.title, (
    verdict.verdict, sections.reproduce, sections.hardware, checkpoint.model_loaded, checkpoint.data, checkpoint.export_checked,
    checkpoint.massive, checkpoint.fp16, checkpoint.recipes, sections.accuracy_level_4, sections.smoothquant,
    sections.search,
    sections.session_and_latency, generation.generation, engines.engines, checkpoint.outliers,
), checkpoint.warnings)

# An ONNX export directory: no PyTorch module; placement from the graph, the graph used as given.
ONNX_REPORT = RunReport(checkpoint.title, (
    verdict.verdict, sections.reproduce, sections.hardware, checkpoint.model_onnx, checkpoint.data, checkpoint.export_given,
    checkpoint.massive, checkpoint.fp16, checkpoint.recipes, sections.accuracy_level_4, sections.smoothquant,
    sections.search,
    sections.session_and_latency, generation.generation, engines.engines, checkpoint.outliers,
), checkpoint.warnings)

# source kind (quantnorm.results.source_kind) -> report; None: a results.json without
# model.source, which only a zoo run of an early version writes
RUN_REPORTS: dict[str | None, RunReport] = {
    None: ZOO_REPORT,
    results_file.TRAINED: ZOO_REPORT,
    results_file.HF: LOADED_REPORT,
    results_file.GGUF: LOADED_REPORT,
    results_file.ONNX: ONNX_REPORT,
}


def render(results: dict, plots: dict[str, str]) -> str:
    """The Markdown of a run's report, its sections chosen by the run's source kind."""
    report = RUN_REPORTS[results_file.source_kind(results)]
    L = [f"# quantnorm report: {report.title(results)}", ""]
    for section in report.sections:
        L += section(results)
    L += sections.closing(results, report.warnings(results), plots)
    return "\n".join(L) + "\n"


def make_plots(run_dir: Path, results: dict) -> dict[str, str]:
    """Render the report's plots into run_dir/plots; returns {title: relative path}."""
    out_dir = run_dir / PLOTS_DIR
    made: dict[str, str] = {}
    # encoders (Hugging Face) have accuracy without a perplexity ratio: nothing to plot there
    ok = [r.entry for r in results_file.recipes(results) if r.metric("ppl_ratio") is not None]
    if ok:
        path = plot_recipe_tradeoff(ok, results.get("latency", []), out_dir / "recipes.png",
                                    "INT8 recipes: accuracy vs latency (CPU)")
        made["INT8 recipes: PPL ratio and latency"] = str(path.relative_to(run_dir))
    outliers = results_file.outliers(results)
    if outliers is not None and outliers.get("residual"):
        path = plot_layer_outliers(outliers["residual"], out_dir / "residual_outliers.png",
                                   "Residual stream: max and median |a| per layer")
        made["Residual stream per layer"] = str(path.relative_to(run_dir))
    if outliers is not None and (out_dir / "heatmap.png").is_file():  # drawn by evaluate, which holds the model
        made[f"|a| over (position, channel), layer {outliers.get('heatmap_layer')}"] = f"{PLOTS_DIR}/heatmap.png"
    made.update(generation.plot(run_dir, results, out_dir))
    made.update(engines.plot(run_dir, results, out_dir))
    for recipe, rows in results.get("sqnr", {}).items():
        points = [r for r in rows if r.get("modules")]  # weight-MatMul inputs (see evaluate.measure_outliers)
        if points:
            path = plot_sqnr_vs_outlier(points, out_dir / f"sqnr.{recipe}.png", f"SQNR vs outlier ratio, {recipe}")
            made[f"SQNR vs max/median ratio ({recipe})"] = str(path.relative_to(run_dir))
    return made


def write_report(run_dir: str | Path, results: dict | None = None) -> Path:
    """Write run_dir/report.md and its plots from ``results`` (default: run_dir/results.json, read
    by quantnorm.results.load), whatever made the run; returns the report's path."""
    run_dir = Path(run_dir)
    results = results if results is not None else results_file.load(run_dir)
    plots = make_plots(run_dir, results)
    target = run_dir / REPORT_FILE
    write_text_atomic(target, render(results, plots))
    return target
