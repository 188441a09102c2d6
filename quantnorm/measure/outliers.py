"""Massive activations and outliers of a PyTorch model, measured with forward hooks.

Definitions (shared FORMULAS.md):

- Massive activation (Sun et al. 2024, arXiv 2402.17762): a residual-stream entry with
  |a| > ``MASSIVE_ABS`` (100) and |a| >= ``MASSIVE_RATIO`` (1000) x the median |a| of its hidden
  state, the hidden state being one sample's (one window's) [seq, d] tensor at that layer.
- Max infinity norm and kurtosis (Bondarenko et al. 2023, arXiv 2306.12929): per sample, max |x|
  over the flattened tensor and Pearson kurtosis ``mean((x-mu)^4) / sigma^4``, averaged over
  samples.
- Outlier feature (LLM.int8()): |x| >= ``OUTLIER_FEATURE_ABS`` (6).

Monitored tensors: the residual stream (embedding output and every block's output; ResiDual's
second stream x_d separately), every norm's output and the input of every weight MatMul
(``nn.Linear``). ``TensorAccumulator`` holds the math; ``sqnr.onnx_tensor_stats`` uses the same
class for the ONNX-side view, so both report identical definitions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from ..errors import MeasureError
from ..models.lm import CausalLM

MASSIVE_ABS = 100.0
MASSIVE_RATIO = 1000.0
OUTLIER_FEATURE_ABS = 6.0
TOP_K = 3
# A model with real massive activations has a few per sample and layer; over many windows that
# would flood results.json, so `massive` keeps the largest ones and `massive_total` counts all.
MASSIVE_LIMIT = 100

Layer = int | str  # "embed" or a block index


# --------------------------------------------------------------------------------------------
# The math, shared with sqnr.py
# --------------------------------------------------------------------------------------------

def per_sample_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sample (leading axis) max |x| and Pearson kurtosis of the flattened rest.

    Kurtosis is ``mean((x-mu)^4) / var^2`` with the biased variance (3 for a Gaussian), computed
    in float64 because fourth powers of float32 activations lose precision. A sample with zero
    variance has no kurtosis: NaN, which the averages skip.
    """
    flat = np.asarray(x).reshape(len(x), -1).astype(np.float64)
    inf_norm = np.abs(flat).max(axis=1)
    centred = flat - flat.mean(axis=1, keepdims=True)
    squared = centred * centred  # (not ** 4: numpy's generic power is several times slower)
    var = squared.mean(axis=1)
    m4 = (squared * squared).mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        kurtosis = np.where(var > 0, m4 / np.where(var > 0, var, 1.0) ** 2, np.nan)
    return inf_norm, kurtosis


def as_samples(x: np.ndarray, n_samples: int) -> np.ndarray:
    """View a batch tensor as [samples, positions, channels].

    The batch axis is the outermost one in every tensor we monitor, so each sample is one
    contiguous chunk even when a graph flattened batch and sequence together ([B*T, C]).
    ``positions`` is the product of the axes between batch and channel (the token position for
    [B, T, C]; a flattened head/position index for 4-D attention tensors).
    """
    x = np.asarray(x)
    channels = x.shape[-1] if x.ndim >= 2 else 1
    if n_samples < 1 or x.size % (n_samples * channels):
        raise MeasureError(
            f"cannot split a tensor of shape {x.shape} into {n_samples} samples: the batch axis "
            f"must be outermost (monitor activations, not weights or shape tensors)"
        )
    return x.reshape(n_samples, -1, channels)


@dataclass(frozen=True)
class TensorStats:
    """Outlier figures of one monitored tensor over the whole probed set.

    ``top``: up to three largest |a| at distinct (position, channel), each with its signed value
    and the sample it came from. ``median_abs`` is over every entry of every sample and ``ratio``
    is max|a| / median|a| (None if the median is 0). ``kurtosis`` and ``inf_norm`` are per-sample
    figures averaged over samples (Bondarenko et al.). ``rms`` is over all entries.
    ``outlier_features`` counts channels (feature dimensions) that reach |x| >= 6 anywhere;
    ``outlier_entries`` counts the entries that do.
    """

    name: str
    top: list[dict]
    median_abs: float
    ratio: float | None
    kurtosis: float | None
    inf_norm: float
    rms: float
    outlier_features: int
    outlier_entries: int = 0
    max_abs: float = 0.0
    n_samples: int = 0

    def metrics(self) -> dict:
        """Everything but the name, JSON-ready."""
        out = asdict(self)
        del out["name"]
        return out

    def to_dict(self, key: str = "tensor") -> dict:
        return {key: self.name, **self.metrics()}


class TensorAccumulator:
    """Streams batches of one tensor and keeps only what the final figures need.

    Per sample: inf-norm and kurtosis (two floats). Across samples: the running max |a| at each
    (position, channel) with its sign and sample, sums for the RMS, the outlier-channel mask, and
    |a| itself (float32) for the exact median. The median is the one figure that needs every
    value; for our sizes (windows x seq x d floats per tensor) that is a few MB.
    """

    def __init__(self, name: str):
        self.name = name
        self._inf_norms: list[np.ndarray] = []
        self._kurtoses: list[np.ndarray] = []
        self._abs_chunks: list[np.ndarray] = []
        self._sum_sq = 0.0
        self._count = 0
        self._n_samples = 0
        self._max_abs: np.ndarray | None = None   # [P, C]
        self._max_signed: np.ndarray | None = None
        self._max_sample: np.ndarray | None = None
        self._outlier_channels: np.ndarray | None = None
        self._outlier_entries = 0

    def add(self, x: np.ndarray, n_samples: int | None = None) -> None:
        """Add a batch; its leading axis is the sample axis unless ``n_samples`` says otherwise."""
        x = as_samples(np.asarray(x, dtype=np.float32), n_samples or len(x))
        inf_norm, kurtosis = per_sample_stats(x)
        self._inf_norms.append(inf_norm)
        self._kurtoses.append(kurtosis)
        a = np.abs(x)
        self._abs_chunks.append(a.reshape(-1))
        self._sum_sq += float(np.sum(x.astype(np.float64) ** 2))
        self._count += x.size

        batch_max = a.max(axis=0)
        batch_arg = a.argmax(axis=0)
        if self._max_abs is None:
            self._max_abs = np.full(batch_max.shape, -1.0, dtype=np.float32)
            self._max_signed = np.zeros(batch_max.shape, dtype=np.float32)
            self._max_sample = np.zeros(batch_max.shape, dtype=np.int64)
            self._outlier_channels = np.zeros(batch_max.shape[-1], dtype=bool)
        elif batch_max.shape != self._max_abs.shape:
            raise MeasureError(
                f"tensor {self.name}: batch of shape {x.shape[1:]} differs from earlier batches "
                f"{self._max_abs.shape}; probe windows of one length"
            )
        better = batch_max > self._max_abs
        signed = np.take_along_axis(x, batch_arg[None], axis=0)[0]
        self._max_abs = np.where(better, batch_max, self._max_abs)
        self._max_signed = np.where(better, signed, self._max_signed)
        self._max_sample = np.where(better, batch_arg + self._n_samples, self._max_sample)

        is_outlier = a >= OUTLIER_FEATURE_ABS
        self._outlier_channels |= is_outlier.any(axis=(0, 1))
        self._outlier_entries += int(is_outlier.sum())
        self._n_samples += len(x)

    def finish(self) -> TensorStats:
        if self._max_abs is None:
            raise MeasureError(f"tensor {self.name} was never seen: nothing to report")
        median = float(np.median(np.concatenate(self._abs_chunks)))
        # Top-k over distinct (position, channel): the same planted channel in every sample is
        # one finding, not three.
        flat = self._max_abs.reshape(-1)
        k = min(TOP_K, flat.size)
        idx = np.argsort(-flat, kind="stable")[:k]
        positions, channels = np.unravel_index(idx, self._max_abs.shape)
        top = [
            {"value": float(self._max_signed[p, c]), "position": int(p), "channel": int(c),
             "sample": int(self._max_sample[p, c])}
            for p, c in zip(positions, channels)
        ]
        max_abs = float(flat[idx[0]])
        kurtosis = np.concatenate(self._kurtoses)
        return TensorStats(
            name=self.name,
            top=top,
            median_abs=median,
            ratio=max_abs / median if median > 0 else None,
            kurtosis=float(np.nanmean(kurtosis)) if np.isfinite(kurtosis).any() else None,
            inf_norm=float(np.mean(np.concatenate(self._inf_norms))),
            rms=float(np.sqrt(self._sum_sq / self._count)),
            outlier_features=int(self._outlier_channels.sum()),
            outlier_entries=self._outlier_entries,
            max_abs=max_abs,
            n_samples=self._n_samples,
        )


def find_massive(x: np.ndarray, layer: Layer, first_sample: int, stream: str = "main") -> list[dict]:
    """Entries of residual batch ``x`` [B, T, d] passing Sun et al.'s test, per sample's median."""
    a = np.abs(x)
    medians = np.median(a.reshape(len(a), -1), axis=1)
    mask = (a > MASSIVE_ABS) & (a >= MASSIVE_RATIO * medians[:, None, None])
    rows = []
    for s, p, c in zip(*np.nonzero(mask)):
        med = float(medians[s])
        rows.append({
            "layer": layer, "stream": stream, "sample": int(first_sample + s), "position": int(p),
            "channel": int(c), "value": float(x[s, p, c]),
            "ratio": float(a[s, p, c]) / med if med > 0 else None,
        })
    return rows


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------

Sink = Callable[[str, str, torch.Tensor], None]  # (kind, name, tensor)


def _register_hooks(model: CausalLM, sink: Sink, kinds: set[str]) -> list[torch.utils.hooks.RemovableHandle]:
    """Hook the monitored tensors; ``sink(kind, name, tensor)`` receives each one per forward.

    kinds: "residual" (name "embed" or the block index; stream[0]), "residual_skip" (ResiDual's
    x_d, block index), "norm" (module name), "matmul" (nn.Linear input, module name),
    "attention" (probabilities [B, H, T, T], block index).
    """
    handles = []
    names = {module: name for name, module in model.named_modules()}

    if "residual" in kinds:
        # The embedding output is the stream entering block 0.
        handles.append(model.blocks[0].register_forward_pre_hook(
            lambda mod, args: sink("residual", "embed", args[0][0])))
    for i, block in enumerate(model.blocks):
        def on_block(mod, args, out, i=i):
            if "residual" in kinds:
                sink("residual", str(i), out[0])
            if "residual_skip" in kinds and len(out) > 1:
                sink("residual_skip", str(i), out[1])
        handles.append(block.register_forward_hook(on_block))
        if "attention" in kinds:
            handles.append(block.attn.probs_tap.register_forward_hook(
                lambda mod, args, out, i=i: sink("attention", str(i), out)))
        if "norm" in kinds:
            for norm in [*block.attn_norms.values(), *block.mlp_norms.values()]:
                handles.append(norm.register_forward_hook(
                    lambda mod, args, out: sink("norm", names[mod], out)))
    if "norm" in kinds and model.final_norm is not None:
        handles.append(model.final_norm.register_forward_hook(
            lambda mod, args, out: sink("norm", names[mod], out)))
    if "matmul" in kinds:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(
                    lambda mod, args: sink("matmul", names[mod], args[0])))
    return handles


def _windows(inputs: np.ndarray, model: CausalLM) -> np.ndarray:
    inputs = np.asarray(inputs)
    if inputs.ndim == 1:
        inputs = inputs[None]
    if inputs.ndim != 2 or inputs.shape[0] == 0 or inputs.shape[1] == 0:
        raise MeasureError(f"probe inputs must be token windows [n, seq], got shape {inputs.shape}")
    if inputs.shape[1] > model.cfg.context:
        raise MeasureError(f"windows of {inputs.shape[1]} tokens exceed the model context {model.cfg.context}")
    return inputs.astype(np.int64)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OutlierReport:
    """The ``outliers`` section of results.json (RESULTS.md) plus extras.

    ``residual``: one row for the embedding output (layer "embed") and one per block output
    (layer 0..L-1); ``residual_skip``: ResiDual's x_d after each block (empty otherwise);
    ``norm_outputs`` / ``matmul_inputs``: one row per norm module / nn.Linear, keyed "tensor" by
    module name (``sqnr.onnx_tensor_stats`` gives the ONNX tensor names' view).
    ``massive``: the ``MASSIVE_LIMIT`` largest entries passing Sun et al.'s test (``massive_total``
    counts all). ``bos_attention``: per layer, mean attention probability on key 0 over heads,
    queries 1..T-1 and samples; query 0 can only attend to key 0 (weight 1 by causality), so it
    is excluded, otherwise every model would get a free 1/T.
    """

    residual: list[dict]
    residual_skip: list[dict]
    norm_outputs: list[dict]
    matmul_inputs: list[dict]
    massive: list[dict]
    bos_attention: list[float | None]
    massive_total: int = 0
    n_samples: int = 0
    seq_len: int = 0
    thresholds: dict = field(default_factory=lambda: {
        "massive_abs": MASSIVE_ABS, "massive_ratio": MASSIVE_RATIO, "outlier_feature_abs": OUTLIER_FEATURE_ABS})

    def to_dict(self) -> dict:
        return asdict(self)


def _layer_key(name: str) -> Layer:
    return name if name == "embed" else int(name)


def probe(model: CausalLM, inputs: np.ndarray, *, batch_size: int = 16) -> OutlierReport:
    """Run ``inputs`` (token windows [n, seq], each starting with BOS) through ``model`` and
    measure every monitored tensor. The model is left as it was (hooks removed, mode restored).
    """
    windows = _windows(inputs, model)
    if batch_size < 1:
        raise MeasureError(f"batch_size must be >= 1, got {batch_size}")
    accs: dict[tuple[str, str], TensorAccumulator] = {}
    massive: list[dict] = []
    attn_sum: dict[str, float] = {}
    attn_count: dict[str, int] = {}
    first_sample = 0

    def sink(kind: str, name: str, t: torch.Tensor) -> None:
        x = _to_numpy(t)
        if kind == "attention":
            to_bos = x[:, :, 1:, 0]  # [B, H, T-1]: every query but the first, key 0
            attn_sum[name] = attn_sum.get(name, 0.0) + float(to_bos.sum(dtype=np.float64))
            attn_count[name] = attn_count.get(name, 0) + to_bos.size
            return
        if kind in ("residual", "residual_skip"):
            stream = "main" if kind == "residual" else "skip"
            massive.extend(find_massive(x, _layer_key(name), first_sample, stream))
        key = (kind, name)
        if key not in accs:
            accs[key] = TensorAccumulator(name)
        accs[key].add(x)

    was_training = model.training
    model.eval()
    handles = _register_hooks(model, sink, {"residual", "residual_skip", "norm", "matmul", "attention"})
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                first_sample = start
                model(torch.from_numpy(windows[start:start + batch_size]))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    def rows(kind: str, key: str = "tensor") -> list[dict]:
        out = []
        for (k, name), acc in accs.items():  # insertion order = forward order
            if k == kind:
                stats = acc.finish()
                out.append({key: _layer_key(name), **stats.metrics()} if key == "layer" else stats.to_dict(key))
        return out

    massive.sort(key=lambda r: -abs(r["value"]))
    seq = windows.shape[1]
    return OutlierReport(
        residual=rows("residual", "layer"),
        residual_skip=rows("residual_skip", "layer"),
        norm_outputs=rows("norm"),
        matmul_inputs=rows("matmul"),
        massive=massive[:MASSIVE_LIMIT],
        bos_attention=[attn_sum[str(i)] / attn_count[str(i)] if attn_count.get(str(i)) else None
                       for i in range(len(model.blocks))],
        massive_total=len(massive),
        n_samples=len(windows),
        seq_len=seq,
    )


def largest_ratio_layer(residual_rows: list[dict]) -> Layer:
    """The residual layer with the largest max/median ratio (for the heatmap)."""
    rated = [r for r in residual_rows if r.get("ratio") is not None]
    if not rated:
        raise MeasureError("no residual layer has a ratio (all medians are zero)")
    return max(rated, key=lambda r: r["ratio"])["layer"]


def heatmap_for_layer(model: CausalLM, inputs_one_window: np.ndarray, layer: Layer | None = None) -> np.ndarray:
    """|a| of the residual stream over (position, channel) for one window, shape [seq, d].

    ``layer`` is "embed" or a block index; None picks the layer with the largest max/median
    ratio in this window.
    """
    window = _windows(inputs_one_window, model)[:1]
    captured: dict[Layer, np.ndarray] = {}

    def sink(kind: str, name: str, t: torch.Tensor) -> None:
        captured[_layer_key(name)] = np.abs(_to_numpy(t)[0])

    was_training = model.training
    model.eval()
    handles = _register_hooks(model, sink, {"residual"})
    try:
        with torch.no_grad():
            model(torch.from_numpy(window))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    if isinstance(layer, str) and layer.isdigit():  # "3" as written in a CLI flag or a JSON key
        layer = int(layer)
    if layer is None:
        def ratio(a: np.ndarray) -> float:
            med = float(np.median(a))
            return float(a.max()) / med if med > 0 else 0.0
        layer = max(captured, key=lambda k: ratio(captured[k]))
    if layer not in captured:
        raise MeasureError(f"no residual layer {layer!r}: choose 'embed' or 0..{len(model.blocks) - 1}")
    return captured[layer]


def first_births(born: list[dict], limit: int = 20) -> list[dict]:
    """The first block at which each (position, channel) became massive (largest value first)."""
    seen, out = set(), []
    for r in born:
        key = (r["position"], r["channel"])
        if key in seen:
            continue
        seen.add(key)
        out.append(r)
    out.sort(key=lambda r: -abs(r["value"]))
    return out[:limit]


def summarize(residual_rows: list[dict], massive: list[dict], massive_total: int) -> dict:
    """Where the largest activations sit: per layer the (position, channel, token) of the max,
    the channels and positions that hold a layer's maximum most often, and the largest ratio."""
    at_max = []
    for r in residual_rows:
        if r.get("top"):
            t = r["top"][0]
            at_max.append({"layer": r["layer"], "value": t["value"], "position": t["position"],
                           "channel": t["channel"], "token": t.get("token"), "ratio": r.get("ratio")})
    channels = Counter(e["channel"] for e in at_max)
    positions = Counter(e["position"] for e in at_max)
    rated = [r for r in residual_rows if r.get("ratio") is not None]
    worst = max(rated, key=lambda r: r["ratio"]) if rated else None
    return {
        "max_per_layer": at_max,
        "channels_holding_layer_max": [{"channel": c, "layers": n} for c, n in channels.most_common()],
        "positions_holding_layer_max": [{"position": p, "layers": n} for p, n in positions.most_common()],
        "largest_ratio": None if worst is None else {"layer": worst["layer"], "ratio": worst["ratio"]},
        "massive_total": massive_total,
        "massive_channels": sorted({m["channel"] for m in massive}),
        "massive_positions": sorted({m["position"] for m in massive}),
    }
