"""How a quantized model is scored against FP32, for every source: a source says *what* is
scored (a ``Scoring``: the windows, their targets, the level), and this module measures it.

- ``byte``: the zoo's byte-level protocol (FORMULAS.md: PPL ratio, bits per byte, KL, top-1);
- ``token``: next tokens of a causal checkpoint (PPL ratio, KL, top-1 over tokens);
- ``embedding``: an encoder's embedding agreement (cosine, nearest-neighbour agreement), plus the
  masked-token figures when the checkpoint has an MLM head (``mlm``: masked windows and which
  positions are scored).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ..errors import MeasureError
from .accuracy import compare
from .token_metrics import compare_tokens, encoder_compare, encoder_outputs

LEVELS = ("byte", "token", "embedding")


@dataclass(frozen=True)
class Scoring:
    """What a source's models are scored on: ``inputs`` [n, window] with their next-token
    ``targets`` (None for an encoder), at ``level``; ``mlm``: (masked windows, scored positions)
    of an encoder with an MLM head."""

    level: str
    inputs: np.ndarray
    targets: np.ndarray | None
    batch_size: int = 16
    mlm: tuple | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise MeasureError(f"scoring level {self.level!r}: expected one of {', '.join(LEVELS)}")


class Scorer:
    """``scorer(int8_session) -> accuracy dict`` against ``fp32_session``; an encoder's FP32
    outputs are computed once, on first use."""

    def __init__(self, scoring: Scoring, fp32_session):
        self.scoring, self.fp32_session = scoring, fp32_session
        self.fp32_reference = None

    def __call__(self, int8_session) -> dict:
        s = self.scoring
        if s.level == "byte":
            return compare(self.fp32_session, int8_session, s.inputs, s.targets, batch_size=s.batch_size).to_dict()
        if s.level == "token":
            return compare_tokens(self.fp32_session, int8_session, s.inputs, s.targets)
        if self.fp32_reference is None:
            self.fp32_reference = encoder_outputs(self.fp32_session, s.inputs, s.batch_size)
        return encoder_compare(self.fp32_reference, int8_session, s.inputs, batch_size=s.batch_size, mlm=s.mlm,
                               fp32_session=self.fp32_session)


def token_scorer(fp32_session, int8_session, inputs, targets) -> SimpleNamespace:
    """The search's scorer over tokens: FORMULAS.md's PPL ratio, KL and top-1 (the fields the
    search reads). A negative target marks a position that is not scored (unmasked MLM positions)."""
    targets = np.asarray(targets)
    scored = targets >= 0
    return SimpleNamespace(**compare_tokens(fp32_session, int8_session, inputs, np.where(scored, targets, 0),
                                            scored=None if scored.all() else scored))


def search_scorer(level: str) -> Callable | None:
    """The search's trial scorer for a level (None: the search's own byte-level metrics)."""
    return None if level == "byte" else token_scorer
