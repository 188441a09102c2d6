"""Accuracy-aware recipe search (``--recipes auto``), driven by neural-compressor's tuner.

neural-compressor 3.x has no ONNX adaptor (PITFALLS.md 7), but its framework-free tuning engine
``neural_compressor.common.base_tuning`` works with numpy 2: a ``BaseConfig`` subclass
registered with ``register_config`` whose ``expand()`` is our recipe space, ``init_tuning``
(config loader + monitor), a ``TuningConfig`` with ``tolerable_loss`` and ``max_trials``, and an
``EvaluationFuncWrapper`` around our accuracy function. The quantizing is ours (ONNX Runtime).

The metric and the target. INC's tuner wants a metric where higher is better and calls a trial
good when ``metric >= baseline * (1 - tolerable_loss)``. We use

    metric = 1 / ppl_ratio          (ppl_ratio = PPL(int8) / PPL(fp32), on the trial windows)
    baseline = 1                    (the FP32 model against itself: ppl_ratio = 1 by definition)
    tolerable_loss = 1 - 1 / max_ppl_ratio

so a trial passes exactly when ``ppl_ratio <= max_ppl_ratio`` (1.01 -> tolerable_loss 0.0099;
10 -> 0.9; an impossible 0.5 -> -1, i.e. "better than FP32 by 2x"). A broken model scores 0.
The PPL target and the other accuracy thresholds (mean KL, KL p99, top-1 agreement) come from the
acceptance policy (quantnorm.policy), the one ``quantnorm gate`` checks with the same defaults: a
trial passes only when the policy accepts its accuracy, and one failing a threshold other than the
PPL ratio scores 0, so the model the search keeps passes the gate's accuracy checks.

Trial accuracy is measured on a subset of the evaluation windows (``eval_windows``, evenly
spaced over the evaluation range, against the ORIGINAL FP32 model); the model the search picks
is measured again on the whole evaluation range by ``evaluate``.

Steps:
1. Recipes: the registry's weight-MatMul recipes, static and dynamic, plus ``smoothquant``
   (``default_space``), in registry order, or, when the FP32 probe found massive activations
   (``massive``), the recipes that survive them first (``probe_ordered``). With ``pick="first"``
   INC's ``need_stop`` ends the search at the first passing recipe. With ``pick="fastest"`` a
   recipe that cannot beat a passing trial is not tried (``pruned_by``: the same per-token
   kernels or more work; with massive activations, per-tensor activation scales once a per-token
   recipe passed) and is listed in ``pruned`` with why; the rest are timed (counted by
   ``max_trials`` like the trials).
2. Per-tensor fallback, only when no recipe passed: keep the k worst-SQNR weight-MatMul inputs of
   the best recipe in FP32 (SQNR from ``measure.sqnr.activation_sqnr`` on the best static trial;
   k counts input tensors, so q/k/v, which share one input, go together), k = 1, 2, 4, ... and
   finally all but one tensor; a second INC loop over ``exclude_worst`` stops at the first pass.
Screening: a trial missing the policy by ``SCREEN_FACTOR`` on 8 of its windows is neither timed
nor scored further. ``time_budget_s``: no trial starts after it ("time budget").
3. Pick: the fastest passing trial by CPU p50 latency at batch 8, or the first. With several
   passing trials they are timed again side by side, in interleaved rounds, and each one's lowest
   round decides (each trial's own timing came minutes apart from the others', between quantizer
   passes).
``max_trials`` bounds both loops together. Every trial is recorded, passing or not.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx

from .errors import ConfigError, QuantnormError
from .fileio import atomic_path
from .measure.accuracy import compare
from .measure.latency import bench_model
from .measure.sessions import ReopenableSession, make_session
from .measure.sqnr import activation_sqnr
from .policy import ACCURACY_LIMITS, DEFAULT_POLICY, Policy
from .quantize import Recipe, get_recipe, quantize, with_exclusions
from .quantize.recipes import ALPHA_SEPARATOR
from .search_space import default_space, probe_ordered, pruned_by, recipe_space_config

PICKS = ("fastest", "first")
SCREEN_FACTOR = 4.0   # real checkpoints' broken recipes miss the KL goal by 10-100x (0.06-0.8 vs 0.007)
ACCURACY_METRICS = tuple(metric for _, metric, _ in ACCURACY_LIMITS)  # what a trial's scorer returns


@contextmanager
def _quiet_inc() -> Iterator[None]:
    """INC logs a table per trial at INFO; we record the trials ourselves."""
    log = logging.getLogger("neural_compressor")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


# ---------------------------------------------------------------------------------------------
# Configuration and results


@dataclass(frozen=True)
class SearchConfig:
    # what a trial must reach to pass: the acceptance policy's accuracy thresholds, the ones the gate
    # checks (quantnorm.policy); it must set max_ppl_ratio, the tuner's target
    policy: Policy = DEFAULT_POLICY
    pick: str = "fastest"                     # "fastest" or "first"
    max_trials: int | None = None             # None: the whole space and the whole fallback
    space: tuple[str, ...] | None = None      # recipe names; None: default_space()
    sq_alpha: float | None = None             # overrides the alpha of SmoothQuant recipes
    eval_windows: int | None = 64             # trial accuracy on this many evaluation windows (None: all)
    screen_windows: int | None = 8            # screening windows (module doc; None: no screening)
    time_budget_s: float | None = None        # no trial starts after this many seconds of search (None: no limit)
    massive: bool = False                     # the probe found massive activations: probe_ordered, pruned_by
    fallback: bool = True
    sqnr_windows: int = 8
    latency_batch: int = 8
    latency_warmup: int = 2
    latency_iters: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"the search's policy must be a quantnorm.policy.Policy, got {type(self.policy).__name__}")
        if self.policy.max_ppl_ratio is None:
            raise ConfigError("the search needs a PPL ratio target: the policy's max_ppl_ratio is off")
        if self.pick not in PICKS:
            raise ConfigError(f"search pick must be one of {', '.join(PICKS)}, got {self.pick!r}")
        if self.max_trials is not None and self.max_trials < 1:
            raise ConfigError(f"max_trials must be >= 1, got {self.max_trials}")
        for name in self.recipes():
            r = get_recipe(name)
            if r.op_scope != "matmul":
                raise ConfigError(f"recipe {name} quantizes more than weight MatMuls; the search covers matmul scope only")
        if self.sq_alpha is not None and not 0.0 <= self.sq_alpha <= 1.0:
            raise ConfigError(f"--sq-alpha must be in [0, 1], got {self.sq_alpha}")
        if self.eval_windows is not None and self.eval_windows < 1:
            raise ConfigError(f"eval_windows must be >= 1, got {self.eval_windows}")
        if self.screen_windows is not None and self.screen_windows < 1:
            raise ConfigError(f"screen_windows must be >= 1, got {self.screen_windows}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ConfigError(f"--search-budget must be > 0 minutes, got {self.time_budget_s / 60:g}")
        if self.sqnr_windows < 1 or self.latency_batch < 1 or self.latency_iters < 1 or self.latency_warmup < 0:
            raise ConfigError("sqnr_windows, latency_batch and latency_iters must be >= 1, latency_warmup >= 0")

    @property
    def max_ppl_ratio(self) -> float:
        return self.policy.max_ppl_ratio

    def screen_policy(self) -> Policy | None:
        """Each threshold's distance from lossless times SCREEN_FACTOR (KL 0.01 -> 0.04); None: no
        screening (no screen windows, or a PPL target at or below FP32's own)."""
        p = self.policy
        if self.screen_windows is None or p.max_ppl_ratio <= 1.0:
            return None
        loose = lambda v, lossless: None if v is None else lossless + SCREEN_FACTOR * (v - lossless)  # noqa: E731
        return Policy(max_ppl_ratio=loose(p.max_ppl_ratio, 1.0), max_kld=loose(p.max_kld, 0.0), max_kld_p99=loose(
            p.max_kld_p99, 0.0), min_top1=None if p.min_top1 is None else max(0.0, loose(p.min_top1, 1.0)))

    def recipes(self) -> tuple[str, ...]:
        """The space in the order it is tried: the default one ordered by the probe's finding
        (``probe_ordered``); a space the user named, as named."""
        return probe_ordered(default_space(), self.massive) if self.space is None else tuple(self.space)

    @property
    def tolerable_loss(self) -> float:
        """INC's tolerable relative loss of ``1/ppl_ratio`` (module docstring)."""
        return 1.0 - 1.0 / self.max_ppl_ratio

    def resolve(self, name: str) -> Recipe:
        recipe = get_recipe(name)
        # an explicit NAME@ALPHA keeps its own alpha; --sq-alpha sets the others
        if self.sq_alpha is not None and recipe.smoothquant_alpha is not None and ALPHA_SEPARATOR not in name:
            recipe = replace(recipe, smoothquant_alpha=self.sq_alpha)
        return recipe


@dataclass(frozen=True)
class Trial:
    index: int                          # 1-based over both phases
    phase: str                          # "recipe" or "fallback"
    recipe: str                         # the registry recipe
    name: str                           # the recipe actually run (fallback: with its exclusions)
    status: str                         # "ok", "broken: ...", "error: ..."
    settings: dict = field(default_factory=dict)
    exclude_worst: int = 0              # FP32-kept input tensors (fallback)
    excluded_nodes: tuple[str, ...] = ()
    ppl_ratio: float | None = None
    kld_mean: float | None = None
    top1_agreement: float | None = None
    latency_p50_ms: float | None = None
    # pick="fastest" with several passing trials: the lowest of their p50s timed again in
    # interleaved rounds after the search (what the pick compares; None: not re-timed)
    latency_side_by_side_ms: float | None = None
    metric: float = 0.0                 # 1 / ppl_ratio: what INC's tuner saw (0: no usable model)
    passed: bool = False
    path: Path | None = None
    screened_windows: int | None = None   # dropped after scoring on this many windows (its numbers are theirs)
    seconds: float | None = None          # wall time of the trial: transform, quantize, score, time

    def to_dict(self) -> dict:
        return {
            "index": self.index, "phase": self.phase, "recipe": self.recipe, "name": self.name,
            "status": self.status, "exclude_worst": self.exclude_worst, "excluded_nodes": list(self.excluded_nodes),
            "ppl_ratio": self.ppl_ratio, "kld_mean": self.kld_mean, "top1_agreement": self.top1_agreement,
            "latency_p50_ms": self.latency_p50_ms, "latency_side_by_side_ms": self.latency_side_by_side_ms,
            "metric": self.metric, "passed": self.passed, "screened_windows": self.screened_windows,
            "seconds": self.seconds, "settings": self.settings,
        }


@dataclass(frozen=True)
class SearchResult:
    target_max_ppl_ratio: float
    target_min_top1: float | None
    tolerable_loss: float
    pick: str
    max_trials: int | None
    eval_windows: int
    trials: tuple[Trial, ...]
    chosen: Trial | None                # the picked passing trial; None when none passed
    best: Trial | None                  # highest metric of all trials (what to show when none passed)
    stopped_by: str                     # "target", "max_trials", "space exhausted"
    worst_tensors: tuple[dict, ...] = ()  # the SQNR ranking the fallback used
    skipped: tuple[str, ...] = ()
    level: str = "byte"                 # what the PPL ratio is over: bytes (zoo) or tokens (--model)
    target_max_kld: float | None = None
    pruned: tuple[dict, ...] = ()       # recipes not tried: {"recipe", "why"} (pruned_by)
    order: str = "registry"             # "registry", "probe: massive activations" or "as named"

    @property
    def status(self) -> str:
        return "passed" if self.chosen is not None else "no passing model"

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "target_max_ppl_ratio": self.target_max_ppl_ratio,
            "target_min_top1": self.target_min_top1,
            "target_max_kld": self.target_max_kld,
            "metric": "1/ppl_ratio (higher is better; FP32 baseline 1)",
            "tolerable_loss": self.tolerable_loss,
            "pick": self.pick, "max_trials": self.max_trials, "eval_windows": self.eval_windows,
            "stopped_by": self.stopped_by,
            "chosen": None if self.chosen is None else self.chosen.to_dict(),
            "best": None if self.best is None else self.best.to_dict(),
            "trials": [t.to_dict() for t in self.trials],
            "worst_tensors": list(self.worst_tensors),
            "skipped": list(self.skipped),
            "pruned": list(self.pruned),
            "order": self.order,
            "level": self.level,
            "tuner": "neural_compressor.common.base_tuning",
        }


# ---------------------------------------------------------------------------------------------
# The search


def eval_subset(n: int, k: int | None) -> np.ndarray:
    """Indices of ``k`` windows evenly spaced over ``n`` (all of them when k is None or >= n)."""
    if k is None or k >= n:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


class _Runner:
    """Quantize, measure and record one trial."""

    def __init__(self, fp32_path, work_dir, calib_inputs, eval_inputs, eval_targets, cfg, spec, vnni,
                 fp32_for, latency_fn, scorer, preprocessed=None, fp32_session=None):
        self.scorer, self.preprocessed = scorer, preprocessed
        self.fp32_path, self.work_dir, self.cfg, self.spec, self.vnni = fp32_path, work_dir, cfg, spec, vnni
        self.calib_inputs, self.eval_inputs, self.eval_targets = calib_inputs, eval_inputs, eval_targets
        self.fp32_for, self.latency_fn = fp32_for, latency_fn
        # closed while a trial quantizes; the caller's (a ReplayedSession over the same model) when given
        self.fp32_session = fp32_session if fp32_session is not None else ReopenableSession(fp32_path, spec)
        self.trials: list[Trial] = []

    def run(self, recipe: Recipe, phase: str, base: str, k: int = 0, nodes: tuple[str, ...] = ()) -> Trial:
        index = len(self.trials) + 1
        common = dict(index=index, phase=phase, recipe=base, name=recipe.name, exclude_worst=k, excluded_nodes=nodes)
        started = time.perf_counter()
        try:
            source = self.fp32_for(recipe)
            self.fp32_session.close()
            q = quantize(source, recipe, self.calib_inputs, self.work_dir / f"trial{index:02d}.{recipe.name}.onnx",
                         vnni=self.vnni, probe_inputs=self.eval_inputs[:2], preprocessed=self.preprocessed)
            if not q.ok or q.path is None:
                trial = Trial(**common, status=q.status, settings=q.settings)
            else:
                int8 = make_session(q.path, self.spec)
                screened = self._screen(int8)
                if screened is not None:   # missed the policy by SCREEN_FACTOR: neither timed nor scored further
                    trial = self._scored(common, q, screened, latency=None, screened_windows=len(self.screen))
                else:
                    acc = self.scorer(self.fp32_session, int8, self.eval_inputs, self.eval_targets)
                    # one INT8 session at a time: the timing opens its own (Gemma 3: the 0.95 GB model
                    # twice, and a batch-8 arena beside the scoring one, was the search's peak)
                    del int8
                    trial = self._scored(common, q, acc, latency=self.latency_fn(q.path, recipe.name))
        except QuantnormError as exc:  # quantize, measure, export (smoothing) or config
            # One recipe failing is a finding of the search, not the end of it.
            trial = Trial(**common, status=f"error: {exc}")
        trial = replace(trial, seconds=round(time.perf_counter() - started, 2))
        self.trials.append(trial)
        return trial

    @property
    def screen(self) -> np.ndarray:   # the screening windows, evenly spaced over the trial windows
        return eval_subset(len(self.eval_inputs), self.cfg.screen_windows)

    def _screen(self, int8_session):   # the screening windows' accuracy when it misses the loose policy
        policy = self.cfg.screen_policy()
        if policy is None or len(self.screen) >= len(self.eval_inputs):
            return None
        acc = self.scorer(self.fp32_session, int8_session, self.eval_inputs[self.screen],
                          self.eval_targets[self.screen])
        return acc if policy.accuracy_failures({m: getattr(acc, m, None) for m in ACCURACY_METRICS}) else None

    def _scored(self, common: dict, q, acc, *, latency: float | None, screened_windows: int | None = None) -> Trial:
        # The gate's own rule (quantnorm.policy); failing a threshold other than the PPL ratio
        # scores 0, so INC's pass rule (metric vs tolerable_loss) and ours agree.
        failures = self.cfg.policy.accuracy_failures({m: getattr(acc, m, None) for m in ACCURACY_METRICS})
        others_ok = all(f.startswith("ppl_ratio ") for f in failures)
        metric = 1.0 / acc.ppl_ratio if acc.ppl_ratio > 0 and others_ok else 0.0
        return Trial(**common, status="ok", settings=q.settings, ppl_ratio=acc.ppl_ratio, kld_mean=acc.kld_mean,
                     top1_agreement=acc.top1_agreement, latency_p50_ms=latency, metric=metric,
                     passed=not failures and screened_windows is None, path=q.path,
                     screened_windows=screened_windows)


def _bench_latency(spec, seq: int, cfg: SearchConfig) -> Callable[[Path, str], float | None]:
    def latency(path: Path, variant: str) -> float | None:
        row = bench_model(path, variant=variant, spec=spec, batch=cfg.latency_batch, seq=seq,
                          warmup=cfg.latency_warmup, iters=cfg.latency_iters, record_placement=False)
        return row.p50_ms if row.measured else None

    return latency


def search_recipes(fp32_path: Path, work_dir: Path, calib_inputs: np.ndarray, eval_inputs: np.ndarray,
                   eval_targets: np.ndarray, *, cfg: SearchConfig, spec, vnni: bool,
                   fp32_for: Callable[[Recipe], Path] | None = None,
                   latency_fn: Callable[[Path, str], float | None] | None = None,
                   scorer: Callable | None = None, level: str = "byte", preprocessed=None,
                   fp32_session=None) -> SearchResult:
    """Search the recipe space for a model with ``ppl_ratio <= cfg.max_ppl_ratio`` (module doc).

    ``fp32_for(recipe)``: the FP32 model a recipe quantizes (without it SmoothQuant recipes are
    skipped); accuracy is always against ``fp32_path``. Trial models stay in ``work_dir``
    (``Trial.path``). ``latency_fn(path, name)`` -> p50 ms (default: ``bench_model``).
    ``preprocessed``: the run's ``quantize.PreprocessCache`` (each FP32 model pre-processed once).
    ``scorer(fp32_session, int8_session, inputs, targets)`` -> an object with ``ppl_ratio``,
    ``kld_mean`` and ``top1_agreement`` (default: the zoo's byte-level ``measure.accuracy.compare``;
    ``--model`` passes a token-level one and ``level="token"``). ``fp32_session``: a session on
    ``fp32_path`` to score against (the run's ``ReplayedSession``: FP32 outputs computed once);
    None opens one.
    """
    # neural-compressor: slow to import, and only --recipes auto needs it
    from neural_compressor.common.base_tuning import EvaluationFuncWrapper, TuningConfig, init_tuning

    fp32_path, work_dir = Path(fp32_path), Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    space = list(cfg.recipes())
    skipped: list[str] = []
    if fp32_for is None:
        skipped = [n for n in space if get_recipe(n).smoothquant_alpha is not None]
        space = [n for n in space if n not in skipped]
        fp32_for = lambda recipe: fp32_path  # noqa: E731
    if not space:
        raise ConfigError("the search space is empty (SmoothQuant recipes need the torch model to smooth)")
    pick = eval_subset(len(eval_inputs), cfg.eval_windows)
    inputs, targets = np.asarray(eval_inputs)[pick], np.asarray(eval_targets)[pick]
    if latency_fn is None:
        latency_fn = _bench_latency(spec, int(inputs.shape[1]), cfg)
    if scorer is None:
        scorer = compare
    runner = _Runner(fp32_path, work_dir, calib_inputs, inputs, targets, cfg, spec, vnni, fp32_for, latency_fn, scorer,
                     preprocessed, fp32_session)
    budget = cfg.max_trials if cfg.max_trials is not None else 10**6
    deadline = None if cfg.time_budget_s is None else time.monotonic() + cfg.time_budget_s

    with _quiet_inc():
        # Phase 1: the recipes. INC expands the config into one trial per recipe and owns the order
        # (its SequentialSampler), the budget and the stop rule.
        by_config: dict[int, Trial] = {}
        pruned: list[dict] = []

        def evaluate(config) -> float:
            recipe = cfg.resolve(config.recipe)
            why = _why_not_tried(cfg, recipe, runner.trials)
            if why is not None:
                pruned.append({"recipe": config.recipe, "why": why})
                return 0.0
            trial = runner.run(recipe, "recipe", config.recipe)
            by_config[id(config)] = trial
            return trial.metric

        stopped_by, monitor = _tune(recipe_space_config(recipe=space), budget, cfg, EvaluationFuncWrapper(evaluate),
                                    TuningConfig, init_tuning, deadline=deadline)
        phase1 = list(runner.trials)
        worst: list[dict] = []
        if (cfg.fallback and not any(t.passed for t in phase1) and len(runner.trials) < budget
                and (deadline is None or time.monotonic() < deadline)):
            base_trial = by_config.get(id(monitor.get_best_quant_config())) if monitor.tuning_history else None
            if base_trial is not None and base_trial.status == "ok":
                worst = _worst_tensors(phase1, fp32_for, cfg, inputs)
                stopped_by = _fallback(runner, base_trial, worst, budget - len(runner.trials), cfg,
                                       TuningConfig, init_tuning, EvaluationFuncWrapper, deadline) or stopped_by

    trials = tuple(runner.trials)
    if cfg.pick == "fastest":
        trials = _retime_side_by_side(trials, latency_fn, SIDE_BY_SIDE_ROUNDS)
    chosen, best = _chosen_and_best(trials, cfg)
    return SearchResult(
        target_max_ppl_ratio=cfg.max_ppl_ratio, target_min_top1=cfg.policy.min_top1, tolerable_loss=cfg.tolerable_loss,
        pick=cfg.pick, max_trials=cfg.max_trials, eval_windows=int(len(inputs)), trials=trials, chosen=chosen,
        best=best, stopped_by=stopped_by, worst_tensors=tuple(worst), skipped=tuple(skipped), level=level,
        target_max_kld=cfg.policy.max_kld, pruned=tuple(pruned), order=_order(cfg),
    )


def _chosen_and_best(trials: tuple[Trial, ...], cfg: SearchConfig) -> tuple[Trial | None, Trial | None]:
    """The pick among the passing trials (None: none passed) and the highest-metric usable trial."""
    passing = [t for t in trials if t.passed]
    chosen = None
    if passing:
        chosen = passing[0] if cfg.pick == "first" else min(passing, key=_pick_latency)
    ok = [t for t in trials if t.status == "ok"]
    return chosen, (max(ok, key=lambda t: (t.metric, -t.index)) if ok else None)


def _why_not_tried(cfg: SearchConfig, recipe: Recipe, trials: list[Trial]) -> str | None:
    """Why ``recipe`` cannot change a ``fastest`` pick after ``trials`` (``search_space.pruned_by``;
    the massive-activation rule only over the default space: a named one is tried as named)."""
    if cfg.pick != "fastest":
        return None
    passed = [cfg.resolve(t.recipe) for t in trials if t.passed]
    return pruned_by(recipe, passed, cfg.massive and cfg.space is None)


def _order(cfg: SearchConfig) -> str:
    return "as named" if cfg.space is not None else "probe: massive activations" if cfg.massive else "registry"


SIDE_BY_SIDE_ROUNDS = 3


def _pick_latency(trial: Trial) -> tuple[float, int]:
    ms = trial.latency_side_by_side_ms if trial.latency_side_by_side_ms is not None else trial.latency_p50_ms
    return (ms if ms is not None else math.inf), trial.index


def _retime_side_by_side(trials: tuple[Trial, ...], latency_fn, rounds: int) -> tuple[Trial, ...]:
    """The passing trials timed again in ``rounds`` interleaved rounds, each keeping its lowest p50:
    timed once, minutes apart, two graphs of the same cost can time 20% apart (enough to pick the
    slower); a neighbour's load only ever adds time, so the lowest, not the median."""
    passing = [t for t in trials if t.passed and t.path is not None and Path(t.path).is_file()]
    if len(passing) < 2:
        return trials
    samples: dict[int, list[float]] = {t.index: [] for t in passing}
    for _ in range(rounds):
        for t in passing:
            ms = latency_fn(Path(t.path), t.name)
            if ms is not None:
                samples[t.index].append(ms)
    best = {i: float(min(v)) for i, v in samples.items() if v}
    return tuple(replace(t, latency_side_by_side_ms=best[t.index]) if t.index in best else t for t in trials)


def _tune(config_set, budget: int, cfg: SearchConfig, evaluator, TuningConfig, init_tuning,
          stop_at_first_pass: bool | None = None, deadline: float | None = None):
    """One INC tuning loop; returns (why it stopped, INC's monitor).

    INC's ``need_stop`` is "max_trials reached or the last trial met the target"; we honour the
    first half always and the second when stopping at the first pass (``pick="first"``); no trial
    but the first starts after ``deadline``."""
    tuning_config = TuningConfig(config_set=config_set, tolerable_loss=cfg.tolerable_loss, max_trials=budget)
    loader, _tuning_logger, monitor = init_tuning(tuning_config)  # caps max_trials at the space size
    monitor.set_baseline(1.0)  # 1/ppl_ratio of the FP32 model against itself
    first = cfg.pick == "first" if stop_at_first_pass is None else stop_at_first_pass
    space_size = len(loader.config_set)
    for index, config in enumerate(loader, 1):
        if deadline is not None and index > 1 and time.monotonic() >= deadline:
            return "time budget", monitor
        metric = evaluator.evaluate(config)
        monitor.add_trial_result(index, metric, config)
        if not monitor.need_stop():
            continue
        if first and metric >= monitor.baseline * (1 - tuning_config.tolerable_loss):
            return "target", monitor
        if monitor.trial_cnt >= tuning_config.max_trials:
            return ("max_trials" if budget < space_size else "space exhausted"), monitor
    return "space exhausted", monitor


def _worst_tensors(trials: list[Trial], fp32_for, cfg: SearchConfig, inputs: np.ndarray) -> list[dict]:
    """Weight-MatMul input tensors of the best static (QDQ) trial, worst SQNR first, each with the
    MatMul nodes it feeds (node names as the quantizer resolves exclusions)."""
    static = [t for t in trials if t.status == "ok" and t.settings.get("mode") == "static" and t.path is not None]
    if not static:
        return []
    ref = max(static, key=lambda t: (t.metric, -t.index))
    rows = activation_sqnr(fp32_for(cfg.resolve(ref.recipe)), ref.path, inputs[: cfg.sqnr_windows])
    consumers = _dequantized_matmuls(ref.path)
    ranked = []
    for row in rows:
        db = row["sqnr_db"] if row["sqnr_db"] is not None else row["sqnr_local_db"]
        nodes = consumers.get(row["tensor"], [])
        if nodes:
            ranked.append({"tensor": row["tensor"], "sqnr_db": db, "matmuls": nodes, "from_trial": ref.index})
    # None (no noise at all) sorts last: nothing to gain from keeping an exact tensor in FP32.
    ranked.sort(key=lambda r: math.inf if r["sqnr_db"] is None else r["sqnr_db"])
    return ranked


def _dequantized_matmuls(int8_path: Path) -> dict[str, list[str]]:
    """{activation tensor: MatMul nodes that read its QuantizeLinear -> DequantizeLinear copy}."""
    graph = onnx.load(str(int8_path)).graph
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    out: dict[str, list[str]] = {}
    for q in graph.node:
        if q.op_type != "QuantizeLinear":
            continue
        tensor = q.input[0].removesuffix("_QuantizeLinear_Input")
        for dq in users.get(q.output[0], []):
            if dq.op_type != "DequantizeLinear":
                continue
            for mm in users.get(dq.output[0], []):
                if mm.op_type == "MatMul" and mm.input[0] == dq.output[0] and mm.name not in out.get(tensor, []):
                    out.setdefault(tensor, []).append(mm.name)
    return out


def trial_recipe(cfg: SearchConfig, trial: Trial) -> Recipe:
    """The recipe a trial ran: the registry recipe, with the fallback's FP32-kept nodes if any."""
    recipe = cfg.resolve(trial.recipe)
    return with_exclusions(recipe, trial.excluded_nodes, name=trial.name) if trial.excluded_nodes else recipe


def fallback_ks(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n - 1: keeping all n in FP32 would leave no INT8 model."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    if n > 1 and ks[-1] != n - 1:
        ks.append(n - 1)
    return ks


def _fallback(runner: _Runner, base: Trial, worst: list[dict], budget: int, cfg: SearchConfig,
              TuningConfig, init_tuning, EvaluationFuncWrapper, deadline: float | None = None) -> str | None:
    ks = fallback_ks(len(worst))
    if not ks or budget < 1:
        return None
    base_recipe = cfg.resolve(base.recipe)

    def evaluate(config) -> float:
        k = int(config.exclude_worst)
        nodes = tuple(dict.fromkeys(n for row in worst[:k] for n in row["matmuls"]))
        recipe = with_exclusions(base_recipe, nodes, name=f"{base.recipe}-fp32worst{k}")
        return runner.run(recipe, "fallback", base.recipe, k, nodes).metric

    # The fallback always stops at its first pass: more FP32 tensors only cost speed.
    stopped_by, _ = _tune(recipe_space_config(recipe=base.recipe, exclude_worst=ks), budget, cfg,
                          EvaluationFuncWrapper(evaluate), TuningConfig, init_tuning, stop_at_first_pass=True,
                          deadline=deadline)
    return stopped_by


def keep_trial_model(trial: Trial, dest: Path) -> Path:
    """Copy a trial's model to ``dest`` (evaluate keeps the chosen one, then drops the work dir)."""
    if trial.path is None:
        raise ConfigError(f"trial {trial.index} ({trial.name}) has no model file")
    dest = Path(dest)
    with atomic_path(dest, suffix=".onnx") as tmp:
        shutil.copyfile(trial.path, tmp)
    return dest
