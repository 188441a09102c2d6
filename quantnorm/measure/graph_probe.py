"""Massive activations and outliers read from the FP32 ONNX graph: the one probe of every source.

Every source becomes this graph after export (zoo, Hugging Face, GGUF, ONNX directory), so the
probe is written once, on it. Tapped, as extra graph outputs (as SQNR does), and reduced batch by
batch with ``measure.outliers``' statistics (``TensorAccumulator``, ``find_massive``):

- the residual stream as ``measure.placement`` walks it: the stream the first block reads, then
  the stream after every residual add; in post/deepnorm stacks also each pre-norm sum
  (``norm_inputs``), where post-LN models keep their large values; for ResiDual its second
  stream x_d (``residual_skip``, as the placement walk finds it);
- every norm output and every weight-MatMul input (q, k and v share one input: one row);
- the attention probabilities: the first input of each activation x activation MatMul that comes
  out of a Softmax (or of a division by its own ReduceSum, the zoo's mask-multiplying softmax):
  per layer the mean probability on key 0 (BOS / [CLS]), over heads, queries 1..T-1 for causal
  models (query 0 can only see key 0) and all queries for encoders, plus the last key ([SEP]).

Blocks: with two residual adds per block (attention, then MLP: every placement we know; the
block count comes from the caller, e.g. config.json's ``num_hidden_layers``), the
block output is the stream after the second add and "born in" names the sublayer whose add
made a massive entry appear; otherwise each add counts as a layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..errors import MeasureError
from ..feeds import window_feeder
from .fake_quant import FakeQuantSqnr
from .outliers import (
    MASSIVE_ABS,
    MASSIVE_LIMIT,
    MASSIVE_RATIO,
    OUTLIER_FEATURE_ABS,
    TensorAccumulator,
    as_samples,
    find_massive,
    first_births,
    summarize,
)
from .placement import detect_placement, find_norms
from .sqnr import expose_tensors, open_beside

SUBLAYERS = ("attention", "mlp")  # the two residual adds of a block, in graph order


def weight_matmul_inputs(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Each tensor that feeds a weight MatMul/Gemm (second input a constant) -> the node names
    reading it (q, k and v share one input: one entry, three names)."""
    graph = model.graph
    constants = {i.name for i in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    producer = {o: n for n in graph.node for o in n.output}

    def constant(name: str, depth: int = 3) -> bool:
        if name in constants:
            return True
        node = producer.get(name)  # a Transpose/Cast of a weight is still a weight
        return (depth > 0 and node is not None and node.op_type in ("Transpose", "Cast", "Identity")
                and constant(node.input[0], depth - 1))

    out: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2 and constant(node.input[1]) \
                and not constant(node.input[0]):
            out.setdefault(node.input[0], []).append(node.name or node.output[0])
    return out


def attention_probabilities(model: onnx.ModelProto) -> list[str]:
    """The attention-probability tensors in graph order (see the module docstring)."""
    graph = model.graph
    constants = {i.name for i in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    producer = {o: n for n in graph.node for o in n.output}

    def source(name: str) -> onnx.NodeProto | None:
        node = producer.get(name)
        for _ in range(4):  # through casts and (inference-time) dropout
            if node is None or node.op_type not in ("Cast", "Identity", "Dropout"):
                break
            node = producer.get(node.input[0])
        return node

    found = []
    for node in graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2 or any(i in constants for i in node.input):
            continue
        made_by = source(node.input[0])
        if made_by is None:
            continue
        divided = made_by.op_type == "Div" and (producer.get(made_by.input[1]) is not None
                                                 and producer[made_by.input[1]].op_type == "ReduceSum")
        if made_by.op_type == "Softmax" or divided:
            found.append(node.input[0])
    return found


def _layers(taps: list[tuple[str, str, str]], n_blocks: int | None) -> tuple[list[str], list[str] | None]:
    """(block output tensors, the stream after each block's first add, or None)."""
    if n_blocks and len(taps) == 2 * n_blocks:
        return [t[1] for t in taps[1::2]], [t[1] for t in taps[0::2]]
    return [t[1] for t in taps], None


def graph_probe(fp32_path: Path, inputs: np.ndarray, *, n_blocks: int | None = None, batch_size: int = 4,
                token: Callable[[int, int], str | None] | None = None, causal: bool = True) -> tuple[dict, dict]:
    """Run ``inputs`` (windows [n, seq]) through the FP32 graph with its residual stream, norm
    outputs and weight-MatMul inputs exposed. Returns (the ``outliers`` section, {layer: |a|
    [seq, d] of the first window}). ``n_blocks``: the model's block count (config.json), which
    pairs the residual adds into blocks when there are two per block. ``token(sample, position)``:
    the token's text, for labels. ``causal``: how attention to key 0 is averaged (see above)."""
    windows = np.asarray(inputs, dtype=np.int64)
    if windows.ndim != 2 or len(windows) == 0:
        raise MeasureError(f"probe inputs must be windows [n, seq], got shape {windows.shape}")
    taps = _find_taps(onnx.load(str(fp32_path)), n_blocks)
    wanted = taps.wanted()
    probe = _Accumulated(taps, causal)
    # The tapped tensors only: the logits are neither computed nor returned.
    session = open_beside(fp32_path, expose_tensors(fp32_path, wanted, only=True))
    feed = window_feeder(session)
    for start in range(0, len(windows), batch_size):
        batch = np.ascontiguousarray(windows[start:start + batch_size])
        probe.add(dict(zip(wanted, session.run(wanted, feed(batch)))), len(batch), start)
    del session
    return probe.report(windows, token or (lambda sample, position: None)), probe.first_window


@dataclass
class _Taps:
    """The tensors the probe exposes, by what they are (each list in graph order)."""

    residual: list[tuple[object, str]]     # ("embed" | block index, the stream tensor)
    mids: list[str] | None                 # the stream after each block's first add, or None
    post_sums: list[tuple[int, str]]       # post/deepnorm: (add index, the pre-norm sum)
    skip: list[tuple[int, str]]            # ResiDual's second stream x_d, per layer
    norms: list[str]
    matmuls: dict[str, list[str]]          # weight-MatMul input -> the nodes reading it
    probabilities: list[str]               # attention probabilities [B, H, T, T]
    residual_adds: int

    def wanted(self) -> list[str]:
        return list(dict.fromkeys([t for _, t in self.residual] + (self.mids or [])
                                  + [s for _, s in self.post_sums] + [t for _, t in self.skip]
                                  + self.norms + list(self.matmuls) + self.probabilities))


def _find_taps(model: onnx.ModelProto, n_blocks: int | None) -> _Taps:
    """Walk the graph once: the residual stream (as ``measure.placement`` finds it), its
    pre-norm sums and second stream, the norm outputs, the weight-MatMul inputs, the attention."""
    placement = detect_placement(model)
    blocks, mids = _layers(placement.taps, n_blocks)
    skip_all = [x for x in placement.skips if x is not None]  # ResiDual's x_d (else empty)
    return _Taps(
        residual=([("embed", placement.embedding)] if placement.embedding else []) + list(enumerate(blocks)),
        mids=mids,
        post_sums=[(i, s) for i, ((s, after, _), label) in enumerate(zip(placement.taps, placement.labels))
                   if s != after and label in ("post", "deepnorm")],
        skip=list(enumerate(skip_all[1::2] if mids is not None else skip_all)),
        norms=[n.output for n in find_norms(model)],
        matmuls=weight_matmul_inputs(model),
        probabilities=attention_probabilities(model),
        residual_adds=len(placement.taps))


class _Accumulated:
    """What the probe keeps across batches: a ``TensorAccumulator`` per tapped tensor, the
    fake-quant SQNR of each MatMul input, the massive entries and their births, attention sums."""

    def __init__(self, taps: _Taps, causal: bool):
        self.taps, self.causal = taps, causal
        self.accs: dict[tuple[str, object], TensorAccumulator] = {}
        self.sqnr: dict[str, FakeQuantSqnr] = {}
        self.massive: list[dict] = []
        self.born: list[dict] = []
        self.first_window: dict = {}
        self.attn_sum = np.zeros(len(taps.probabilities))
        self.attn_count = np.zeros(len(taps.probabilities))
        self.last_sum = np.zeros(len(taps.probabilities))

    def _acc(self, kind: str, key, x: np.ndarray, n: int) -> None:
        self.accs.setdefault((kind, key), TensorAccumulator(str(key))).add(x, n)

    def add(self, values: dict, n: int, start: int) -> None:
        """One batch of ``n`` windows starting at window ``start``: tensor name -> value."""
        taps = self.taps
        stream = {}
        for layer, tensor in taps.residual:
            x = as_samples(values[tensor], n)
            stream[layer] = x
            self._acc("residual", layer, x, n)
            self.massive.extend(find_massive(x, layer, start))
            if start == 0:
                self.first_window[layer] = np.abs(x[0])
        for layer, tensor in taps.skip:
            x = as_samples(values[tensor], n)
            self._acc("residual_skip", layer, x, n)
            self.massive.extend(find_massive(x, layer, start, stream="skip"))
        self._add_attention(values)
        for i, tensor in taps.post_sums:
            x = as_samples(values[tensor], n)
            self._acc("norm_input", tensor, x, n)
            self.massive.extend(find_massive(x, i, start, stream="pre-norm sum"))
        for tensor in taps.norms:
            self._acc("norm", tensor, values[tensor], n)
        for tensor in taps.matmuls:
            self._acc("matmul", tensor, values[tensor], n)
            self.sqnr.setdefault(tensor, FakeQuantSqnr()).add(values[tensor])
        self.born += _births(stream, taps.mids, values, n, start)

    def _add_attention(self, values: dict) -> None:
        for k, tensor in enumerate(self.taps.probabilities):
            p = values[tensor]  # [B, H, T, T]
            to_first = p[:, :, 1:, 0] if self.causal else p[..., 0]
            self.attn_sum[k] += float(to_first.sum(dtype=np.float64))
            self.attn_count[k] += to_first.size
            self.last_sum[k] += float(p[..., -1].sum(dtype=np.float64))

    def _rows(self, kind: str, name: Callable, key: str = "tensor") -> list[dict]:
        out = []
        for (k, tensor), acc in self.accs.items():  # insertion order = graph order
            if k != kind:
                continue
            metrics = acc.finish().metrics()
            for entry in metrics["top"]:
                entry["token"] = name(entry["sample"], entry["position"])
            row = {key: tensor, **metrics}
            if kind == "matmul":
                row["modules"] = self.taps.matmuls[tensor]
                row["sqnr_db_fake"] = self.sqnr[tensor].to_dict()
            out.append(row)
        return out

    def _matmul_rows(self, massive: list[dict], name: Callable) -> list[dict]:
        matmul_rows = self._rows("matmul", name)
        massive_positions = {m["position"] for m in massive}
        for row in matmul_rows:
            top = row["top"][0] if row.get("top") else None
            row["carries_massive"] = bool(top and top["position"] in massive_positions
                                          and abs(top["value"]) > MASSIVE_ABS)
        return matmul_rows

    def report(self, windows: np.ndarray, name: Callable) -> dict:
        """The ``outliers`` section; ``name(sample, position)`` labels each entry with its token."""
        causal, mids = self.causal, self.taps.mids
        self.massive.sort(key=lambda r: -abs(r["value"]))
        massive_total = len(self.massive)
        massive = self.massive[:MASSIVE_LIMIT]
        for r in massive + self.born:
            r["token"] = name(r["sample"], r["position"])
        matmul_rows = self._matmul_rows(massive, name)
        residual_rows = self._rows("residual", name, "layer")
        all_queries = np.where(self.attn_count > 0, self.attn_count, 1)
        report = {
            "residual": residual_rows,
            "massive_born": first_births(sorted(self.born, key=lambda r: (r["layer"], -abs(r["value"])))),
            "residual_skip": self._rows("residual_skip", name, "layer"),
            "norm_outputs": self._rows("norm", name),
            "norm_inputs": self._rows("norm_input", name),
            "matmul_inputs": matmul_rows,
            "massive": massive,
            "massive_total": massive_total,
            "bos_attention": [float(v) for v in self.attn_sum / all_queries],
            "attention_key": "BOS (key 0), queries 1..T-1" if causal else "[CLS] (key 0), all queries",
            "n_samples": int(len(windows)),
            "seq_len": int(windows.shape[1]),
            "thresholds": {"massive_abs": MASSIVE_ABS, "massive_ratio": MASSIVE_RATIO,
                           "outlier_feature_abs": OUTLIER_FEATURE_ABS},
            "taps": {"from": "the FP32 ONNX graph (quantnorm.measure.graph_probe)",
                     "layer": ("block output (two residual adds per block)" if mids is not None
                               else "the stream after each residual add"),
                     "residual_adds": self.taps.residual_adds},
            "summary": summarize(residual_rows, massive, massive_total),
        }
        if not causal:  # encoders: all queries, so key 0 and the last key are averaged over the same count
            report["sep_attention"] = [float(v) for v in self.last_sum / all_queries]
        return report


def _births(stream: dict, mids: list[str] | None, values: dict, n: int, start: int) -> list[dict]:
    """Massive entries a block's output has and its input lacks, with the sublayer that made them."""
    out = []
    layers = [k for k in stream if k != "embed"]
    for i in layers:
        before = stream.get(i - 1 if i > 0 else "embed")
        if before is None:
            continue
        seen = {(r["sample"], r["position"], r["channel"]) for r in find_massive(before, i, 0)}
        mid = as_samples(values[mids[i]], n) if mids else None
        for r in find_massive(stream[i], i, 0):
            key = (r["sample"], r["position"], r["channel"])
            if key in seen:
                continue
            s, p, c = key
            origin = None
            if mid is not None:
                origin = SUBLAYERS[0] if abs(float(mid[s, p, c])) > MASSIVE_ABS else SUBLAYERS[1]
            out.append({"layer": i, "sample": int(start + s), "position": int(p), "channel": int(c),
                        "value": r["value"], "ratio": r["ratio"], "input_value": float(before[s, p, c]),
                        "born_in": f"block {i} {origin}" if origin else f"add {i}"})
    return out
