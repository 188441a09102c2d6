"""SmoothQuant for Hugging Face checkpoints: the zoo's fold rule on the real model's dataflow.

``quantnorm.transforms.smoothquant.smooth_module`` does the work; this module says what a norm is in a
Hugging Face model and how 1/s goes into it:

- norms: ``nn.LayerNorm`` (GPT-2, BERT) and every ``*RMSNorm`` class (LLaMA, Mistral, Qwen2,
  Gemma 2/3, OLMo 2);
- folding: ``w /= s`` (and ``b /= s``) for ``w * x_hat (+ b)``; Gemma's norms compute
  ``(1 + w) * x_hat``, so there ``w' = (1 + w) / s - 1`` (``spec.norm_formula == "rms_1p"``).

The rule (fold only when the tensor is a norm output read by nothing but that MatMul group) then
gives, per architecture (L blocks; read off the autograd graph, checked in tests):

| architecture | folded (free) | explicit per-channel Mul |
|---|---|---|
| gpt2 | c_attn (ln_1), c_fc (ln_2), lm_head (ln_f) | attn.c_proj, mlp.c_proj |
| llama, mistral, qwen2 | q/k/v (input_layernorm), gate/up (post_attention_layernorm), lm_head (norm) | o_proj, down_proj |
| gemma2, gemma3_text | q/k/v (input_layernorm), gate/up (pre_feedforward_layernorm), lm_head (norm), via (1 + w) | o_proj, down_proj |
| olmo2 | lm_head (norm) | everything in the blocks: no norm reads the stream before a sublayer |
| bert | the MLM decoder (cls.predictions.transform.LayerNorm), when there is an MLM head | all block Linears: each post-norm output is also the residual stream |

Heads tied to the token embedding (GPT-2, Gemma, BERT's decoder) are untied in the smoothed copy:
scaling the head's columns must not scale the embedding table. The smoothed model is exported
with the export's own parity gate (against the smoothed wrapper) and then compared with the
*original* wrapper output by output (relative to each output's scale, as the export gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..module_export import export_matching_original
from ..transforms.rotation import rotate_and_export
from ..transforms.smoothquant import (
    DEFAULT_PARITY_TOLERANCE,
    SmoothedModels,
    SmoothQuantPlan,
    divide_norm_affine,
    divide_norm_one_plus,
    smooth_module,
)
from .hf_export import WRAPPER_ATTR
from .hf_loader import DETECTED

ROTATED_ONNX_FILE = "model.fp32.rotated.onnx"


def is_hf_norm(module) -> bool:
    from torch import nn

    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


FOLD_FORMULAS = {"affine": "w' = w / s (and b' = b / s)", "one_plus": "w' = (1 + w) / s - 1 (Gemma's (1 + w) norms)"}


def missing_fold_rule(spec, recipe) -> str | None:
    """Why ``recipe`` cannot run on this architecture for want of a fold rule, else None. SmoothQuant
    and the stream rotation fold into the norms, and which norm feeds which Linears (and Gemma's
    ``(1 + w)``) is the loader table's, not the graph's; the online rotation folds nothing."""
    if spec.placement != DETECTED:
        return None
    if getattr(recipe, "smoothquant_alpha", None) is not None:
        return f"SmoothQuant needs a fold rule and {spec.family} has none"
    if getattr(recipe, "rotation", None) == "hadamard":
        return f"the residual-stream rotation needs a fold rule and {spec.family} has none"
    return None


def fold_rule(spec):
    """How 1/s goes into this architecture's norms: (function, formula)."""
    if spec.norm_formula == "rms_1p":
        return divide_norm_one_plus, FOLD_FORMULAS["one_plus"]
    return divide_norm_affine, FOLD_FORMULAS["affine"]


@dataclass(frozen=True)
class HFSmoothQuantExport:
    path: Path
    plan: SmoothQuantPlan
    export: object                      # HFExportResult (parity vs the smoothed wrapper)
    onnx_vs_original_max_abs_logit_diff: float   # relative to max(1, max |original output|)
    fold_formula: str = FOLD_FORMULAS["affine"]

    def to_dict(self, run_dir: Path | None = None) -> dict:
        return {**self.plan.to_dict(), "path": Path(self.path).name, "export": self.export.to_dict(run_dir),
                "onnx_vs_original_max_abs_logit_diff": self.onnx_vs_original_max_abs_logit_diff,
                "parity_rule": "max |delta| / max(1, max |original|) per output, max over outputs",
                "fold_formula": self.fold_formula}


def smooth_and_export(loaded, wrapper, calib_inputs: np.ndarray, parity_inputs: np.ndarray, out_path: Path, *,
                      alpha: float, outputs: tuple[str, ...], max_positions: int | None, opset: int,
                      tolerance: float = DEFAULT_PARITY_TOLERANCE) -> HFSmoothQuantExport:
    """Smooth ``wrapper`` (a deep copy; the original is untouched), export it and prove that the
    ONNX file computes the original outputs. A failure leaves no file."""
    spec = loaded.spec
    if spec.placement == DETECTED:
        raise ConfigError(f"SmoothQuant: {spec.family} has no known fold rule (the loader table has none for it)")
    fold, formula = fold_rule(spec)
    smoothed, plan = smooth_module(wrapper, calib_inputs, alpha, placement=spec.placement, norm=spec.norm,
                                   is_norm=is_hf_norm, fold=fold, batch_size=8,
                                   parity_tolerance=tolerance, relative_parity=True,
                                   strip_prefix=f"{WRAPPER_ATTR}.")  # names as the ONNX nodes carry them
    exported, diff = export_matching_original(smoothed, wrapper, out_path, parity_inputs, what="smoothed",
                                              outputs=outputs, max_positions=max_positions, opset=opset,
                                              tolerance=tolerance)
    return HFSmoothQuantExport(Path(out_path), plan, exported, diff, formula)


class HFSmoothedModels(SmoothedModels):
    """``SmoothedModels`` for a checkpoint: one smoothed export per alpha, made on first use, shared by
    the recipe loop and the search."""

    def __init__(self, weights, calib_inputs, parity_inputs, out_dir: Path, *, outputs: tuple[str, ...],
                 max_positions: int | None, opset: int, spec=None):
        """``weights()`` -> (the LoadedCheckpoint, its export wrapper), called on first use: the
        source may have let go of the torch weights after the export and reloads them then.
        ``spec``: the architecture's table row, so a recipe without a fold rule is refused
        before any reload."""
        super().__init__(None, calib_inputs, parity_inputs, out_dir, opset=opset)
        self._weights = weights
        self.spec = spec
        self.outputs, self.max_positions = outputs, max_positions
        self.rotated: dict = {}  # rotation form -> its rotated FP32 export (quantnorm.transforms.rotation), on first use

    @property
    def loaded(self):
        return self._weights()[0]

    @property
    def model(self):
        return self._weights()[1]

    @model.setter
    def model(self, value) -> None:   # the base class stores its model; here the weights come from the source
        if value is not None:
            raise AttributeError("HFSmoothedModels reads its model from the source's weights()")

    def fp32_for(self, recipe, default: Path) -> Path:
        """The FP32 model ``recipe`` quantizes: the rotated export for a rotation recipe, the
        smoothed one for a SmoothQuant recipe, else ``default``. A ConfigError (the recipe is
        then not applicable) where the fold rule it needs is unknown."""
        why = missing_fold_rule(self.spec, recipe) if self.spec is not None else None
        if why is not None:
            raise ConfigError(why)
        form = getattr(recipe, "rotation", None)
        if form is None:
            return super().fp32_for(recipe, default)
        if form not in self.rotated:
            name = ROTATED_ONNX_FILE if form == "hadamard" else ROTATED_ONNX_FILE.replace("rotated", f"rotated-{form}")
            self.rotated[form] = rotate_and_export(self.loaded, self.model, self.parity_inputs, self.out_dir / name,
                                                   outputs=self.outputs, max_positions=self.max_positions,
                                                   opset=self.opset, form=form)
        return self.rotated[form].path

    def _export(self, alpha: float, path: Path) -> HFSmoothQuantExport:
        return smooth_and_export(self.loaded, self.model, self.calib_inputs, self.parity_inputs, path, alpha=alpha,
                                 outputs=self.outputs, max_positions=self.max_positions, opset=self.opset)
