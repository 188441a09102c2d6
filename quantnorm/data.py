"""Corpus, byte-level tokens and the three disjoint splits (train / calibration / evaluation).

Tokens are the corpus bytes (0..255) plus one BOS token (256): vocabulary 257, nothing to
download. Every sequence the model sees starts with BOS, because attention sinks and massive
activations form on a first token and a zoo without one could not show them.

The corpus is split by byte offset into three ranges that never overlap. Calibration and
evaluation must stay disjoint: a quantization score measured on calibration text is not a score.
"""

from __future__ import annotations

import hashlib
import pydoc_data.topics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

VOCAB_SIZE = 257
BOS = 256
BUILTIN_PYDOC = "builtin:pydoc"


@dataclass(frozen=True)
class Corpus:
    """The corpus bytes and where they came from (a path, or ``builtin:pydoc``)."""

    source: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.uint8)


def load_corpus(source: str | Path | None = None) -> Corpus:
    """Load ``builtin:pydoc`` (the default), a text file, or a directory of files.

    A directory's files are joined in sorted path order with a newline between them.
    """
    if source is None or str(source) == BUILTIN_PYDOC:
        text = "".join(pydoc_data.topics.topics.values())
        return Corpus(BUILTIN_PYDOC, text.encode("utf-8"))
    path = Path(source)
    if not path.exists():
        raise DataError(f"corpus not found: {path} (pass an existing file or directory, or omit --corpus for {BUILTIN_PYDOC})")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            raise DataError(f"corpus directory is empty: {path} (put text files in it)")
        data = b"\n".join(p.read_bytes() for p in files)
    else:
        data = path.read_bytes()
    if not data:
        raise DataError(f"corpus is empty: {path} (give a text file with content)")
    return Corpus(str(path), data)


@dataclass(frozen=True)
class Splits:
    """Byte ranges ``[start, end)`` of the three splits; they are disjoint and in this order."""

    train: tuple[int, int]
    calibration: tuple[int, int]
    evaluation: tuple[int, int]

    def sizes(self) -> dict[str, int]:
        return {name: end - start for name, (start, end) in self.as_dict().items()}

    def as_dict(self) -> dict[str, tuple[int, int]]:
        return {"train": self.train, "calibration": self.calibration, "evaluation": self.evaluation}


def make_splits(n_bytes: int, window: int, calibration_fraction: float = 0.1,
                evaluation_fraction: float = 0.1) -> Splits:
    """Split ``n_bytes`` into train / calibration / evaluation ranges.

    Each range must hold at least one full window (training needs a window plus room to sample,
    so train needs two), otherwise the corpus is too small.
    """
    n_eval = int(n_bytes * evaluation_fraction)
    n_calib = int(n_bytes * calibration_fraction)
    n_train = n_bytes - n_eval - n_calib
    if n_eval < window or n_calib < window or n_train < 2 * window:
        need = int(np.ceil(window / min(evaluation_fraction, calibration_fraction)))
        raise DataError(
            f"corpus too small: {n_bytes} bytes cannot hold train/calibration/evaluation ranges of "
            f"at least one {window}-byte window each (need about {max(need, 4 * window)} bytes; "
            f"use a larger corpus or a smaller --context)"
        )
    train = (0, n_train)
    calibration = (n_train, n_train + n_calib)
    evaluation = (n_train + n_calib, n_bytes)
    return Splits(train, calibration, evaluation)


def window_starts(byte_range: tuple[int, int], window: int) -> np.ndarray:
    """Start offsets of the non-overlapping windows of the perplexity protocol.

    Window k starts at ``start + k*window`` and is used while ``s + window <= end``.
    """
    start, end = byte_range
    count = (end - start) // window
    return start + window * np.arange(count, dtype=np.int64)


def windows_at(corpus_bytes: np.ndarray, starts: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Model inputs and targets for windows starting at ``starts``.

    Input is ``[BOS] + b[s : s+window-1]``, target is ``b[s : s+window]``: each byte is scored
    once, the first of a window predicted from BOS alone. Shapes ``[n, window]``, int64.
    """
    starts = np.asarray(starts, dtype=np.int64)
    offsets = starts[:, None] + np.arange(window, dtype=np.int64)[None, :]
    targets = corpus_bytes[offsets].astype(np.int64)
    inputs = np.empty_like(targets)
    inputs[:, 0] = BOS
    inputs[:, 1:] = targets[:, :-1]
    return inputs, targets


def evaluation_windows(corpus_bytes: np.ndarray, byte_range: tuple[int, int], window: int) -> tuple[np.ndarray, np.ndarray]:
    """All protocol windows of a range: (inputs, targets), each ``[n, window]`` int64."""
    return windows_at(corpus_bytes, window_starts(byte_range, window), window)


def sample_train_batch(corpus_bytes: np.ndarray, byte_range: tuple[int, int], window: int,
                       batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random batch of windows from the train range (same input/target layout as evaluation)."""
    start, end = byte_range
    starts = rng.integers(start, end - window + 1, size=batch_size)
    return windows_at(corpus_bytes, starts, window)


@dataclass(frozen=True)
class DataConfig:
    """Which corpus, and what share of it goes to calibration and evaluation (the rest trains)."""

    corpus: str = BUILTIN_PYDOC
    calibration_fraction: float = 0.1
    evaluation_fraction: float = 0.1

    def __post_init__(self) -> None:
        for name in ("calibration_fraction", "evaluation_fraction"):
            value = getattr(self, name)
            if not 0.0 < value < 0.5:
                raise DataError(f"{name} must be in (0, 0.5), got {value}")


@dataclass(frozen=True)
class PreparedData:
    """A loaded corpus with its splits: what every stage after ``data`` receives."""

    corpus: Corpus
    splits: Splits
    window: int

    @property
    def tokens(self) -> np.ndarray:
        return self.corpus.array()

    def describe(self) -> dict:
        """The ``data`` section of results.json (ranges are ``[start, end)`` byte offsets)."""
        return {
            "corpus": self.corpus.source,
            "sha256": self.corpus.sha256,
            "n_bytes": len(self.corpus.data),
            **{name: list(r) for name, r in self.splits.as_dict().items()},
            "sizes_bytes": self.splits.sizes(),
            "bos": True,
            "window": self.window,
            "scored_from": 0,
        }


def prepare_data(config: DataConfig, window: int) -> PreparedData:
    corpus = load_corpus(config.corpus)
    splits = make_splits(len(corpus.data), window, config.calibration_fraction, config.evaluation_fraction)
    return PreparedData(corpus, splits, window)
