"""FP32-vs-INT8 metrics for Hugging Face checkpoints, over tokens.

Causal LMs: FORMULAS.md's perplexity, KL(p_fp32 || p_int8) ladder and top-1 agreement, with
tokens where the zoo has bytes (``level: "token"``, bits per *token*). The math is
``quantnorm.measure.accuracy``'s ``PairLadder``; only the windows differ: a real vocabulary has a
token 256, which the zoo's byte-level checks would take for its BOS.

Encoders (sentence embeddings): per evaluation passage (window) the cosine similarity of the FP32
and INT8 embeddings (mean, 1st percentile, min); nearest-neighbour agreement: for each passage,
whether its most similar other passage (cosine) is the same under FP32 and INT8 embeddings; the
mean per-token cosine of the last hidden state. With an MLM head, also the masked-LM perplexity
and the KL / top-1 figures over the masked positions (``data.mlm_windows``).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import MeasureError
from ..feeds import window_feeder
from .accuracy import PairLadder

LOGIT_BUDGET_BYTES = 256 * 1024 * 1024  # float64 log-probs of one batch, both models


def auto_batch(seq: int, vocab: int, cap: int = 16) -> int:
    """Windows per batch so that a batch's float64 log-probabilities of both models stay in budget."""
    per_window = max(1, seq * vocab * 8 * 2)
    return int(max(1, min(cap, LOGIT_BUDGET_BYTES // per_window)))


def _run(session, inputs: np.ndarray, output: str, batch_size: int):
    feed = window_feeder(session)
    for lo in range(0, len(inputs), batch_size):
        batch = np.ascontiguousarray(inputs[lo:lo + batch_size], dtype=np.int64)
        try:
            out = session.run([output], feed(batch))[0]
        except Exception as exc:  # noqa: BLE001 - ORT's untyped errors
            raise MeasureError(f"running the model on a batch of shape {batch.shape} failed: "
                               f"{' '.join(str(exc).split())[:300]}") from exc
        if not np.isfinite(out).all():
            raise MeasureError(f"model output {output} holds NaN or inf: the model is broken "
                               "(for INT8 models check the quantization scales)")
        yield lo, out


def compare_tokens(fp32_session, int8_session, inputs: np.ndarray, targets: np.ndarray, *,
                   scored: np.ndarray | None = None, batch_size: int | None = None,
                   output: str = "logits") -> dict:
    """PPL of each model, their ratio, KL mean/p99/max and top-1 agreement over scored positions.

    ``scored``: boolean ``[n, seq]`` (None: every position). Returns the ``accuracy`` dict of a
    ``recipes[]`` entry (the zoo's keys, bits per token instead of per byte).
    """
    inputs = np.asarray(inputs, dtype=np.int64)
    targets = np.asarray(targets, dtype=np.int64)
    if inputs.shape != targets.shape or inputs.ndim != 2 or len(inputs) == 0:
        raise MeasureError(f"inputs {inputs.shape} and targets {targets.shape} must be the same [n, seq]")
    if scored is None:
        scored = np.ones(inputs.shape, dtype=bool)
    ladder = PairLadder()
    batch_size = batch_size or auto_batch(inputs.shape[1], logits_vocab(fp32_session))
    for (lo, lp), (_, lq) in zip(_run(fp32_session, inputs, output, batch_size),
                                 _run(int8_session, inputs, output, batch_size), strict=True):
        if lp.shape != lq.shape:
            raise MeasureError(f"FP32 and INT8 logits differ in shape: {lp.shape} vs {lq.shape}")
        mask = scored[lo:lo + len(lp)]
        tgt = targets[lo:lo + len(lp)][mask]
        if tgt.size and tgt.max() >= lp.shape[-1]:
            raise MeasureError(f"a target id {int(tgt.max())} is outside the model's vocabulary of {lp.shape[-1]}")
        ladder.add(lp[mask], lq[mask], tgt)
    return token_summary(ladder)


def token_summary(ladder: PairLadder) -> dict:
    """The ``accuracy`` dict of a filled ladder over tokens: its summary, bits per token."""
    s = ladder.summary()
    nll_p, nll_q = s.pop("mean_nll_fp32"), s.pop("mean_nll_int8")
    return {**s, "level": "token",
            "bits_per_token_fp32": nll_p / math.log(2), "bits_per_token_int8": nll_q / math.log(2)}


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows (float64); 1 where both rows are zero, 0 where one is."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, np.shape(a)[-1])
    b = np.asarray(b, dtype=np.float64).reshape(-1, np.shape(b)[-1])
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dot = (a * b).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot / (na * nb)
    cos = np.where((na == 0) & (nb == 0), 1.0, np.where((na == 0) | (nb == 0), 0.0, cos))
    return np.clip(cos, -1.0, 1.0)


def nearest_neighbours(emb: np.ndarray) -> np.ndarray:
    """Index of each row's most cosine-similar *other* row (ties: the lowest index)."""
    e = np.asarray(emb, dtype=np.float64)
    norms = np.linalg.norm(e, axis=1, keepdims=True)
    e = e / np.where(norms == 0, 1.0, norms)
    sim = e @ e.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(axis=1)


ENCODER_OUTPUTS = ("sentence_embedding", "last_hidden_state")


def encoder_outputs(session, inputs: np.ndarray, batch_size: int = 16) -> dict[str, np.ndarray]:
    """One pass over ``inputs``: the sentence embeddings and last hidden states, concatenated.
    The FP32 model's are computed once per run and compared with every recipe's."""
    inputs = np.asarray(inputs, dtype=np.int64)
    feed = window_feeder(session)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ENCODER_OUTPUTS}
    for lo in range(0, len(inputs), batch_size):
        batch = np.ascontiguousarray(inputs[lo:lo + batch_size])
        try:
            values = session.run(list(ENCODER_OUTPUTS), feed(batch))
        except Exception as exc:  # noqa: BLE001 - ORT's untyped errors
            raise MeasureError(f"running the model on a batch of shape {batch.shape} failed: "
                               f"{' '.join(str(exc).split())[:300]}") from exc
        for key, value in zip(ENCODER_OUTPUTS, values):
            if not np.isfinite(value).all():
                raise MeasureError(f"model output {key} holds NaN or inf: the model is broken")
            parts[key].append(value)
    return {k: np.concatenate(v) for k, v in parts.items()}


def encoder_compare(fp32: dict[str, np.ndarray], int8_session, inputs: np.ndarray, *, batch_size: int = 16,
                    mlm: tuple[np.ndarray, np.ndarray] | None = None, fp32_session=None) -> dict:
    """Embedding agreement of the FP32 outputs ``fp32`` (``encoder_outputs`` of the FP32 model on
    ``inputs``) and the INT8 model on the evaluation passages ``inputs``.

    ``mlm``: (masked inputs, scored positions) from ``data.mlm_windows`` when the checkpoint has
    an MLM head (then ``fp32_session`` too); the targets are ``inputs`` themselves.
    """
    inputs = np.asarray(inputs, dtype=np.int64)
    int8 = encoder_outputs(int8_session, inputs, batch_size)
    cos = cosine_rows(fp32["sentence_embedding"], int8["sentence_embedding"])
    tok = cosine_rows(fp32["last_hidden_state"], int8["last_hidden_state"])
    out = {
        "cosine_mean": float(cos.mean()), "cosine_p1": float(np.percentile(cos, 1)), "cosine_min": float(cos.min()),
        "n_passages": int(len(cos)),
        "token_cosine_mean": float(tok.mean()), "token_cosine_p1": float(np.percentile(tok, 1)),
        "level": "passage",
    }
    if len(cos) >= 2:
        nn_p = nearest_neighbours(fp32["sentence_embedding"])
        nn_q = nearest_neighbours(int8["sentence_embedding"])
        out["nn_agreement"] = float((nn_p == nn_q).mean())
    else:
        out["nn_agreement"] = None
    if mlm is not None:
        if fp32_session is None:
            raise MeasureError("MLM metrics need the FP32 session")
        masked, scored = mlm
        mlm_acc = compare_tokens(fp32_session, int8_session, masked, inputs, scored=scored,
                                 batch_size=auto_batch(inputs.shape[1], logits_vocab(fp32_session)))
        out.update({k: v for k, v in mlm_acc.items() if k != "level"})
        out["mlm"] = True
    return out


def logits_vocab(session) -> int:
    """The vocabulary of a graph's ``logits`` output (32000 when its shape does not say)."""
    for o in session.get_outputs():
        if o.name == "logits" and isinstance(o.shape[-1], int):
            return o.shape[-1]
    return 32000
