"""Run a calibration method over calibration windows and return the tensor ranges.

We drive ONNX Runtime's calibrators ourselves (instead of letting ``quantize_static`` do it) so
that each method runs with settings that make it what its name says (see ``entropy.py``: ORT's
built-in entropy settings reduce it to MinMax), and so that the ranges can be saved and handed
to ``quantize_static`` through its calibration cache.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization.calibrate import CalibraterBase, HistogramCollector, create_calibrator
from tqdm import tqdm

from ..feeds import window_feeder
from ..fileio import onnx_needs_external_data, release_memory
from ..providers import CPU
from . import WindowCalibrationReader, get_calibration_method
from .entropy import ENTROPY_NUM_BINS, ENTROPY_QUANTIZED_BINS, fast_entropy_collector
from .shape_infer import calibrator_beside, ort_loads_fast

HISTOGRAM_BINS = 2048  # percentile and distribution: ORT's defaults
SINK_POSITIONS = (0,)  # the first token: BOS, the attention sink that carries massive activations
CALIBRATION_BUFFER_BYTES = 1 << 30  # collected tensors held at once before they are folded in


def batch_bytes(session, inputs: np.ndarray, batch_size: int) -> int:
    """Bytes of one batch's outputs of the (augmented) calibration session: every output's static
    dimensions times batch x sequence for its symbolic ones (float32)."""
    rows = int(batch_size) * int(np.asarray(inputs).shape[1])
    total = 0
    for out in session.get_outputs():
        dims = [d for d in (out.shape or []) if isinstance(d, int) and d > 0]
        symbolic = len(out.shape or []) - len(dims)
        size = int(np.prod(dims)) if dims else 1
        total += size * (rows if symbolic else 1) * 4
    return total


def method_details(method: str, percentile: float = 99.999) -> dict:
    """What a method ran with, for the settings record of results.json."""
    if method == "entropy":
        return {"num_bins": ENTROPY_NUM_BINS, "num_quantized_bins": ENTROPY_QUANTIZED_BINS,
                "threshold_search": "quantnorm (TensorRT/MXNet KL search)"}
    if method == "percentile":
        return {"num_bins": HISTOGRAM_BINS, "percentile": percentile, "symmetric_range": True}
    if method == "minmax-nosink":
        return {"excluded_positions": list(SINK_POSITIONS),
                "rule": "min/max over every token position but these (the sink's values are clipped to that range)"}
    if method == "distribution":
        # For INT8 ORT uses the histogram's edges, i.e. [-max|x|, max|x|]: a symmetric MinMax.
        return {"num_bins": HISTOGRAM_BINS, "int8_range": "[-max|x|, max|x|]"}
    return {}


@contextlib.contextmanager
def _calibrating_inputs_only(enabled: bool) -> Iterator[None]:
    """While active, ORT's calibrators pick only the *inputs* of the calibrated node types.

    Why: a recipe that quantizes MatMul inputs and keeps MatMul outputs in float (the matmul-scope
    recipes) never reads an output's range, yet ORT calibrates inputs and outputs alike. The
    largest output is the LM head's, the logits (262,144 wide on Gemma 3: 134 MB a window), whose
    histograms cost most of an entropy or percentile calibration's time and memory for nothing.
    The ranges of the tensors that are quantized do not change: each is reduced on its own."""
    if not enabled:
        yield
        return
    original = CalibraterBase.select_tensors_to_calibrate

    def inputs_only(self, model):
        tensors, value_infos = original(self, model)
        read = {i for n in model.graph.node
                if not self.op_types_to_calibrate or n.op_type in self.op_types_to_calibrate for i in n.input}
        return {t for t in tensors if t in read}, value_infos

    CalibraterBase.select_tensors_to_calibrate = inputs_only
    try:
        yield
    finally:
        CalibraterBase.select_tensors_to_calibrate = original


@contextlib.contextmanager
def _sessions_without_memory_pattern() -> Iterator[None]:
    """While active, ORT's calibrators open their session as ORT does (graph optimizations off, so
    every calibrated tensor exists), but with the memory pattern off.

    Why: with the pattern on, ORT's CPU arena grew by 4.5 GB over the first two batches of 4
    windows on Gemma 3 with every op calibrated (one planned block per run beside what the arena
    already held; the logits alone are 512 MiB a batch); off, by 3.0 GB, at the same speed.
    The pattern only places buffers: the values, and so the ranges, are the same."""
    original = CalibraterBase.create_inference_session

    def without_pattern(self):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.enable_mem_pattern = False
        options.log_severity_level = 3   # errors only, as every session of ours
        self.infer_session = ort.InferenceSession(self.augmented_model_path, sess_options=options,
                                                  providers=self.execution_providers)

    CalibraterBase.create_inference_session = without_pattern
    try:
        yield
    finally:
        CalibraterBase.create_inference_session = original


def collect_ranges(model_path: str | Path, method: str, inputs: np.ndarray, *, op_types: list[str] | None,
                   percentile: float = 99.999, batch_size: int = 4, progress: bool = False,
                   buffer_bytes: int = CALIBRATION_BUFFER_BYTES, inputs_only: bool = False, minmax=None):
    """Calibrate ``model_path`` on ``inputs`` [n, seq] and return ORT's ``TensorsData``.

    ``op_types``: the node types whose inputs/outputs are calibrated (None: ORT's default list).
    ``inputs_only``: calibrate only their inputs (for recipes that keep those nodes' outputs in
    float; see ``_calibrating_inputs_only``).
    ``minmax``: a callable returning this very call's MinMax ranges (same model, windows, op types),
    for the histogram methods' pre-pass when the windows take several chunks; a run that already
    calibrated MinMax hands its ranges over instead of computing them again (None: computed here).
    Raises ORT's ``ValueError`` ("... range of [-inf, inf] is not finite") when a histogram
    method meets an infinite tensor; callers turn that into a broken recipe.
    """
    calibrate_method = get_calibration_method(method)
    if method == "minmax-nosink":
        return collect_ranges_without_positions(model_path, inputs, op_types=op_types, skip_positions=SINK_POSITIONS,
                                                batch_size=batch_size, progress=progress, inputs_only=inputs_only)
    with tempfile.TemporaryDirectory(prefix="quantnorm-calib-") as tmp:
        def make_calibrator():
            return _make_calibrator(model_path, method, calibrate_method, op_types, percentile, inputs_only, Path(tmp))

        calibrator = make_calibrator()
        feed = window_feeder(calibrator.infer_session)
        reader = WindowCalibrationReader(inputs, batch_size=batch_size, feed=feed)
        # A batch whose collected tensors alone pass the buffer is split: on Gemma 3 with every op
        # calibrated, one batch of 4 windows holds 512 MiB of logits plus every block's tensors. The
        # ranges do not depend on how the windows are batched (MinMax reduces, histograms add).
        per_window = batch_bytes(calibrator.infer_session, inputs, 1)
        if batch_size > 1 and per_window * batch_size > buffer_bytes:
            batch_size = max(1, int(buffer_bytes // max(1, per_window)))
            reader = WindowCalibrationReader(inputs, batch_size=batch_size, feed=feed)
        # Streamed: ORT's calibrators keep every batch's tensors (the logits too) until
        # ``collect_data`` returns, which peaked near 21 GB on SmolLM2 (PITFALLS.md 11). Each call
        # gets as many batches as fit in ``buffer_bytes`` and folds them into the running ranges /
        # histograms. (Merging histograms re-bins them, so a model that fits gets one call: exact.)
        per_call = max(1, int(buffer_bytes // max(1, batch_bytes(calibrator.infer_session, inputs, batch_size))))
        starts = range(0, len(reader), per_call)
        if method != "minmax" and len(starts) > 1:
            # Histograms merged chunk by chunk are re-binned when a later chunk widens the range,
            # which changes what entropy and percentile pick. A streamed MinMax pass first gives
            # every tensor its final range; histograms seeded with it only ever add counts.
            # A calibrator holds the model, its augmented copy and a session on it (about 3x the
            # FP32 weights): the pre-pass's own one must not live beside this one.
            del calibrator
            release_memory()
            extremes = minmax() if minmax is not None else collect_ranges(
                model_path, "minmax", inputs, op_types=op_types, batch_size=batch_size, progress=progress,
                buffer_bytes=buffer_bytes, inputs_only=inputs_only)
            calibrator = make_calibrator()
            seed_histograms(calibrator, extremes)
        with contextlib.redirect_stdout(io.StringIO()):  # ORT prints progress lines
            for start in tqdm(starts, desc=f"calibrating ({method})", unit="chunk", disable=not progress, leave=False):
                reader.set_range(start, start + per_call)
                calibrator.collect_data(reader)
            ranges = calibrator.compute_data()
        del calibrator  # holds an inference session on the augmented model inside tmp
    # The calibration freed gigabytes (the augmented model, the session's arena): hand them back
    # to the OS before the quantizer loads its own copy of the model.
    release_memory()
    return ranges


def _make_calibrator(model_path: str | Path, method: str, calibrate_method, op_types: list[str] | None,
                     percentile: float, inputs_only: bool, tmp: Path):
    """ORT's calibrator for ``method`` on ``model_path``, with our collectors where ORT's own are
    slow or not what the name says, holding the graph without its weights."""
    extra: dict = {}
    if method == "entropy":
        extra = {"num_bins": ENTROPY_NUM_BINS, "num_quantized_bins": ENTROPY_QUANTIZED_BINS}
    elif method == "percentile":
        extra = {"num_bins": HISTOGRAM_BINS, "percentile": percentile}
    elif method == "distribution":
        extra = {"num_bins": HISTOGRAM_BINS}
    # The augmented model is saved beside the model, its weights referenced, not copied
    # (``shape_infer``); where nothing can be written there, in tmp with the weights.
    with calibrator_beside(model_path) as beside:
        with _calibrating_inputs_only(inputs_only), _sessions_without_memory_pattern(), \
                ort_loads_fast(weights=beside is None):
            made = create_calibrator(
                Path(model_path), op_types, augmented_model_path=beside or str(tmp / "augmented.onnx"),
                calibrate_method=calibrate_method, extra_options=extra,
                # a copy with the weights is FP32-sized: past 2 GB it needs external data too
                use_external_data_format=beside is None and onnx_needs_external_data(model_path),
            )
    if method == "entropy":
        made.collector = fast_entropy_collector(made)
    elif method == "percentile":
        made.collector = UniformAbsHistogramCollector(
            method="percentile", symmetric=made.symmetric, num_bins=made.num_bins,
            num_quantized_bins=made.num_quantized_bins, percentile=made.percentile, scenario=made.scenario)
    made.model = without_weights(made.model)
    return made


def without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``'s graph without its initializers. ORT's calibrator keeps the augmented model it
    wrote and opened its session on, weights included (1.7 GB on Gemma 3 once pre-processing has
    folded a transposed copy of the tied embedding), yet ``collect_data`` and ``compute_data``
    read only the session. A new message, not ``ClearField``: the upb protobuf backend frees
    nothing until the message itself goes."""
    graph = model.graph
    lean = onnx.helper.make_graph(graph.node, graph.name, graph.input, graph.output, value_info=graph.value_info)
    return onnx.helper.make_model(lean, opset_imports=model.opset_import, ir_version=model.ir_version)


class UniformAbsHistogramCollector(HistogramCollector):
    """ORT's percentile collector (histograms of |x|), counting with numpy's equal-bin path.

    Once a tensor has a histogram, ORT counts each later chunk with ``np.histogram(x,
    bins=edges)``: an array of edges takes numpy's general path, which sorts the data (a large
    share of a percentile calibration of a large model, whose chunks follow a MinMax pre-pass). The edges are
    equal bins over ``[0, top]`` (``seed_histograms``, or ORT's first chunk), so ``bins=n,
    range=(0, top)`` gives the same counts: numpy builds the same float32 edges and checks each
    value against them. Where ORT would widen the histogram (a value past ``top``), or the edges
    are not those equal bins, or a value is not finite, ORT's own code runs."""

    def collect_absolute_value(self, name_to_arr):
        rest = {}
        for tensor, data in name_to_arr.items():
            old = self.histogram_dict.get(tensor)
            arr = np.asarray(data).ravel()
            if old is None or arr.size == 0 or arr.dtype != old[1].dtype:
                rest[tensor] = data
                continue
            hist, edges, old_min, old_max = old
            top = float(edges[-1])
            bins = len(edges) - 1
            magnitude = np.absolute(arr)
            if not (np.isfinite(magnitude).all() and float(magnitude.max()) <= top and float(edges[0]) == 0.0
                    and np.array_equal(edges, np.linspace(0.0, top, bins + 1, dtype=edges.dtype))):
                rest[tensor] = data
                continue
            counts, _ = np.histogram(magnitude, bins=bins, range=(0.0, top))
            self.histogram_dict[tensor] = (counts + hist, edges, min(old_min, arr.min()), max(old_max, arr.max()))
        if rest:
            super().collect_absolute_value(rest)


def seed_histograms(calibrator, extremes) -> None:
    """Empty histograms spanning each tensor's final range, in the layout ORT's
    ``HistogramCollector`` keeps (``collect_value``: symmetric, ``collect_absolute_value``: |x|)."""
    if not calibrator.collector:
        calibrator.collector = HistogramCollector(
            method=calibrator.method, symmetric=calibrator.symmetric, num_bins=calibrator.num_bins,
            num_quantized_bins=calibrator.num_quantized_bins, percentile=calibrator.percentile,
            scenario=calibrator.scenario)
    collector = calibrator.collector
    absolute = collector.method == "percentile" and collector.symmetric  # ORT's collect() dispatch
    for name, value in extremes.data.items():
        lo = np.array(np.min(value.range_value[0]), dtype=np.float32)
        hi = np.array(np.max(value.range_value[1]), dtype=np.float32)
        bins = collector.num_bins
        if absolute:
            top = np.float32(max(abs(lo), abs(hi)))
            edges = np.linspace(0.0, top, bins + 1).astype(np.float32)
            collector.histogram_dict[name] = (np.zeros(bins, dtype=np.int64), edges, lo, hi)
        else:
            threshold = np.array(max(abs(lo), abs(hi)), dtype=np.float32)
            _, edges = np.histogram(np.zeros(0, dtype=np.float32), bins, range=(-threshold, threshold))
            collector.histogram_dict[name] = (np.zeros(bins, dtype=np.int64), edges, lo, hi, threshold)


def collect_ranges_without_positions(model_path: str | Path, inputs: np.ndarray, *, op_types: list[str] | None,
                                     skip_positions=SINK_POSITIONS, batch_size: int = 4, progress: bool = False,
                                     inputs_only: bool = False):
    """MinMax ranges with some token positions left out (a collector of our own: ORT's calibrators
    reduce whole tensors). The tensors are the ones ORT's MinMax calibrator would calibrate; a
    tensor with a token axis (axis 1 of [batch, seq, ...], seq = the window length) is reduced over
    the other positions, anything else over all of it. Streams: one batch is held at a time."""
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import CalibrationMethod, MinMaxCalibrater, TensorsData

    with tempfile.TemporaryDirectory(prefix="quantnorm-calib-") as tmp, ort_loads_fast():
        selector = MinMaxCalibrater(Path(model_path), op_types, augmented_model_path=str(Path(tmp) / "unused.onnx"))
        model = selector.model  # shape-inferred, as ORT's own calibrator sees it
        with _calibrating_inputs_only(inputs_only):
            tensors, value_infos = selector.select_tensors_to_calibrate(model)
        del selector
    tensors = sorted(tensors)
    existing = {o.name for o in model.graph.output}
    for name in tensors:
        if name not in existing:
            model.graph.output.append(value_infos[name] if name in value_infos else
                                      onnx.helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every tensor
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])
    windows = np.ascontiguousarray(inputs, dtype=np.int64)
    seq = windows.shape[1]
    keep = np.setdiff1d(np.arange(seq), np.asarray(skip_positions, dtype=np.int64))
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    feed = window_feeder(session)
    for start in tqdm(range(0, len(windows), batch_size), desc="calibrating (minmax-nosink)", unit="batch",
                      disable=not progress, leave=False):
        values = session.run(tensors, feed(windows[start:start + batch_size]))
        for name, value in zip(tensors, values):
            v = np.asarray(value)
            if v.ndim >= 2 and v.shape[1] == seq and len(keep):
                v = v[:, keep]
            if v.size == 0:
                continue
            lo[name] = min(lo.get(name, np.inf), float(v.min()))
            hi[name] = max(hi.get(name, -np.inf), float(v.max()))
    data = {n: (np.array(min(lo[n], 0.0), dtype=np.float32), np.array(max(hi[n], 0.0), dtype=np.float32))
            for n in lo}
    return TensorsData(CalibrationMethod.MinMax, data)
