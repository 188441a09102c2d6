"""Perplexity of one model and the FP32-vs-INT8 comparison (``shared/FORMULAS.md``).

Protocol: inputs and targets come from ``data.evaluation_windows`` (input ``[BOS] + b[s:s+w-1]``,
target ``b[s:s+w]``), target positions ``i >= scored_from`` are scored, and each probability is
read from the full 257-way softmax. PPL = exp(mean NLL in nats); bits per byte = mean NLL / ln 2.
The comparison adds KL(p_fp32 || p_int8) per scored position (mean, 99th percentile, max) and the
share of positions where both models pick the same next token.

Everything streams over batches: only per-position scalars (NLL sums, the KL of each position)
are kept, never the logits of the whole evaluation range.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..data import BOS
from ..errors import MeasureError
from ..feeds import window_feeder


class _Session(Protocol):
    """What this module needs of an ORT InferenceSession (tests pass a fake)."""

    def get_inputs(self) -> list: ...

    def run(self, output_names, input_feed, run_options=None) -> list: ...


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    bits_per_byte: float
    mean_nll: float  # nats per scored byte
    n_scored: int

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "bits_per_byte": self.bits_per_byte, "mean_nll": self.mean_nll,
                "n_scored": self.n_scored}


@dataclass(frozen=True)
class AccuracyResult:
    ppl_fp32: float
    ppl_int8: float
    ppl_ratio: float  # ppl_int8 / ppl_fp32
    kld_mean: float  # nats, KL(p_fp32 || p_int8) averaged over scored positions
    kld_p99: float
    kld_max: float
    top1_agreement: float  # share of scored positions with the same argmax
    n_scored: int
    bits_per_byte_fp32: float
    bits_per_byte_int8: float

    def to_dict(self) -> dict:
        """``recipes[].accuracy`` of results.json: the contract's keys, then the extras."""
        return {
            "ppl_fp32": self.ppl_fp32, "ppl_int8": self.ppl_int8, "ppl_ratio": self.ppl_ratio,
            "kld_mean": self.kld_mean, "kld_p99": self.kld_p99, "kld_max": self.kld_max,
            "top1_agreement": self.top1_agreement,
            "n_scored": self.n_scored,
            "bits_per_byte_fp32": self.bits_per_byte_fp32, "bits_per_byte_int8": self.bits_per_byte_int8,
        }


# --- input checks ---------------------------------------------------------------------------

def _check_windows(inputs: np.ndarray, targets: np.ndarray | None, scored_from: int,
                   batch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    inputs = np.asarray(inputs)
    if inputs.ndim != 2 or inputs.shape[0] == 0 or inputs.shape[1] == 0:
        raise MeasureError(f"inputs must be a non-empty [windows, seq] array of token ids, got shape {inputs.shape}")
    if not np.issubdtype(inputs.dtype, np.integer):
        raise MeasureError(f"inputs must hold integer token ids, got dtype {inputs.dtype}")
    if batch_size < 1:
        raise MeasureError(f"batch_size must be >= 1, got {batch_size}")
    if targets is not None:
        targets = np.asarray(targets)
        if targets.shape != inputs.shape:
            raise MeasureError(f"targets shape {targets.shape} differs from inputs shape {inputs.shape}")
        if not np.issubdtype(targets.dtype, np.integer):
            raise MeasureError(f"targets must hold integer token ids, got dtype {targets.dtype}")
        if targets.min() < 0:
            raise MeasureError("targets hold a negative token id")
        # BOS is never a target (FORMULAS.md): a BOS here means inputs and targets were built
        # without data.windows_at, e.g. not shifted by one.
        if (targets == BOS).any():
            raise MeasureError(f"targets contain BOS ({BOS}); build windows with quantnorm.data.evaluation_windows")
        targets = targets.astype(np.int64, copy=False)
    seq = inputs.shape[1]
    if not 0 <= scored_from < seq:
        raise MeasureError(f"scored_from must be in [0, {seq}) for windows of {seq} tokens, got {scored_from}")
    return inputs.astype(np.int64, copy=False), targets


def _check_logits(logits: np.ndarray, batch: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim != 3 or logits.shape[:2] != batch.shape:
        raise MeasureError(f"model returned logits of shape {logits.shape} for input of shape {batch.shape}; "
                           f"expected [batch, seq, vocab]")
    if not np.isfinite(logits).all():
        raise MeasureError("model returned non-finite logits (NaN or inf); the model is broken "
                           "(for INT8 models check the quantization scales)")
    return logits


def _check_vocab(targets: np.ndarray, vocab: int) -> None:
    if targets.max() >= vocab:
        raise MeasureError(f"a target id {int(targets.max())} is outside the model's vocabulary of {vocab}")


# --- core math (numpy, float64) -------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis in float64 (the max is subtracted first, so it never overflows)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# Rows of logits processed together by the row-block math below: 16 rows of a 262,144-token
# vocabulary are 32 MB of float64 per temporary. Whole-batch float64 temporaries (a batch of 256
# rows is 0.5 GB each, about ten of them) made the same math 10x slower, memory-bound.
ROWS_PER_BLOCK = 16


def _row_blocks(logits: np.ndarray, targets: np.ndarray):
    x = np.asarray(logits)
    x = x.reshape(-1, x.shape[-1])
    t = np.asarray(targets, dtype=np.int64).reshape(-1)
    for lo in range(0, x.shape[0], ROWS_PER_BLOCK):
        yield lo, x[lo:lo + ROWS_PER_BLOCK], t[lo:lo + ROWS_PER_BLOCK]


def _shifted(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a = x - max x`` in float64 and ``log sum exp a`` per row."""
    a = block.astype(np.float64)
    a -= a.max(axis=-1, keepdims=True)
    return a, np.log(np.exp(a).sum(axis=-1))


def nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per position (float64), ``logits`` [..., vocab] -> [...]:
    ``target_nll(log_softmax(logits), targets)`` computed in row blocks."""
    out = np.empty(np.shape(targets), dtype=np.float64).reshape(-1)
    for lo, block, tgt in _row_blocks(logits, targets):
        a, lse = _shifted(block)
        out[lo:lo + len(block)] = lse - a[np.arange(len(block)), tgt]
    return out.reshape(np.shape(targets))


def pair_stats(logits_p: np.ndarray, logits_q: np.ndarray,
               targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per position of two models' logits [..., vocab] on the same inputs: -log p(target),
    -log q(target), KL(p || q) (clipped at 0: float64 rounding leaves -1e-17 for identical
    distributions) and whether the argmaxes agree. Float64, in row blocks. With ``a``, ``b`` the
    max-shifted logits, ``log p - log q = (a - b) - (lse_a - lse_b)``, so
    ``KL = sum p (a - b) - (lse_a - lse_b)``: one exp per model instead of a third for ``p``."""
    shape = np.shape(targets)
    nll_p, nll_q, kld = (np.empty(int(np.prod(shape)), dtype=np.float64) for _ in range(3))
    rows_q = np.asarray(logits_q).reshape(-1, np.shape(logits_q)[-1])
    for lo, block_p, tgt in _row_blocks(logits_p, targets):
        block_q = rows_q[lo:lo + len(block_p)]
        rows, hi = np.arange(len(block_p)), lo + len(block_p)
        a = block_p.astype(np.float64)
        a -= a.max(axis=-1, keepdims=True)
        ea = np.exp(a)
        sa = ea.sum(axis=-1)
        lse_a = np.log(sa)
        b, lse_b = _shifted(block_q)
        nll_p[lo:hi] = lse_a - a[rows, tgt]
        nll_q[lo:hi] = lse_b - b[rows, tgt]
        np.subtract(a, b, out=b)
        kld[lo:hi] = np.maximum(np.einsum("ij,ij->i", ea, b) / sa - lse_a + lse_b, 0.0)
    agree = np.asarray(logits_p).argmax(-1) == np.asarray(logits_q).argmax(-1)
    return nll_p.reshape(shape), nll_q.reshape(shape), kld.reshape(shape), agree.reshape(shape)


def target_nll(logp: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per position: ``logp`` [..., vocab], ``targets`` [...] -> [...]."""
    return -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def ppl_result(nll_sum: float, count: int) -> PerplexityResult:
    """PPL = exp(mean NLL): inf past float64's range (a mean NLL above 709 nats, a broken model's),
    which the pipeline records as broken rather than failing on."""
    mean = nll_sum / count
    ppl = math.exp(mean) if mean < math.log(np.finfo(np.float64).max) else math.inf
    return PerplexityResult(ppl=ppl, bits_per_byte=mean / math.log(2), mean_nll=mean, n_scored=count)


# --- ONNX Runtime ---------------------------------------------------------------------------

def run_logits(session: _Session, inputs: np.ndarray, batch_size: int = 16) -> Iterator[np.ndarray]:
    """Run ``inputs`` [windows, seq] through the session ``batch_size`` windows at a time; yield the
    logits [b, seq, vocab] of each batch in order."""
    inputs, _ = _check_windows(inputs, None, 0, batch_size)
    feed = window_feeder(session)
    for lo in range(0, inputs.shape[0], batch_size):
        batch = np.ascontiguousarray(inputs[lo:lo + batch_size])
        try:
            out = session.run(None, feed(batch))[0]
        except MeasureError:
            raise
        except Exception as exc:
            raise MeasureError(f"running the model on a batch of shape {batch.shape} failed: "
                               f"{' '.join(str(exc).split())[:300]}") from exc
        yield _check_logits(out, batch)


def perplexity(session: _Session, inputs: np.ndarray, targets: np.ndarray, *, scored_from: int = 0,
               batch_size: int = 16) -> PerplexityResult:
    """Perplexity and bits per byte of one model over the scored positions (FORMULAS.md)."""
    inputs, targets = _check_windows(inputs, targets, scored_from, batch_size)
    nll_sum, count, lo = 0.0, 0, 0
    for logits in run_logits(session, inputs, batch_size):
        hi = lo + logits.shape[0]
        tgt = targets[lo:hi, scored_from:]
        _check_vocab(tgt, logits.shape[-1])
        nll = nll_rows(logits[:, scored_from:], tgt)
        nll_sum += float(nll.sum())
        count += nll.size
        lo = hi
    return ppl_result(nll_sum, count)


class PairLadder:
    """The FP32-vs-INT8 ladder over scored positions, filled batch by batch: both NLL sums, the KL
    of each position (only these scalars are kept, never the logits) and the top-1 agreements.
    The one implementation every comparison reads (byte-level ``compare``, token-level
    ``measure.token_metrics``, the FP16 check's forwards)."""

    def __init__(self) -> None:
        self.nll_p = self.nll_q = 0.0
        self.agree = 0
        self._klds: list[np.ndarray] = []

    def add(self, logits_p: np.ndarray, logits_q: np.ndarray, targets: np.ndarray) -> None:
        """One batch: logits ``[..., vocab]`` of both models at the scored positions, their targets."""
        if np.shape(logits_p) != np.shape(logits_q):
            raise MeasureError(f"FP32 and INT8 logits differ in shape: {np.shape(logits_p)} vs {np.shape(logits_q)}")
        np_, nq, kl, same = pair_stats(logits_p, logits_q, targets)
        self.nll_p += float(np_.sum())
        self.nll_q += float(nq.sum())
        self._klds.append(kl.ravel())
        self.agree += int(same.sum())

    @property
    def kld(self) -> np.ndarray:
        return np.concatenate(self._klds) if self._klds else np.zeros(0)

    def summary(self) -> dict:
        """PPL of each model and their ratio, KL mean / p99 / max, top-1 agreement, positions
        scored, and each model's mean NLL in nats (MeasureError when nothing was scored)."""
        kld = self.kld
        n = int(kld.size)
        if n == 0:
            raise MeasureError("no scored positions")
        p, q = ppl_result(self.nll_p, n), ppl_result(self.nll_q, n)
        return {
            "ppl_fp32": p.ppl, "ppl_int8": q.ppl, "ppl_ratio": q.ppl / p.ppl,
            "kld_mean": float(kld.mean()), "kld_p99": float(np.percentile(kld, 99)), "kld_max": float(kld.max()),
            "top1_agreement": self.agree / n, "n_scored": n, "mean_nll_fp32": p.mean_nll, "mean_nll_int8": q.mean_nll,
        }


def compare(fp32_session: _Session, int8_session: _Session, inputs: np.ndarray, targets: np.ndarray, *,
            scored_from: int = 0, batch_size: int = 16) -> AccuracyResult:
    """FP32 vs INT8 on the same windows: both perplexities and their ratio, KL(p_fp32 || p_int8)
    mean / p99 / max, and top-1 agreement, all over the same scored positions.

    Run both sessions with the same SessionSpec (FORMULAS.md; pitfall 2 shows why it matters).
    """
    inputs, targets = _check_windows(inputs, targets, scored_from, batch_size)
    ladder = PairLadder()
    lo = 0
    for logits_p, logits_q in zip(run_logits(fp32_session, inputs, batch_size),
                                  run_logits(int8_session, inputs, batch_size), strict=True):
        hi = lo + logits_p.shape[0]
        tgt = targets[lo:hi, scored_from:]
        _check_vocab(tgt, logits_p.shape[-1])
        ladder.add(logits_p[:, scored_from:], logits_q[:, scored_from:], tgt)
        lo = hi
    s = ladder.summary()
    return AccuracyResult(
        ppl_fp32=s["ppl_fp32"], ppl_int8=s["ppl_int8"], ppl_ratio=s["ppl_ratio"],
        kld_mean=s["kld_mean"], kld_p99=s["kld_p99"], kld_max=s["kld_max"],
        top1_agreement=s["top1_agreement"], n_scored=s["n_scored"],
        bits_per_byte_fp32=s["mean_nll_fp32"] / math.log(2), bits_per_byte_int8=s["mean_nll_int8"] / math.log(2),
    )


# --- PyTorch (the trainer's final evaluation, same protocol) --------------------------------

def torch_perplexity(model, inputs: np.ndarray, targets: np.ndarray, scored_from: int = 0,
                     batch_size: int = 16) -> PerplexityResult:
    """``perplexity`` for a PyTorch CausalLM (input ids [b, seq] -> logits [b, seq, vocab]).

    Runs under torch.no_grad on the model's device, in eval mode (restored afterwards), with the
    log-softmax in float64 like the ONNX path so the two agree to rounding.
    """
    # torch only for this reference path: the gate imports measure (and so this module) without torch
    import torch
    import torch.nn.functional as F

    inputs, targets = _check_windows(inputs, targets, scored_from, batch_size)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    was_training = model.training
    model.eval()
    nll_sum, count = 0.0, 0
    try:
        with torch.no_grad():
            for lo in range(0, inputs.shape[0], batch_size):
                x = torch.from_numpy(np.ascontiguousarray(inputs[lo:lo + batch_size])).to(device)
                tgt = targets[lo:lo + batch_size, scored_from:]
                logits = model(x)
                if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(x.shape):
                    raise MeasureError(f"model returned logits of shape {tuple(logits.shape)} for input of "
                                       f"shape {tuple(x.shape)}; expected [batch, seq, vocab]")
                if not torch.isfinite(logits).all():
                    raise MeasureError("model returned non-finite logits (NaN or inf); the model is broken")
                _check_vocab(tgt, logits.shape[-1])
                logits = logits[:, scored_from:].double()
                nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      torch.from_numpy(tgt.reshape(-1)).to(device), reduction="sum")
                nll_sum += float(nll)
                count += tgt.size
    finally:
        model.train(was_training)
    return ppl_result(nll_sum, count)
