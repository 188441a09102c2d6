"""What a model source hands the one pipeline (``quantnorm.evaluate.evaluate``).

A source turns a checkpoint (a zoo run, a Hugging Face directory, a GGUF file, an ONNX export
directory) into what the stages take. Everything else — the recipe loop, the search, SmoothQuant
latency, latency, placement detection on the FP32 graph, SQNR, results.json — is written once in
the pipeline. A source supplies only what really differs between checkpoints:

- ``prepare(cfg)``: load the model and tokenize the corpus into ``SourceData`` (the windows and
  which positions are scored);
- ``export(fp32_path, cfg)``: write the FP32 ONNX graph every later stage reads, checked against
  the original (the ``export`` section of results.json);
- ``transforms``: the FP32 variants recipes quantize instead of the plain export (SmoothQuant,
  rotation), or a refusal that says why this source cannot make them;
- ``scoring(cfg)``: what an INT8 model is scored on against FP32 (a ``measure.scoring.Scoring``:
  byte-level windows for the zoo, next tokens for causal checkpoints, embedding agreement for
  encoders); ``measure.scoring`` measures it, the same for every source;
- ``search_scoring()``: what the accuracy-aware search (``--recipes auto``) optimizes;
- ``probe_options()``: what the graph probe (``measure.graph_probe``, the same for every source)
  needs to know: the block count, causal or encoder attention, the token names;
- ``torch_checks(cfg)``: the torch module behind the graph, for the checks only a module allows
  (the zoo's diagnostics, a causal checkpoint's FP16 check; none for an ONNX export), which the
  pipeline measures with ``measure``;
- ``sections(detected)``: the ``model``, ``data`` and ``train`` sections of results.json (the run
  report picks its sections from ``model.source``'s kind: ``quantnorm.report.run``).

Adding a source is one new module with one class that has these members.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..measure.scoring import Scoring
from ..transforms.variants import FP32Variants
from .hf_loader import DETECTED

__all__ = ["DETECTED", "ModelSource", "Scoring", "SearchScoring", "SourceData", "TorchChecks", "no_transforms"]


@dataclass(frozen=True)
class SourceData:
    """The token windows every stage after export uses, and the ``data`` section describing them."""

    window: int                       # tokens (or bytes, for the zoo) per window
    eval_inputs: np.ndarray           # [n, window] int64
    eval_targets: np.ndarray | None   # [n, window] next-token targets (None for encoders)
    calib_inputs: np.ndarray          # [n_calib, window], from the calibration range only
    describe: dict = field(default_factory=dict)  # results["data"]


@dataclass(frozen=True)
class SearchScoring:
    """What ``--recipes auto`` scores trials on: inputs/targets (a negative target is not scored),
    the level ("byte": the zoo's byte-level metrics; "token") and a sentence for the report."""

    inputs: np.ndarray
    targets: np.ndarray
    level: str
    metric: str | None = None


@dataclass(frozen=True)
class TorchChecks:
    """The torch module a source has, for the checks that need one: ``diagnostics`` (a zoo model:
    perturbation sensitivity, block-output similarity) and ``fp16`` (a causal checkpoint: a
    callable giving the ``LoadedCheckpoint``, its weights reloaded when the export let them go)."""

    diagnostics: Any = None
    fp16: Callable[[], Any] | None = None


class ModelSource(Protocol):
    """The members the pipeline uses (see the module docstring)."""

    kind: str            # "zoo" | "causal" | "encoder"
    run_dir: Path
    table_placement: str  # what the source's own table says ("detected": read from the graph)
    data: SourceData

    def prepare(self, cfg) -> None: ...
    def export(self, fp32_path: Path, cfg) -> dict: ...
    def transforms(self, cfg) -> Any: ...
    def scoring(self, cfg) -> Scoring: ...
    def search_scoring(self, cfg) -> SearchScoring: ...
    def probe_options(self) -> dict: ...
    def torch_checks(self, cfg) -> TorchChecks: ...
    def sections(self, detected: dict) -> dict: ...


def no_transforms(what: str, run_dir: Path) -> FP32Variants:
    """For a source without a torch module (an ONNX export): every recipe quantizes the FP32 graph
    as it is; a SmoothQuant or rotation recipe is refused with the reason, recorded as "not
    applicable" in results.json and the report."""
    return FP32Variants(
        run_dir,
        no_smooth=f"SmoothQuant is not available for {what}: it folds scales into the torch module's norms "
                  "(export from the checkpoint directory to use it)",
        no_rotate=f"rotation is not available for {what}: it rotates the torch module's weights "
                  "(export from the checkpoint directory to use it)")
