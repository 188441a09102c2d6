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
scaling the head's columns must not scale the embedding table. ``fold_rules`` hands these rules to
``quantnorm.transforms.smoothquant.smooth_and_export``, which smooths and exports the wrapper with
both parity gates.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..transforms.smoothquant import FoldRules, divide_norm_affine, divide_norm_one_plus
from .hf_export import WRAPPER_ATTR
from .hf_loader import DETECTED


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
    if getattr(recipe, "rotates_stream", False):
        return f"the residual-stream rotation needs a fold rule and {spec.family} has none"
    return None


def fold_rule(spec):
    """How 1/s goes into this architecture's norms: (function, formula)."""
    if spec.norm_formula == "rms_1p":
        return divide_norm_one_plus, FOLD_FORMULAS["one_plus"]
    return divide_norm_affine, FOLD_FORMULAS["affine"]


def fold_rules(spec) -> FoldRules:
    """SmoothQuant's fold rules for this checkpoint (ConfigError where the loader table has none)."""
    if spec.placement == "detected":
        raise ConfigError(f"SmoothQuant: {spec.family} has no known fold rule (the loader table has none for it)")
    fold, formula = fold_rule(spec)
    return FoldRules(placement=spec.placement, norm=spec.norm, is_norm=is_hf_norm, fold=fold, formula=formula,
                     strip_prefix=f"{WRAPPER_ATTR}.")  # names as the ONNX nodes carry them
