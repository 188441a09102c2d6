"""``quantnorm evaluate --model PATH``: a local Hugging Face checkpoint through the zoo's pipeline.

load (local files only) -> detect placement/norm -> tokenize the corpus splits -> export with the
parity gate -> quantize with each recipe (``quantnorm.quantize``, calibration windows from the
calibration range) -> accuracy (token-level for causal LMs, embedding agreement for encoders) ->
latency -> probe + SQNR -> results.json (same schema, ``model.source = "hf:<path>"``) + report.md.

SmoothQuant recipes smooth the checkpoint with the zoo's fold rule (``quantnorm.hf.smoothquant``:
per-architecture foldability, Gemma's ``(1 + w)`` norms, tied heads untied) and quantize the
smoothed export. ``--recipes auto`` runs the zoo's accuracy-aware search (INC's tuner, then the
FP32 fallback of the worst-SQNR tensors) scored with token-level metrics: the PPL ratio over next
tokens for causal LMs, over the masked positions for encoders with an MLM head. An encoder
without an MLM head has no perplexity to target: ``auto`` is refused for it with a one-line error.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

from ..data import BUILTIN_PYDOC
from ..errors import ConfigError, QuantizeError
from ..evaluate import AUTO, measure_latency, results_header, run_search, smoothquant_section
from ..fileio import write_json_atomic
from ..hardware import cpu_has_vnni
from ..measure.placement import detect_placement
from ..measure.sessions import SessionSpec, make_session
from ..portable import portable_path
from ..quantize import quantize
from ..runs import FP32_ONNX_FILE, PLOTS_DIR, RESULTS_FILE, check_out_dir, int8_onnx_file
from .gguf import gguf_checkpoint, is_gguf_path, resolve_gguf
from .loader import DETECTED

FP16_CHECK_WINDOWS = 4  # torch float16 on a CPU is slow; the overflow shows on any window with BOS


@dataclass(frozen=True)
class HFOptions:
    """What to load and which text to use; the CLI builds it from --model and friends."""

    path: Path
    allow_pickle: bool = False
    corpus: str = BUILTIN_PYDOC
    window: int = 128                 # tokens per window (--context)
    max_eval_windows: int | None = 128
    out_dir: Path | None = None
    # Where the checkpoint came from when it is not a plain directory (a GGUF file): the
    # ``model.source`` object of results.json (RESULTS.md additions). None: ``hf:<path>``.
    provenance: dict | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.window < 3:
            raise ConfigError(f"--context (the window in tokens) must be >= 3 for --model, got {self.window}")
        if self.max_eval_windows is not None and self.max_eval_windows < 2:
            raise ConfigError(f"evaluation windows must be >= 2, got {self.max_eval_windows}")


def default_out_dir(model_path: Path) -> Path:
    path = Path(model_path).resolve()
    name = path.parent.name if path.name in ("model", "checkpoint", "") and path.parent.name else path.name
    return Path("runs") / f"hf-{name}"


def check_search_supported(recipes, kind: str, mlm_head: bool, path) -> None:
    """``auto`` needs a perplexity to target: causal LMs, or encoders with an MLM head."""
    if AUTO in recipes and kind == "encoder" and not mlm_head:
        raise ConfigError(f"--recipes auto needs a perplexity to target, and {path} is an encoder without an MLM "
                          f"head: run the static-*/dynamic/smoothquant recipes and read the embedding metrics")


def evaluate_hf(opts: HFOptions, cfg, *, command: str) -> tuple[dict, Path]:
    """Run the whole pipeline on a local checkpoint; write results.json and report.md into the
    run directory; return (results, run directory). ``cfg`` is the zoo's ``EvaluateConfig``."""
    import time

    from .data import mlm_windows, prepare_hf_data
    from .export import export_hf_onnx, make_wrapper, output_names
    from .loader import load_checkpoint
    from .report import write_hf_report

    stage_seconds: dict[str, float] = {}

    def timed(stage: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stage_seconds[stage] = round(time.perf_counter() - start, 2)

    from .smoothquant import HFSmoothedModels

    loaded = timed("load", load_checkpoint, opts.path, allow_pickle=opts.allow_pickle)
    spec, config = loaded.spec, loaded.model.config
    check_search_supported(cfg.recipes, spec.kind, loaded.files.mlm_head, opts.path)
    recipes = [n for n in cfg.recipes if n != AUTO]
    max_positions = _max_positions(config)
    data = timed("data", prepare_hf_data, loaded.tokenizer, config, spec.kind, corpus=opts.corpus, window=opts.window,
                 calib_samples=cfg.calib_samples, max_eval_windows=opts.max_eval_windows, model_path=opts.path,
                 max_positions=max_positions)
    run_dir = check_out_dir(opts.out_dir or default_out_dir(opts.path))
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run_dir / PLOTS_DIR, ignore_errors=True)

    wrapper = make_wrapper(loaded)
    outputs = output_names(spec.kind, loaded.files.mlm_head)
    fp32_path = run_dir / FP32_ONNX_FILE
    exported = timed("export", export_hf_onnx, wrapper, fp32_path, data.eval_inputs[: cfg.parity_windows],
                     outputs=outputs, max_positions=max_positions, opset=cfg.opset)
    spec_session = SessionSpec(graph_optimization_level=cfg.graph_optimization_level, threads=cfg.threads)
    fp32_session = make_session(fp32_path, spec_session)
    vnni = cpu_has_vnni()
    mlm = mlm_windows(data.eval_inputs, data.special.mask) if loaded.files.mlm_head and data.special.mask is not None \
        else None

    # SmoothQuant recipes quantize a smoothed FP32 export, made once per alpha on first use.
    smoothed = HFSmoothedModels(loaded, wrapper, data.calib_inputs, data.eval_inputs[: cfg.parity_windows], run_dir,
                                outputs=outputs, max_positions=max_positions, opset=cfg.opset)
    fp32_sources: dict[str, Path] = {}  # recipe -> the FP32 model it quantized, when not fp32_path
    recipes_out: list[dict] = []
    int8_paths: dict[str, Path] = {}
    accuracy = HFAccuracy(spec.kind, fp32_session, data, mlm, cfg.eval_batch_size, timed)
    bar = tqdm(recipes, desc="quantize+accuracy", unit="recipe", disable=not cfg.progress, leave=False)
    for name in bar:
        recipe = cfg.recipe(name)
        name = recipe.name  # with --exclude: the mixed-precision variant's own name
        bar.set_postfix_str(name)
        try:
            source = timed(f"smooth:{name}", smoothed.fp32_for, recipe, fp32_path)
        except ConfigError as exc:  # e.g. a rotation this architecture does not support: say why, go on
            recipes_out.append({"name": name, "status": f"not applicable: {exc}", "settings": recipe.settings(vnni)})
            continue
        if source != fp32_path:
            fp32_sources[name] = source
        q = timed(f"quantize:{name}", quantize, source, recipe, data.calib_inputs, run_dir / int8_onnx_file(name),
                  vnni=vnni, probe_inputs=data.eval_inputs[:2])
        entry: dict = {"name": name, "status": q.status, "settings": q.settings, "session": spec_session.to_dict()}
        softmax = softmax_input_quantization(q.path) if q.path is not None and q.path.is_file() else None
        if softmax is not None:
            entry["softmax_inputs"] = softmax
        # A model broken only by its calibrated mask still runs: measure its damage too.
        runs_anyway = bool(softmax and softmax["problem"])
        if (q.status == "ok" or runs_anyway) and q.path is not None:
            entry["path"] = q.path.name
            entry["size_bytes"] = q.path.stat().st_size
            acc = timed(f"accuracy:{name}", accuracy, make_session(q.path, spec_session))
            if q.status != "ok":
                # Broken although it runs: record the damage, never as a deployable accuracy.
                entry["problems"] = q.problems
                entry["damage"] = acc
            else:
                entry["accuracy"] = acc
                int8_paths[name] = q.path
        else:
            entry["problems"] = q.problems
        recipes_out.append(entry)
    bar.close()
    if len(cfg.recipes) == 1 and recipes and not int8_paths:
        raise QuantizeError(f"recipe {recipes[0]} produced a broken model: {recipes_out[0]['status']}")
    extra: dict = {}
    if AUTO in cfg.recipes:
        extra["search"] = timed("search", run_search_hf, run_dir, cfg, spec.kind, fp32_path, accuracy, smoothed,
                                data, mlm, spec_session, vnni, recipes_out, int8_paths, fp32_sources)
    if smoothed.rotated:
        extra["rotation"] = {form: r.to_dict(run_dir) for form, r in smoothed.rotated.items()}
    if smoothed.exports:
        extra["smoothquant"] = timed("smoothquant_latency", smoothquant_section, run_dir, cfg, fp32_path, smoothed,
                                     data.window)

    rows = timed("latency", measure_latency, cfg, {"fp32": fp32_path, **int8_paths}, data.window)

    detected = timed("placement_from_graph", placement_from_graph, fp32_path, spec.placement)
    if spec.placement == DETECTED:  # outside the loader table: the graph's answer is the placement
        if detected.get("placement") is None:
            raise ConfigError(f"--model {opts.path}: {spec.model_type} is not in the loader table and its placement "
                              f"cannot be read from the exported graph ({detected.get('how')})")
    results = {
        **results_header(command, cfg.threads),
        "model": {**model_section(loaded, opts, max_positions, run_dir), "placement_detected": detected,
                  **({"placement": detected["placement"], "norm": detected["norm"]} if spec.placement == DETECTED
                     else {})},
        "data": data.describe(),
        "train": {"pretrained": True, "diverged": False, "note": "pretrained checkpoint: not trained by quantnorm"},
        "export": exported.to_dict(run_dir),
        "recipes": recipes_out,
        "latency": [r.to_dict() for r in rows],
        "file_sizes_bytes": {"fp32": fp32_path.stat().st_size, **{k: p.stat().st_size for k, p in int8_paths.items()}},
        **extra,
    }
    if mlm is not None:
        results["data"]["mlm"] = {"mask_fraction": 0.15, "seed": 0, "n_scored": int(mlm[1].sum()),
                                  "rule": "fixed seeded 15% of inner positions replaced by [MASK]"}
    if cfg.outliers:
        results.update(timed("outliers", measure_outliers_hf, loaded, run_dir, fp32_path, int8_paths,
                             data.eval_inputs[: cfg.probe_windows], fp32_sources))
    if cfg.outliers and spec.kind == "causal":
        from .fp16 import fp16_check  # torch forwards in three dtypes: only when the probe runs

        n = min(FP16_CHECK_WINDOWS, len(data.eval_inputs))
        results["fp16"] = timed("fp16_check", fp16_check, loaded, data.eval_inputs[:n], data.eval_targets[:n])
    results["stage_seconds"] = stage_seconds
    write_json_atomic(run_dir / RESULTS_FILE, results)
    write_hf_report(run_dir, results)
    return results, run_dir


class HFAccuracy:
    """A recipe's accuracy dict from its INT8 session: token-level for causal LMs, embedding agreement
    (plus MLM figures) for encoders, whose FP32 outputs are computed once, on first use."""

    def __init__(self, kind: str, fp32_session, data, mlm, batch_size: int, timed=None):
        self.kind, self.fp32_session, self.data, self.mlm, self.batch_size = kind, fp32_session, data, mlm, batch_size
        self.timed = timed or (lambda stage, fn, *args: fn(*args))
        self.fp32_reference = None

    def __call__(self, int8_session) -> dict:
        from .metrics import compare_tokens, encoder_compare, encoder_outputs

        if self.kind == "causal":
            return compare_tokens(self.fp32_session, int8_session, self.data.eval_inputs, self.data.eval_targets)
        if self.fp32_reference is None:
            self.fp32_reference = self.timed("accuracy:fp32", encoder_outputs, self.fp32_session,
                                             self.data.eval_inputs, self.batch_size)
        return encoder_compare(self.fp32_reference, int8_session, self.data.eval_inputs, batch_size=self.batch_size,
                               mlm=self.mlm, fp32_session=self.fp32_session)


def token_scorer(fp32_session, int8_session, inputs, targets) -> SimpleNamespace:
    """The search's scorer for ``--model``: FORMULAS.md's PPL ratio, KL and top-1 over tokens (the
    fields the search reads). A negative target marks a position that is not scored (the unmasked
    positions of MLM windows)."""
    from .metrics import compare_tokens

    targets = np.asarray(targets)
    scored = targets >= 0
    return SimpleNamespace(**compare_tokens(fp32_session, int8_session, inputs, np.where(scored, targets, 0),
                                            scored=None if scored.all() else scored))


def run_search_hf(run_dir: Path, cfg, kind: str, fp32_path: Path, accuracy: HFAccuracy, smoothed, data, mlm,
                  spec_session, vnni: bool, recipes_out: list[dict], int8_paths: dict[str, Path],
                  fp32_sources: dict[str, Path]) -> dict:
    """``--recipes auto`` on a checkpoint: the zoo's search scored over tokens (next tokens for causal
    LMs, the masked positions for MLM encoders); the kept model is measured with the usual metrics."""
    from ..measure.sessions import make_session

    if kind == "causal":
        inputs, targets = data.eval_inputs, data.eval_targets
    else:  # encoders with an MLM head (checked before anything ran): score the masked positions
        masked, scored = mlm
        inputs, targets = masked, np.where(scored, data.eval_inputs, -1)
    out = run_search(run_dir, cfg, fp32_path, smoothed, data.calib_inputs, inputs, targets, spec_session, vnni,
                     recipes_out, int8_paths, fp32_sources, scorer=token_scorer, level="token",
                     measure=lambda path: accuracy(make_session(path, spec_session)))
    out["metric"] = ("1/ppl_ratio over next tokens (higher is better; FP32 baseline 1)" if kind == "causal" else
                     "1/ppl_ratio over the masked positions of the MLM windows (higher is better; FP32 baseline 1)")
    return out


def softmax_input_quantization(int8_path: Path) -> dict:
    """How the INT8 model quantizes its Softmax inputs (the attention scores, where HF models add
    their mask): ``{"quantized": n, "max_scale": s or None, "tensors": [...], "problem": text or None}``."""
    import onnx

    from ..quantize.sanity import check_softmax_inputs, softmax_input_scales

    model = onnx.load(str(int8_path))
    quantized = softmax_input_scales(model)
    problems = check_softmax_inputs(model)
    return {"quantized": len(quantized), "max_scale": max((q["scale"] for q in quantized), default=None),
            "tensors": quantized[:8], "problem": problems[0] if problems else None}


def _max_positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def placement_from_graph(fp32_path: Path, table_placement: str) -> dict:
    """The placement read off the exported graph, beside the loader table's (a cross-check)."""
    try:
        found = detect_placement(fp32_path).to_dict()
    except Exception as exc:  # noqa: BLE001 - a detector miss must not cost the measured run
        return {"placement": None, "norm": None, "how": f"detector failed: {' '.join(str(exc).split())[:200]}",
                "table": table_placement, "agrees": False}
    if table_placement == DETECTED:
        return {**found, "table": None, "agrees": None}
    return {**found, "table": table_placement, "agrees": found["placement"] == table_placement}


def model_section(loaded, opts: HFOptions, max_positions: int | None, run_dir: Path) -> dict:
    """``results["model"]``: the zoo's keys where they have a meaning, plus what was detected."""
    config, spec, files = loaded.model.config, loaded.spec, loaded.files
    d_model = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    return {
        "source": opts.provenance if opts.provenance is not None else f"hf:{portable_path(opts.path.resolve(), run_dir)}",
        "architecture": spec.model_type,
        "architectures": list(files.config.get("architectures") or []),
        "model_class": type(loaded.model).__name__,
        **spec.describe(),
        "detected_from": "config.json model_type (quantnorm.hf.loader.ARCHITECTURES)",
        "placement_check": loaded.placement_check,
        "n_layers": len(loaded.layers),
        "d_model": d_model,
        "n_heads": getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None),
        "context": max_positions,
        "vocab_size": getattr(config, "vocab_size", None),
        "n_params": int(loaded.n_params()),
        "weights": files.weights,
        "mlm_head": files.mlm_head,
        "pooling": files.pooling if spec.kind == "encoder" else None,
        "dtype": "float32",
        "attn_implementation": "eager",
    }


def measure_outliers_hf(loaded, run_dir: Path, fp32_path: Path, int8_paths: dict[str, Path], inputs,
                        fp32_sources: dict[str, Path] | None = None) -> dict:
    """The ``outliers``, ``sqnr`` and ``sqnr_summary`` sections, and the heat map of the layer with
    the largest max/median ratio (as the zoo's ``evaluate.measure_outliers``)."""
    from ..measure.sqnr import matmul_input_modules, sqnr_sections
    from ..plots import plot_activation_heatmap
    from .probe import heatmap_layer, probe_hf

    report, first_window = probe_hf(loaded, inputs)
    matmul_inputs = matmul_input_modules(fp32_path, loaded.model)
    sqnr_inputs = inputs[:8]
    sqnr, summaries = sqnr_sections(fp32_path, int8_paths, sqnr_inputs, matmul_inputs, fp32_sources)
    layer = heatmap_layer(report["residual"])
    if layer in first_window:
        plot_activation_heatmap(first_window[layer], run_dir / PLOTS_DIR / "heatmap.png",
                                f"|a| of the residual stream after layer {layer} (first evaluation window)")
        report["heatmap_layer"] = layer
    return {"outliers": report, "sqnr": sqnr, "sqnr_summary": summaries}


def evaluate_from_cli(model_path: Path, cfg, flags: dict, *, checkpoint, out, allow_pickle: bool,
                      command: str) -> str:
    """The ``evaluate --model`` branch of the CLI: check the flag combination, run, summarize."""
    if checkpoint is not None:
        raise ConfigError("give either --model (a Hugging Face checkpoint) or --checkpoint (a trained run), not both")
    if flags.get("placement") is not None or flags.get("norm") is not None:
        raise ConfigError("--placement/--norm are detected from the checkpoint with --model; leave them out")
    window = int(flags.get("context") or 128)
    eval_tokens = flags.get("eval_tokens")
    max_eval_windows = HFOptions.max_eval_windows if eval_tokens is None else max(2, int(eval_tokens) // window)
    provenance = None
    model_path = Path(model_path)
    if is_gguf_path(model_path):
        # A GGUF file: dequantize once into <run dir>/checkpoint, then the same pipeline reads it.
        gguf = resolve_gguf(model_path, progress=cfg.progress)
        out = check_out_dir(out or Path("runs") / f"gguf-{gguf_run_name(gguf.provenance.file)}")
        model_path = gguf_checkpoint(gguf, out, progress=cfg.progress)
        provenance = gguf.provenance.to_dict()
    opts = HFOptions(path=Path(model_path), allow_pickle=allow_pickle, corpus=flags.get("corpus") or BUILTIN_PYDOC,
                     window=window, out_dir=out, max_eval_windows=max_eval_windows, provenance=provenance)
    results, run_dir = evaluate_hf(opts, cfg, command=command)
    return summary_lines_hf(results, run_dir)


def gguf_run_name(file_name: str) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct.q4_1`` (a run directory name)."""
    stem = file_name[: -len(".gguf")] if file_name.endswith(".gguf") else file_name
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in stem).lower()


def summary_lines_hf(results: dict, run_dir: Path) -> str:
    m = results["model"]
    check = "verified" if m.get("placement_check", {}).get("verified") else "NOT verified"
    lines = [f"{run_dir}: results.json and report.md written",
             f"  {m['architecture']}: {m['placement']}/{m['norm']} ({check}), {m['n_params']:,} parameters"]
    for r in results["recipes"]:
        a = r.get("accuracy")
        if not a:
            lines.append(f"  {r['name']:<34} {r['status']}")
        elif "cosine_mean" in a:
            nn = a.get("nn_agreement")
            lines.append(f"  {r['name']:<34} cosine mean {a['cosine_mean']:.5f}  p1 {a['cosine_p1']:.5f}  "
                         f"NN agreement {'–' if nn is None else f'{100 * nn:.1f}%'}"
                         + (f"  MLM PPL ratio {a['ppl_ratio']:.4f}" if a.get("mlm") else ""))
        else:
            lines.append(f"  {r['name']:<34} PPL ratio {a['ppl_ratio']:.4f}  KL mean {a['kld_mean']:.2e}  "
                         f"top-1 {100 * a['top1_agreement']:.2f}% (token-level)")
    o = results.get("outliers")
    if o and o.get("summary", {}).get("largest_ratio"):
        lr = o["summary"]["largest_ratio"]
        lines.append(f"  largest residual max/median {lr['ratio']:.1f} at layer {lr['layer']}; massive entries: "
                     f"{o.get('massive_total', 0)}")
    return "\n".join(lines)
