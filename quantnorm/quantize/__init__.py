"""Quantization: named recipes, the ONNX Runtime backend that applies them, and a sanity check.

    recipe = get_recipe("static-minmax-matmul")
    result = quantize(fp32_path, recipe, calib_inputs, out_path, vnni=hardware.cpu_has_vnni(), probe_inputs=probe)
    if result.status != "ok": ...   # "broken: <reason>"; the file (if any) is kept for measuring

See ``recipes.py`` for the table of recipes and the default set.
"""

from __future__ import annotations

from ..transforms.gptq import GPTQCodes
from .ort_backend import PreprocessCache, QuantizeResult, quantize, resolve_exclusions, weight_matmuls
from .recipes import DEFAULT_RECIPES, MASSIVE_DEFAULT_RECIPES, OP_SCOPES, RECIPES, Recipe, get_recipe, with_exclusions
from .sanity import sanity_check

__all__ = [
    "DEFAULT_RECIPES",
    "GPTQCodes",
    "MASSIVE_DEFAULT_RECIPES",
    "OP_SCOPES",
    "PreprocessCache",
    "RECIPES",
    "QuantizeResult",
    "Recipe",
    "get_recipe",
    "quantize",
    "resolve_exclusions",
    "sanity_check",
    "weight_matmuls",
    "with_exclusions",
]
