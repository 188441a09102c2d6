"""The main job: train (or reuse) -> export -> quantize -> measure -> results.json -> report.md.

Each stage is its own module; this one only wires them and assembles results.json (the contract
in shared RESULTS.md). A recipe that produces a broken model is recorded as broken, not skipped.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from . import __version__
from .calibration import calibration_windows
from .config import AUTO, EvaluateConfig
from .data import PreparedData, evaluation_windows, prepare_data
from .errors import ConfigError, QuantizeError
from .export import export_onnx
from .fileio import write_json_atomic
from .hardware import cpu_has_vnni
from .measure.accuracy import compare
from .measure.latency import bench_grid
from .measure.sessions import SessionSpec, hardware_info, make_session
from .quantize import quantize
from .runs import FP32_ONNX_FILE, PLOTS_DIR, RESULTS_FILE, TRAIN_SUMMARY_FILE, RunDir, check_out_dir, int8_onnx_file
from .smoothquant import SmoothedModels
from .train import RunConfig, load_model, train

SCHEMA_VERSION = 1


@contextmanager
def timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    """Record a stage's wall time (results.json keeps them, so users see where the minutes go)."""
    start = time.perf_counter()
    yield
    seconds[stage] = round(time.perf_counter() - start, 2)


def ensure_trained(run: RunConfig, out_dir: Path, data: PreparedData, progress: bool) -> RunDir:
    """Reuse the run directory's checkpoint when its config hash matches, else train it."""
    run_dir = RunDir(check_out_dir(out_dir))
    if run_dir.stored_hash() == run.hash(data.corpus.sha256):
        return run_dir
    train(run, out_dir, progress=progress, data=data)
    return run_dir


def evaluate(run_dir: RunDir, cfg: EvaluateConfig, *, command: str) -> dict:
    """Export, quantize with every recipe, measure; write results.json and return it."""
    from .report import write_report

    stage_seconds: dict[str, float] = {}
    model, run = load_model(run_dir)
    train_summary = run_dir.read_json(TRAIN_SUMMARY_FILE)
    if train_summary.get("diverged"):
        raise QuantizeError(
            f"{run_dir.path}: training diverged at step {train_summary.get('diverged_at')}; there is no model to "
            f"deploy (retrain with warm-up or a lower --lr)"
        )
    data = prepare_data(run.data, run.model.context)
    window = data.window
    eval_inputs, eval_targets = evaluation_windows(data.tokens, data.splits.evaluation, window)
    calib_inputs = calibration_windows(data.tokens, data.splits.calibration, window, cfg.calib_samples)
    vnni = cpu_has_vnni()
    spec = SessionSpec(graph_optimization_level=cfg.graph_optimization_level, threads=cfg.threads)

    shutil.rmtree(run_dir.file(PLOTS_DIR), ignore_errors=True)  # plots of an earlier evaluation would be stale
    with timed(stage_seconds, "export"):
        fp32_path = run_dir.file(FP32_ONNX_FILE)
        exported = export_onnx(model, fp32_path, eval_inputs[: cfg.parity_windows], opset=cfg.opset)
    fp32_session = make_session(fp32_path, spec)
    # SmoothQuant recipes quantize a smoothed FP32 export, made once on first use.
    smoothed = SmoothedModels(model, calib_inputs, eval_inputs[: cfg.parity_windows], run_dir.path, opset=cfg.opset)
    fp32_sources: dict[str, Path] = {}  # recipe -> the FP32 model it quantized, when not fp32_path

    recipes_out: list[dict] = []
    int8_paths: dict[str, Path] = {}
    bar = tqdm([n for n in cfg.recipes if n != AUTO], desc="quantize+accuracy", unit="recipe",
               disable=not cfg.progress, leave=False)
    for name in bar:
        recipe = cfg.recipe(name)
        name = recipe.name
        bar.set_postfix_str(name)
        with timed(stage_seconds, f"quantize:{name}"):
            try:
                source = smoothed.fp32_for(recipe, fp32_path)
            except ConfigError as exc:  # a recipe this model cannot take (rotation on a zoo model)
                recipes_out.append({"name": name, "status": f"not applicable: {exc}",
                                    "settings": recipe.settings(vnni)})
                continue
            q = quantize(source, recipe, calib_inputs, run_dir.file(int8_onnx_file(name)), vnni=vnni,
                         probe_inputs=eval_inputs[:2])
        if source != fp32_path:
            fp32_sources[name] = source
        entry: dict = {"name": name, "status": q.status, "settings": q.settings, "session": spec.to_dict()}
        if q.status == "ok" and q.path is not None:
            entry["path"] = q.path.name
            entry["size_bytes"] = q.path.stat().st_size
            with timed(stage_seconds, f"accuracy:{name}"):
                acc = compare(fp32_session, make_session(q.path, spec), eval_inputs, eval_targets,
                              batch_size=cfg.eval_batch_size)
            entry["accuracy"] = acc.to_dict()
            int8_paths[name] = q.path
        else:
            entry["problems"] = q.problems
        recipes_out.append(entry)
    bar.close()
    if len(cfg.recipes) == 1 and cfg.recipes[0] != AUTO and not int8_paths:
        raise QuantizeError(f"recipe {cfg.recipes[0]} produced a broken model: {recipes_out[0]['status']}")
    extra: dict = {}
    if AUTO in cfg.recipes:
        with timed(stage_seconds, "search"):
            extra["search"] = run_search(
                run_dir.path, cfg, fp32_path, smoothed, calib_inputs, eval_inputs, eval_targets, spec, vnni,
                recipes_out, int8_paths, fp32_sources,
                measure=lambda path: compare(fp32_session, make_session(path, spec), eval_inputs, eval_targets,
                                             batch_size=cfg.eval_batch_size).to_dict())
    if smoothed.exports:
        with timed(stage_seconds, "smoothquant_latency"):
            extra["smoothquant"] = smoothquant_section(run_dir.path, cfg, fp32_path, smoothed, window)

    with timed(stage_seconds, "latency"):
        rows = measure_latency(cfg, {"fp32": fp32_path, **int8_paths}, window)

    results = {
        **results_header(command, cfg.threads),
        "model": {**run.model.to_dict(), "n_params": model.n_params(), "source": "trained",
                  "run_dir": "."},  # paths in results are relative to the run directory (no machine path)
        "data": {**data.describe(), "n_eval_windows": int(len(eval_inputs)), "n_calib_windows": int(len(calib_inputs))},
        "train": {**train_summary, "config": run.to_dict()["train"]},
        "export": exported.to_dict(run_dir.path),
        "recipes": recipes_out,
        "latency": [r.to_dict() for r in rows],
        "file_sizes_bytes": {"fp32": fp32_path.stat().st_size,
                             **{k: p.stat().st_size for k, p in int8_paths.items()}},
        **extra,
    }
    if cfg.outliers:
        with timed(stage_seconds, "outliers"):
            results.update(measure_outliers(model, run_dir, fp32_path, int8_paths, eval_inputs[: cfg.probe_windows],
                                            fp32_sources))
        with timed(stage_seconds, "diagnostics"):
            from .measure.diagnostics import diagnostics

            results["diagnostics"] = diagnostics(model, eval_inputs[: cfg.probe_windows])
    results["stage_seconds"] = stage_seconds
    write_json_atomic(run_dir.file(RESULTS_FILE), results)
    write_report(run_dir.path, results)
    return results


def results_header(command: str, threads: int | None) -> dict:
    """The keys every results.json starts with (RESULTS.md): schema, version, command, time, hardware."""
    return {
        "schema_version": SCHEMA_VERSION,
        "quantnorm_version": __version__,
        "command": command,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware_info(threads),
    }


def measure_latency(cfg: EvaluateConfig, models: dict[str, Path], seq: int) -> list:
    """p50/p90 rows of every model x provider x batch size at ``seq`` tokens, as ``cfg`` asks."""
    return bench_grid(models, cfg.provider_list(), list(cfg.latency_batches), seq, threads=cfg.threads,
                      graph_optimization_level=cfg.graph_optimization_level, warmup=cfg.latency_warmup,
                      iters=cfg.latency_iters, progress=cfg.progress)


def measure_outliers(model, run_dir: RunDir, fp32_path: Path, int8_paths: dict[str, Path], inputs,
                     fp32_sources: dict[str, Path] | None = None) -> dict:
    """The ``outliers`` and ``sqnr`` sections, and the activation heat map of the worst layer.

    SQNR is collected for static (QDQ) recipes; its correlation with outlier figures is taken over
    the inputs of weight MatMuls (attention probabilities are mostly exact zeros from the causal
    mask, so their max/median ratios are meaningless and would swamp the correlation).
    """
    from .measure.outliers import heatmap_for_layer, largest_ratio_layer, probe
    from .measure.sqnr import matmul_input_modules, sqnr_sections
    from .plots import plot_activation_heatmap

    report = probe(model, inputs).to_dict()
    matmul_inputs = matmul_input_modules(fp32_path, model)
    sqnr_inputs = inputs[:8]
    sqnr, summaries = sqnr_sections(fp32_path, int8_paths, sqnr_inputs, matmul_inputs, fp32_sources)
    layer = largest_ratio_layer(report["residual"])
    plot_activation_heatmap(heatmap_for_layer(model, inputs[:1], layer), run_dir.file(PLOTS_DIR) / "heatmap.png",
                            f"|a| of the residual stream at layer {layer} (first evaluation window)")
    report["heatmap_layer"] = layer
    return {"outliers": report, "sqnr": sqnr, "sqnr_summary": summaries}


def smoothquant_section(run_dir: Path, cfg: EvaluateConfig, fp32_path: Path, smoothed, seq: int) -> dict:
    """``results["smoothquant"]``: the plan (folded / explicit MatMuls, per-placement statement),
    the parity figures, and what the explicit Muls cost the FP32 model at batch 8 on the CPU.
    ``smoothed``: the run's ``SmoothedModels`` (zoo) or ``HFSmoothedModels`` (checkpoints)."""
    from .measure.sessions import CPU
    from .smoothquant import fp32_latency_cost

    export = next(iter(smoothed.exports.values()))  # one alpha per evaluate run
    section = export.to_dict(run_dir)
    cost = fp32_latency_cost(fp32_path, export.path,
                             SessionSpec(provider=CPU, graph_optimization_level=cfg.graph_optimization_level,
                                         threads=cfg.threads),
                             seq=seq, iters=cfg.latency_iters, warmup=cfg.latency_warmup)
    section["fp32_latency"] = cost
    section["fp32_latency_ratio"] = cost.get("fp32_latency_ratio")
    return section


def run_search(run_dir: Path, cfg: EvaluateConfig, fp32_path: Path, smoothed, calib_inputs, eval_inputs,
               eval_targets, spec: SessionSpec, vnni: bool, recipes_out: list[dict], int8_paths: dict[str, Path],
               fp32_sources: dict[str, Path], *, measure: Callable[[Path], dict], scorer: Callable | None = None,
               level: str = "byte") -> dict:
    """``--recipes auto``: search, keep the chosen model (or, when none passes, the best one) as the
    recipe entry ``auto:<recipe>``, measured by ``measure(int8_path)`` (the run's own accuracy dict,
    on the whole evaluation range); return ``results["search"]``. ``scorer``/``level``: how trials
    are scored (default: the zoo's byte-level metrics; ``--model`` scores over tokens)."""
    from .search import keep_trial_model, search_recipes

    work_dir = Path(run_dir) / "search"
    shutil.rmtree(work_dir, ignore_errors=True)
    try:
        result = search_recipes(fp32_path, work_dir, calib_inputs, eval_inputs, eval_targets,
                                cfg=cfg.search_config(), spec=spec, vnni=vnni, scorer=scorer, level=level,
                                fp32_for=lambda recipe: smoothed.fp32_for(recipe, fp32_path))
        keep = result.chosen or result.best
        if keep is not None:
            name = f"{AUTO}:{keep.name}"
            path = keep_trial_model(keep, Path(run_dir) / int8_onnx_file(AUTO))
            recipes_out.append({"name": name, "status": "ok", "settings": keep.settings, "session": spec.to_dict(),
                                "path": path.name, "size_bytes": path.stat().st_size, "accuracy": measure(path),
                                "search_passed": keep.passed})
            int8_paths[name] = path
            source = smoothed.fp32_for(cfg.search_config().resolve(keep.recipe), fp32_path)
            if source != fp32_path:
                fp32_sources[name] = source
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return result.to_dict()
