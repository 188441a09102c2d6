"""Training status: did a run learn anything beyond byte frequencies?

A run is ``trained``, ``collapsed`` or ``diverged``:

- ``diverged``: training hit a NaN/inf loss or gradient (no evaluation bits/byte);
- ``collapsed``: its evaluation bits/byte is not better than the *unigram baseline* by at least
  ``collapse_margin`` bits/byte -- a model sitting on the unigram plateau and one that barely left
  it alike. Its INT8 numbers (top-1 agreement 100%, PPL ratio 1.000x) say nothing about INT8;
- ``trained`` otherwise.

The unigram baseline is the cross-entropy (bits/byte) of the evaluation range under the training
range's byte frequencies. Add-one smoothing is used only when an evaluation byte never occurs in
the training range (otherwise the baseline would be infinite).

Why the default margin is 0.8 bits/byte: measured from the unigram baseline (4.688 on
builtin:pydoc), the 51 cells of the committed reference sweep and the 10 of the zoo fall in three
clusters: within 0.01 of it (16 cells on the plateau, 4.679-4.694), 0.29-0.64 below (three DeepNorm
cells at 4 blocks, barely trained) and 1.07-2.34 below (every other cell). 0.8 sits in the gap between the second and third clusters, so a
barely trained model is counted with the plateaued ones (0.16 bits/byte of slack on that side,
0.27 on the trained side). A margin of 0.1 (the gap below the plateau) would call the barely
trained cells trained.

Committed runs written before these keys existed carry their data ranges, so the status can be
derived when they are read (:func:`status_from_results`) without re-running training. This module
reads results only (numpy and the corpus bytes): the gate and the reports use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .data import load_corpus
from .errors import DataError

TRAINED, COLLAPSED, DIVERGED = "trained", "collapsed", "diverged"
STATUSES = (TRAINED, COLLAPSED, DIVERGED)
DEFAULT_COLLAPSE_MARGIN = 0.8   # bits/byte below the unigram baseline a trained run must reach


def check_margin(margin: float, what: str = "collapse margin") -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
        raise DataError(f"{what} must be a finite number of bits/byte >= 0, got {margin!r}")
    return float(margin)


def unigram_bits_per_byte(data: bytes | np.ndarray, train: tuple[int, int], evaluation: tuple[int, int]) -> float:
    """Bits/byte of ``data[evaluation]`` under the byte frequencies of ``data[train]``."""
    a = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else np.asarray(data, np.uint8)
    tr, ev = a[train[0]:train[1]], a[evaluation[0]:evaluation[1]]
    if tr.size == 0 or ev.size == 0:
        raise DataError(f"empty training {tuple(train)} or evaluation {tuple(evaluation)} range: no unigram baseline")
    counts = np.bincount(tr, minlength=256).astype(np.float64)
    if np.any(counts[np.unique(ev)] == 0):
        counts += 1.0   # an evaluation byte unseen in training: add-one smoothing keeps it finite
    p = counts / counts.sum()
    return float(-np.mean(np.log2(p[ev])))


def classify(eval_bits_per_byte: float | None, diverged: bool, unigram: float, margin: float) -> str:
    if diverged or eval_bits_per_byte is None or not math.isfinite(eval_bits_per_byte):
        return DIVERGED
    return TRAINED if eval_bits_per_byte <= unigram - margin else COLLAPSED


@dataclass(frozen=True)
class TrainStatus:
    status: str
    unigram_bits_per_byte: float | None
    eval_bits_per_byte: float | None
    collapse_margin: float
    derived: bool = False   # True: computed when read from the data ranges (the run did not record it)

    @property
    def trained(self) -> bool:
        return self.status == TRAINED

    def describe(self) -> str:
        if self.status == DIVERGED:
            return "diverged"
        return (f"{self.status}: {self.eval_bits_per_byte:.3f} bits/byte vs unigram "
                f"{self.unigram_bits_per_byte:.3f} (margin {self.collapse_margin:g})")

    def to_dict(self) -> dict:
        return {"status": self.status, "unigram_bits_per_byte": self.unigram_bits_per_byte,
                "collapse_margin": self.collapse_margin}


@lru_cache(maxsize=16)
def _unigram_for(corpus: str, sha256: str | None, train: tuple[int, int], evaluation: tuple[int, int]) -> float:

    c = load_corpus(corpus)
    if sha256 and c.sha256 != sha256:
        raise DataError(f"corpus {corpus} has sha256 {c.sha256[:12]}..., the run recorded {sha256[:12]}...: "
                        f"cannot derive its unigram baseline")
    return unigram_bits_per_byte(c.data, train, evaluation)


def unigram_from_data_section(data: dict) -> float:
    """The unigram baseline of a results.json ``data`` section (corpus, sha256, ranges)."""
    try:
        train = (int(data["train"][0]), int(data["train"][1]))
        evaluation = (int(data["evaluation"][0]), int(data["evaluation"][1]))
        corpus = str(data["corpus"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise DataError(f"results.json data section lacks {exc} (corpus and byte ranges)") from None
    return _unigram_for(corpus, data.get("sha256"), train, evaluation)


def status_from_results(train: dict, data: dict | None, margin: float | None = None) -> TrainStatus:
    """The status of a run from its results.json ``train`` and ``data`` sections (or train.json
    and config.json's ``data_ranges``). ``margin`` None: the run's recorded margin, else the default.

    Recorded keys are used when present (with ``margin`` re-applied to the recorded baseline);
    otherwise the baseline is computed from the data ranges. DataError when it cannot be."""
    bits = train.get("eval_bits_per_byte")
    bits = float(bits) if isinstance(bits, (int, float)) and not isinstance(bits, bool) else None
    diverged = bool(train.get("diverged"))
    recorded_margin = train.get("collapse_margin")
    m = check_margin(margin if margin is not None else
                     (recorded_margin if recorded_margin is not None else DEFAULT_COLLAPSE_MARGIN))
    unigram = train.get("unigram_bits_per_byte")
    derived = not isinstance(unigram, (int, float)) or isinstance(unigram, bool)
    if diverged or bits is None:
        return TrainStatus(DIVERGED, None if derived else float(unigram), bits, m, derived)
    if derived:
        if not isinstance(data, dict):
            raise DataError("the run records no unigram baseline and no data section to derive it from")
        unigram = unigram_from_data_section(data)
    return TrainStatus(classify(bits, diverged, float(unigram), m), float(unigram), bits, m, derived)
