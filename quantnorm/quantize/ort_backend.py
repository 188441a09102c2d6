"""ONNX Runtime backend: turn a ``Recipe`` into an INT8 model file, then check it.

Steps: the pre-processing ORT recommends (its basic graph optimization, then ONNX shape inference;
``_preprocess``) into a temporary directory, once per FP32 model when a ``PreprocessCache`` is
shared by the recipes of one run; pick the nodes to quantize from that graph; ``quantize_static``
(QDQ), ``quantize_dynamic``, the per-token rewrite (``pertoken``) or MatMulNBits (``weight_only``);
``sanity_check``; copy the model to ``out_path`` atomically.

A model that quantizes but fails the sanity check is still written (so the damage can be
measured) and comes back with ``status = "broken: <first problem>"``; a quantizer that refuses
because a calibrated range is not finite also gives ``broken`` (and no file). Any other
exception from ONNX Runtime is a ``QuantizeError``: the caller decides whether to go on.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..calibration import get_calibration_method
from ..calibration.ranges import collect_ranges, method_details
from ..calibration.shape_infer import ort_loads_fast
from ..errors import ConfigError, QuantizeError
from ..fileio import atomic_path, onnx_needs_external_data
from ..measure.fp16_check import graph_fp16_range
from ..measure.graph_probe import graph_probe
from ..measure.placement import find_norms
from ..measure.sessions import CPU
from ..onnx_wire import model_with_weights_by_reference
from ..transforms.gptq import (
    ABS_HISTOGRAM_BINS,
    GPTQCodes,
    LazyHessians,
    collect_activation_stats,
    collect_hessians,
    matmul_inputs,
    mse_clip,
    windows_digest,
)
from ..transforms.rotation import ONLINE_ROTATION_MARKER
from .embedding import quantize_embedding
from .fp16 import convert_fp16
from .ort_weights import ort_quantizes_weights_fast
from .pertoken import ACT_QMAX, ACT_ZERO_POINT, EPS, quantize_per_token, weight_qmax
from .recipes import Recipe
from .sanity import sanity_check
from .weight_only import activation_blocks, quantize_weight_only

DEFAULT_CALIB_BATCH = 4


@dataclass
class QuantizeResult:
    recipe: str
    path: Path | None
    settings: dict
    status: str                  # "ok" or "broken: <reason>"
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self, run_dir: Path | None = None) -> dict:
        """A ``recipes[]`` entry of results.json without the accuracy (measure adds that)."""
        path = None
        if self.path is not None:
            path = Path(self.path)
            if run_dir is not None:
                path = Path(os.path.relpath(path.resolve(), Path(run_dir).resolve()))
            path = path.as_posix()
        return {"name": self.recipe, "path": path, "settings": dict(self.settings),
                "status": self.status, "problems": list(self.problems)}


class PreprocessCache:
    """The pre-processed copy of each FP32 model, made once and shared by every recipe that
    quantizes it (the pre-processing of a 1 GB graph costs tens of seconds and a few GB of memory
    each time). The copies live in a temporary directory removed by ``close()`` (or the ``with``
    block). A model file changed since its copy was made (size or mtime) is pre-processed again.
    ``gptq_codes``: the GPTQ codes its recipes solve, shared the same way (pass another cache's
    to share them across caches: the with-past graphs read the whole-window graphs' codes)."""

    def __init__(self, gptq_codes: GPTQCodes | None = None):
        self.gptq_codes = gptq_codes if gptq_codes is not None else GPTQCodes()
        self._tmp = tempfile.TemporaryDirectory(prefix="quantnorm-pre-")
        self._made: dict[tuple, Path] = {}
        self._ranges: dict[tuple, object] = {}
        self.ranges_reused = 0   # calibrations answered from the cache (tests read it)

    def ranges(self, key: tuple, compute):
        """The calibrated ranges for ``key`` (the pre-processed model, the method and its settings,
        the calibration windows' digest), computed by ``compute()`` once per run: MinMax with
        per-channel and per-tensor weights calibrates the same activations, and a calibration of
        Gemma 3 costs about a minute."""
        if key not in self._ranges:
            self._ranges[key] = compute()
        else:
            self.ranges_reused += 1
        return self._ranges[key]

    def get(self, src: Path) -> Path:
        st = Path(src).stat()
        key = (str(Path(src).resolve()), st.st_size, st.st_mtime_ns)
        if key not in self._made:
            work = Path(self._tmp.name) / f"m{len(self._made)}"
            work.mkdir()
            self._made[key] = _preprocess(Path(src), work / "preprocessed.onnx")
        return self._made[key]

    def close(self) -> None:
        self._made.clear()
        self._ranges.clear()
        self._tmp.cleanup()

    def __enter__(self) -> PreprocessCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quantize(fp32_path: Path, recipe: Recipe, calib_inputs: np.ndarray | None, out_path: Path, *,
             vnni: bool, probe_inputs: np.ndarray, calib_batch_size: int = DEFAULT_CALIB_BATCH,
             progress: bool = False, preprocessed: PreprocessCache | None = None,
             diagnostics: bool = True) -> QuantizeResult:
    """Quantize the FP32 model at ``fp32_path`` with ``recipe`` into ``out_path``.

    ``calib_inputs``: int64 windows [n, seq] from the calibration split (static recipes only;
    see ``calibration.calibration_windows``). ``vnni`` resolves ``reduce_range="auto"``.
    ``probe_inputs``: windows the sanity check runs (any split; only finiteness is checked).
    ``preprocessed``: a cache shared by the recipes of one run (None: pre-process for this call).
    ``diagnostics``: False skips what a recipe measures beside its model (accuracy_level 4's
    per-block inputs), for a caller that records none of it. GPTQ codes already solved for the
    same weights on the same windows are read from ``preprocessed.gptq_codes``, new ones kept there.
    """
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    if not fp32_path.is_file():
        raise ConfigError(f"FP32 model not found: {fp32_path} (export the model first)")
    if recipe.mode == "static" and (calib_inputs is None or len(calib_inputs) == 0):
        raise ConfigError(f"recipe {recipe.name} is static and needs calibration windows (got none)")
    settings = recipe.settings(vnni)
    if recipe.mode == "fp16":
        return _fp16_variant(fp32_path, recipe, out_path, probe_inputs, settings)

    with tempfile.TemporaryDirectory(prefix="quantnorm-quant-") as tmp_dir, \
            contextlib.ExitStack() as own:
        cache = preprocessed if preprocessed is not None else own.enter_context(PreprocessCache())
        pre_path = cache.get(fp32_path)
        settings["preprocess"] = PREPROCESS_STEPS
        carriers: list[str] = []
        if recipe.carriers is not None:   # before our copy of the graph: the probe loads its own
            carriers, settings["carriers_found"] = find_carriers(pre_path, calib_inputs)
        to_quantize, excluded, normed = _nodes_to_quantize(pre_path, fp32_path.name, recipe, carriers, settings)
        q_path = Path(tmp_dir) / "quantized.onnx"
        if recipe.mode == "weight-only":
            with _quiet(), warnings.catch_warnings():
                warnings.simplefilter("ignore")   # HQQ's torch.from_numpy on a read-only array
                settings.update(quantize_weight_only(pre_path, q_path, recipe, to_quantize, calib_inputs))
            blocks = activation_blocks(pre_path, recipe, settings["quantized_nodes"], calib_inputs, cache) \
                if diagnostics else None
            if blocks is not None:
                settings["activation_blocks"] = blocks
            problems = []
        elif recipe.mode == "pertoken":
            settings.update(_quantize_pertoken(pre_path, q_path, recipe, to_quantize, normed, calib_inputs, settings,
                                               cache.gptq_codes, fp32_path.name))
            problems = []
        else:
            problems, made = _static_quantize(pre_path, q_path, recipe, settings, calib_inputs, to_quantize,
                                              excluded, carriers, calib_batch_size, progress, cache)
            if not made:
                return QuantizeResult(recipe.name, None, settings, f"broken: {problems[0]}", problems)
        if recipe.embedding_bits:
            settings["embedding"] = quantize_embedding(q_path)
        # The sanity problems name the damage (an inf scale), the quantizer's warnings only hint at it: first.
        problems = sanity_check(q_path, probe_inputs) + problems
        with atomic_path(out_path, suffix=".onnx") as final_tmp:
            _move(q_path, final_tmp)
    status = "ok" if not problems else f"broken: {problems[0]}"
    return QuantizeResult(recipe.name, out_path, settings, status, problems)


def _nodes_to_quantize(pre_path: Path, model_name: str, recipe: Recipe, carriers: list[str],
                       settings: dict) -> tuple[list[str], list[str], dict[str, tuple[str, int]]]:
    """(the weight MatMuls to quantize, the nodes excluded, the norm outputs they read where the
    recipe calibrates those); records both lists in ``settings``."""
    # the graph alone: nodes, names and shapes are all that is read here (Gemma 3's
    # pre-processed graph holds 1.7 GB of weights)
    model = onnx.ModelProto.FromString(model_with_weights_by_reference(pre_path))
    graph = model.graph
    excluded = resolve_exclusions(graph, recipe.excluded)
    if recipe.carriers == "fp32":
        excluded += [n for n in carriers if n not in excluded]
    to_quantize = weight_matmuls(graph) if recipe.op_scope == "matmul" else []
    if recipe.op_scope == "matmul":
        to_quantize = [n for n in to_quantize if n not in set(excluded)]
        if not to_quantize:
            raise ConfigError(
                f"recipe {recipe.name} has nothing to quantize in {model_name}: no MatMul with a "
                "weight initializer is left" + (" after the exclusions" if excluded else "")
            )
    settings["excluded_nodes_resolved"] = excluded
    normed = norm_output_inputs(model, to_quantize) if recipe.norm_inputs == "calibrated" else {}
    if to_quantize:
        settings["quantized_nodes"] = to_quantize
    return to_quantize, excluded, normed


def _static_quantize(pre_path: Path, q_path: Path, recipe: Recipe, settings: dict, calib_inputs,
                     to_quantize: list[str], excluded: list[str], carriers: list[str], calib_batch_size: int,
                     progress: bool, cache: PreprocessCache) -> tuple[list[str], bool]:
    """ORT's quantizer (then per-token carriers where the recipe says so) into ``q_path``.
    Returns (its problems, whether it wrote the model: not where calibration met an inf)."""
    try:
        per_token_carriers = recipe.carriers == "pertoken"
        static_nodes = [n for n in to_quantize if n not in carriers] if per_token_carriers else to_quantize
        problems = _run_quantizer(pre_path, q_path, recipe, settings, calib_inputs, static_nodes,
                                  excluded + (carriers if per_token_carriers else []),
                                  calib_batch_size, progress, cache)
        if per_token_carriers and carriers:
            # the carriers are still FP32 MatMuls with their weights in the QDQ graph: per token now
            per_token = q_path.parent / "carriers-pertoken.onnx"
            unsigned = settings["unsigned_pertoken_weights"]
            settings["carriers_pertoken"] = quantize_per_token(q_path, per_token, carriers, fused=True,
                                                               reduce_range=settings["reduce_range"] and not unsigned,
                                                               unsigned_weights=unsigned)
            per_token.replace(q_path)
        return problems, True
    except ValueError as exc:
        if not _is_non_finite_range(exc):
            raise QuantizeError(f"ONNX Runtime failed to quantize with recipe {recipe.name}: {exc}") from exc
        return [f"calibration failed: {exc} (a calibrated tensor holds inf; see PITFALLS.md 1)"], False
    except (ConfigError, QuantizeError):
        raise
    except Exception as exc:
        raise QuantizeError(f"ONNX Runtime failed to quantize with recipe {recipe.name}: {exc}") from exc


def _fp16_variant(fp32_path: Path, recipe: Recipe, out_path: Path, probe_inputs: np.ndarray,
                  settings: dict) -> QuantizeResult:
    """The float16 copy of the FP32 model, checked like an INT8 one (finite outputs on the probe
    windows), with the FP32 tensors that pass float16's range on one window: the CPU provider
    computes float16 in float32 and hides an overflow that a GPU would show."""
    convert_fp16(fp32_path, out_path)
    settings["fp16_range"] = graph_fp16_range(fp32_path, probe_inputs[:1])
    problems = sanity_check(out_path, probe_inputs)
    status = "ok" if not problems else f"broken: {problems[0]}"
    return QuantizeResult(recipe.name, out_path, settings, status, problems)


def _move(src: Path, dst: Path) -> None:
    """``src`` to ``dst``: a rename where both sit on one filesystem (the temporary directory
    usually does), a copy where they do not (an INT8 Gemma 3 is 940 MB)."""
    try:
        os.replace(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _quantize_pertoken(pre_path: Path, q_path: Path, recipe: Recipe, to_quantize: list[str],
                       normed: dict[str, tuple[str, int]], calib_inputs, settings: dict, gptq_codes: GPTQCodes,
                       model_name: str) -> dict:
    """The per-token rewrite of ``to_quantize`` into ``q_path``, calibrated as the recipe asks;
    GPTQ codes already in ``gptq_codes`` (same weight, same windows) are read, not solved."""
    hessians, scales = _pertoken_calibration(pre_path, recipe, to_quantize, normed, calib_inputs, settings, gptq_codes)
    digest = windows_digest(calib_inputs) if hessians is not None else None
    try:
        done = quantize_per_token(pre_path, q_path, to_quantize, reduce_range=settings["reduce_range"],
                                  unsigned_weights=settings["unsigned_pertoken_weights"],
                                  fused=recipe.pertoken_kernel == "ort-fused", hessians=hessians,
                                  calibrated_scales=scales, gptq_codes=gptq_codes, calib_digest=digest)
    except ValueError as exc:  # a graph the rewrite cannot take (too old an opset)
        raise QuantizeError(f"recipe {recipe.name} cannot quantize {model_name}: {exc}") from exc
    if isinstance(hessians, LazyHessians):   # the pass ran only if a weight's codes were not known
        if hessians.rows is not None:
            gptq_codes.rows[digest] = hessians.rows
        done["gptq_calibration_positions"] = gptq_codes.rows.get(digest)
    return done


def _pertoken_calibration(pre_path: Path, recipe: Recipe, to_quantize: list[str], normed: dict[str, tuple[str, int]],
                          calib_inputs, settings: dict, gptq_codes: GPTQCodes
                          ) -> tuple[Mapping | None, dict[str, float] | None]:
    """What a per-token recipe reads from the calibration windows, in one pass of the FP32 graph:
    GPTQ's ``X^T X`` per MatMul input, and for the norm outputs in ``normed`` (calibrated recipes)
    one scale each. Returns (hessians or None, scales or None); records both in ``settings``.
    With no norm scales to calibrate, the hessians are :class:`LazyHessians`: the pass runs only
    if a weight's codes are not already in ``gptq_codes``."""
    gptq = recipe.weight_rounding == "gptq"
    if recipe.norm_inputs == "calibrated" and not normed:
        settings["norm_input_scales"] = {"rule": "no quantized MatMul reads a norm output here: every "
                                                 "input is quantized per token"}
    if not (gptq or normed):
        return None, None
    if calib_inputs is None or len(calib_inputs) == 0:
        raise ConfigError(f"recipe {recipe.name}: {'GPTQ rounding' if gptq else 'calibrated norm-input scales'}"
                          " needs calibration windows (got none)")
    tensors = sorted(set(matmul_inputs(pre_path, to_quantize).values())) if gptq else []
    if gptq and not normed:
        hessians = LazyHessians(tensors, lambda: collect_hessians(pre_path, tensors, calib_inputs))
        if not gptq_codes.knows(pre_path, to_quantize, weight_qmax(settings["reduce_range"]),
                                windows_digest(calib_inputs)):
            hessians.load()   # now, before the rewrite loads the model: the graph pass and the model never share memory
        return hessians, None
    # A row of RMS 1 has no entry above sqrt(width): the histograms' range.
    bound = {x: float(np.sqrt(width)) for x, (_, width) in normed.items()}
    hessians, abs_stats, rows = collect_activation_stats(pre_path, calib_inputs, hessians_of=tensors,
                                                         abs_max_of=sorted(normed), histogram_range=bound)
    if gptq:
        settings["gptq_calibration_positions"] = gptq_codes.rows[windows_digest(calib_inputs)] = rows
    if not normed:
        return hessians, None
    clips = {x: min(mse_clip(st["histogram"], bound[x], ACT_QMAX), st["max_abs"]) for x, st in abs_stats.items()}
    settings["norm_input_scales"] = {
        "rule": f"one scale per norm-output tensor: clip / {ACT_QMAX}, zero point {ACT_ZERO_POINT}, the clip "
                f"minimizing the squared error over a {ABS_HISTOGRAM_BINS}-bin histogram of |x| on "
                "[0, sqrt(width)] from the calibration windows (values beyond saturate)",
        "calibration_positions": rows,
        "tensors": {x: {"max_abs": abs_stats[x]["max_abs"], "clip": clips[x], "norm": normed[x][0]}
                    for x in sorted(abs_stats)}}
    return (hessians if gptq else None), {x: max(c, EPS) / ACT_QMAX for x, c in clips.items()}


CARRIER_PROBE_WINDOWS = 8


def find_carriers(fp32_path: Path, calib_inputs: np.ndarray) -> tuple[list[str], dict]:
    """The weight MatMuls whose input carries a massive activation (Sun et al.: |a| > 100 and
    >= 1000x the median of its tensor, at a position where the residual stream has one), found by
    the graph probe on the first calibration windows: a calibration-time choice, never the
    evaluation text. Returns (node names, what was found for ``settings``)."""
    windows = np.asarray(calib_inputs)[:CARRIER_PROBE_WINDOWS]
    report, _ = graph_probe(fp32_path, windows)
    rows = [r for r in report["matmul_inputs"] if r.get("carries_massive")]
    nodes = [n for r in rows for n in r["modules"]]
    return nodes, {"rule": "weight-MatMul inputs whose largest |a| is a massive activation of the residual stream's "
                           f"positions (graph probe on {len(windows)} calibration windows)",
                   "nodes": nodes,
                   "inputs": [{"tensor": r["tensor"], "max_abs": r["top"][0]["value"] if r.get("top") else None,
                               "position": r["top"][0]["position"] if r.get("top") else None} for r in rows]}


def norm_output_inputs(model: onnx.ModelProto, nodes: list[str]) -> dict[str, tuple[str, int]]:
    """The inputs of ``nodes`` that are a normalization's output (after its per-channel weight),
    as the placement detector finds norms in the graph: tensor -> (the norm's kind, its width K,
    read off the weight [K, N] of the MatMul that reads it)."""
    outputs = {n.output: n.kind for n in find_norms(model)}
    widths = {i.name: int(i.dims[0]) for i in model.graph.initializer if len(i.dims) == 2}
    wanted = set(nodes)
    return {n.input[0]: (outputs[n.input[0]], widths[n.input[1]]) for n in model.graph.node
            if n.name in wanted and len(n.input) > 1 and n.input[0] in outputs and n.input[1] in widths}


def weight_matmuls(graph: onnx.GraphProto) -> list[str]:
    """Names of the MatMul nodes whose second input is a weight initializer.

    These are the Linear layers and the LM head; ``q @ k^T`` and ``probs @ v`` multiply two
    activations and are left out, so attention scores are never calibrated. (Initializers only,
    as ORT's own ``MatMulConstBOnly`` test; ``quant_pre_process`` folds Constant nodes into them.)
    """
    weights = {init.name for init in graph.initializer}
    return [n.name for n in graph.node if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in weights
            and ONLINE_ROTATION_MARKER not in n.name]


def resolve_exclusions(graph: onnx.GraphProto, patterns: tuple[str, ...]) -> list[str]:
    """Node names matched by ``patterns`` (exact names or fnmatch patterns), in graph order.

    A pattern that matches nothing is a ``ConfigError``: a typo must not silently quantize the
    layer the user meant to keep in FP32.
    """
    names = [n.name for n in graph.node]
    matched: list[str] = []
    for pattern in patterns:
        hits = [name for name in names if name == pattern or fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            examples = ", ".join(n.name for n in graph.node if n.op_type == "MatMul")[:300]
            raise ConfigError(f"exclusion {pattern!r} matches no node of the model (MatMul nodes: {examples})")
        matched += [h for h in hits if h not in matched]
    return [name for name in names if name in set(matched)]


PREPROCESS_STEPS = "ORT basic optimization + onnx shape inference (symbolic shape inference skipped)"


def _preprocess(src: Path, dst: Path) -> Path:
    """What ORT's ``quant_pre_process(skip_symbolic_shape=True)`` does, file to file: ORT's basic
    graph optimization, then ONNX's shape inference. Written here because ``quant_pre_process`` first loads the whole model into Python
    and keeps it alive while ORT loads and optimizes its own copy: one FP32-sized copy more at the
    memory peak of every recipe (1 GB for Gemma 3 270M). Symbolic shape inference is skipped: it
    fails on the dynamo exporter's graphs ("Incomplete symbolic shape inference", ORT 1.31), and
    ONNX's shape inference gives every weight MatMul its shapes. ``dst`` is the graph alone: its
    weights stay in ``optimized.onnx`` beside it (a graph past 2 GB: ``optimized.onnx.data``), read
    where they are, so that directory must stay whole. Returns ``dst``."""
    import onnxruntime as ort

    optimized = dst.with_name("optimized.onnx")
    with _quiet():
        try:
            options = ort.SessionOptions()
            options.optimized_model_filepath = str(optimized)
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            options.log_severity_level = 3   # errors only, as every session of ours
            if onnx_needs_external_data(src):
                options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                                 "optimized.onnx.data")
            session = ort.InferenceSession(str(src), options, providers=[CPU])
            del session
            # Shape inference on the graph alone: dst references the weights in optimized.onnx (or
            # its .data file) in the same directory, where infer_shapes_path wrote and read back a
            # second copy of them (1.7 GB for Gemma 3).
            graph = onnx.ModelProto.FromString(model_with_weights_by_reference(optimized))
            onnx.save(onnx.shape_inference.infer_shapes(graph), str(dst))
        except Exception as exc:
            raise QuantizeError(f"pre-processing {src.name} for quantization failed (ORT's optimizer or ONNX "
                                f"shape inference): {exc}") from exc
    return dst


def _run_quantizer(pre_path: Path, q_path: Path, recipe: Recipe, settings: dict, calib_inputs,
                   to_quantize: list[str], excluded: list[str], calib_batch_size: int, progress: bool,
                   cache: PreprocessCache) -> list[str]:
    """Calibrate and call quantize_static, or call quantize_dynamic; returns the RuntimeWarnings
    raised meanwhile (numpy's "invalid value encountered in divide" is how an inf range shows)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.calibrate import save_tensors_data

    reduce_range = settings["reduce_range"]
    op_types = None if recipe.op_scope == "all" else ["MatMul"]  # None: ORT's full default list
    extra = {"WeightSymmetric": True, "MatMulConstBOnly": recipe.op_scope == "matmul"}
    if recipe.op_scope == "matmul":
        # Keep MatMul outputs in float: only the inputs need INT8 for the integer kernel, and a QDQ
        # on an output quantizes the logits themselves (8-bit logits cost ~1 point of top-1).
        extra["OpTypesToExcludeOutputQuantization"] = ["MatMul"]
    log: list[str] = []
    # ort_loads_fast: ORT's loader without its shape-inferred copy of the model on disk (calibration.shape_infer);
    # ort_quantizes_weights_fast: per-channel weights in one numpy pass, not one Python call per channel
    with _quiet(log), warnings.catch_warnings(record=True) as caught, ort_loads_fast(), ort_quantizes_weights_fast():
        warnings.simplefilter("always")
        if recipe.mode == "static":
            extra["ActivationSymmetric"] = recipe.symmetric_activations
            settings["calibration_details"] = {
                "samples": len(calib_inputs), "window": int(np.asarray(calib_inputs).shape[1]),
                **method_details(recipe.calibration, recipe.percentile),
            }
            # Our calibration (see calibration/ranges.py), handed over through ORT's cache file.
            # matmul scope keeps MatMul outputs in float: only their inputs need ranges
            windows = np.ascontiguousarray(calib_inputs, dtype=np.int64)
            common = dict(op_types=recipe.op_types(), batch_size=calib_batch_size, progress=progress,
                          inputs_only=recipe.op_scope == "matmul")
            # One calibration per method and setting in a run (the cache's key): the MinMax ranges
            # serve both weight granularities and the histogram methods' pre-pass as well.
            digest = (str(pre_path), tuple(recipe.op_types() or ()), recipe.op_scope == "matmul", calib_batch_size,
                      windows.shape, hashlib.sha256(windows.tobytes()).hexdigest())

            def minmax():
                return cache.ranges(("minmax", *digest), lambda: collect_ranges(pre_path, "minmax", windows, **common))

            ranges = minmax() if recipe.calibration == "minmax" else cache.ranges(
                (recipe.calibration, recipe.percentile, *digest),
                lambda: collect_ranges(pre_path, recipe.calibration, windows, percentile=recipe.percentile,
                                       minmax=minmax, **common))
            cache = q_path.with_suffix(".calibration.json")
            save_tensors_data(ranges, cache)
            quantize_static(
                str(pre_path), str(q_path), None,
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=op_types,
                per_channel=recipe.per_channel,
                reduce_range=reduce_range,
                activation_type=QuantType.QInt8 if recipe.symmetric_activations else QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                nodes_to_quantize=to_quantize or None,
                nodes_to_exclude=excluded or None,
                calibrate_method=get_calibration_method(recipe.calibration),
                extra_options=extra,
                calibration_cache_path=str(cache),
            )
        else:
            quantize_dynamic(
                str(pre_path), str(q_path),
                op_types_to_quantize=op_types,
                per_channel=recipe.per_channel,
                reduce_range=reduce_range,
                weight_type=QuantType.QInt8,
                nodes_to_quantize=to_quantize or None,
                nodes_to_exclude=excluded or None,
                extra_options=extra,
            )
    if log:
        settings["quantizer_log"] = log
    problems = []
    for w in caught:
        if issubclass(w.category, RuntimeWarning):
            text = f"quantizer warning: {w.message}"
            if text not in problems:
                problems.append(text)
    return problems


def _is_non_finite_range(exc: ValueError) -> bool:
    """ORT's words when a calibrated range holds inf ("supplied range of [-inf, inf] is not finite"):
    the model is broken by what it computes, not by a bug, so it is a broken recipe, not an error."""
    text = str(exc).lower()
    return "not finite" in text or "range of [" in text and ("inf" in text or "nan" in text)


class _LogCollector(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)


@contextlib.contextmanager
def _quiet(log: list[str] | None = None):
    """ORT's calibrators print progress lines to stdout and its quantizer logs warnings to the
    root logger (e.g. "Axis 1 is out-of-range for weight ..." for per-channel norm weights).
    Keep the CLI's output clean; the log warnings are kept in ``log`` for the settings record."""
    root = logging.getLogger()
    collector = _LogCollector()
    saved = root.handlers[:]
    root.handlers = [collector]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.handlers = saved
        if log is not None:
            log.extend(m for m in collector.messages if m not in log)
