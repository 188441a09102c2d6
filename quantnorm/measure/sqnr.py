"""Per-tensor quantization error (SQNR) of a QDQ INT8 model, and its link to outliers.

``SQNR = 10 * log10(sum(x^2) / sum((x - x_q)^2))`` in dB (shared FORMULAS.md), summed over all
entries of all probed windows. For each activation tensor the INT8 model quantizes:

- ``sqnr_db``: x = the tensor in the FP32 model, x_q = its dequantized value inside the INT8
  model (``post_qdq``). This is the error the next op really sees: this tensor's rounding plus
  everything accumulated upstream.
- ``sqnr_local_db``: x = the INT8 model's own float tensor just before its QuantizeLinear
  (``pre_qdq``), x_q = ``post_qdq``: the rounding/clipping noise of this tensor alone, which is
  what its outliers (a per-tensor scale stretched by one channel) explain.

No noise or no signal (an all-zero tensor) has no finite SQNR: stored as None (JSON null). No
noise is common for ``sqnr_local_db``: the quantizer re-quantizes a Transpose/Reshape of an
already dequantized tensor with the same scale, which is exact.

The INT8 model's QuantizeLinear inputs and DequantizeLinear outputs are tapped as graph outputs
(``qdq_tapped_model``: the tensors ``qdq_loss_debug.modify_model_output_intermediate_tensors``
would save) and ``qdq_loss_debug.create_activation_matching`` pairs them with the FP32 tensors.
Models run with graph optimizations off, as ``collect_activations`` does, so QDQ pairs are not
fused away: this is the simulated (QDQ) error, not a fused INT8 kernel's (the accuracy metrics
measure those). We run the sessions ourselves instead of calling ``collect_activations`` because it
keeps every batch of every tensor in memory; here each batch is reduced to running sums and dropped.
The tapped copies reference their model's weights instead of copying them (``open_beside``): on
Gemma 3 each copy had cost a shape inference and a 1.1 GB write, most of the probe's time.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnxruntime.quantization import qdq_loss_debug

from ..errors import MeasureError
from ..feeds import window_feeder
from ..fileio import save_onnx
from ..onnx_wire import model_with_weights_by_reference, onnx_nodes
from .latency import quant_format
from .outliers import TensorAccumulator
from .sessions import CPU

# A graph output that gets quantized keeps its name on the DQ output; its float input is renamed.
_Q_INPUT_SUFFIX = "_QuantizeLinear_Input"


def sqnr_db(x: np.ndarray, x_q: np.ndarray) -> float | None:
    """SQNR in dB of one pair of tensors; None when exact or when ``x`` is all zeros."""
    acc = _SqnrSums()
    acc.add(x, x_q)
    return acc.db()


class _SqnrSums:
    """Running sum(x^2) and sum((x - x_q)^2) in float64, so batches never need to be kept."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.n = 0

    def add(self, x: np.ndarray, x_q: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        x_q = np.asarray(x_q, dtype=np.float64).reshape(-1)
        if x.shape != x_q.shape:
            raise MeasureError(f"SQNR pair has {x.size} vs {x_q.size} values: not the same tensor")
        self.signal += float(np.dot(x, x))
        self.noise += float(np.dot(x - x_q, x - x_q))
        self.n += x.size

    def db(self) -> float | None:
        if self.noise <= 0.0 or self.signal <= 0.0:
            return None
        return 10.0 * math.log10(self.signal / self.noise)


def _batches(inputs: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    inputs = np.asarray(inputs)
    if inputs.ndim == 1:
        inputs = inputs[None]
    if len(inputs) == 0:
        raise MeasureError("no input windows to run")
    if batch_size < 1:
        raise MeasureError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(inputs), batch_size):
        yield inputs[start:start + batch_size]


def _feed(session: ort.InferenceSession, batch: np.ndarray) -> dict[str, np.ndarray]:
    return window_feeder(session)(batch)


def expose_tensors(model_path: Path, names: Sequence[str], *, only: bool = False) -> onnx.ModelProto:
    """The model's graph with ``names`` added as graph outputs, shapes kept (unlike the flattened
    outputs qdq_loss_debug adds), so each sample can be taken from the batch axis. Its weights stay
    in ``model_path``'s file, referenced (``onnx_wire.model_with_weights_by_reference``): open it
    with ``open_beside``. No shape inference: ORT types an added output from the node that makes it.

    ``only``: ``names`` become the only outputs and the nodes none of them needs are dropped
    (``keep_only_outputs``): a probe of a few inner tensors then neither computes nor returns
    the logits (1 GiB per batch of 8 windows with Gemma 3's 262k vocabulary)."""
    model = model_by_reference(model_path)
    elem_types = {vi.name: vi.type.tensor_type.elem_type
                  for vi in [*model.graph.value_info, *model.graph.output, *model.graph.input]}
    produced = {o for node in model.graph.node for o in node.output} | {i.name for i in model.graph.input}
    existing = {o.name for o in model.graph.output}
    for name in names:
        if name not in produced:
            raise MeasureError(f"tensor {name!r} is not produced by any node of {model_path}")
        if name not in existing:
            existing.add(name)
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_types[name], None)
                                      if elem_types.get(name) else onnx.ValueInfoProto(name=name))
    if only:
        keep_only_outputs(model, set(names))
    return model


def model_by_reference(model_path: Path) -> onnx.ModelProto:
    """The model with its weights referenced where they lie in ``model_path``'s file, not read
    (``onnx_wire.model_with_weights_by_reference``): its graph, for what reads nodes and names."""
    try:
        return onnx.ModelProto.FromString(model_with_weights_by_reference(model_path))
    except (OSError, ValueError, DecodeError) as exc:
        raise MeasureError(f"cannot read ONNX model {model_path}: {exc}") from exc


def open_beside(model_path: Path, model: onnx.ModelProto, options: ort.SessionOptions | None = None
                ) -> ort.InferenceSession:
    """A CPU session on ``model``, a graph whose weights are referenced in ``model_path``'s file
    (``expose_tensors``, ``qdq_tapped_model``). ORT resolves the references against the graph
    file's own directory, so the graph is written beside ``model_path`` under a hidden temporary
    name and removed as soon as the session holds it (the weights are read from ``model_path``).
    Where that directory is not writable, the weights are copied into a temporary model instead."""
    model_path = Path(model_path)
    if options is None:
        options = ort.SessionOptions()
        # No fusion: every tapped tensor exists as the graph writes it.
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3   # errors only, as every session of ours
    try:
        fd, graph_path = tempfile.mkstemp(prefix=f".{model_path.stem}.tap-", suffix=".onnx", dir=model_path.parent)
    except OSError:
        return _open_copied(model_path, model, options)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
        return ort.InferenceSession(graph_path, sess_options=options, providers=[CPU])
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise MeasureError(f"cannot load ONNX model {model_path} with tapped outputs: {exc}") from exc
    finally:
        os.unlink(graph_path)


def _open_copied(model_path: Path, model: onnx.ModelProto, options: ort.SessionOptions) -> ort.InferenceSession:
    from onnx.external_data_helper import load_external_data_for_model

    load_external_data_for_model(model, str(model_path.parent))
    with tempfile.TemporaryDirectory(prefix="quantnorm-tap-") as tmp:
        path = Path(tmp) / "tapped.onnx"
        save_onnx(model, path)
        try:
            return ort.InferenceSession(str(path), sess_options=options, providers=[CPU])
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise MeasureError(f"cannot load ONNX model {model_path} with tapped outputs: {exc}") from exc


def keep_only_outputs(model: onnx.ModelProto, keep: set[str]) -> None:
    """Make ``keep`` the graph's only outputs, in place, and drop the nodes and initializers that
    none of them needs. A graph with subgraphs (If/Loop bodies read outer names implicitly) keeps
    all its nodes."""
    graph = model.graph
    outputs = [o for o in graph.output if o.name in keep]
    del graph.output[:]
    graph.output.extend(outputs)
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for node in graph.node for a in node.attribute):
        return
    needed = set(keep)
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):  # graph order is topological: walk it backwards
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    initializers = [init for init in graph.initializer if init.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)


def qdq_tapped_model(int8_path: Path) -> onnx.ModelProto:
    """The QDQ model with the tensors around its activation QuantizeLinear/DequantizeLinear pairs as
    its only outputs, weights referenced (open it with ``open_beside``): each QuantizeLinear's float
    input and each DequantizeLinear's output whose input is not a constant. These are the tensors
    qdq_loss_debug's augmentation saves, minus the dequantized weights (a copy of every weight per
    batch, never paired), under their own names: ``create_activation_matching`` pairs them by name.
    The model's own outputs are no outputs here unless quantized themselves: the logits of a
    MatMul-only recipe (and the head's MatMul that only they need) are not computed."""
    model = model_by_reference(int8_path)
    graph = model.graph
    constants = {i.name for i in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    saved: list[str] = []
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in constants:
            saved.append(node.input[0])
        elif node.op_type == "DequantizeLinear" and node.input[0] not in constants:
            saved.append(node.output[0])
    saved = list(dict.fromkeys(saved))
    existing = {o.name for o in graph.output}
    graph.output.extend(onnx.ValueInfoProto(name=name) for name in saved if name not in existing)
    keep_only_outputs(model, set(saved))
    return model


def _run_saved(session: ort.InferenceSession, batch: np.ndarray) -> dict[str, list[np.ndarray]]:
    """One batch through a ``qdq_tapped_model``: {tensor: [values]}, as collect_activations gives."""
    names = [o.name for o in session.get_outputs()]
    return {n: [v] for n, v in zip(names, session.run(names, _feed(session, batch)))}


# Windows per session run. One: every exposed tensor of a batch is held at once, in both models,
# and with Gemma 3 a batch of 8 windows made this stage the run's peak (12 GB); one window at a
# time costs a few per-run overheads on small models and nothing measurable on large ones.
SQNR_BATCH = 1


def activation_sqnr(fp32_path: Path, int8_path: Path, inputs: np.ndarray, *,
                    batch_size: int = SQNR_BATCH) -> list[dict]:
    """SQNR of every activation tensor the QDQ model quantizes, in graph order.

    Rows: ``{"tensor": <name in the FP32 model>, "sqnr_db", "sqnr_local_db", "n_values"}``
    (definitions in the module docstring; ``sqnr_db`` is None too when the FP32 model lacks the
    tensor). ``inputs``: token windows [n, seq]; use evaluation windows, not calibration ones.
    """
    return sqnr_with_stats(fp32_path, int8_path, inputs, batch_size=batch_size, stats=False)[0]


def sqnr_with_stats(fp32_path: Path, int8_path: Path, inputs: np.ndarray, *, batch_size: int = SQNR_BATCH,
                    stats: bool = True) -> tuple[list[dict], dict[str, dict]]:
    """``activation_sqnr``'s rows and, from the same FP32 runs, ``onnx_tensor_stats``' outlier
    figures of each paired FP32 tensor (``{}`` with ``stats=False``): one FP32 pass, not two."""
    fp32_path, int8_path = Path(fp32_path), Path(int8_path)
    int8_session = open_beside(int8_path, qdq_tapped_model(int8_path))
    fp32_session: ort.InferenceSession | None = None
    fp32_opened = False  # opened once, on the first batch; stays None if it has none of the tensors
    total: dict[str, _SqnrSums] = {}
    local: dict[str, _SqnrSums] = {}
    accs: dict[str, TensorAccumulator] = {}
    for batch in _batches(inputs, batch_size):
        qdq_acts = _run_saved(int8_session, batch)
        pairs = qdq_loss_debug.create_activation_matching(qdq_acts)
        if not fp32_opened:
            fp32_opened = True
            # Now we know which tensors are quantized: expose exactly those in the FP32 model.
            produced = {o for _, _, outputs in onnx_nodes(fp32_path) for o in outputs}
            float_names = [name for name in pairs if name in produced]
            if float_names:
                fp32_session = open_beside(fp32_path, expose_tensors(fp32_path, float_names, only=True))
        float_outputs = [o.name for o in fp32_session.get_outputs()] if fp32_session is not None else []
        float_values = fp32_session.run(float_outputs, _feed(fp32_session, batch)) if float_outputs else []
        if stats:
            for name, value in zip(float_outputs, float_values):
                accs.setdefault(name, TensorAccumulator(name)).add(value, n_samples=len(batch))
        pairs = qdq_loss_debug.create_activation_matching(
            qdq_acts, {n: [v] for n, v in zip(float_outputs, float_values)})
        del qdq_acts, float_values
        for name, pair in pairs.items():
            post = pair["post_qdq"][0]
            local.setdefault(name, _SqnrSums()).add(pair["pre_qdq"][0], post)
            if "float" in pair:
                total.setdefault(name, _SqnrSums()).add(pair["float"][0], post)
        del pairs
    del int8_session, fp32_session
    if not local:
        raise MeasureError(f"{int8_path} has no QuantizeLinear/DequantizeLinear activation pairs: is it a QDQ model?")
    order = _quantize_order(int8_path)
    rows = [
        {"tensor": name, "sqnr_db": total[name].db() if name in total else None,
         "sqnr_local_db": local[name].db(), "n_values": local[name].n}
        for name in sorted(local, key=lambda n: order.get(n, len(order)))
    ]
    return rows, {name: acc.finish().metrics() for name, acc in accs.items()}


def _quantize_order(int8_path: Path) -> dict[str, int]:
    """Graph position of each quantized activation (its QuantizeLinear), for a stable row order."""
    order: dict[str, int] = {}
    for op, inputs, _ in onnx_nodes(int8_path):
        if op == "QuantizeLinear":
            order.setdefault(inputs[0].removesuffix(_Q_INPUT_SUFFIX), len(order))
    return order


def onnx_tensor_stats(fp32_path: Path, tensor_names: Sequence[str], inputs: np.ndarray,
                      *, batch_size: int = SQNR_BATCH) -> dict[str, dict]:
    """Outlier figures of the named tensors of the FP32 ONNX model, per outliers.TensorAccumulator.

    Returns ``{name: {"ratio", "kurtosis", "inf_norm", "median_abs", "rms", "top", ...}}``; one
    sample is one input window (the batch axis of each tensor).
    """
    names = list(dict.fromkeys(tensor_names))
    if not names:
        return {}
    session = open_beside(Path(fp32_path), expose_tensors(Path(fp32_path), names, only=True))
    accs = {name: TensorAccumulator(name) for name in names}
    for batch in _batches(inputs, batch_size):
        for name, value in zip(names, session.run(names, _feed(session, batch))):
            accs[name].add(value, n_samples=len(batch))
    del session
    return {name: acc.finish().metrics() for name, acc in accs.items()}


def spearman(xs: Sequence[float | None], ys: Sequence[float | None]) -> float | None:
    """Spearman rank correlation with average ranks for ties, over pairs where both are finite.

    None with fewer than 3 such pairs or when either side is constant (undefined).
    """
    pairs = [(float(x), float(y)) for x, y in zip(xs, ys)
             if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    if len(pairs) < 3:
        return None
    a, b = np.array(pairs).T
    if np.all(a == a[0]) or np.all(b == b[0]):
        return None
    from scipy import stats  # here, not at import: 0.7 s that every start of the CLI would pay

    return float(stats.spearmanr(a, b).statistic)


def sqnr_summary(sqnr_rows: list[dict], tensor_stats: dict[str, dict], worst: int = 5,
                 tensors: Collection[str] | None = None) -> dict:
    """Does a tensor's outlier figure predict its quantization error?

    Spearman correlations across tensors of ratio and of kurtosis with ``sqnr_db`` (and with
    ``sqnr_local_db``); a strongly negative value means outlier-heavy tensors quantize worst.
    ``worst``: the tensors with the lowest ``sqnr_db``, with their outlier figures.
    ``tensors`` restricts both to those names. Attention probabilities are quantized too and
    are mostly exact zeros (the causal mask), so their max/median ratio is astronomically large
    by construction; ``tensors=graph_probe.weight_matmul_inputs(model)`` keeps the weight-MatMul inputs.
    """
    joined = []
    for row in sqnr_rows:
        if tensors is not None and row["tensor"] not in tensors:
            continue
        st = tensor_stats.get(row["tensor"], {})
        joined.append({"tensor": row["tensor"], "sqnr_db": row.get("sqnr_db"),
                       "sqnr_local_db": row.get("sqnr_local_db"), "ratio": st.get("ratio"),
                       "kurtosis": st.get("kurtosis"), "inf_norm": st.get("inf_norm")})

    def rho(stat: str, err: str) -> float | None:
        return spearman([r[stat] for r in joined], [r[err] for r in joined])

    ranked = sorted((r for r in joined if r["sqnr_db"] is not None), key=lambda r: r["sqnr_db"])
    return {
        "spearman_ratio_sqnr": rho("ratio", "sqnr_db"),
        "spearman_kurtosis_sqnr": rho("kurtosis", "sqnr_db"),
        "spearman_ratio_sqnr_local": rho("ratio", "sqnr_local_db"),
        "spearman_kurtosis_sqnr_local": rho("kurtosis", "sqnr_local_db"),
        "n_tensors": sum(1 for r in joined if r["sqnr_db"] is not None and r["ratio"] is not None),
        "worst": ranked[:worst],
    }


def sqnr_sections(fp32_path: Path, int8_paths: dict[str, Path], inputs: np.ndarray,
                  matmul_inputs: dict[str, list[str]], fp32_sources: dict[str, Path] | None = None
                  ) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """results.json's ``sqnr`` (rows per QDQ model, each labelled with the modules it feeds and its
    FP32 outlier figures) and ``sqnr_summary`` (correlations over weight-MatMul inputs).

    A model quantized from another FP32 model (SmoothQuant) is compared with that model
    (``fp32_sources``); dynamic (QOperator) models have no QDQ pairs and are skipped.
    """
    sqnr: dict[str, list[dict]] = {}
    summaries: dict[str, dict] = {}
    for name, path in int8_paths.items():
        if quant_format(path) != "qdq":
            continue
        source = (fp32_sources or {}).get(name, fp32_path)
        rows, stats = sqnr_with_stats(source, path, inputs)
        for row in rows:
            figures = stats.get(row["tensor"], {})
            row.update(modules=matmul_inputs.get(row["tensor"], []),
                       **{k: figures.get(k) for k in ("ratio", "kurtosis", "inf_norm")})
        sqnr[name] = rows
        summaries[name] = sqnr_summary(rows, stats, tensors=matmul_inputs)
    return sqnr, summaries
