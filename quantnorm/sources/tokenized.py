"""The corpus, tokenized with the checkpoint's own tokenizer, with the zoo's split discipline.

The corpus (``builtin:pydoc`` or ``--corpus``) is split by byte offset exactly as
``quantnorm.data.make_splits`` splits it for the zoo (train / calibration / evaluation, disjoint,
recorded as ``[start_byte, end_byte)``). A pretrained checkpoint trains on nothing here, so the
train range is recorded but unused; calibration windows come from the calibration range only and
every score from the evaluation range only.

Each range's bytes are decoded as UTF-8 (``errors="ignore"``: a range edge may cut a character,
which is dropped) and tokenized without special tokens. Windows are over those tokens (the
protocol is token-level, not byte-level):

- causal LMs: window k starts at token ``s = k*W`` and is used while ``s + W <= n``; input
  ``[BOS] + t[s : s+W-1]``, target ``t[s : s+W]`` (FORMULAS.md's protocol with tokens for bytes:
  each token of the range is scored once, the first of a window predicted from BOS alone);
- encoders: ``[CLS] + t[s : s+W-2] + [SEP]`` with ``s = k*(W-2)``; for an MLM head a fixed,
  seeded 15% of the inner positions are replaced by ``[MASK]`` and scored.

Calibration takes ``n`` windows evenly spaced over the calibration range's windows (window
``floor(i * available / n)``, as ``quantnorm.calibration.calibration_windows`` does for bytes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data import BUILTIN_PYDOC, Corpus, Splits, load_corpus, make_splits
from ..errors import DataError

MLM_MASK_FRACTION = 0.15
MLM_SEED = 0


@dataclass(frozen=True)
class SpecialTokens:
    kind: str                      # causal | encoder
    bos: int | None = None         # causal: the begin-of-sequence token every window starts with
    bos_source: str = ""
    cls: int | None = None         # encoder
    sep: int | None = None
    mask: int | None = None        # encoder with an MLM head

    def to_dict(self) -> dict:
        out = {"bos_token_id": self.bos, "bos_source": self.bos_source} if self.kind == "causal" else \
            {"cls_token_id": self.cls, "sep_token_id": self.sep, "mask_token_id": self.mask}
        return {k: v for k, v in out.items() if v is not None and v != ""}


def special_tokens(tokenizer, config, kind: str) -> SpecialTokens:
    """BOS for causal LMs (tokenizer's, else config's, else EOS as GPT-2 uses it); CLS/SEP for encoders."""
    if kind == "causal":
        for source, value in (("tokenizer.bos_token_id", getattr(tokenizer, "bos_token_id", None)),
                              ("config.bos_token_id", getattr(config, "bos_token_id", None)),
                              ("tokenizer.eos_token_id (no BOS token)", getattr(tokenizer, "eos_token_id", None))):
            if isinstance(value, int):
                return SpecialTokens(kind, bos=value, bos_source=source)
        raise DataError("the tokenizer has neither a BOS nor an EOS token: no begin-of-sequence token to start "
                        "windows with")
    cls = getattr(tokenizer, "cls_token_id", None)
    sep = getattr(tokenizer, "sep_token_id", None)
    cls = cls if isinstance(cls, int) else getattr(tokenizer, "bos_token_id", None)
    sep = sep if isinstance(sep, int) else getattr(tokenizer, "eos_token_id", None)
    if not isinstance(cls, int) or not isinstance(sep, int):
        raise DataError("the encoder's tokenizer has no [CLS]/[SEP] (or BOS/EOS) tokens to frame windows with")
    mask = getattr(tokenizer, "mask_token_id", None)
    return SpecialTokens(kind, cls=cls, sep=sep, mask=mask if isinstance(mask, int) else None)


def tokenize_range(tokenizer, data: bytes, byte_range: tuple[int, int]) -> np.ndarray:
    """Token ids of ``data[start:end]`` (UTF-8, partial characters at the edges dropped)."""
    start, end = byte_range
    text = data[start:end].decode("utf-8", errors="ignore")
    # Through the tokenizer's own call (not its backend, whose tokenizer.json may pad/truncate),
    # with transformers' "longer than the maximum sequence length" warning silenced: we window.
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        ids = tokenizer(text, add_special_tokens=False, truncation=False, padding=False)["input_ids"]
    finally:
        hf_logging.set_verbosity(level)
    return np.asarray(ids, dtype=np.int64)


def window_count(n_tokens: int, window: int, kind: str) -> int:
    body = window if kind == "causal" else window - 2
    return max(0, n_tokens // body) if body > 0 else 0


def make_windows(tokens: np.ndarray, window: int, special: SpecialTokens,
                 indices: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(inputs, targets) for the windows ``indices`` (default all) of one range's tokens.

    Causal: inputs ``[BOS] + t[s:s+W-1]``, targets ``t[s:s+W]``. Encoder: inputs
    ``[CLS] + t[s:s+W-2] + [SEP]``, targets None.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    count = window_count(len(tokens), window, special.kind)
    indices = np.arange(count) if indices is None else np.asarray(indices, dtype=np.int64)
    if special.kind == "causal":
        starts = indices * window
        targets = tokens[starts[:, None] + np.arange(window)[None, :]]
        inputs = np.empty_like(targets)
        inputs[:, 0] = special.bos
        inputs[:, 1:] = targets[:, :-1]
        return inputs, targets
    body = window - 2
    starts = indices * body
    inner = tokens[starts[:, None] + np.arange(body)[None, :]]
    inputs = np.empty((len(indices), window), dtype=np.int64)
    inputs[:, 0] = special.cls
    inputs[:, 1:-1] = inner
    inputs[:, -1] = special.sep
    return inputs, None


def mlm_windows(inputs: np.ndarray, mask_id: int, fraction: float = MLM_MASK_FRACTION,
                seed: int = MLM_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Masked copies of encoder windows and the boolean positions to score.

    Per window, ``round(fraction * (W-2))`` (at least 1) of the inner positions 1..W-2, drawn
    without replacement by ``numpy.random.default_rng(seed)``, become ``mask_id``.
    """
    inputs = np.asarray(inputs, dtype=np.int64)
    n, width = inputs.shape
    k = max(1, int(round(fraction * (width - 2))))
    rng = np.random.default_rng(seed)
    scored = np.zeros_like(inputs, dtype=bool)
    for i in range(n):
        scored[i, 1 + rng.choice(width - 2, size=k, replace=False)] = True
    masked = np.where(scored, mask_id, inputs)
    return masked, scored


@dataclass(frozen=True)
class HFData:
    """Tokenized splits and the windows every later stage uses."""

    corpus: Corpus
    splits: Splits
    window: int
    special: SpecialTokens
    calib_inputs: np.ndarray
    eval_inputs: np.ndarray
    eval_targets: np.ndarray | None
    n_tokens: dict[str, int]
    available_windows: dict[str, int]
    tokenizer_info: dict = field(default_factory=dict)
    calib_requested: int = 0
    eval_rule: str = ""   # how the number of evaluation windows was chosen

    @property
    def kind(self) -> str:
        return self.special.kind

    def describe(self) -> dict:
        """The ``data`` section of results.json: byte ranges and the token-level protocol."""
        causal = self.kind == "causal"
        layout = ("input [BOS] + t[s : s+W-1], target t[s : s+W], s = k*W" if causal else
                  "input [CLS] + t[s : s+W-2] + [SEP], s = k*(W-2)")
        return {
            "corpus": self.corpus.source,
            "sha256": self.corpus.sha256,
            "n_bytes": len(self.corpus.data),
            **{name: list(r) for name, r in self.splits.as_dict().items()},
            "sizes_bytes": self.splits.sizes(),
            "train_range_used": False,
            "level": "token",
            "bos": causal,
            **self.special.to_dict(),
            "window": self.window,
            "window_unit": "tokens",
            "scored_from": 0,
            "layout": layout,
            "decode": "UTF-8 with errors='ignore' per byte range; tokenized without special tokens",
            "tokenizer": dict(self.tokenizer_info),
            "n_tokens": dict(self.n_tokens),
            "available_windows": dict(self.available_windows),
            "n_eval_windows": int(len(self.eval_inputs)),
            "eval_windows": f"the first {len(self.eval_inputs)} of the evaluation range's windows",
            "eval_windows_rule": self.eval_rule,
            "n_calib_windows": int(len(self.calib_inputs)),
            "calib_windows_requested": self.calib_requested,
            "calib_selection": "evenly spaced: window floor(i * available / n), i = 0..n-1",
        }


def tokenizer_info(tokenizer, path: Path | None = None) -> dict:
    info = {"class": type(tokenizer).__name__, "vocab_size": int(len(tokenizer))}
    if path is not None and (Path(path) / "tokenizer.json").is_file():
        info["tokenizer_json_sha256"] = hashlib.sha256((Path(path) / "tokenizer.json").read_bytes()).hexdigest()
    return info


# The default evaluation set (--eval-tokens not given): 128 windows, fewer where the vocabulary
# makes each window's logits large. Scoring a position reads both models' full distributions
# (FORMULAS.md's KL), so the evaluation's cost per recipe grows with positions x vocabulary; the
# budget keeps 128 windows up to a 131k vocabulary and gives Gemma 3's 262k one 64 windows
# (8,192 tokens), so its default evaluate stays within the 2-core budget that
# benchmarks/evaluate_budget.py checks.
DEFAULT_EVAL_WINDOWS = 128
MIN_DEFAULT_EVAL_WINDOWS = 16
EVAL_LOGIT_BUDGET = 1 << 31   # scored positions x vocabulary of the default evaluation set
AUTO_EVAL_WINDOWS = "auto"


def default_eval_windows(window: int, vocab: int) -> int:
    """Windows of the default evaluation set: ``DEFAULT_EVAL_WINDOWS`` within ``EVAL_LOGIT_BUDGET``
    positions x vocabulary, never fewer than ``MIN_DEFAULT_EVAL_WINDOWS``."""
    fit = EVAL_LOGIT_BUDGET // max(1, int(window) * int(vocab))
    return int(max(MIN_DEFAULT_EVAL_WINDOWS, min(DEFAULT_EVAL_WINDOWS, fit)))


def prepare_hf_data(tokenizer, config, kind: str, *, corpus: str | None = BUILTIN_PYDOC, window: int = 128,
                    calib_samples: int = 64, max_eval_windows: int | str | None = None, model_path: Path | None = None,
                    max_positions: int | None = None, calibration_fraction: float = 0.1,
                    evaluation_fraction: float = 0.1) -> HFData:
    """Load and split the corpus, tokenize its calibration and evaluation ranges, build windows."""
    min_window = 2 if kind == "causal" else 3
    if window < min_window:
        raise DataError(f"window must be >= {min_window} tokens, got {window}")
    if max_positions is not None and window > max_positions:
        raise DataError(f"window of {window} tokens exceeds the model's {max_positions} positions (lower --context)")
    special = special_tokens(tokenizer, config, kind)
    source = load_corpus(corpus)
    splits = make_splits(len(source.data), window, calibration_fraction, evaluation_fraction)
    calib_tokens = tokenize_range(tokenizer, source.data, splits.calibration)
    eval_tokens = tokenize_range(tokenizer, source.data, splits.evaluation)
    available = {"calibration": window_count(len(calib_tokens), window, kind),
                 "evaluation": window_count(len(eval_tokens), window, kind)}
    for name, count in available.items():
        if count == 0:
            raise DataError(f"the {name} range tokenizes to too few tokens for one {window}-token window "
                            f"(use a larger corpus or a smaller --context)")
    n_calib = min(int(calib_samples), available["calibration"])
    chosen = (np.arange(n_calib, dtype=np.int64) * available["calibration"]) // n_calib
    calib_inputs, _ = make_windows(calib_tokens, window, special, chosen)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    eval_rule = "all windows of the evaluation range"
    if max_eval_windows == AUTO_EVAL_WINDOWS:
        max_eval_windows = default_eval_windows(window, vocab or len(tokenizer))
        eval_rule = (f"default: {DEFAULT_EVAL_WINDOWS} windows within {EVAL_LOGIT_BUDGET:,} positions x vocabulary "
                     f"(here {max_eval_windows}); --eval-tokens sets it")
    elif max_eval_windows is not None:
        eval_rule = f"--eval-tokens: {max_eval_windows} windows"
    n_eval = available["evaluation"] if max_eval_windows is None else min(max_eval_windows, available["evaluation"])
    eval_inputs, eval_targets = make_windows(eval_tokens, window, special, np.arange(n_eval))
    if vocab and max(int(calib_inputs.max()), int(eval_inputs.max())) >= vocab:
        raise DataError(f"the tokenizer produced ids >= the model's vocabulary of {vocab}: tokenizer and "
                        f"weights do not match")
    return HFData(
        corpus=source, splits=splits, window=window, special=special, calib_inputs=calib_inputs,
        eval_inputs=eval_inputs, eval_targets=eval_targets,
        n_tokens={"calibration": int(len(calib_tokens)), "evaluation": int(len(eval_tokens))},
        available_windows=available, tokenizer_info=tokenizer_info(tokenizer, model_path),
        calib_requested=int(calib_samples), eval_rule=eval_rule,
    )
