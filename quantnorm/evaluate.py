"""The one pipeline: source -> export -> quantize -> measure -> results.json -> report.md.

``evaluate(source, cfg)`` runs every model source (``quantnorm.sources``: a zoo run, a Hugging
Face directory, a GGUF file, an ONNX export directory) through the same stages: the recipe loop,
the accuracy-aware search, SmoothQuant latency, latency, placement detection on the FP32 graph,
the probe and SQNR. A source supplies only what differs (``quantnorm.sources.base``). This module
wires the stages; they fill a ``quantnorm.results.ResultsBuilder``, which writes results.json (the
contract in shared RESULTS.md). A recipe that
produces a broken model is recorded as broken, not skipped.
"""

from __future__ import annotations

import math
import numbers
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from tqdm import tqdm

from .config import AUTO, EvaluateConfig
from .engine_stage import engines_section
from .errors import ConfigError, QuantizeError
from .fileio import collections_skip_existing_objects, release_memory, sweep_stale_temporaries
from .generation_stage import generation_section
from .hardware import cpu_has_vnni
from .measure.diagnostics import diagnostics
from .measure.fp16_check import FP16_CHECK_WINDOWS, fp16_check
from .measure.graph_probe import graph_probe
from .measure.latency import bench_grid
from .measure.outliers import largest_ratio_layer
from .measure.placement import detect_placement
from .measure.scoring import Scorer, search_scorer
from .measure.sessions import CPU, ReopenableSession, ReplayedSession, SessionSpec, make_session
from .measure.sqnr import sqnr_sections
from .quantize import MASSIVE_DEFAULT_RECIPES, PreprocessCache, quantize
from .quantize.sanity import softmax_input_report
from .report import write_report
from .report.plots import plot_activation_heatmap
from .results import ResultsBuilder
from .runs import FP32_ONNX_FILE, PLOTS_DIR, RunDir, int8_onnx_file
from .search import keep_trial_model, search_recipes, trial_recipe
from .sources.base import DETECTED, ModelSource, SearchScoring
from .sources.zoo import ZooSource, ensure_trained
from .transforms.smoothquant import fp32_latency_cost

__all__ = ["AUTO", "EvaluateConfig", "ensure_trained", "evaluate"]  # ensure_trained: the sweep's and the CLI's


@contextmanager
def timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    """Record a stage's wall time (results.json keeps them, so users see where the minutes go)."""
    start = time.perf_counter()
    yield
    seconds[stage] = round(time.perf_counter() - start, 2)


@dataclass
class _Run:
    """What the stages of one evaluation share: the FP32 model, its sessions and scoring, the
    transforms, and the INT8 models made so far."""

    cfg: EvaluateConfig
    source: ModelSource
    run_dir: Path
    fp32_path: Path
    stage: Callable[[str], AbstractContextManager]
    stage_seconds: dict[str, float]
    spec: SessionSpec
    vnni: bool
    fp32_session: ReopenableSession
    fp32_scores: ReplayedSession
    accuracy: Callable
    transforms: Any
    preprocessed: PreprocessCache
    fp32_sources: dict[str, Path] = field(default_factory=dict)  # recipe -> the FP32 model it quantized
    int8_paths: dict[str, Path] = field(default_factory=dict)
    recipes: dict[str, Any] = field(default_factory=dict)   # name -> the Recipe each ok model was made with
    probe: tuple[dict, dict] | None = None   # graph_probe's (report, first window), when run before quantizing

    def measure(self, path: Path) -> dict:
        return self.accuracy(make_session(path, self.spec))

    def close(self) -> None:
        self.preprocessed.close()
        self.fp32_session.close()
        self.fp32_scores.discard()


def evaluate(source: ModelSource | RunDir, cfg: EvaluateConfig, *, command: str) -> dict:
    """Export, quantize with every recipe, measure; write results.json and the report into the
    source's run directory and return the results. ``source``: any model source
    (``quantnorm.sources``); a ``RunDir`` is read as the zoo source."""
    if isinstance(source, RunDir):
        source = ZooSource(source)
    with collections_skip_existing_objects():   # entered before prepare loads a model: mostly the imports
        return _evaluate(source, cfg, command)


def _evaluate(source: ModelSource, cfg: EvaluateConfig, command: str) -> dict:
    stage_seconds: dict[str, float] = {}

    def stage(name: str):
        return timed(stage_seconds, name)

    with stage("prepare"):
        source.prepare(cfg)
    out = ResultsBuilder(command, cfg.threads)
    out.section("policy", cfg.accuracy_thresholds())   # what the report's verdict judges by
    run = open_run(source, cfg, out, stage, stage_seconds)
    if cfg.probe_picks_recipes:
        cfg = run.cfg = choose_recipes(run, out)
    quantize_recipes(run, out)
    run.fp32_session.close()   # the search opens its own; latency, the probe and the FP16 check read files
    if AUTO in cfg.recipes:
        # the probe orders the search's default space (search.probe_ordered) and lets it prune
        # what massive activations break once a per-token recipe passed (search.pruned_by)
        massive = bool(probed_massive(run))
        with stage("search"):
            out.section("search", run_search(run.run_dir, cfg, run.fp32_path, run.transforms, source.data.calib_inputs,
                                             source.search_scoring(cfg), run.spec, run.vnni, out.recipes,
                                             run.int8_paths, run.fp32_sources, recipes_used=run.recipes,
                                             measure=run.measure, massive=massive,
                                             preprocessed=run.preprocessed, fp32_session=run.fp32_scores))
    run.close()
    transform_sections(run, out)
    measure_models(run, out)
    generation = None
    if cfg.generation:   # its own stages (generation:export, :quantize, :agreement, :decode) time it
        generation = generation_section(source, cfg, run_dir=run.run_dir, fp32_path=run.fp32_path,
                                        recipes=run.recipes, int8_paths=run.int8_paths, vnni=run.vnni, stage=stage,
                                        gptq_codes=run.preprocessed.gptq_codes)
        out.section("generation", generation)
    if cfg.engines:   # after generation: agreement continues its FP32 with-past graph
        out.section("engines", engines_section(source, cfg, run_dir=run.run_dir, fp32_path=run.fp32_path,
                                               generation=generation, stage=stage))
    results = out.write(run.run_dir, stage_seconds)
    write_report(run.run_dir, results)  # the sections are chosen by the source's kind (quantnorm.report.run)
    return results


def open_run(source: ModelSource, cfg: EvaluateConfig, out: ResultsBuilder, stage, stage_seconds) -> _Run:
    """Export the FP32 model (``export`` section) and open what every recipe is scored with."""
    run_dir = Path(source.run_dir)
    # what a run stopped by a signal (SIGKILL, a power cut) could not clean up
    sweep_stale_temporaries(run_dir, older_than=psutil.Process().create_time())
    shutil.rmtree(run_dir / PLOTS_DIR, ignore_errors=True)  # plots of an earlier evaluation would be stale
    fp32_path = run_dir / FP32_ONNX_FILE
    with stage("export"):
        out.export(source.export(fp32_path, cfg))
    release_memory()  # the exporter's graphs and copies of the weights are garbage now
    spec = SessionSpec(graph_optimization_level=cfg.graph_optimization_level, threads=cfg.threads)
    # Opened for each recipe's scoring and let go before each quantizer pass: the FP32 weights and
    # the quantizer's sessions are the two largest things of the run, never resident together.
    fp32_session = ReopenableSession(fp32_path, spec)
    # Every recipe and search trial is scored against the FP32 model on the same windows: its outputs
    # are computed once and read back from disk after (a large vocabulary makes them gigabytes, and
    # running the FP32 model again for every recipe would cost as much as scoring the recipe).
    fp32_scores = ReplayedSession(fp32_session, run_dir)
    # SmoothQuant and rotation recipes quantize a transformed FP32 export, made once on first use.
    # Each FP32 model is pre-processed for the quantizer once, for every recipe and search trial
    # (closed after the search; on an exception its temporary directory goes with the object).
    return _Run(cfg=cfg, source=source, run_dir=run_dir, fp32_path=fp32_path, stage=stage,
                stage_seconds=stage_seconds, spec=spec, vnni=cpu_has_vnni(), fp32_session=fp32_session,
                fp32_scores=fp32_scores, accuracy=Scorer(source.scoring(cfg), fp32_scores),
                transforms=source.transforms(cfg), preprocessed=PreprocessCache())


def choose_recipes(run: _Run, out: ResultsBuilder) -> EvaluateConfig:
    """No --recipes named: probe the FP32 model before quantizing it. When the probe finds massive
    activations, the recipes that survive them (MASSIVE_DEFAULT_RECIPES) replace the default set,
    whose per-tensor scales the probe already says will spend their 8 bits on those values; the
    ``recipe_choice`` section records why, and the report's verdict says so. The probe is kept for
    the ``outliers`` section (it is not run twice). An encoder keeps the default set."""
    cfg = run.cfg
    massive = probed_massive(run)
    if massive is None:
        return cfg
    recipes = MASSIVE_DEFAULT_RECIPES if massive else cfg.recipes
    out.section("recipe_choice", {"by": "probe", "massive_total": massive, "probe_windows": cfg.probe_windows,
                                  "recipes": list(recipes), "default_recipes": list(cfg.recipes)})
    return replace(cfg, recipes=recipes, probe_picks_recipes=False)


def probed_massive(run: _Run) -> int | None:
    """The massive activations the FP32 probe finds in a language model (``run.probe``, probed
    once: the outliers section reads it too); None for an encoder, which is not probed first."""
    options = run.source.probe_options()
    if not options.get("causal", True):
        return None
    if run.probe is None:
        with run.stage("probe"):
            run.probe = graph_probe(run.fp32_path, run.source.data.eval_inputs[: run.cfg.probe_windows], **options)
    return int(run.probe[0]["massive_total"])


def quantize_recipes(run: _Run, out: ResultsBuilder) -> None:
    """Quantize with each named recipe and measure it: one ``recipes`` entry each."""
    cfg = run.cfg
    bar = tqdm([n for n in cfg.recipes if n != AUTO], desc="quantize+accuracy", unit="recipe",
               disable=not cfg.progress, leave=False)
    for name in bar:
        recipe = cfg.recipe(name)
        bar.set_postfix_str(recipe.name)  # with --exclude: the mixed-precision variant's own name
        out.add_recipe(quantize_recipe(run, recipe))
    bar.close()
    if len(cfg.recipes) == 1 and cfg.recipes[0] != AUTO and not run.int8_paths:
        raise QuantizeError(f"recipe {cfg.recipes[0]} produced a broken model: {out.recipes[0]['status']}")


def quantize_recipe(run: _Run, recipe) -> dict:
    """One recipe's ``recipes`` entry: quantized (from a transformed export where the recipe asks for
    one), checked, and measured; a model broken only by its calibrated attention mask still runs,
    so its damage is measured too."""
    name, data = recipe.name, run.source.data
    started = time.perf_counter()
    # Let the FP32 weights go before a transform reloads the torch ones and exports them (Gemma 3:
    # the open FP32 session is 1.3 GB of the rotated export's peak); scoring opens it again.
    run.fp32_session.close()
    try:
        quantized_from = run.transforms.fp32_for(recipe, run.fp32_path)
    except ConfigError as exc:  # a recipe this model cannot take (rotation on a zoo model): say why, go on
        return {"name": name, "status": f"not applicable: {exc}", "settings": recipe.settings(run.vnni)}
    if quantized_from != run.fp32_path:  # a smoothed or rotated export, made (or reused) just now
        run.fp32_sources[name] = quantized_from
        run.stage_seconds[f"transform:{name}"] = round(time.perf_counter() - started, 2)
    with run.stage(f"quantize:{name}"):
        q = quantize(quantized_from, recipe, data.calib_inputs, run.run_dir / int8_onnx_file(name), vnni=run.vnni,
                     probe_inputs=data.eval_inputs[:2], preprocessed=run.preprocessed)
    release_memory()  # the quantizer's model copies and calibration buffers
    entry: dict = {"name": name, "status": q.status, "settings": q.settings, "session": run.spec.to_dict()}
    softmax = softmax_input_report(q.path) if q.path is not None and q.path.is_file() else None
    if softmax is not None:
        entry["softmax_inputs"] = softmax
    runs_anyway = bool(softmax and softmax["problem"])
    if (q.status == "ok" or runs_anyway) and q.path is not None:
        entry["path"] = q.path.name
        entry["size_bytes"] = q.path.stat().st_size
        with run.stage(f"accuracy:{name}"):
            acc = run.measure(q.path)
        if any(isinstance(v, numbers.Real) and not math.isfinite(v) for v in acc.values()):
            # NaN scores, or a perplexity past float64's range: no accuracy block can hold them
            shown = {k: f"{float(acc[k]):.4g}" if isinstance(acc.get(k), numbers.Real) else "-"
                     for k in ("ppl_int8", "ppl_fp32", "kld_mean")}
            why = (f"broken: its scores are not finite (perplexity INT8 {shown['ppl_int8']}, FP32 {shown['ppl_fp32']}; "
                   f"KL mean {shown['kld_mean']})")
            return {**entry, "status": why, "problems": [*q.problems, why.removeprefix("broken: ")]}
        if q.status != "ok":  # broken although it runs: the damage, never a deployable accuracy
            entry["problems"] = q.problems
            entry["damage"] = acc
        else:
            entry["accuracy"] = acc
            run.int8_paths[name] = q.path
            run.recipes[name] = recipe
    else:
        entry["problems"] = q.problems
    return entry


def transform_sections(run: _Run, out: ResultsBuilder) -> None:
    """The ``rotation`` section (rotated exports) and the ``smoothquant`` one (with its FP32 latency cost)."""
    transforms = run.transforms
    if getattr(transforms, "rotated", None):
        out.section("rotation", {form: r.to_dict(run.run_dir) for form, r in transforms.rotated.items()})
    if transforms.exports:
        with run.stage("smoothquant_latency"):
            out.section("smoothquant", smoothquant_section(run.run_dir, run.cfg, run.fp32_path, transforms,
                                                           run.source.data.window))


def measure_models(run: _Run, out: ResultsBuilder) -> None:
    """Latency of every model, placement read off the FP32 graph (the source's sections), file
    sizes, and (unless ``--no-outliers``) the probe's sections and the source's extras."""
    cfg, source, fp32_path = run.cfg, run.source, run.fp32_path
    with run.stage("latency"):
        rows = measure_latency(cfg, {"fp32": fp32_path, **run.int8_paths}, source.data.window)
    with run.stage("placement_from_graph"):
        detected = placement_from_graph(fp32_path, source.table_placement)
    out.source(source.sections(detected))
    out.latency([r.to_dict() for r in rows])
    out.file_sizes({"fp32": fp32_path, **run.int8_paths})
    if cfg.outliers:
        with run.stage("outliers"):
            out.sections(probe_sections(run.run_dir, fp32_path, run.int8_paths,
                                        source.data.eval_inputs[: cfg.probe_windows], run.fp32_sources,
                                        probed=run.probe, **source.probe_options()))
        out.sections(torch_sections(source, cfg, run.stage))


def torch_sections(source: ModelSource, cfg: EvaluateConfig, stage) -> dict:
    """What only a torch module can show, measured on the one the source has: the zoo's
    diagnostics, a causal checkpoint's FP16 check (none for an ONNX export)."""
    checks, data, out = source.torch_checks(cfg), source.data, {}
    if checks.diagnostics is not None:
        with stage("diagnostics"):
            out["diagnostics"] = diagnostics(checks.diagnostics, data.eval_inputs[: cfg.probe_windows])
    if checks.fp16 is not None:
        n = min(FP16_CHECK_WINDOWS, len(data.eval_inputs))
        with stage("fp16_check"):
            out["fp16"] = fp16_check(checks.fp16(), data.eval_inputs[:n], data.eval_targets[:n])
    return out


def probe_sections(run_dir: Path, fp32_path: Path, int8_paths: dict[str, Path], inputs, fp32_sources: dict[str, Path],
                   *, n_blocks: int | None, causal: bool, token=None, probed: tuple[dict, dict] | None = None) -> dict:
    """The ``outliers``, ``sqnr`` and ``sqnr_summary`` sections, read off the FP32 graph for every
    source (``measure.graph_probe``), and the heat map of the layer with the largest max/median.

    SQNR's correlation with outlier figures is taken over the inputs of weight MatMuls
    (attention probabilities are mostly exact zeros from the causal mask, so their max/median
    ratios are meaningless and would swamp the correlation). ``probed``: graph_probe's answer on
    these inputs, when it already ran (choose_recipes)."""
    report, first_window = probed or graph_probe(fp32_path, inputs, n_blocks=n_blocks, token=token, causal=causal)
    matmul_inputs = {row["tensor"]: row["modules"] for row in report["matmul_inputs"]}  # the probe's own walk
    sqnr, summaries = sqnr_sections(fp32_path, int8_paths, inputs[:8], matmul_inputs, fp32_sources)
    layer = largest_ratio_layer(report["residual"]) if report["residual"] else None
    if layer in first_window:
        plot_activation_heatmap(first_window[layer], run_dir / PLOTS_DIR / "heatmap.png",
                                f"|a| of the residual stream after layer {layer} (first evaluation window)")
        report["heatmap_layer"] = layer
    return {"outliers": report, "sqnr": sqnr, "sqnr_summary": summaries}


def placement_from_graph(fp32_path: Path, table_placement: str) -> dict:
    """The placement read off the exported graph, beside the source's own table (a cross-check).
    ``table_placement`` "detected": the source has no table; the graph's answer stands alone."""
    try:
        found = detect_placement(fp32_path).to_dict()
    except Exception as exc:  # noqa: BLE001 - a detector miss must not cost the measured run
        return {"placement": None, "norm": None, "how": f"detector failed: {' '.join(str(exc).split())[:200]}",
                "table": table_placement, "agrees": False}
    if table_placement == DETECTED:
        return {**found, "table": None, "agrees": None}
    return {**found, "table": table_placement, "agrees": found["placement"] == table_placement}


def measure_latency(cfg: EvaluateConfig, models: dict[str, Path], seq: int) -> list:
    """p50/p90 rows of every model x provider x batch size at ``seq`` tokens, as ``cfg`` asks."""
    return bench_grid(models, cfg.provider_list(), list(cfg.latency_batches), seq, threads=cfg.threads,
                      graph_optimization_level=cfg.graph_optimization_level, warmup=cfg.latency_warmup,
                      iters=cfg.latency_iters, progress=cfg.progress, max_seconds=cfg.latency_seconds)


def smoothquant_section(run_dir: Path, cfg: EvaluateConfig, fp32_path: Path, smoothed, seq: int) -> dict:
    """``results["smoothquant"]``: the plan (folded / explicit MatMuls, per-placement statement),
    the parity figures, and what the explicit Muls cost the FP32 model at batch 8 on the CPU.
    ``smoothed``: the run's ``transforms.variants.FP32Variants`` (what the source's transforms gave). With
    several alphas (``smoothquant@ALPHA`` recipes or search trials) the first one's plan is the
    section and ``per_alpha`` lists each export; the Muls' cost is the same for every alpha (the
    same explicit MatMuls get one), so it is timed on the first."""
    export = next(iter(smoothed.exports.values()))
    section = export.to_dict(run_dir)
    section["per_alpha"] = [{"alpha": alpha, **e.to_dict(run_dir)} for alpha, e in smoothed.exports.items()]
    cost = fp32_latency_cost(fp32_path, export.path,
                             SessionSpec(provider=CPU, graph_optimization_level=cfg.graph_optimization_level,
                                         threads=cfg.threads),
                             seq=seq, iters=cfg.latency_iters, warmup=cfg.latency_warmup)
    section["fp32_latency"] = cost
    section["fp32_latency_ratio"] = cost.get("fp32_latency_ratio")
    return section


def run_search(run_dir: Path, cfg: EvaluateConfig, fp32_path: Path, transforms, calib_inputs,
               scoring: SearchScoring, spec: SessionSpec, vnni: bool, recipes_out: list[dict],
               int8_paths: dict[str, Path], fp32_sources: dict[str, Path], *, measure: Callable[[Path], dict],
               recipes_used: dict[str, Any] | None = None, massive: bool = False,
               preprocessed: PreprocessCache | None = None, fp32_session=None) -> dict:
    """``--recipes auto``: search, keep the chosen model (or, when none passes, the best one) as the
    recipe entry ``auto:<recipe>``, measured by ``measure(int8_path)`` (the run's own accuracy dict,
    on the whole evaluation range); return ``results["search"]``. ``scoring``: what trials are
    scored on (the source's: byte-level for the zoo, tokens for checkpoints and ONNX exports).
    ``massive``: the probe found massive activations (the search's order and pruning)."""
    work_dir = Path(run_dir) / "search"
    search_cfg = replace(cfg.search_config(), massive=massive)
    shutil.rmtree(work_dir, ignore_errors=True)
    try:
        result = search_recipes(fp32_path, work_dir, calib_inputs, scoring.inputs, scoring.targets,
                                cfg=search_cfg, spec=spec, vnni=vnni, scorer=search_scorer(scoring.level),
                                level=scoring.level, fp32_for=lambda recipe: transforms.fp32_for(recipe, fp32_path),
                                preprocessed=preprocessed, fp32_session=fp32_session)
        keep = result.chosen or result.best
        if keep is not None:
            name = f"{AUTO}:{keep.name}"
            path = keep_trial_model(keep, Path(run_dir) / int8_onnx_file(AUTO))
            recipes_out.append({"name": name, "status": "ok", "settings": keep.settings, "session": spec.to_dict(),
                                "path": path.name, "size_bytes": path.stat().st_size, "accuracy": measure(path),
                                "search_passed": keep.passed})
            int8_paths[name] = path
            if recipes_used is not None:
                recipes_used[name] = trial_recipe(search_cfg, keep)
            quantized_from = transforms.fp32_for(search_cfg.resolve(keep.recipe), fp32_path)
            if quantized_from != fp32_path:
                fp32_sources[name] = quantized_from
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    out = result.to_dict()
    if scoring.metric is not None:
        out["metric"] = scoring.metric
    return out
