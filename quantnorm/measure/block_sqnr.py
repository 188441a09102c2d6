"""How ``accuracy_level`` 4 sees a MatMul input: int8 per row and per block along K.

At accuracy_level 4 ONNX Runtime's CPU MatMulNBits kernel (MLAS, CompInt8) quantizes its input A
row by row in blocks of the node's ``block_size`` along K: ``scale = max|a| / 127`` over the
block, codes ``round-half-to-even(a * 127 / max|a|)``, then an int8 GEMM against the weight
codes. A massive activation (Sun et al.: one channel thousands of times the rest) sets the step
of its block: the other values of that block, in that row, land on a coarse grid or on zero.
This measures that on the FP32 graph, weights float, so the activations' share of the error
stands alone:

- input SQNR: ``||x||^2 / ||x - q(x)||^2`` over every row of the windows, and over the row that
  holds the tensor's largest |a| (where a massive activation sits);
- output SQNR: the same for ``x @ W`` against ``q(x) @ W``, W the float weight of the first
  MatMul reading x (q, k and v share an input), which weighs each channel by what the layer does
  with it: a massive channel the weights scale down matters little, the small values it zeroes
  may carry the output.

Each input is labelled with the graph probe's verdict (``carries_massive``: its largest |a| is a
massive activation of the residual stream's positions) and the summary compares the carriers
with the other inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import MeasureError
from ..feeds import window_feeder
from .graph_probe import graph_probe
from .sqnr import expose_tensors, open_beside

ACT_LEVELS = 127   # MLAS: symmetric int8 codes in [-127, 127]
BATCH = 2          # windows per run of the tapped graph
LISTED = 8         # the other inputs listed by name beside the carriers (the worst max-|a| rows)
ROW_CHUNK = 64     # rows multiplied by a weight at a time


def block_int8(x: np.ndarray, block: int) -> np.ndarray:
    """``x`` [..., K] through int8 per block of ``block`` along K, as MLAS quantizes A (dequantized)."""
    x = np.asarray(x, dtype=np.float32)
    k_dim = x.shape[-1]
    blocks = -(-k_dim // block)
    padded = np.zeros((*x.shape[:-1], blocks * block), dtype=np.float32)
    padded[..., :k_dim] = x
    grouped = padded.reshape(*x.shape[:-1], blocks, block)
    amax = np.abs(grouped).max(axis=-1, keepdims=True)
    inv = np.divide(ACT_LEVELS, amax, out=np.zeros_like(amax), where=amax > 0)
    codes = np.rint(grouped * inv)
    return (codes * (amax / ACT_LEVELS)).reshape(padded.shape)[..., :k_dim]


def _not_block_max(rows: np.ndarray, block: int) -> np.ndarray:
    """1.0 where a value of ``rows`` [n, K] is not the largest |a| of its block along K, else 0.0."""
    k_dim = rows.shape[1]
    blocks = -(-k_dim // block)
    padded = np.zeros((len(rows), blocks * block), dtype=np.float32)
    padded[:, :k_dim] = np.abs(rows)
    grouped = padded.reshape(len(rows), blocks, block)
    mask = np.ones_like(grouped)
    np.put_along_axis(mask, grouped.argmax(axis=-1)[..., None], 0.0, axis=-1)
    return mask.reshape(len(rows), -1)[:, :k_dim]


def _db(signal: float, noise: float) -> float | None:
    """SQNR in dB; None where it is not a number (no signal, or no error at all: results.json
    holds no infinities)."""
    if signal <= 0 or noise <= 0:
        return None
    return float(10 * np.log10(signal / noise))


class _Tensor:
    """Running sums of one input: over all rows, and for the row holding its largest |a|."""

    def __init__(self, weight: np.ndarray | None):
        self.weight = weight
        # |x|^2, |x - q|^2, |xW|^2, |(x - q)W|^2, and the first two over the values that are not
        # their block's largest |a| (what a massive value in the block costs its neighbours)
        self.sums = np.zeros(6)
        self.top = (-1.0, None, None)    # (max |a|, position, [6] sums of that row)

    def add(self, x: np.ndarray, block: int) -> None:
        """One batch of the input, [batch, seq, K] (or [rows, K])."""
        rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
        err = rows - block_int8(rows, block)
        per_row = np.zeros((len(rows), 6))
        per_row[:, 0], per_row[:, 1] = (rows ** 2).sum(1), (err ** 2).sum(1)
        rest = _not_block_max(rows, block)
        per_row[:, 4], per_row[:, 5] = (rows ** 2 * rest).sum(1), (err ** 2 * rest).sum(1)
        if self.weight is not None:   # in slices of rows: a 262k-wide head's output is 1 MB a row
            for lo in range(0, len(rows), ROW_CHUNK):
                per_row[lo:lo + ROW_CHUNK, 2] = ((rows[lo:lo + ROW_CHUNK] @ self.weight) ** 2).sum(1)
                per_row[lo:lo + ROW_CHUNK, 3] = ((err[lo:lo + ROW_CHUNK] @ self.weight) ** 2).sum(1)
        self.sums += per_row.sum(0)
        amax = np.abs(rows).max(1)
        i = int(amax.argmax())
        if amax[i] > self.top[0]:
            self.top = (float(amax[i]), i % x.shape[-2] if x.ndim > 2 else None, per_row[i])

    def row(self, tensor: str, modules: list[str], carries: bool) -> dict:
        s, t = self.sums, self.top[2]
        return {"tensor": tensor, "modules": modules, "carries_massive": carries,
                "input_sqnr_db": _db(s[0], s[1]), "output_sqnr_db": _db(s[2], s[3]) if self.weight is not None else None,
                "max_abs": self.top[0], "max_abs_position": self.top[1],
                "rest_sqnr_db": _db(s[4], s[5]), "max_row_input_sqnr_db": _db(t[0], t[1]),
                "max_row_rest_sqnr_db": _db(t[4], t[5]),
                "max_row_output_sqnr_db": _db(t[2], t[3]) if self.weight is not None else None}


def activation_block_sqnr(fp32_path: Path, windows: np.ndarray, block: int, nodes: list[str]) -> dict:
    """The per-block int8 SQNR of the inputs of the weight MatMuls named in ``nodes`` over
    ``windows`` [n, seq] (int64 token ids; calibration windows), each labelled by the graph probe
    on the same windows. Returns ``{"rule", "block_size", "windows", "summary", "inputs"}``:
    ``summary`` per group (carriers, others): ``_group``; ``inputs``: the carriers, then the
    ``LISTED`` other inputs whose max-|a| row keeps the least of its small values."""
    windows = np.asarray(windows, dtype=np.int64)
    if windows.ndim != 2 or not len(windows):
        raise MeasureError(f"block SQNR needs windows [n, seq], got shape {windows.shape}")
    model = onnx.load(str(fp32_path))
    weights = {i.name: i for i in model.graph.initializer if len(i.dims) == 2}
    wanted, readers = set(nodes), {}
    for node in model.graph.node:
        if node.name in wanted and node.op_type == "MatMul":
            readers.setdefault(node.input[0], []).append(node)
    if not readers:
        raise MeasureError(f"none of the {len(nodes)} named MatMuls is in {Path(fp32_path).name}")
    sums = {x: _Tensor(numpy_helper.to_array(weights[ns[0].input[1]]).astype(np.float32)
                       if ns[0].input[1] in weights else None) for x, ns in readers.items()}
    del model, weights
    report, _ = graph_probe(fp32_path, windows)
    carriers = {r["tensor"] for r in report["matmul_inputs"] if r.get("carries_massive")}
    tensors = list(readers)
    session = open_beside(fp32_path, expose_tensors(fp32_path, tensors, only=True))
    feed = window_feeder(session)
    for lo in range(0, len(windows), BATCH):
        batch = np.ascontiguousarray(windows[lo:lo + BATCH])
        for name, x in zip(tensors, session.run(tensors, feed(batch)), strict=True):
            sums[name].add(np.asarray(x), block)
    del session
    rows = [sums[x].row(x, [n.name for n in readers[x]], x in carriers) for x in tensors]
    return {"rule": f"int8 per row and per block of {block} along K (scale max|a| / {ACT_LEVELS}, round half to "
                    "even: MLAS's accuracy_level 4 input quantization) on the FP32 graph, float weights; output "
                    "SQNR through the first MatMul reading the input; carriers as the graph probe marks them",
            "block_size": block, "windows": int(len(windows)), "positions": int(windows.size),
            "summary": {"carriers": _group([r for r in rows if r["carries_massive"]]),
                        "others": _group([r for r in rows if not r["carries_massive"]])},
            "inputs": [r for r in rows if r["carries_massive"]]
            + sorted((r for r in rows if not r["carries_massive"]), key=_worst_row)[:LISTED]}


def _worst_row(row: dict) -> float:
    value = row["max_row_rest_sqnr_db"]
    return float("inf") if value is None else value


def _group(rows: list[dict]) -> dict:
    """Count, median and minimum of the output SQNR (the input SQNR where no weight was at hand),
    the median rest SQNR, and the worst rest SQNR of a max-|a| row."""
    out = [v for r in rows if (v := r["output_sqnr_db"] if r["output_sqnr_db"] is not None
                                else r["input_sqnr_db"]) is not None]
    rest = [r["rest_sqnr_db"] for r in rows if r["rest_sqnr_db"] is not None]
    worst = [r["max_row_rest_sqnr_db"] for r in rows if r["max_row_rest_sqnr_db"] is not None]
    return {"inputs": len(rows), "median_output_db": float(np.median(out)) if out else None,
            "min_output_db": min(out, default=None), "median_rest_db": float(np.median(rest)) if rest else None,
            "min_max_row_rest_db": min(worst, default=None)}
