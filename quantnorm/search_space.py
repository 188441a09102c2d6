"""The search's space: which recipes it tries, in what order, and which a passing trial makes
pointless to try (``search`` runs them)."""

from __future__ import annotations

from typing import List  # noqa: UP035 - INC's TuningParam asserts a typing._GenericAlias

import numpy as np

from .quantize import RECIPES, Recipe

FRAMEWORK = "quantnorm_onnxruntime"   # our name in INC's config registry
ALGO = "quantnorm_recipe"

# With massive activations (the probe's finding): the recipes that survive them first, the
# fastest kernels first within them (calibrated norm scales skip a row max; fused rescales in the
# GEMM), then what adds accuracy at more cost (GPTQ, the online Hadamard), then the unfused
# per-token and SmoothQuant; per-tensor activations (static, dynamic) last.
MASSIVE_ORDER = ("rotated-pertoken-fused-calnorm", "pertoken-fused", "rotated-pertoken-fused",
                 "rotated-pertoken-fused-calnorm-gptq", "pertoken-fused-gptq", "rotated-pertoken-fused-gptq",
                 "online-rotated-pertoken-fused", "online-rotated-pertoken-fused-gptq",
                 "pertoken", "rotated-pertoken", "smoothquant")


def probe_ordered(space: tuple[str, ...], massive: bool) -> tuple[str, ...]:
    """``space`` in the order the search tries it: as given without massive activations; with
    them, ``MASSIVE_ORDER``'s recipes first (those of the space, in that order), the rest after
    in the space's own order."""
    if not massive:
        return tuple(space)
    first = [name for name in MASSIVE_ORDER if name in space]
    return tuple(first + [name for name in space if name not in first])


def pruned_by(candidate: Recipe, passed: list[Recipe], massive: bool) -> str | None:
    """Why a passing trial already makes ``candidate`` unable to change a ``fastest`` pick, or None.

    - Same kernels or more work: a per-token recipe that runs every operator of a passing
      per-token trial (GPTQ changes codes, not the graph; unfused rescales, per-row norm scales
      where the passing one calibrated them and more Hadamards only add work) cannot be faster.
    - Per-tensor activation scales (static, dynamic, SmoothQuant's) after the probe found massive
      activations and a per-token recipe passed: one scale per tensor spends its 8 bits on the
      massive values (every checkpoint measured here broke them: SmolLM2 PPL ratio 1.8-2.2,
      Gemma 3 KL 0.10-0.69); ``--search-space`` tries them anyway."""
    per_token = [p for p in passed if p.mode == "pertoken" and p.smoothquant_alpha is None]
    if candidate.mode == "pertoken" and candidate.smoothquant_alpha is None and not candidate.excluded:
        for p in per_token:
            if (_work(candidate) >= _work(p)).all():
                return f"{p.name} passed and runs no more operators (the same kernels or fewer)"
    if massive and per_token and (candidate.mode in ("static", "dynamic") or candidate.smoothquant_alpha is not None):
        return (f"massive activations (the probe) and {per_token[0].name} passed: per-tensor activation scales "
                f"spend their 8 bits on the massive values")
    return None


def _work(recipe: Recipe) -> np.ndarray:
    """What a per-token recipe's graph runs besides its integer GEMMs, as flags (1: more work)."""
    return np.array([recipe.pertoken_kernel != "ort-fused",        # rescale in three float passes
                     recipe.norm_inputs != "calibrated",           # a row max per norm output
                     # Hadamards in the graph: none; before each down-projection (the stream
                     # rotation) or one MatMul inside each block of every input (block<b>); two
                     # MatMuls before every quantized input (online)
                     {None: 0, "hadamard": 1, "online": 2}.get(recipe.rotation, 1)])


def default_space() -> tuple[str, ...]:
    """The registry's INT8 recipes that quantize only weight MatMuls (static, dynamic, per token,
    SmoothQuant included), in registry order: ``static-minmax-matmul`` first, the baseline. The
    weight-only recipes are another deployment (MatMulNBits, a grid of them): a space names them
    (``--search-space wo-int8-b128,wo-int4-b32-acc4,...``), the default does not try them all."""
    return tuple(name for name, r in RECIPES.items()
                 if r.op_scope == "matmul" and not r.excluded and r.mode != "weight-only")


# ---------------------------------------------------------------------------------------------
# The config class INC expands into trials


def _register_config_class():
    # neural-compressor: slow to import, and only --recipes auto needs it
    from neural_compressor.common.base_config import BaseConfig, register_config
    from neural_compressor.common.tuning_param import TuningParam
    from neural_compressor.common.utils import DEFAULT_WHITE_LIST

    @register_config(framework_name=FRAMEWORK, algo_name=ALGO)
    class RecipeSpaceConfig(BaseConfig):
        """One point of our space: a registry recipe, and how many worst-SQNR MatMul inputs stay
        FP32. Given lists, ``expand()`` yields their product (INC's own expansion)."""

        name = ALGO
        # TuningParam with explicit types: INC reads a plain name's type from the __init__
        # annotation, which `from __future__ import annotations` turns into a string.
        params_list = [TuningParam("recipe", tunable_type=List[str]),  # noqa: UP006
                       TuningParam("exclude_worst", tunable_type=List[int])]  # noqa: UP006

        def __init__(self, recipe="static-minmax-matmul", exclude_worst=0, white_list=DEFAULT_WHITE_LIST):
            super().__init__(white_list=white_list)
            self.recipe = recipe
            self.exclude_worst = exclude_worst
            self._post_init()

        @classmethod
        def register_supported_configs(cls) -> None:
            cls.supported_configs = []

        @classmethod
        def get_config_set_for_tuning(cls):
            return cls(recipe=list(default_space()))

    return RecipeSpaceConfig


_CONFIG_CLASS = None


def recipe_space_config(recipe, exclude_worst=0):
    """An INC ``RecipeSpaceConfig`` (the class is registered on first use: importing INC costs
    about a second, which commands that never search should not pay)."""
    global _CONFIG_CLASS
    if _CONFIG_CLASS is None:
        _CONFIG_CLASS = _register_config_class()
    return _CONFIG_CLASS(recipe=recipe, exclude_worst=exclude_worst)
