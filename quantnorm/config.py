"""What ``quantnorm evaluate`` deploys and measures: one frozen, validated configuration.

The CLI builds it from flags, a sweep cell carries it serialized, and ``quantnorm.evaluate``
runs it on any model source.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import serial
from .engines import ENGINES
from .engines.llamacpp import DEFAULT_TYPES as LLAMACPP_DEFAULT_TYPES
from .engines.llamacpp import check_types as check_llamacpp_types
from .errors import ConfigError
from .measure.sessions import SessionSpec, listed_providers, resolve_providers
from .policy import DEFAULT_POLICY, Policy
from .quantize import DEFAULT_RECIPES, get_recipe, with_exclusions
from .quantize.recipes import ALPHA_SEPARATOR
from .search import SearchConfig

AUTO = "auto"  # --recipes auto: the accuracy-aware search (quantnorm.search)
# EvaluateConfig fields that only the search reads: without --recipes auto they change nothing.
SEARCH_ONLY_FIELDS = ("max_ppl_ratio", "min_top1", "max_kld", "max_kld_p99", "search_pick", "search_space",
                      "search_budget_min")


@dataclass(frozen=True)
class EvaluateConfig:
    """What to deploy and measure; the CLI builds it from flags."""

    recipes: tuple[str, ...] = DEFAULT_RECIPES
    # No --recipes named: when the FP32 probe finds massive activations, the recipes that survive
    # them (MASSIVE_DEFAULT_RECIPES) replace the default set (quantnorm.evaluate.choose_recipes).
    probe_picks_recipes: bool = False
    providers: tuple[str, ...] | None = None   # None: every provider this onnxruntime lists
    calib_samples: int = 64
    opset: int = 18
    graph_optimization_level: str = "ORT_ENABLE_ALL"
    threads: int | None = None
    latency_batches: tuple[int, ...] = (1, 8)
    latency_iters: int = 30
    latency_warmup: int = 5
    # Seconds of timed runs per latency cell before it stops short of latency_iters (at least
    # measure.latency.MIN_TIMED_RUNS run); None: every iteration. The CLI sets 10 s for --model
    # (a checkpoint's batch of 8 takes seconds a run on a CPU, and warm-up + iters runs per cell
    # would make latency the largest stage of its evaluate); the default stays None so recorded
    # sweeps resume unchanged.
    latency_seconds: float | None = None
    eval_batch_size: int = 16
    parity_windows: int = 4
    probe_windows: int = 32
    outliers: bool = True
    progress: bool = True
    sq_alpha: float | None = None       # overrides the alpha of SmoothQuant recipes
    # What the search (--recipes auto) must reach: the acceptance policy's accuracy thresholds, with
    # its defaults, the ones `quantnorm gate` checks (None: that threshold is off).
    max_ppl_ratio: float = DEFAULT_POLICY.max_ppl_ratio
    min_top1: float | None = DEFAULT_POLICY.min_top1
    max_kld: float | None = DEFAULT_POLICY.max_kld
    max_kld_p99: float | None = DEFAULT_POLICY.max_kld_p99
    search_pick: str = "fastest"        # the search's pick: fastest or first passing model
    search_space: tuple[str, ...] | None = None  # the search's recipes (None: every weight-MatMul recipe)
    search_budget_min: float | None = None  # no search trial starts after this many minutes (None: no limit)
    exclude: tuple[str, ...] = ()       # node names / fnmatch patterns kept in FP32 by every recipe
    # Generation (causal models): each recipe on the with-past (KV-cache) graph, decode speed and
    # generation agreement (quantnorm.generation). Off unless asked: `quantnorm evaluate` turns it
    # on by default; a sweep only with --generation, so recorded sweeps resume unchanged.
    generation: bool = False
    gen_batches: tuple[int, ...] = (1, 4)
    gen_prompt_tokens: int = 128        # decode speed: prompt length and new tokens (cut to the model's positions)
    gen_new_tokens: int = 128
    gen_rounds: int = 2
    agreement_prompts: int = 16         # generation agreement: prompts from the evaluation split
    agreement_new_tokens: int = 64
    # A split deployment beside each weight-only recipe: prompts through this recipe's with-past
    # graph (per-token INT8: an integer GEMM, fast at many rows), the new tokens through the
    # weight-only graph (fast at one row), the cache shared; None: none.
    gen_prefill_recipe: str | None = None
    # Other engines measured beside the recipes (quantnorm.engines: "llamacpp"), and the llama.cpp
    # types made from a GGUF checkpoint.
    engines: tuple[str, ...] = ()
    llamacpp_types: tuple[str, ...] = LLAMACPP_DEFAULT_TYPES

    def __post_init__(self) -> None:
        if not self.recipes:
            raise ConfigError("no recipes given: pass --recipes with at least one name")
        for name in self.recipes:
            if name != AUTO:
                get_recipe(name)  # unknown name -> ConfigError listing the choices
        self.search_config()  # validates sq_alpha, the accuracy thresholds (the policy), search_pick
        if self.providers is not None:
            object.__setattr__(self, "providers", tuple(resolve_providers(list(self.providers))))
        if self.calib_samples < 1:
            raise ConfigError(f"--calib-samples must be >= 1, got {self.calib_samples}")
        if not self.latency_batches or min(self.latency_batches) < 1:
            raise ConfigError(f"latency batches must be >= 1, got {self.latency_batches}")
        if self.latency_iters < 1:
            raise ConfigError(f"latency iterations must be >= 1, got {self.latency_iters}")
        if self.latency_seconds is not None and not self.latency_seconds > 0:
            raise ConfigError(f"--latency-budget must be > 0 seconds (0 on the command line: no budget), "
                              f"got {self.latency_seconds}")
        SessionSpec(graph_optimization_level=self.graph_optimization_level, threads=self.threads)
        if not self.gen_batches or min(self.gen_batches) < 1:
            raise ConfigError(f"--gen-batches must be >= 1, got {self.gen_batches}")
        for flag, value, least in (("--gen-prompt-tokens", self.gen_prompt_tokens, 1),
                                   ("--gen-new-tokens", self.gen_new_tokens, 2), ("--gen-rounds", self.gen_rounds, 1),
                                   ("--agreement-prompts", self.agreement_prompts, 1),
                                   ("--agreement-new-tokens", self.agreement_new_tokens, 1)):
            if value < least:
                raise ConfigError(f"{flag} must be >= {least}, got {value}")
        self._check_prefill_recipe()
        for name in self.engines:
            if name not in ENGINES:
                raise ConfigError(f"--engines: unknown engine {name!r}: choose from {', '.join(sorted(ENGINES))}")
        object.__setattr__(self, "llamacpp_types", check_llamacpp_types(self.llamacpp_types))

    @property
    def searches(self) -> bool:
        """Whether the accuracy-aware search runs (``--recipes auto``)."""
        return AUTO in self.recipes

    def to_dict(self) -> dict:
        """Every field, as JSON (tuples as lists): what a sweep cell is given and sweep.json records."""
        return serial.to_dict(self)

    @classmethod
    def from_dict(cls, data: dict, what: str = "the evaluate configuration") -> EvaluateConfig:
        """The exact inverse of ``to_dict``; an unknown key or a mistyped value is a ConfigError naming it."""
        return serial.from_dict(cls, data, what)

    def policy(self) -> Policy:
        """The acceptance policy of the search: these accuracy thresholds, the policy's other defaults."""
        return replace(DEFAULT_POLICY, max_ppl_ratio=self.max_ppl_ratio, min_top1=self.min_top1, max_kld=self.max_kld,
                       max_kld_p99=self.max_kld_p99)

    def accuracy_thresholds(self) -> dict:
        """``results["policy"]``: the accuracy thresholds the run is judged by (the search's goals and
        the report's verdict), as the policy names them."""
        return {"max_ppl_ratio": self.max_ppl_ratio, "max_kld": self.max_kld, "max_kld_p99": self.max_kld_p99,
                "min_top1": self.min_top1}

    def _check_prefill_recipe(self) -> None:
        """``--prefill-recipe``: a registry recipe that quantizes activations (a prompt is many rows),
        among the run's ``--recipes`` beside a weight-only recipe to generate with, when those are named."""
        name = self.gen_prefill_recipe
        if name is None:
            return
        flag = f"--prefill-recipe {name}"
        if not self.generation:
            raise ConfigError(f"{flag} needs generation: drop --no-generation (or pass --generation in a sweep)")
        try:
            mode = get_recipe(name).mode
        except ConfigError as exc:
            raise ConfigError(f"--prefill-recipe: {exc}") from None
        if mode in ("weight-only", "fp16"):
            raise ConfigError(f"{flag}: a {mode} recipe runs the prompt no faster than the weight-only graph; "
                              f"name a per-token, dynamic or static recipe (e.g. rotated-pertoken-fused-gptq)")
        if self.probe_picks_recipes:   # the probe may still change the set: the generation stage says what applied
            return
        if name not in self.recipes:
            raise ConfigError(f"{flag}: it is not among --recipes; add it there (its with-past graph runs the prompts)")
        if not any(n != AUTO and get_recipe(n).mode == "weight-only" for n in self.recipes):
            raise ConfigError(f"{flag}: --recipes names no weight-only recipe to generate with (e.g. "
                              f"rotated-wo-int8-b128-acc4-gptq)")

    def search_config(self):
        return SearchConfig(policy=self.policy(), pick=self.search_pick, space=self.search_space,
                            sq_alpha=self.sq_alpha, latency_iters=min(self.latency_iters, 10),
                            time_budget_s=None if self.search_budget_min is None else 60.0 * self.search_budget_min)

    def recipe(self, name: str):
        """The registry recipe, with --sq-alpha applied to SmoothQuant recipes."""
        recipe = get_recipe(name)
        # an explicit NAME@ALPHA keeps its own alpha; --sq-alpha sets the others
        if self.sq_alpha is not None and recipe.smoothquant_alpha is not None and ALPHA_SEPARATOR not in name:
            recipe = replace(recipe, smoothquant_alpha=self.sq_alpha)
        # mixed precision: the variant gets its own name (<recipe>-mixed-<hash>); the FP16 variant
        # has no INT8 to keep nodes out of
        if self.exclude and recipe.mode != "fp16":
            recipe = with_exclusions(recipe, self.exclude)
        return recipe

    def engine_formats(self, engine: str) -> tuple[str, ...]:
        """What ``engine`` is asked to make (empty: its defaults)."""
        return self.llamacpp_types if engine == "llamacpp" else ()

    def provider_list(self) -> list[str]:
        if self.providers is not None:
            return list(self.providers)
        return listed_providers()
