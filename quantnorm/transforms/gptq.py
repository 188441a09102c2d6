"""GPTQ-style rounding of INT8 weights (Frantar et al. 2023), for the per-token recipes (and of
the 4- and 8-bit block codes of the weight-only ones, ``gptq_block_codes``).

Round-to-nearest gives every weight its own rounding error; GPTQ rounds the input rows of a
weight ``W`` [K, N] one at a time and pushes each row's error onto the rows not yet rounded, in
the direction the layer's inputs make cheapest: it minimizes ``||X W - X W_q||^2`` over the
calibration activations ``X`` through ``H = X^T X`` (K x K), instead of ``||W - W_q||^2``.

The grid is the one the recipes already use: symmetric per output channel,
``s_n = max_k |W[k, n]| / q_max``, codes in ``[-q_max, q_max]``; only which code each weight gets
changes. The rows are taken in order with lazy block updates (128 rows), ``H`` is damped by
1% of its mean diagonal (GPTQ's default) and inputs that never fire (a zero diagonal) are dropped.

``collect_hessians`` runs the FP32 graph on calibration windows with the MatMul inputs exposed
and accumulates ``X^T X`` per input tensor (q, k and v read one tensor: one Hessian); float32
accumulators (GPTQ's own choice): 0.4-0.8 GB for SmolLM2 or Gemma 3 270M.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..feeds import window_feeder
from ..measure.sqnr import expose_tensors, model_by_reference, open_beside
from ..onnx_wire import raw_initializers

DAMP = 0.01
BLOCK = 128
HESSIAN_BATCH = 2   # calibration windows per run of the exposed graph


def collect_hessians(model_path: Path, tensors: list[str], windows: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
    """``X^T X`` (float32, [K, K]) of each tensor in ``tensors`` over every position of
    ``windows`` [n, seq] (int64 token ids), and the number of rows (positions) summed."""
    hessians, _, rows = collect_activation_stats(model_path, windows, hessians_of=tensors)
    return hessians, rows


ABS_HISTOGRAM_BINS = 4096


def collect_activation_stats(model_path: Path, windows: np.ndarray, *, hessians_of: list[str] = (),
                             abs_max_of: list[str] = (), histogram_range: dict[str, float] | None = None
                             ) -> tuple[dict[str, np.ndarray], dict[str, dict], int]:
    """One pass of the FP32 graph over ``windows`` [n, seq] with the named tensors exposed:
    ``X^T X`` of each tensor in ``hessians_of`` (GPTQ); for each in ``abs_max_of`` (a calibrated
    activation scale) ``{"max_abs": max |X|, "histogram": counts}``, the counts of |X| in
    ``ABS_HISTOGRAM_BINS`` equal bins over ``[0, histogram_range[tensor]]`` (values beyond land in
    the last bin; no histogram without a range); and the number of rows (positions) seen."""
    windows = np.asarray(windows, dtype=np.int64)
    tensors = list(dict.fromkeys([*hessians_of, *abs_max_of]))
    want_h, want_max = set(hessians_of), set(abs_max_of)
    hessians: dict[str, np.ndarray] = {}
    abs_stats: dict[str, dict] = {}
    ranges = histogram_range or {}
    rows = 0
    if not tensors:
        return hessians, abs_stats, rows
    # The graph with the tensors tapped, on the original weights, with ORT's full optimizations
    # (an optimizer never fuses away a graph output).
    session = open_beside(model_path, expose_tensors(model_path, tensors, only=True), ort.SessionOptions())
    feed = window_feeder(session)
    for lo in range(0, len(windows), HESSIAN_BATCH):
        batch = np.ascontiguousarray(windows[lo:lo + HESSIAN_BATCH])
        outputs = session.run(tensors, feed(batch))
        for name, x in zip(tensors, outputs, strict=True):
            x = np.asarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
            if name in want_max:
                stats = abs_stats.setdefault(name, {"max_abs": 0.0})
                a = np.abs(x)
                stats["max_abs"] = max(stats["max_abs"], float(a.max(initial=0.0)))
                if name in ranges:
                    bins = np.minimum((a * (ABS_HISTOGRAM_BINS / ranges[name])).astype(np.int64),
                                      ABS_HISTOGRAM_BINS - 1)
                    counts = np.bincount(bins.ravel(), minlength=ABS_HISTOGRAM_BINS)
                    stats["histogram"] = stats["histogram"] + counts if "histogram" in stats else counts
            if name not in want_h:
                continue
            h = hessians.get(name)
            if h is None:
                hessians[name] = x.T @ x
            else:
                h += x.T @ x
        rows += batch.shape[0] * batch.shape[1]
    del session
    return hessians, abs_stats, rows


class LazyHessians(Mapping):
    """``X^T X`` per input tensor, computed by one pass of the graph (``compute()`` -> (hessians,
    rows)) by ``load()`` or when a weight first asks for one: where every weight's codes are
    already known (:class:`GPTQCodes`), the pass never runs."""

    def __init__(self, tensors: list[str], compute: Callable[[], tuple[dict[str, np.ndarray], int]]):
        self.tensors, self._compute = list(tensors), compute
        self._hessians: dict[str, np.ndarray] | None = None
        self.rows: int | None = None

    def load(self) -> LazyHessians:
        if self._hessians is None:
            self._hessians, self.rows = self._compute()
        return self

    def __getitem__(self, tensor: str) -> np.ndarray:
        return self.load()._hessians[tensor]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, tensor: object) -> bool:
        return tensor in self.tensors


def windows_digest(windows: np.ndarray) -> str:
    windows = np.ascontiguousarray(windows, dtype=np.int64)
    return hashlib.sha1(repr(windows.shape).encode() + windows.tobytes()).hexdigest()


class GPTQCodes:
    """GPTQ's codes of one run, by weight and calibration windows. A recipe's with-past graph holds
    the same weights as its whole-window graph and is calibrated on the same windows (the cache
    proof shows it computes the same activations), so it would solve the same ``X^T X`` again:
    on SmolLM2 one pass of the graph over the calibration windows and 211 solves, about a minute
    on 2 cores. It reads the codes here instead. The key is the weight's bytes and shape, the code range and the
    windows' digest: a weight that differs in one bit, or other windows, is solved anew."""

    def __init__(self):
        self._codes: dict[tuple, tuple[np.ndarray, np.ndarray, float]] = {}
        self.rows: dict[str, int] = {}   # windows digest -> the calibration positions summed

    @staticmethod
    def key(weight: np.ndarray, qmax: int, digest: str) -> tuple:
        weight = np.ascontiguousarray(weight)
        return GPTQCodes.key_of_bytes(weight.data, weight.shape, weight.dtype, qmax, digest)

    @staticmethod
    def key_of_bytes(data, shape: tuple[int, ...], dtype, qmax: int, digest: str) -> tuple:
        """``key`` of a weight given as its C-order little-endian bytes (a buffer: not copied)."""
        return hashlib.sha1(data).hexdigest(), tuple(int(d) for d in shape), str(np.dtype(dtype)), int(qmax), digest

    def knows(self, model_path: Path, nodes: list[str], qmax: int, digest: str) -> bool:
        """Whether the codes of every 2-D weight of the MatMuls ``nodes`` in the model are here.
        The weights are hashed where they lie in the file (``onnx_wire.raw_initializers``): loading
        the model to read them held the whole graph and two copies of the largest weight (2.9 GB
        on Gemma 3's with-past graph, the generation stage's peak)."""
        if not any(key[-1] == digest for key in self._codes):   # nothing solved on these windows yet
            return False
        wanted = set(nodes)
        graph = model_by_reference(model_path).graph
        initializers = {i.name for i in graph.initializer}
        weight_of = {node.input[1] for node in graph.node
                     if node.op_type == "MatMul" and node.name in wanted and node.input[1] in initializers}
        model = None
        with raw_initializers(model_path) as raw:
            for name in weight_of:
                if name in raw and raw[name][1] == onnx.TensorProto.FLOAT and sys.byteorder == "little":
                    dims, _, data = raw[name]
                    if len(dims) != 2:
                        continue
                    key = self.key_of_bytes(data, dims, np.float32, qmax, digest)
                else:   # held in typed fields (float_data, ...), or not float32: read it the ordinary way
                    model = model or onnx.load(str(model_path))
                    init = next((i for i in model.graph.initializer if i.name == name), None)
                    if init is None:
                        continue
                    weight = numpy_helper.to_array(init)
                    if weight.ndim != 2:
                        continue
                    key = self.key(weight, qmax, digest)
                if key not in self._codes:
                    return False
        return True

    def get(self, key: tuple) -> tuple[np.ndarray, np.ndarray, float] | None:
        return self._codes.get(key)

    def put(self, key: tuple, codes: np.ndarray, scales: np.ndarray, error_ratio: float) -> None:
        self._codes[key] = (codes, scales, error_ratio)


def mse_clip(counts: np.ndarray, top: float, levels: int) -> float:
    """The clip ``c`` of a symmetric uniform quantizer (step ``c / levels``) that minimizes the
    expected squared error over a histogram of |x| (``counts`` in equal bins over ``[0, top]``):
    values below ``c`` pay the rounding noise ``step^2 / 12``, values above pay ``(|x| - c)^2``.
    On a norm output whose rows all have RMS 1 a few rows reach the tensor's max; the clip trades
    their error for a finer step on every other row (the MSE rule of ACIQ and TensorRT's
    calibrators)."""
    counts = np.asarray(counts, dtype=np.float64)
    width = top / len(counts)
    centers = (np.arange(len(counts)) + 0.5) * width
    used = np.nonzero(counts)[0]
    if not len(used):
        return float(top)
    candidates = (np.arange(1, used[-1] + 2)) * width        # bin edges up to just past the largest value
    below = np.cumsum(counts)                                 # elements whose bin lies under each edge
    # sum over bins above the edge of n * (center - c)^2, from prefix sums of n, n*x and n*x^2
    n_above = counts.sum() - below[:len(candidates)]
    s1 = (counts * centers).sum() - np.cumsum(counts * centers)[:len(candidates)]
    s2 = (counts * centers ** 2).sum() - np.cumsum(counts * centers ** 2)[:len(candidates)]
    clip_error = s2 - 2 * candidates * s1 + candidates ** 2 * n_above
    rounding = below[:len(candidates)] * (candidates / levels) ** 2 / 12
    return float(candidates[int(np.argmin(clip_error + rounding))])


def gptq_quantize(weight: np.ndarray, hessian: np.ndarray, qmax: int, *, damp: float = DAMP,
                  block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ codes of ``weight`` [K, N] (``y = x @ W``) on the per-output-channel grid
    ``s = max|W[:, n]| / qmax``: (codes int8 [K, N], scales float32 [N])."""
    # max |w| of float32 values is exact in float32: no float64 copy of a 262k-wide head for it
    amax = np.abs(np.asarray(weight, dtype=np.float32)).max(axis=0).astype(np.float64)
    scale = np.where(amax > 0, amax / qmax, 1.0)
    codes = _gptq_rows(weight, hessian, lambda k, cols: scale[cols], -qmax, qmax, damp=damp, block=block)
    return codes, scale.astype(np.float32)


def block_scales(weight: np.ndarray, bits: int, block: int) -> np.ndarray:
    """ORT's symmetric scales of ``weight`` [K, N]: per block of ``block`` rows (the last one
    padded with zeros) and column, the weight of largest magnitude over ``qmin``. [K / block, N]."""
    k_dim, n_dim = weight.shape
    blocks = -(-k_dim // block)
    padded = np.zeros((blocks * block, n_dim), dtype=np.float32)
    padded[:k_dim] = weight
    grouped = padded.reshape(blocks, block, n_dim)
    top = np.take_along_axis(grouped, np.abs(grouped).argmax(axis=1)[:, None, :], axis=1)[:, 0, :]
    return (top / -(1 << (bits - 1))).astype(np.float32)


def gptq_block_codes(weight: np.ndarray, hessian: np.ndarray, bits: int, group: int, *,
                     damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ codes of ``weight`` [K, N] on ONNX Runtime's symmetric MatMulNBits grid: one scale per
    ``group`` rows along K and column (``block_scales``), codes in ``[qmin, -qmin - 1]``. The
    scales come from the weights (GPTQ's static groups): only the codes differ from round-to-nearest.
    Returns (codes int8 [K, N], scales float32 [ceil(K / group), N])."""
    qmin = -(1 << (bits - 1))
    scales = block_scales(np.asarray(weight, dtype=np.float32), bits, group)
    safe = np.where(scales != 0, scales, 1.0).astype(np.float64)
    codes = _gptq_rows(weight, hessian, lambda k, cols: safe[k // group, cols], qmin, -qmin - 1, damp=damp)
    return codes, scales


# Output columns per slice of the GPTQ loop and of ``output_error``: each column is rounded on its
# own (H is shared), so a wide weight is taken a slice at a time. Gemma 3's tied head is [640, 262144]:
# whole, its float64 working copy and the rank-128 update are 1.3 and 1.1 GB, and the error measure
# four float64 copies more (the run's memory peak); a 16384-column slice keeps each under 90 MB.
COLUMN_SLICE = 16384


def _column_slices(n_dim: int) -> list[slice]:
    return [slice(c0, min(c0 + COLUMN_SLICE, n_dim)) for c0 in range(0, n_dim, COLUMN_SLICE)]


def _gptq_rows(weight: np.ndarray, hessian: np.ndarray, scale_of, qmin: int, qmax: int, *, damp: float = DAMP,
               block: int = BLOCK) -> np.ndarray:
    """The GPTQ loop: row ``k`` of ``weight`` rounded to ``scale_of(k, columns)`` (the scales of
    those columns) times a code in ``[qmin, qmax]``, its error pushed onto the rows after it
    through the Cholesky factor of H^-1; one slice of output columns at a time."""
    weight = np.asarray(weight)
    k_dim, n_dim = weight.shape
    h = np.asarray(hessian, dtype=np.float64).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h[np.diag_indices(k_dim)] += damp * float(np.mean(np.diag(h)))
    # The upper Cholesky factor of H^-1: row i's update of the rows after it, as in GPTQ.
    h_inv = np.linalg.inv(h)
    h_inv = (h_inv + h_inv.T) / 2
    u = np.linalg.cholesky(h_inv).T
    codes = np.empty(weight.shape, dtype=np.int8)   # qmin >= -128 and qmax <= 127 for every caller
    for cols in _column_slices(n_dim):
        w = np.asarray(weight[:, cols], dtype=np.float64)   # a copy: updated in place
        w[dead, :] = 0.0
        for b0 in range(0, k_dim, block):
            b1 = min(b0 + block, k_dim)
            w1 = w[b0:b1]                      # a view: updated in place
            errors = np.empty_like(w1)
            u1 = u[b0:b1, b0:b1]
            for i in range(b1 - b0):
                scale = scale_of(b0 + i, cols)
                q = np.clip(np.rint(w1[i] / scale), qmin, qmax)
                codes[b0 + i, cols] = q
                err = (w1[i] - q * scale) / u1[i, i]
                w1[i:] -= np.outer(u1[i, i:], err)
                errors[i] = err
            w[b1:] -= u[b0:b1, b1:].T @ errors
    return codes


def output_error(weight: np.ndarray, codes: np.ndarray, scale: np.ndarray, hessian: np.ndarray) -> float:
    """``trace(dW^T H dW)``: the summed squared error of ``X W`` over the calibration rows (a sum
    over output columns, taken a slice at a time)."""
    h = np.asarray(hessian, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    total = 0.0
    for cols in _column_slices(np.shape(weight)[1]):
        delta = np.asarray(weight[:, cols], dtype=np.float64) - codes[:, cols].astype(np.float64) * scale[cols]
        total += float(((h @ delta) * delta).sum())
    return total


def matmul_inputs(model_path: Path, nodes: list[str]) -> dict[str, str]:
    """node name -> the activation tensor it reads (its first input)."""
    wanted = set(nodes)
    return {n.name: n.input[0] for n in model_by_reference(model_path).graph.node if n.name in wanted}

