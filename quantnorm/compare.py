"""The comparison report of a sweep: training status, statistics over seeds, a ranking, and
findings with verdicts.

Reads only what the cells wrote (``<cell>/results.json`` -- or ``cells/<cell>/results.json`` in a
published copy --, its ``diagnostics`` included; ``train.json``/``config.json`` of a cell whose
training diverged; ``train_log.jsonl`` for step 0's gradient norms; ``sweep.json`` for the
command), so ``quantnorm compare DIR`` can regenerate the report, and ``quantnorm findings DIR``
its findings section, at any time, byte for byte.

Training status first (quantnorm.train_status): a cell is trained, collapsed (not at least the
collapse margin below the unigram baseline) or diverged; collapsed and diverged cells are left out
of every mean, ranking, plot and effect, and named.

Statistics (the seed is the unit of replication):

- mean and 95% Student-t interval ``mean +/- t(0.975, n-1) * sd / sqrt(n)`` over seeds (no
  interval with n = 1);
- a claim is split into sub-tests (:class:`SubTest`): one per setting of the other axes (norm,
  depth, warm-up, learning rate: separate rows, never replicates) and per half of the claim, with
  one value per seed -- a paired difference where the design pairs the arms on the seed (same
  initialisation and batch order) -- and a t-test over n = seeds (equivalence by two one-sided
  tests for "about zero", the F-test for "less seed-to-seed variance", a per-seed Spearman rho
  through Fisher's z for correlations);
- the sub-tests of one claim are corrected together with Holm's step-down method (:func:`holm`);
  a sub-test holds / does not hold when its corrected p is below 0.05 in / against the claimed
  direction, is not significant otherwise, and is not tested with one seed or without data;
  :func:`combine` makes the claim's verdict;
- tuning (best warm-up, best learning rate) chooses on the other seeds and measures on the held-out
  one (:func:`held_out_best`), so the comparison is not biased by the choice; the in-sample choice
  and its bias are reported beside it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from .errors import DataError, RunDirError
from .fileio import write_text_atomic
from .runs import CONFIG_FILE, PLOTS_DIR, REPORT_FILE, RESULTS_FILE, TRAIN_LOG_FILE, TRAIN_SUMMARY_FILE
from .train_status import (
    DEFAULT_COLLAPSE_MARGIN,
    DIVERGED,
    STATUSES,
    TRAINED,
    check_margin,
    status_from_results,
)

LEVEL = 0.95
HOLDS = "holds here"
DOES_NOT_HOLD = "does not hold here"
NOT_SIGNIFICANT = "not significant"
NOT_TESTED = "not tested"
VERDICTS = (HOLDS, DOES_NOT_HOLD, NOT_SIGNIFICANT, NOT_TESTED)
CPU = "CPUExecutionProvider"
PLACEMENT_ORDER = ("post", "pre", "peri", "deepnorm", "residual")
NORM_ORDER = ("layer", "rms")
FINDINGS_FILE = "findings.md"
CONSTANT_GROWTH = 1.10   # "stays constant": per-layer RMS growth factor within [1/1.1, 1.1]


# ------------------------------------------------------------------------------------ statistics


def t_quantile(df: float, level: float = LEVEL) -> float:
    """Two-sided Student-t critical value (4.303 for df = 2 at 95%)."""
    return float(scipy_stats.t.ppf(0.5 + level / 2, df))


def _finite(values: Iterable) -> list[float]:
    out = []
    for v in values:
        if v is None or isinstance(v, bool):
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out.append(f)
    return out


@dataclass(frozen=True)
class Estimate:
    """A mean over n values with its 95% interval (lo/hi None when n < 2)."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int
    sd: float | None = None

    @property
    def has_interval(self) -> bool:
        return self.lo is not None and self.hi is not None

    def overlaps(self, other: Estimate) -> bool:
        """True when the two intervals overlap, or either has none (cannot be told apart)."""
        if not (self.has_interval and other.has_interval):
            return True
        return self.lo <= other.hi and other.lo <= self.hi

    def scaled(self, factor: float) -> Estimate:
        f = lambda v: None if v is None else v * factor  # noqa: E731
        lo, hi = f(self.lo), f(self.hi)
        if factor < 0 and lo is not None:
            lo, hi = hi, lo
        return Estimate(f(self.mean), lo, hi, self.n, None if self.sd is None else abs(self.sd * factor))

    def format(self, spec: str = ".4g", unit: str = "") -> str:
        if self.mean is None:
            return "–"
        if not self.has_interval:
            return f"{self.mean:{spec}}{unit} (n={self.n})"
        return f"{self.mean:{spec}}{unit} [{self.lo:{spec}}, {self.hi:{spec}}]"

    def to_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n, "sd": self.sd}


def estimate(values: Iterable, level: float = LEVEL) -> Estimate:
    """Mean and Student-t interval of the finite values (None, NaN and inf are left out)."""
    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return Estimate(None, None, None, 0)
    mean = sum(xs) / n
    if n == 1:
        return Estimate(mean, None, None, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(n - 1, level) * sd / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n, sd)


def welch_difference(a: Iterable, b: Iterable, level: float = LEVEL) -> Estimate:
    """mean(a) - mean(b) with Welch's interval (Welch-Satterthwaite degrees of freedom)."""
    xa, xb = _finite(a), _finite(b)
    if not xa or not xb:
        return Estimate(None, None, None, 0)
    ea, eb = estimate(xa, level), estimate(xb, level)
    diff = ea.mean - eb.mean
    n = min(len(xa), len(xb))
    if len(xa) < 2 or len(xb) < 2:
        return Estimate(diff, None, None, n)
    va, vb = ea.sd ** 2 / len(xa), eb.sd ** 2 / len(xb)
    se = math.sqrt(va + vb)
    if se == 0:
        return Estimate(diff, diff, diff, n, 0.0)
    df = (va + vb) ** 2 / (va ** 2 / (len(xa) - 1) + vb ** 2 / (len(xb) - 1))
    half = t_quantile(df, level) * se
    return Estimate(diff, diff - half, diff + half, n, se * math.sqrt(n))


def matched_difference(a: dict, b: dict, level: float = LEVEL) -> Estimate:
    """a[k] - b[k] over the keys both have (paired t-interval); Welch when fewer than 2 pairs."""
    common = [k for k in a if k in b and _finite([a[k]]) and _finite([b[k]])]
    if len(common) >= 2:
        return estimate([a[k] - b[k] for k in common], level)
    return welch_difference(a.values(), b.values(), level)


@dataclass(frozen=True)
class Correlation:
    rho: float | None
    lo: float | None
    hi: float | None
    n: int

    @property
    def has_interval(self) -> bool:
        return self.lo is not None

    def format(self) -> str:
        if self.rho is None:
            return f"undefined (n={self.n})"
        if not self.has_interval:
            return f"{self.rho:+.2f} (n={self.n}, no interval)"
        return f"{self.rho:+.2f} [{self.lo:+.2f}, {self.hi:+.2f}] (n={self.n})"


def spearman_interval(xs: Sequence, ys: Sequence, level: float = LEVEL) -> Correlation:
    """Spearman's rho over pairs where both are finite, with a Fisher-z interval (n >= 4)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if _finite([x]) and _finite([y])]
    n = len(pairs)
    if n < 3:
        return Correlation(None, None, None, n)
    a, b = np.array(pairs, dtype=float).T
    if np.all(a == a[0]) or np.all(b == b[0]):
        return Correlation(None, None, None, n)
    rho = float(scipy_stats.spearmanr(a, b).statistic)
    if n < 4:
        return Correlation(rho, None, None, n)
    z = math.atanh(max(-0.999999, min(0.999999, rho)))
    half = float(scipy_stats.norm.ppf(0.5 + level / 2)) * math.sqrt(1.06 / (n - 3))
    return Correlation(rho, math.tanh(z - half), math.tanh(z + half), n)


# -------------------------------------------------------------------------------------- verdicts


def verdict_sign(est: Estimate | Correlation, expected: int) -> str:
    """The claim says the quantity is > 0 (expected=+1) or < 0 (expected=-1)."""
    mean = est.rho if isinstance(est, Correlation) else est.mean
    if mean is None:
        return NOT_TESTED
    if not est.has_interval:
        return NOT_SIGNIFICANT
    if est.lo > 0:
        return HOLDS if expected > 0 else DOES_NOT_HOLD
    if est.hi < 0:
        return HOLDS if expected < 0 else DOES_NOT_HOLD
    return NOT_SIGNIFICANT


def verdict_order(a: Estimate, b: Estimate) -> str:
    """The claim says a < b; overlapping 95% intervals are not significant."""
    if a.mean is None or b.mean is None:
        return NOT_TESTED
    if a.overlaps(b):
        return NOT_SIGNIFICANT
    return HOLDS if a.mean < b.mean else DOES_NOT_HOLD


def verdict_within(est: Estimate, bound: float) -> str:
    """The claim says the quantity is about 0: interval inside [-bound, bound] holds, wholly
    outside it does not hold, anything else is not significant."""
    if est.mean is None:
        return NOT_TESTED
    if not est.has_interval:
        return NOT_SIGNIFICANT
    if -bound <= est.lo and est.hi <= bound:
        return HOLDS
    if est.lo > bound or est.hi < -bound:
        return DOES_NOT_HOLD
    return NOT_SIGNIFICANT


def combine(parts: Sequence[str]) -> str:
    """A claim of several parts: any part that does not hold decides; all tested parts hold -> holds;
    parts that were not tested are left out (all untested -> not tested)."""
    tested = [p for p in parts if p != NOT_TESTED]
    if not tested:
        return NOT_TESTED
    if DOES_NOT_HOLD in tested:
        return DOES_NOT_HOLD
    if all(p == HOLDS for p in tested):
        return HOLDS
    return NOT_SIGNIFICANT


# ----------------------------------------------------------------------------------------- cells


@dataclass
class CellResult:
    """One finished cell: its results.json (None when training diverged) and training summary.

    ``status`` (trained / collapsed / diverged, quantnorm.train_status) is set by :func:`load_cell`
    from the recorded keys or, for runs written before they existed, from the data ranges. A cell
    built in memory without it takes the recorded ``train.status``, else ``diverged`` or ``trained``.
    """

    name: str
    path: Path
    placement: str
    norm: str
    depth: int
    warmup: int
    seed: int
    diverged: bool
    train: dict
    results: dict | None = None
    grad0: dict | None = None
    perturbation: list[dict] | None = None   # results["diagnostics"]["perturbation"]
    block_cosine: list[float] | None = None  # results["diagnostics"]["block_cosine"], one per block
    status: str | None = None
    unigram: float | None = None              # bits/byte of the unigram baseline
    grad_ffn0: dict | None = None            # step 0's per-block FFN weight gradient norms (train_log.jsonl)
    lr: float | None = None                  # peak learning rate (train.config.lr)
    status_derived: bool = False             # status computed when read (the run did not record one)

    def __post_init__(self) -> None:
        if self.status is None:
            recorded = self.train.get("status")
            self.status = DIVERGED if self.diverged else (recorded if recorded in STATUSES else TRAINED)
        if self.lr is None:
            lr = (self.train.get("config") or {}).get("lr")
            self.lr = float(lr) if _finite([lr]) else None

    @property
    def trained(self) -> bool:
        return self.status == TRAINED

    @property
    def group(self) -> tuple:
        return (self.placement, self.norm, self.depth, self.warmup, self.lr)

    @property
    def bits_per_byte(self) -> float | None:
        return None if self.diverged else self.train.get("eval_bits_per_byte")

    def recipe_names(self) -> list[str]:
        return [r["name"] for r in (self.results or {}).get("recipes", [])]

    def recipe(self, name: str) -> dict | None:
        for r in (self.results or {}).get("recipes", []):
            if r.get("name") == name:
                return r
        return None

    def accuracy(self, recipe: str, key: str) -> float | None:
        r = self.recipe(recipe)
        acc = (r or {}).get("accuracy") or {}
        return acc.get(key)

    def latency_ratio(self, recipe: str) -> tuple[float | None, int | None]:
        """INT8/FP32 p50 on the CPU provider at the largest batch where both were measured."""
        rows = [r for r in (self.results or {}).get("latency", [])
                if r.get("provider") == CPU and r.get("status") == "measured"]
        fp32 = {r["batch"]: r["p50_ms"] for r in rows if r["variant"] == "fp32"}
        int8 = {r["batch"]: r["p50_ms"] for r in rows if r["variant"] == recipe}
        both = sorted(set(fp32) & set(int8))
        if not both or not fp32[both[-1]]:
            return None, None
        return int8[both[-1]] / fp32[both[-1]], both[-1]

    def fp32_p50(self) -> tuple[float | None, int | None]:
        rows = [r for r in (self.results or {}).get("latency", [])
                if r.get("provider") == CPU and r.get("status") == "measured" and r.get("variant") == "fp32"]
        if not rows:
            return None, None
        row = max(rows, key=lambda r: r["batch"])
        return row["p50_ms"], row["batch"]

    def residual(self) -> list[dict]:
        return ((self.results or {}).get("outliers") or {}).get("residual") or []

    def max_ratio(self) -> float | None:
        ratios = _finite(r.get("ratio") for r in self.residual())
        return max(ratios) if ratios else None

    def max_kurtosis(self) -> float | None:
        k = _finite(r.get("kurtosis") for r in self.residual())
        return max(k) if k else None

    def massive_count(self) -> int | None:
        o = (self.results or {}).get("outliers")
        return None if o is None else len(o.get("massive") or [])

    def noise_levels(self) -> list[float]:
        return sorted({float(r["relative_noise"]) for r in self.perturbation or []
                       if _finite([r.get("relative_noise")])})

    def logit_change(self, noise: float) -> float | None:
        """Relative logit change at relative weight noise ``noise`` (perturbation probe)."""
        for r in self.perturbation or []:
            if _finite([r.get("relative_noise")]) and float(r["relative_noise"]) == noise:
                v = _finite([r.get("relative_logit_change")])
                return v[0] if v else None
        return None

    def log_logit_change(self, noise: float) -> float | None:
        v = self.logit_change(noise)
        return math.log(v) if v is not None and v > 0 else None

    def late_cosine(self) -> float | None:
        """Mean cosine(block output, block input) over the last half of the blocks (the middle one
        included when the depth is odd; the only block at depth 1)."""
        cos = self.block_cosine or []
        values = _finite(cos[len(cos) // 2:])
        return sum(values) / len(values) if values and len(values) == len(cos[len(cos) // 2:]) else None

    def cosine_slope(self) -> float | None:
        """Least-squares slope of cosine(block output, block input) over the block index (>= 2 blocks)."""
        cos = self.block_cosine or []
        values = _finite(cos)
        if len(values) < 2 or len(values) != len(cos):
            return None
        return float(np.polyfit(np.arange(len(values), dtype=float), np.array(values), 1)[0])


@dataclass
class Sweep:
    path: Path
    cells: list[CellResult]
    manifest: dict | None = None
    problems: list[str] = field(default_factory=list)   # cells left out, and why
    collapse_margin: float = DEFAULT_COLLAPSE_MARGIN

    @property
    def depths(self) -> list[int]:
        return sorted({c.depth for c in self.cells})

    @property
    def warmups(self) -> list[int]:
        return sorted({c.warmup for c in self.cells})

    @property
    def lrs(self) -> list[float]:
        return sorted({c.lr for c in self.cells if c.lr is not None})

    @property
    def seeds(self) -> list[int]:
        return sorted({c.seed for c in self.cells})

    @property
    def not_trained(self) -> list[CellResult]:
        return sorted((c for c in self.cells if not c.trained), key=lambda c: (_order_key(c.group), c.seed))

    def trained_view(self) -> Sweep:
        """The same sweep with only its trained cells: every effect is computed on this view."""
        return Sweep(self.path, [c for c in self.cells if c.trained], self.manifest, self.problems,
                     self.collapse_margin)

    def groups(self) -> dict[tuple, list[CellResult]]:
        out: dict[tuple, list[CellResult]] = {}
        for c in sorted(self.cells, key=lambda c: (_order_key(c.group), c.seed)):
            out.setdefault(c.group, []).append(c)
        return out

    def label(self, group: tuple) -> str:
        placement, norm, depth, warmup, lr = (tuple(group) + (None,))[:5]
        return f"{placement}/{norm}" + self.axes_label(depth=depth, warmup=warmup, lr=lr)

    def axes_label(self, *, norm: str | None = None, depth: int | None = None, warmup: int | None = None,
                   lr: float | None = None, placement: str | None = None) -> str:
        """The axes that vary in this sweep, as ' L8 w30 lr0.003' (norm and placement when given)."""
        parts = [x for x in (placement, norm) if x is not None]
        if depth is not None and len(self.depths) > 1:
            parts.append(f"L{depth}")
        if warmup is not None and len(self.warmups) > 1:
            parts.append(f"w{warmup}")
        if lr is not None and len(self.lrs) > 1:
            parts.append(f"lr{lr:g}")
        return (" " + " ".join(parts)) if parts else ""

    def recipes(self) -> list[str]:
        """Recipe names in the order the cells list them (the first is the primary recipe)."""
        names: dict[str, None] = {}
        for c in self.cells:
            for n in c.recipe_names():
                names.setdefault(n, None)
        return list(names)

    def select(self, **where) -> list[CellResult]:
        return [c for c in self.cells if all(getattr(c, k) == v for k, v in where.items())]


def _order_key(group: tuple) -> tuple:
    placement, norm, depth, warmup, lr = (tuple(group) + (None,))[:5]
    p = PLACEMENT_ORDER.index(placement) if placement in PLACEMENT_ORDER else len(PLACEMENT_ORDER)
    n = NORM_ORDER.index(norm) if norm in NORM_ORDER else len(NORM_ORDER)
    return (p, placement, n, norm, depth, warmup, lr if lr is not None else 0.0)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _step0(cell_dir: Path) -> dict:
    try:
        with open(cell_dir / TRAIN_LOG_FILE, encoding="utf-8") as log:
            first = json.loads(log.readline())
        return first if isinstance(first, dict) else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _grad0(cell_dir: Path) -> dict | None:
    return _step0(cell_dir).get("grad_norm_per_layer")


def _diagnostics(results: dict) -> tuple[list[dict] | None, list[float] | None]:
    """The perturbation rows and per-block cosines of results["diagnostics"] (None when absent)."""
    d = results.get("diagnostics")
    if not isinstance(d, dict):
        return None, None
    rows = d.get("perturbation")
    rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else None
    cos = d.get("block_cosine")
    cos = list(cos) if isinstance(cos, list) else None
    return rows or None, cos or None


def _status(train: dict, data: dict | None, margin: float | None) -> dict:
    try:
        st = status_from_results(train, data, margin)
    except DataError as exc:
        raise RunDirError(f"training status unknown ({exc})") from None
    return {"status": st.status, "unigram": st.unigram_bits_per_byte, "status_derived": st.derived}


def load_cell(cell_dir: Path, margin: float | None = None) -> CellResult | None:
    """A finished cell, or None when the directory holds no finished cell. Raises RunDirError for
    a results.json that cannot be used (corrupt, other schema, no way to tell its training status)."""
    from .report import load_results

    cell_dir = Path(cell_dir)
    step0 = _step0(cell_dir)
    if (cell_dir / RESULTS_FILE).is_file():
        results = load_results(cell_dir / RESULTS_FILE)
        try:
            m, t = results["model"], results["train"]
            tc = t["config"]
            perturbation, block_cosine = _diagnostics(results)
            status = _status(t, results.get("data"), margin)
            return CellResult(cell_dir.name, cell_dir, m["placement"], m["norm"], int(m["n_layers"]),
                              int(tc["warmup"]), int(tc["seed"]), bool(t.get("diverged")), t, results,
                              step0.get("grad_norm_per_layer"), perturbation=perturbation,
                              block_cosine=block_cosine, **status,
                              grad_ffn0=step0.get("grad_norm_ffn_per_layer"))
        except (KeyError, TypeError, ValueError) as exc:
            raise RunDirError(f"{cell_dir / RESULTS_FILE} lacks {exc} (model / train.config)") from None
    summary, config = cell_dir / TRAIN_SUMMARY_FILE, cell_dir / CONFIG_FILE
    if summary.is_file() and config.is_file():
        try:
            train, cfg = _read_json(summary), _read_json(config)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunDirError(f"{cell_dir}: unreadable train.json/config.json ({exc})") from None
        if train.get("diverged") is True:
            try:
                m, tc = cfg["model"], cfg["train"]
                return CellResult(cell_dir.name, cell_dir, m["placement"], m["norm"], int(m["n_layers"]),
                                  int(tc["warmup"]), int(tc["seed"]), True, {**train, "config": tc}, None,
                                  step0.get("grad_norm_per_layer"), status=DIVERGED,
                                  grad_ffn0=step0.get("grad_norm_ffn_per_layer"))
            except (KeyError, TypeError, ValueError) as exc:
                raise RunDirError(f"{cell_dir / CONFIG_FILE} lacks {exc}") from None
    return None


CELLS_DIR = "cells"   # a published sweep (tools/publish_sweep.py) keeps its cells under cells/


def cell_dirs(sweep_dir: Path) -> list[Path]:
    """The cell directories of a sweep: ``DIR/<cell>/`` as `quantnorm sweep` writes them, or
    ``DIR/cells/<cell>/`` in a published copy."""
    root = sweep_dir / CELLS_DIR if (sweep_dir / CELLS_DIR).is_dir() else sweep_dir
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name not in (PLOTS_DIR, CELLS_DIR))


def load_sweep(sweep_dir: str | Path, margin: float | None = None) -> Sweep:
    """Every finished cell under ``sweep_dir``; unusable and unfinished cells are listed as problems.
    ``margin``: the collapse margin in bits/byte (None: each run's recorded one, else the default)."""
    from .manifest import MANIFEST_FILE, read_manifest

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise RunDirError(f"{sweep_dir} is not a directory: pass the --out directory of `quantnorm sweep`")
    if margin is not None:
        try:
            margin = check_margin(margin, "--collapse-margin")
        except DataError as exc:
            raise RunDirError(str(exc)) from None
    manifest = read_manifest(sweep_dir) if (sweep_dir / MANIFEST_FILE).is_file() else None
    cells, problems = [], []
    for cell_dir in cell_dirs(sweep_dir):
        try:
            cell = load_cell(cell_dir, margin)
        except RunDirError as exc:
            problems.append(f"`{cell_dir.name}` left out: {exc}")
            continue
        if cell is None:
            entry = ((manifest or {}).get("cells") or {}).get(cell_dir.name, {})
            if entry.get("status") == "failed":
                tail = entry.get("log_tail") or []
                problems.append(f"`{cell_dir.name}` failed (exit code {entry.get('rc')}): "
                                f"{tail[-1] if tail else 'no output'} (see {cell_dir.name}/evaluate.log)")
            else:
                problems.append(f"`{cell_dir.name}` not finished (no results.json)")
            continue
        cells.append(cell)
    if not cells:
        raise RunDirError(f"{sweep_dir} holds no finished cell (no <cell>/results.json or cells/<cell>/results.json):"
                          f" run `quantnorm sweep` first")
    return Sweep(sweep_dir, cells, manifest, problems,
                 margin if margin is not None else DEFAULT_COLLAPSE_MARGIN)


# ------------------------------------------------------------------------------------ aggregates


def group_estimate(cells: list[CellResult], metric: Callable[[CellResult], float | None]) -> Estimate:
    return estimate(metric(c) for c in cells)


def best_recipe(sweep: Sweep, cells: list[CellResult]) -> tuple[str | None, Estimate]:
    """The recipe with the lowest mean PPL ratio in a group, and its estimate."""
    best: tuple[str | None, Estimate] = (None, Estimate(None, None, None, 0))
    for name in sweep.recipes():
        est = group_estimate(cells, lambda c, n=name: c.accuracy(n, "ppl_ratio"))
        if est.mean is not None and (best[1].mean is None or est.mean < best[1].mean):
            best = (name, est)
    return best


@dataclass(frozen=True)
class RankRow:
    rank: int
    group: tuple
    label: str
    what: str
    est: Estimate
    not_significant: bool   # its interval overlaps the row above's


def rank(items: list[tuple[tuple, str, str, Estimate]]) -> list[RankRow]:
    """Ascending by mean; rows without a value go last. Each row is marked not significant when
    its interval overlaps the previous row's."""
    valued = sorted([i for i in items if i[3].mean is not None], key=lambda i: i[3].mean)
    rows: list[RankRow] = []
    for k, (group, label, what, est) in enumerate(valued):
        ns = k > 0 and est.overlaps(valued[k - 1][3])
        rows.append(RankRow(k + 1, group, label, what, est, ns))
    for group, label, what, est in items:
        if est.mean is None:
            rows.append(RankRow(len(rows) + 1, group, label, what, est, False))
    return rows


def growth_fit(rms: Sequence[float]) -> dict | None:
    """Fit RMS over depth (x = 0, 1, ... for consecutive outputs) as exponential (log-linear) and
    as linear; R^2 of both in RMS units (so they compare). None with fewer than 3 points.

    The embedding output is not a point of the fit: its scale is the initialisation's, not the
    blocks' growth (a small embedding makes every placement look exponential at the first step)."""
    y = np.array(_finite(rms), dtype=float)
    if len(y) < 3 or len(y) != len(rms) or np.any(y <= 0):
        return None
    x = np.arange(len(y), dtype=float)
    sst = float(np.sum((y - y.mean()) ** 2))
    b_log, a_log = np.polyfit(x, np.log(y), 1)
    pred_exp = np.exp(a_log + b_log * x)
    b_lin, a_lin = np.polyfit(x, y, 1)
    pred_lin = a_lin + b_lin * x

    def r2(pred: np.ndarray) -> float:
        return 1.0 - float(np.sum((y - pred) ** 2)) / sst if sst > 0 else 1.0

    return {"growth_factor": float(math.exp(b_log)), "log_growth": float(b_log), "slope": float(b_lin),
            "relative_slope": float(b_lin / y[0]), "r2_exp": r2(pred_exp), "r2_lin": r2(pred_lin),
            "delta_r2": r2(pred_exp) - r2(pred_lin)}


def _residual_series(cell: CellResult, key: str) -> tuple[list[str], list[float | None]]:
    rows = cell.residual()
    return [str(r.get("layer")) for r in rows], [r.get(key) for r in rows]


def _keyed(cells: list[CellResult], key: Callable[[CellResult], tuple], metric: Callable[[CellResult], float | None]) -> dict:
    return {key(c): metric(c) for c in cells}


# --------------------------------------------------------------------------------------- findings


@dataclass
class Finding:
    number: int
    claim: str
    source: str
    verdict: str
    lines: list[str] = field(default_factory=list)
    why: str = ""
    plots: dict[str, str] = field(default_factory=dict)   # title -> path relative to the sweep directory
    tests: list = field(default_factory=list)              # its SubTests (Holm-corrected together)

    def render(self) -> list[str]:
        out = [f"### Claim {self.number}: {self.claim}", "", f"*{self.source}*", ""]
        out += [f"- {line}" for line in self.lines]
        if self.lines:
            out.append("")
        for title, path in self.plots.items():
            out += [f"![{title}]({path})", ""]
        tail = f" ({self.why})" if self.why else ""
        out.append(f"**Verdict: {self.verdict}**{tail}")
        return out + [""]


def _missing(sweep: Sweep, placements: Iterable[str]) -> list[str]:
    present = {c.placement for c in sweep.cells}
    return [p for p in placements if p not in present]


def _missing_why(sweep: Sweep, placements: Iterable[str]) -> str | None:
    """Why a claim is not tested when placements it compares have no trained cells; None when all are there."""
    missing = _missing(sweep, placements)
    return f"no trained {' and '.join(missing)} cells in the sweep" if missing else None


def _fmt_pct(est: Estimate) -> str:
    """A log-ratio estimate as a percentage change."""
    if est.mean is None:
        return "–"
    f = lambda v: f"{100 * (math.exp(v) - 1):+.1f}%"  # noqa: E731
    return f"{f(est.mean)} [{f(est.lo)}, {f(est.hi)}]" if est.has_interval else f"{f(est.mean)} (n={est.n})"


def _fmt_factor(est: Estimate) -> str:
    """A log-ratio estimate as a factor (x1.00 = equal)."""
    if est.mean is None:
        return "–"
    f = lambda v: f"x{math.exp(v):.3g}"  # noqa: E731
    return f"{f(est.mean)} [{f(est.lo)}, {f(est.hi)}]" if est.has_interval else f"{f(est.mean)} (n={est.n})"


def _placements(sweep: Sweep, cells: Iterable[CellResult] | None = None) -> list[str]:
    """The placements of ``cells`` (default: the sweep's), in report order."""
    present = {c.placement for c in (sweep.cells if cells is None else cells)}
    return [p for p in PLACEMENT_ORDER if p in present] + sorted(present - set(PLACEMENT_ORDER))


# ------------------------------------------------------------- sub-tests over seeds, Holm's correction
#
# The seed is the unit of replication: a sub-test is one stratum of the design (one value of every
# other axis: norm, depth, warm-up, learning rate), its values are one per seed (a paired difference
# where the design pairs the two arms on the seed: same initialisation and batch order), and its
# interval and p-value use n = the number of seeds. Other axes are separate sub-tests, never
# replicates. The sub-tests of one claim are corrected together with Holm's step-down method
# (family-wise error 5%); the 95% intervals shown are the uncorrected ones.

ALPHA = 1 - LEVEL
EVEN_FACTOR = 1.5   # "Pre-LN's gradients are even": last block's FFN gradient within x1/1.5..x1.5 of the first's


@dataclass
class SubTest:
    label: str                      # the stratum, e.g. "rms L4 w30"
    what: str                       # what was measured
    est: Estimate                   # over seeds
    p: float | None                 # raw p-value (None: not tested)
    direction: str | None           # the verdict when significant (HOLDS / DOES_NOT_HOLD)
    why: str = ""                   # why not tested
    fmt: Callable[[Estimate], str] | None = None
    p_holm: float | None = None
    verdict: str = NOT_TESTED

    def line(self) -> str:
        shown = (self.fmt or (lambda e: e.format("+.3g")))(self.est) if self.est.mean is not None else "–"
        n = f"n={self.est.n} seed{'s' if self.est.n != 1 else ''}"
        if self.p is None:
            # Estimate.format already says (n=1) when there is no interval
            counted = "" if self.est.mean is not None and not self.est.has_interval else f" ({n})"
            return f"{self.label}: {self.what}: {shown}{counted} -> **{NOT_TESTED}** ({self.why})"
        return (f"{self.label}: {self.what}: {shown} ({n}; p = {self.p:.2g}, Holm p = {self.p_holm:.2g}) -> "
                f"**{self.verdict}**")

    def to_dict(self) -> dict:
        return {"stratum": self.label, "what": self.what, "estimate": self.est.to_dict(), "p": self.p,
                "p_holm": self.p_holm, "verdict": self.verdict, "why": self.why}


def _p_two_sided(est: Estimate, null: float = 0.0) -> float | None:
    if est.n < 2 or est.sd is None or est.mean is None:
        return None
    if est.sd == 0:
        return 1.0 if est.mean == null else 0.0
    t = (est.mean - null) / (est.sd / math.sqrt(est.n))
    return float(2 * scipy_stats.t.sf(abs(t), est.n - 1))


def _p_one_sided(est: Estimate, null: float, greater: bool) -> float | None:
    """p of H0: mean <= null (greater=True) or mean >= null (greater=False)."""
    if est.n < 2 or est.sd is None or est.mean is None:
        return None
    if est.sd == 0:
        return 0.0 if (est.mean > null if greater else est.mean < null) else 1.0
    t = (est.mean - null) / (est.sd / math.sqrt(est.n))
    return float(scipy_stats.t.sf(t, est.n - 1) if greater else scipy_stats.t.cdf(t, est.n - 1))


def _untested_why(n: int, missing: str | None) -> str:
    if n == 1:
        return "one seed" + (f"; {missing}" if missing else "")
    return missing or "no trained cell with this measurement"


def sign_test(label: str, what: str, values: dict | Iterable, expected: int, *, missing: str | None = None,
              fmt: Callable[[Estimate], str] | None = None) -> SubTest:
    """The claim says the per-seed values are > 0 (expected +1) or < 0 (-1): a one-sample t-test."""
    xs = _finite(values.values() if isinstance(values, dict) else values)
    est = estimate(xs)
    if est.n < 2:
        return SubTest(label, what, est, None, None, _untested_why(est.n, missing), fmt)
    direction = None if est.mean == 0 else (HOLDS if (est.mean > 0) == (expected > 0) else DOES_NOT_HOLD)
    return SubTest(label, what, est, _p_two_sided(est), direction, "", fmt)


def within_test(label: str, what: str, values: dict | Iterable, bound: float, *, missing: str | None = None,
                fmt: Callable[[Estimate], str] | None = None) -> SubTest:
    """The claim says the per-seed values are about 0: inside [-bound, bound] by two one-sided tests
    (holds), or outside it by a one-sided test against the nearer bound (does not hold)."""
    xs = _finite(values.values() if isinstance(values, dict) else values)
    est = estimate(xs)
    if est.n < 2:
        return SubTest(label, what, est, None, None, _untested_why(est.n, missing), fmt)
    if -bound <= est.mean <= bound:
        p = max(_p_one_sided(est, -bound, True), _p_one_sided(est, bound, False))
        return SubTest(label, what, est, p, HOLDS, "", fmt)
    above = est.mean > bound
    return SubTest(label, what, est, _p_one_sided(est, bound if above else -bound, above), DOES_NOT_HOLD, "", fmt)


def variance_test(label: str, what: str, a: Iterable, b: Iterable, expected: int) -> SubTest:
    """The claim says a's seed-to-seed variance is below b's (expected -1) or above (+1): the F-test.
    The estimate is log(sd_a / sd_b) with its F-distribution interval."""
    xa, xb = _finite(a), _finite(b)
    n = min(len(xa), len(xb))
    if len(xa) < 2 or len(xb) < 2:
        return SubTest(label, what, Estimate(None, None, None, n), None, None, _untested_why(n, None), _fmt_factor)
    va, vb = float(np.var(xa, ddof=1)), float(np.var(xb, ddof=1))
    if va == 0 or vb == 0:
        return SubTest(label, what, Estimate(None, None, None, n), None, None,
                       "no seed-to-seed spread in an arm", _fmt_factor)
    d1, d2 = len(xa) - 1, len(xb) - 1
    r = va / vb
    lo, hi = r / scipy_stats.f.ppf(0.5 + LEVEL / 2, d1, d2), r / scipy_stats.f.ppf(0.5 - LEVEL / 2, d1, d2)
    est = Estimate(0.5 * math.log(r), 0.5 * math.log(lo), 0.5 * math.log(hi), n)
    p = float(min(1.0, 2 * min(scipy_stats.f.cdf(r, d1, d2), scipy_stats.f.sf(r, d1, d2))))
    direction = HOLDS if (r < 1) == (expected < 0) else DOES_NOT_HOLD
    return SubTest(label, what, est, p, direction, "", _fmt_factor)


def holm(tests: Sequence[SubTest]) -> None:
    """Holm's step-down correction over the tested sub-tests; sets p_holm and each verdict."""
    tested = sorted((t for t in tests if t.p is not None), key=lambda t: t.p)
    m, running = len(tested), 0.0
    for i, t in enumerate(tested):
        running = max(running, min(1.0, (m - i) * t.p))
        t.p_holm = running
        t.verdict = t.direction if (running < ALPHA and t.direction) else NOT_SIGNIFICANT
    for t in tests:
        if t.p is None:
            t.verdict = NOT_TESTED


def decide(f: Finding, tests: list[SubTest], rule: str) -> Finding:
    """Holm over the claim's sub-tests, then :func:`combine`; the sub-tests become the finding's lines."""
    holm(tests)
    f.tests = tests
    f.lines += [t.line() for t in tests]
    f.verdict = combine([t.verdict for t in tests])
    n = sum(t.p is not None for t in tests)
    if f.verdict == NOT_TESTED:
        parts = [part for t in tests if t.why for part in t.why.split("; ")]
        reasons = sorted(dict.fromkeys(parts), key=lambda r: r != "one seed")   # one seed first: it says most
        f.why = "; ".join(reasons) if reasons else "no sub-test could be run"
    else:
        f.why = f"{rule}; Holm's correction over {n} sub-test{'s' if n != 1 else ''}"
        if n < len(tests):
            f.why += f"; {len(tests) - n} of {len(tests)} sub-tests not tested (see above)"
    return f


def by_seed(cells: Iterable[CellResult], metric: Callable[[CellResult], float | None]) -> dict[int, float]:
    out = {}
    for c in cells:
        v = metric(c)
        if _finite([v]):
            out[c.seed] = float(v)
    return out


def paired(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """a - b per seed, over the seeds both have."""
    return {s: a[s] - b[s] for s in sorted(a) if s in b}


def strata(cells: Iterable[CellResult], *axes: str) -> list[tuple]:
    """The distinct values of ``axes`` among ``cells``, sorted."""
    return sorted({tuple(getattr(c, a) for a in axes) for c in cells},
                  key=lambda k: tuple((0, v) if isinstance(v, (int, float)) else (1, str(v)) for v in k))


def _arm_status(full: Sweep, **where) -> str:
    """'3 of 3 seeds collapsed' etc. for one arm of the design (all cells, trained or not)."""
    cells = full.select(**where)
    if not cells:
        return "no cells"
    counts = {s: sum(c.status == s for c in cells) for s in STATUSES}
    bad = [f"{counts[s]} collapsed" if s == "collapsed" else f"{counts[s]} {s}" for s in STATUSES[1:] if counts[s]]
    return f"{counts[TRAINED]} of {len(cells)} trained" + (f", {', '.join(bad)}" if bad else "")


def _arm_why(full: Sweep, label: str, **where) -> str:
    return f"{label}: {_arm_status(full, **where)}"


def _log(v: float | None) -> float | None:
    return math.log(v) if v is not None and _finite([v]) and v > 0 else None


def held_out_best(cells: Iterable[CellResult], setting: Callable[[CellResult], tuple],
                  metric: Callable[[CellResult], float | None]) -> tuple[dict[int, float], dict[int, tuple],
                                                                          tuple | None, dict[int, float]]:
    """Tuning without the selection bias: for each seed s, the setting with the lowest mean
    ``metric`` over the *other* seeds is chosen and its value at s is kept (leave one seed out).
    Returns (held-out value per seed, setting chosen per seed, the setting best on all seeds, that
    setting's values per seed: the in-sample, optimistically biased choice)."""
    table: dict[tuple, dict[int, float]] = {}
    for c in cells:
        v = metric(c)
        if _finite([v]):
            table.setdefault(setting(c), {})[c.seed] = float(v)
    seeds = sorted({s for t in table.values() for s in t})
    held, chosen = {}, {}
    for s in seeds:
        cands = [(sum(v for k, v in t.items() if k != s) / sum(1 for k in t if k != s), st)
                 for st, t in table.items() if s in t and any(k != s for k in t)]
        if cands:
            _, best = min(cands, key=lambda x: (x[0], str(x[1])))
            held[s], chosen[s] = table[best][s], best
    if not table:
        return held, chosen, None, {}
    best_all = min(table, key=lambda st: (sum(table[st].values()) / len(table[st]), str(st)))
    return held, chosen, best_all, table[best_all]


# ------------------------------------------------------------------------------------------ claims


def claim_warmup(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(1, "Post-LN needs learning-rate warm-up; Pre-LN trains without it", "Xiong et al. 2020", NOT_TESTED)
    if 0 not in full.warmups or len(full.warmups) < 2:
        f.why = "the sweep has no warm-up axis with 0 and a positive value: run with --warmups 0,30"
        return f
    if why := _missing_why(full, ("post", "pre")):
        f.why = why
        return f
    w = max(full.warmups)
    bpb = lambda c: c.bits_per_byte  # noqa: E731
    tests = []
    for norm, depth, lr in strata([c for c in full.cells if c.placement in ("post", "pre")], "norm", "depth", "lr"):
        if not all(full.select(placement="post", norm=norm, depth=depth, lr=lr, warmup=wu) for wu in (0, w)):
            continue   # the design has no warm-up contrast here
        label = full.axes_label(norm=norm, depth=depth, lr=lr).strip()
        arm = {}
        whys = []
        for p in ("post", "pre"):
            for wu in (0, w):
                where = dict(placement=p, norm=norm, depth=depth, warmup=wu, lr=lr)
                arm[p, wu] = by_seed(sweep.select(**where), bpb)
                whys.append(_arm_why(full, f"{p} w{wu}", **where))
        f.lines.append(f"{label}: training status per arm: " + "; ".join(whys))
        gain = {p: paired(arm[p, 0], arm[p, w]) for p in ("post", "pre")}
        failed = lambda x: "collapsed" in x or "diverged" in x or "no cells" in x  # noqa: E731
        why_post = "; ".join(x for x in whys if x.startswith("post") and failed(x))
        tests.append(sign_test(label, f"post: bits/byte without warm-up minus with {w} steps (> 0: warm-up helps)",
                               gain["post"], +1, missing=why_post or None))
        why_both = "; ".join(x for x in whys if failed(x))
        tests.append(sign_test(label, "post's warm-up gain minus pre's (> 0: post needs it more)",
                               paired(gain["post"], gain["pre"]), +1, missing=why_both or None))
    return decide(f, tests, "rule: post's warm-up gain > 0 and above pre's, paired on the seed, per norm and depth; "
                            "collapsed or diverged arms are left out")


def _ffn_log_ratio(c: CellResult) -> float | None:
    g = c.grad_ffn0 or {}
    blocks = sorted((int(k[5:]), v) for k, v in g.items() if k.startswith("block") and k[5:].isdigit())
    if len(blocks) < 2 or not _finite([blocks[0][1], blocks[-1][1]]) or blocks[0][1] <= 0 or blocks[-1][1] <= 0:
        return None
    return math.log(blocks[-1][1] / blocks[0][1])


def claim_grad_at_init(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(2, "At initialization Post-LN's gradients are largest near the output and shrink toward the "
                   "input; Pre-LN's are even", "Xiong et al. 2020", NOT_TESTED)
    if why := _missing_why(sweep, ("post", "pre")):
        f.why = why
        return f
    if not any(c.grad_ffn0 for c in full.cells):
        f.why = ("the cells carry no train_log.jsonl with step 0's per-block FFN gradient norms "
                 "(grad_norm_ffn_per_layer: training writes it from this version on; tools/publish_sweep.py copies it)")
        if any(c.grad0 for c in full.cells):
            f.why += "; the whole-block norms in the logs are not the FFN weights the claim is about"
        return f
    # once per run: the step-0 gradient is taken before any update, so cells that differ only in
    # warm-up or learning rate share it; keep one per (placement, norm, depth, seed)
    once: dict[tuple, CellResult] = {}
    for c in sorted(sweep.cells, key=lambda c: (c.warmup, c.lr or 0.0)):
        once.setdefault((c.placement, c.norm, c.depth, c.seed), c)
    cells = list(once.values())
    tests = []
    bound = math.log(EVEN_FACTOR)
    for norm, depth in strata([c for c in cells if c.placement in ("post", "pre")], "norm", "depth"):
        label = full.axes_label(norm=norm, depth=depth).strip()
        post = by_seed([c for c in cells if (c.placement, c.norm, c.depth) == ("post", norm, depth)], _ffn_log_ratio)
        pre = by_seed([c for c in cells if (c.placement, c.norm, c.depth) == ("pre", norm, depth)], _ffn_log_ratio)
        tests.append(sign_test(label, "post: log(FFN gradient norm of the last block / the first) at step 0 "
                                      "(> 0: larger near the output)", post, +1, fmt=_fmt_factor))
        tests.append(within_test(label, f"pre: the same ratio within x{1 / EVEN_FACTOR:.2f}..x{EVEN_FACTOR:g} "
                                        f"(even)", pre, bound, fmt=_fmt_factor))
    return decide(f, tests, "rule: post's last/first FFN gradient ratio > 1 and pre's within "
                            f"x{1 / EVEN_FACTOR:.2f}..x{EVEN_FACTOR:g}, one value per run and seed")


def claim_not_measured(number: int, claim: str, source: str, why: str) -> Finding:
    return Finding(number, claim, source, NOT_TESTED, why=why)


def depth_exponent(points: dict[int, float]) -> float | None:
    """Slope of log(value) over log(depth), the k of value ~ depth^k (>= 2 depths, values > 0)."""
    pts = sorted((d, v) for d, v in points.items() if d > 0 and _finite([v]) and v > 0)
    if len(pts) < 2:
        return None
    x = np.log([d for d, _ in pts])
    y = np.log([v for _, v in pts])
    return float(np.polyfit(x, y, 1)[0])


def log_reference_exponent(depths: Sequence[int]) -> float | None:
    """The k a change growing as log(depth) would show over these depths (None with depth 1 in them)."""
    ds = sorted(set(depths))
    if len(ds) < 2 or ds[0] < 2:
        return None
    return depth_exponent({d: math.log(d) for d in ds})


def _depth_shape(k: Estimate, ref: float | None) -> str:
    """Words for an exponent estimate of change ~ depth^k: 1 is O(N), ``ref`` is O(log N)."""
    if k.mean is None:
        return "no fit"
    if not k.has_interval:
        return "one series: no interval"
    if k.hi < 0:
        return "shrinks with depth"
    if k.lo > 1:
        return "grows faster than linearly"
    near_lin = k.lo <= 1 <= k.hi
    near_log = ref is not None and k.lo <= ref <= k.hi
    if near_lin and near_log:
        return "linear and logarithmic growth not told apart"
    if near_lin:
        return "about linear in depth, O(N)"
    if near_log:
        return "about logarithmic in depth, O(log N)"
    if ref is not None and k.lo > ref:
        return "between logarithmic and linear"
    if k.lo > 0:
        return "grows, slower than logarithmically" if ref is not None else "grows, slower than linearly"
    return "no significant growth with depth"


def claim_perturbation(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(3, "Post-LN amplifies parameter perturbations (O(N) in depth) far more than Pre-LN (O(log N))",
                "Liu et al. 2020", NOT_TESTED)
    if why := _missing_why(sweep, ("post", "pre")):
        f.why = why
        return f
    if not any(c.perturbation for c in sweep.cells):
        f.why = ("results.json holds no weight-perturbation measurement (diagnostics.perturbation: evaluate "
                 "without --no-outliers)")
        return f
    post, pre = sweep.select(placement="post"), sweep.select(placement="pre")
    levels = sorted({lv for c in post for lv in c.noise_levels()} & {lv for c in pre for lv in c.noise_levels()})
    if not levels:
        f.why = "no trained post and pre cells measured at the same noise level"
        return f
    level = levels[0]
    metric = lambda c: c.log_logit_change(level)  # noqa: E731
    tests = []
    for norm, depth, warmup, lr in strata(full.select(placement="post") + full.select(placement="pre"),
                                          "norm", "depth", "warmup", "lr"):
        label = full.axes_label(norm=norm, depth=depth, warmup=warmup, lr=lr).strip()
        where = dict(norm=norm, depth=depth, warmup=warmup, lr=lr)
        a, b = by_seed(sweep.select(placement="post", **where), metric), by_seed(sweep.select(placement="pre", **where),
                                                                                 metric)
        bad = "; ".join(x for x in (_arm_why(full, "post", placement="post", **where),
                                    _arm_why(full, "pre", placement="pre", **where)) if " 0 of" in x
                        or "collapsed" in x or "diverged" in x)
        tests.append(sign_test(label, f"relative logit change at noise {level:g}, post / pre (trained pairs)",
                               paired(a, b), +1, missing=bad or None, fmt=_fmt_factor))
    if len(sweep.depths) >= 2:
        ref = log_reference_exponent(sweep.depths)
        exps: dict[str, dict[tuple, dict[int, float]]] = {}
        for p in ("post", "pre"):
            series: dict[tuple, dict[int, dict[int, float]]] = {}
            for c in sweep.select(placement=p):
                v = c.logit_change(level)
                if _finite([v]):
                    series.setdefault((c.norm, c.warmup, c.lr), {}).setdefault(c.seed, {})[c.depth] = v
            exps[p] = {k: {s: e for s, pts in by.items() if (e := depth_exponent(pts)) is not None}
                       for k, by in series.items()}
            for k, ks in exps[p].items():
                if ks:
                    est = estimate(ks.values())
                    f.lines.append(f"{p}{full.axes_label(norm=k[0], warmup=k[1], lr=k[2])}: change ~ depth^k over "
                                   f"depths {', '.join(map(str, sweep.depths))}, k = {est.format('.2f')} -> "
                                   f"{_depth_shape(est, ref)}")
        if ref is not None:
            f.lines.append(f"k = 1 is O(N); a change growing as log(depth) would give k = {ref:.2f} over these depths")
        for k in sorted({k for p in ("post", "pre") for k, v in exps[p].items() if v}, key=str):
            label = full.axes_label(norm=k[0], warmup=k[1], lr=k[2]).strip()
            tests.append(sign_test(label, "post's depth exponent k minus pre's (> 0: post's change grows faster)",
                                   paired(exps["post"].get(k, {}), exps["pre"].get(k, {})), +1,
                                   missing="no trained post or pre series over two depths"))
    why = f"rule: post's change > pre's at noise {level:g} x each weight's RMS, paired on the seed, per stratum"
    if len(sweep.depths) < 2:
        why += "; no depth axis among trained cells, so O(N) vs O(log N) is not tested"
    return decide(f, tests, why)


def claim_residual_growth(sweep: Sweep, full: Sweep | None = None) -> tuple[Finding, dict[str, dict]]:
    full = full or sweep
    f = Finding(4, "Pre-LN hidden-state variance grows fast (exponentially) with depth; Peri-LN about linearly; "
                   "Post-LN stays constant", "Peri-LN paper (Kim et al. 2025)", NOT_TESTED)
    fit = lambda c: growth_fit([r.get("rms") for r in c.residual() if r.get("layer") != "embed"])  # noqa: E731
    table: dict[str, dict] = {}
    tests: list[SubTest] = []
    bound = math.log(CONSTANT_GROWTH)
    for p in ("pre", "peri", "post"):
        for norm, depth, warmup, lr in strata(sweep.select(placement=p), "norm", "depth", "warmup", "lr"):
            cells = sweep.select(placement=p, norm=norm, depth=depth, warmup=warmup, lr=lr)
            fits = {c.seed: x for c in cells if (x := fit(c)) is not None}
            if not fits:
                continue
            label = full.axes_label(placement=p, norm=norm, depth=depth, warmup=warmup, lr=lr).strip()
            vals = lambda key, fits=fits: {s: x[key] for s, x in fits.items()}  # noqa: E731
            table[label] = {k: estimate(vals(k).values()) for k in ("growth_factor", "log_growth", "relative_slope",
                                                                    "r2_exp", "r2_lin", "delta_r2")}
            if p == "pre":
                tests.append(sign_test(label, "residual RMS growth per block (log-linear fit)",
                                       vals("log_growth"), +1, fmt=_fmt_factor))
                tests.append(sign_test(label, "R^2 exponential minus linear (> 0: exponential fits better)",
                                       vals("delta_r2"), +1))
            elif p == "peri":
                tests.append(sign_test(label, "linear slope of the RMS per block, in block 0's RMS",
                                       vals("relative_slope"), +1))
                tests.append(sign_test(label, "R^2 exponential minus linear (< 0: linear fits better)",
                                       vals("delta_r2"), -1))
            else:
                tests.append(within_test(label, f"growth per block within x{1 / CONSTANT_GROWTH:.2f}.."
                                                f"x{CONSTANT_GROWTH:.2f} (constant)", vals("log_growth"), bound,
                                         fmt=_fmt_factor))
    if not tests:
        f.why = ("needs trained pre, peri or post cells with the outlier probe (no --no-outliers) and depth >= 3 "
                 "(3 block outputs per fit)")
        return f, table
    for p in ("pre", "peri", "post"):
        if not any(t.label.startswith(p + " ") for t in tests):
            f.lines.append(f"{p}: no trained cell with a fit: not tested")
    decide(f, tests, "rule: pre grows and its exponential fit is better, peri grows and its linear fit is better, "
                     f"post's growth within x{1 / CONSTANT_GROWTH:.2f}..x{CONSTANT_GROWTH:.2f} per block, over seeds "
                     "per setting")
    return f, table


def claim_massive(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(5, "Pre-LN develops massive activations; Peri-LN keeps them bounded", "Sun et al. 2024; Peri-LN paper",
                NOT_TESTED)
    if why := _missing_why(sweep, ("pre", "peri")):
        f.why = why
        return f
    if not any(c.max_ratio() is not None for c in sweep.cells):
        f.why = "needs the outlier probe (run without --no-outliers)"
        return f
    tests = []
    none_anywhere = True
    for norm, depth, warmup, lr in strata(full.select(placement="pre") + full.select(placement="peri"),
                                          "norm", "depth", "warmup", "lr"):
        where = dict(norm=norm, depth=depth, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip()
        if not (full.select(placement="pre", **where) and full.select(placement="peri", **where)):
            continue   # the design does not pair pre with peri here
        pre, peri = sweep.select(placement="pre", **where), sweep.select(placement="peri", **where)
        missing = "; ".join(x for x in (_arm_why(full, p, placement=p, **where) for p in ("pre", "peri"))
                            if "collapsed" in x or "diverged" in x) or None
        tests.append(sign_test(label, "largest residual max/median ratio, pre / peri",
                               paired(by_seed(pre, lambda c: _log(c.max_ratio())),
                                      by_seed(peri, lambda c: _log(c.max_ratio()))), +1,
                               missing=missing, fmt=_fmt_factor))
        counts = (by_seed(pre, CellResult.massive_count), by_seed(peri, CellResult.massive_count))
        none_anywhere &= not any(v for d in counts for v in d.values())
        tests.append(sign_test(label, "massive activations per model (Sun et al.: |a| > 100 and >= 1000x the "
                                      "median), pre minus peri", paired(*counts), +1, missing=missing))
    decide(f, tests, "rule: pre's outlier ratio above peri's and pre with more massive activations, paired on the "
                     "seed")
    if none_anywhere and f.verdict != NOT_TESTED:
        f.why += ("; no pre or peri cell has a massive activation (|a| > 100): at this scale the massive-activation "
                  "half cannot hold (PITFALLS 8), so it reads not significant, not 'does not hold'")
    return f


def claim_peri_vs_pre(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(6, "Peri-LN reaches lower loss with fewer gradient spikes and less seed-to-seed variance than Pre-LN",
                "Peri-LN paper", NOT_TESTED)
    if why := _missing_why(sweep, ("pre", "peri")):
        f.why = why
        return f
    tests = []
    for norm, depth, warmup, lr in strata(full.select(placement="pre") + full.select(placement="peri"),
                                          "norm", "depth", "warmup", "lr"):
        where = dict(norm=norm, depth=depth, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip()
        if not (full.select(placement="pre", **where) and full.select(placement="peri", **where)):
            continue   # the design does not pair pre with peri here
        pre, peri = sweep.select(placement="pre", **where), sweep.select(placement="peri", **where)
        missing = "; ".join(x for x in (_arm_why(full, p, placement=p, **where) for p in ("pre", "peri"))
                            if "collapsed" in x or "diverged" in x) or None
        bpb = lambda c: c.bits_per_byte  # noqa: E731
        spikes = lambda c: c.train.get("gradient_spikes")  # noqa: E731
        tests.append(sign_test(label, "eval bits/byte, peri minus pre", paired(by_seed(peri, bpb), by_seed(pre, bpb)),
                               -1, missing=missing))
        tests.append(sign_test(label, "gradient spikes, peri minus pre", paired(by_seed(peri, spikes),
                                                                                by_seed(pre, spikes)), -1,
                               missing=missing))
        t = variance_test(label, "seed-to-seed sd of bits/byte, peri / pre (F-test)",
                          by_seed(peri, bpb).values(), by_seed(pre, bpb).values(), -1)
        if missing:
            t.p, t.why = None, missing
        tests.append(t)
    return decide(f, tests, "rule: peri's loss lower, spikes fewer and seed-to-seed variance smaller than pre's, "
                            "per setting")


def claim_collapse(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(7, "Deep Pre-LN stacks lose representation diversity (later layers' outputs become alike)",
                "ResiDual paper (Xie et al. 2023)", NOT_TESTED)
    if why := _missing_why(sweep, ("pre",)):
        f.why = why
        return f
    measured = [c for c in sweep.cells if c.block_cosine]
    if not measured:
        f.why = ("results.json holds no similarity of consecutive block outputs (diagnostics.block_cosine: evaluate "
                 "without --no-outliers)")
        return f
    pre_measured = [c for c in measured if c.placement == "pre"]
    if not pre_measured:
        f.why = "no trained pre cell has the block-similarity measurement"
        return f
    depth = max(c.depth for c in pre_measured)
    for d in sorted({c.depth for c in measured}):
        parts = [f"{p} {group_estimate([c for c in measured if c.placement == p and c.depth == d], CellResult.late_cosine).format('.3f')}"  # noqa: E501
                 for p in _placements(sweep, [c for c in measured if c.depth == d])]
        f.lines.append(f"depth {d}: mean cosine(block output, block input) over the last half of the blocks "
                       f"(trained cells): " + ", ".join(parts))
    tests = []
    for norm, warmup, lr in strata([c for c in pre_measured if c.depth == depth], "norm", "warmup", "lr"):
        where = dict(norm=norm, depth=depth, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip() or f"L{depth}"
        pre = by_seed(sweep.select(placement="pre", **where), CellResult.late_cosine)
        others = [p for p in _placements(sweep) if p != "pre" and sweep.select(placement=p, **where)]
        pooled: dict[int, list[float]] = {}
        for p in others:
            for s, v in by_seed(sweep.select(placement=p, **where), CellResult.late_cosine).items():
                pooled.setdefault(s, []).append(v)
        rest = {s: sum(v) / len(v) for s, v in pooled.items()}
        missing = None if others else "no other trained placement at this depth and setting: " + "; ".join(
            _arm_why(full, p, placement=p, **where) for p in _placements(full) if p != "pre"
            and full.select(placement=p, **where))
        tests.append(sign_test(label, f"pre's late-block cosine minus the mean of {', '.join(others) or 'the others'} "
                                      f"(> 0: pre's late blocks change the stream less)", paired(pre, rest), +1,
                               missing=missing))
        tests.append(sign_test(label, "slope of pre's cosine over the block index (> 0: later blocks more alike)",
                               by_seed(sweep.select(placement="pre", **where), CellResult.cosine_slope), +1,
                               missing="one block per stack, so no slope" if depth < 2 else None))
    return decide(f, tests, f"rule at depth {depth}, the deepest trained pre stack: pre's late-block cosine above the "
                            f"other placements' and rising over its blocks, paired on the seed")


def claim_deepnorm(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(8, "DeepNorm trains much deeper stacks stably", "DeepNet (Wang et al. 2022)", NOT_TESTED)
    if len(full.depths) < 2:
        f.why = "the sweep has no depth axis: run with --depths 2,8 (or deeper)"
        return f
    if why := _missing_why(full, ("deepnorm", "post")):
        f.why = why.replace("trained ", "")
        return f
    for d in full.depths:
        f.lines.append(f"depth {d}: deepnorm {_arm_status(full, placement='deepnorm', depth=d)}; post "
                       f"{_arm_status(full, placement='post', depth=d)}")
    d = max(full.depths)
    tests = []
    for norm, warmup, lr in strata(full.select(placement="deepnorm", depth=d) + full.select(placement="post", depth=d),
                                   "norm", "warmup", "lr"):
        where = dict(norm=norm, depth=d, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip() or f"L{d}"
        arms = {p: full.select(placement=p, **where) for p in ("deepnorm", "post")}
        bad = [_arm_why(full, p, placement=p, **where) for p, cells in arms.items()
               if not cells or not all(c.trained for c in cells)]
        t = sign_test(label, "eval bits/byte, deepnorm minus post", paired(
            by_seed(sweep.select(placement="deepnorm", **where), lambda c: c.bits_per_byte),
            by_seed(sweep.select(placement="post", **where), lambda c: c.bits_per_byte)), -1)
        if bad:   # a collapsed or diverged arm: its loss says nothing about stable training of a deep stack
            t.p, t.direction, t.why = None, None, "an arm did not train: " + "; ".join(bad)
        tests.append(t)
    return decide(f, tests, f"rule at depth {d}, the deepest: deepnorm's bits/byte below post's, paired on the seed, "
                            f"only where both arms trained in every seed")


def _norm_tests(sweep: Sweep, full: Sweep, what: str, metric: Callable[[CellResult], float | None],
                expected: int, first: str = "rms", second: str = "layer") -> list[SubTest]:
    """``metric`` of the ``first`` norm minus the ``second``'s per (placement, depth, warm-up, lr),
    paired on the seed."""
    tests = []
    for p, depth, warmup, lr in strata(full.cells, "placement", "depth", "warmup", "lr"):
        where = dict(placement=p, depth=depth, warmup=warmup, lr=lr)
        if not (full.select(norm=first, **where) and full.select(norm=second, **where)):
            continue
        label = full.axes_label(**where).strip()
        a, b = by_seed(sweep.select(norm=first, **where), metric), by_seed(sweep.select(norm=second, **where), metric)
        bad = "; ".join(x for x in (_arm_why(full, n, norm=n, **where) for n in (first, second))
                        if "collapsed" in x or "diverged" in x)
        tests.append(sign_test(label, what, paired(a, b), expected, missing=bad or None,
                               fmt=_fmt_pct if "%" in what else None))
    return tests


def claim_rms_speed(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(9, "RMSNorm is faster than LayerNorm (7-64% reported); optimized LayerNorm closes the gap",
                "Zhang & Sennrich 2019; Costello et al. 2025", NOT_TESTED)
    if {c.norm for c in full.cells} < {"layer", "rms"}:
        f.why = "the sweep needs both norms: --norms layer,rms"
        return f
    log_tps = lambda c: _log(c.train.get("tokens_per_s"))  # noqa: E731
    tests = _norm_tests(sweep, full, "training tokens/s, RMSNorm vs LayerNorm (%)", log_tps, +1)
    tests += _norm_tests(sweep, full, "ONNX Runtime FP32 p50 (CPU, largest batch), LayerNorm vs RMSNorm (%; > 0: "
                                      "RMSNorm faster)", lambda c: _log(c.fp32_p50()[0]), +1, "layer", "rms")
    f.lines.append("the second half (optimized LayerNorm closes the gap) needs native vs decomposed norm kernels: "
                   "benchmarks/, not this sweep")
    jobs = (sweep.manifest or {}).get("jobs")
    if jobs and jobs > 1:
        for t in tests:   # two processes on one CPU: a timing measures the neighbour as much as the model
            t.p, t.direction, t.why = None, None, f"cells were timed {jobs} at a time, sharing the CPU"
    return decide(f, tests, "rule: RMSNorm faster in training throughput and in ONNX Runtime latency, paired on "
                            "the seed, per placement and depth")


def claim_layer_friendlier(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(10, "LayerNorm's zero-mean output makes it friendlier to low-precision quantization than RMSNorm",
                "seed article (claim without a source)", NOT_TESTED)
    if {c.norm for c in full.cells} < {"layer", "rms"}:
        f.why = "the sweep needs both norms: --norms layer,rms"
        return f
    recipes = sweep.recipes()
    if not recipes:
        f.why = "no recipe was measured on a trained cell"
        return f
    for name in recipes[1:]:
        parts = [f"{t.label} {t.est.format('+.4f')}" for t in
                 _norm_tests(sweep, full, "", lambda c, n=name: c.accuracy(n, "ppl_ratio"), +1)
                 if t.est.mean is not None]
        f.lines.append(f"`{name}` (reported, not a sub-test): PPL ratio RMSNorm minus LayerNorm: " + "; ".join(parts))
    tests = _norm_tests(sweep, full, f"`{recipes[0]}` PPL ratio, RMSNorm minus LayerNorm (> 0: LayerNorm quantizes "
                                     f"better)", lambda c: c.accuracy(recipes[0], "ppl_ratio"), +1)
    return decide(f, tests, f"rule on the primary recipe `{recipes[0]}`: RMSNorm's PPL ratio above LayerNorm's, paired "
                            f"on the seed, per placement and depth")


def claim_outliers_predict(sweep: Sweep, full: Sweep | None = None) -> tuple[Finding, dict[str, Correlation]]:
    full = full or sweep
    f = Finding(11, "Outlier size predicts INT8 error", "Bondarenko et al. 2023; He et al. 2024", NOT_TESTED)
    corr: dict[str, Correlation] = {}
    recipes = sweep.recipes()
    cells = [c for c in sweep.cells if c.results is not None]
    if not any(c.max_ratio() is not None for c in cells) or not recipes:
        f.why = "needs the outlier probe (run without --no-outliers) on trained cells"
        return f, corr

    def per_seed_z(x: Callable[[CellResult], float | None], name: str) -> tuple[dict[int, float], list[str]]:
        """Spearman rho across the trained settings of each seed (Fisher z), one value per seed."""
        zs, shown = {}, []
        for s in sweep.seeds:
            mine = [c for c in cells if c.seed == s]
            r = spearman_interval([x(c) for c in mine], [c.accuracy(name, "ppl_ratio") for c in mine])
            if r.rho is not None:
                zs[s] = math.atanh(max(-0.999999, min(0.999999, r.rho)))
                shown.append(f"seed {s} {r.rho:+.2f} (n={r.n})")
        return zs, shown

    for name in recipes:
        zs, shown = per_seed_z(CellResult.max_ratio, name)
        allc = spearman_interval([c.max_ratio() for c in cells], [c.accuracy(name, "ppl_ratio") for c in cells])
        corr[name] = allc
        f.lines.append(f"`{name}`: Spearman rho of the largest residual max/median ratio vs PPL ratio across the "
                       f"trained settings of each seed: {', '.join(shown) or '–'}")
    within: dict[str, dict[int, list[float]]] = {}
    for c in cells:
        for name, s in ((c.results or {}).get("sqnr_summary") or {}).items():
            if _finite([s.get("spearman_ratio_sqnr")]):
                within.setdefault(name, {}).setdefault(c.seed, []).append(s["spearman_ratio_sqnr"])
    for name, per in within.items():
        f.lines.append(f"`{name}` (reported, not a sub-test): within each cell, Spearman rho of tensor max/median "
                       f"ratio vs SQNR, mean per seed then over seeds "
                       f"{estimate(sum(v) / len(v) for v in per.values()).format('+.2f')} (negative = bigger outliers, "
                       f"lower SQNR)")
    primary = recipes[0]
    tests = []
    for what, x in (("max/median ratio", CellResult.max_ratio), ("kurtosis", CellResult.max_kurtosis)):
        zs, _ = per_seed_z(x, primary)
        tests.append(sign_test("per seed", f"Fisher z of Spearman rho, largest residual {what} vs `{primary}` PPL "
                                           f"ratio, across settings (> 0: bigger outliers, bigger INT8 error)", zs, +1,
                               missing=None if zs else "fewer than 3 trained settings per seed",
                               fmt=lambda e: (f"rho {math.tanh(e.mean):+.2f} [{math.tanh(e.lo):+.2f}, "
                                              f"{math.tanh(e.hi):+.2f}]" if e.has_interval
                                              else f"rho {math.tanh(e.mean):+.2f}")))
    decide(f, tests, f"rule: the rank correlation of outlier size with the `{primary}` PPL ratio, computed within each "
                     f"seed across its trained settings, > 0 over seeds")
    return f, corr


def claim_post_best(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(12, "Post-LN, trained well, can end with better accuracy than Pre-LN", "seed articles", NOT_TESTED)
    if why := _missing_why(full, ("post", "pre")):
        f.why = why.replace("trained ", "")
        return f
    setting = lambda c: (c.warmup, c.lr)  # noqa: E731
    bpb = lambda c: c.bits_per_byte  # noqa: E731
    tuned_over = "warm-up" + (" and learning rate" if len(full.lrs) > 1 else "")
    tests = []
    for norm, depth in strata(full.select(placement="post") + full.select(placement="pre"), "norm", "depth"):
        label = full.axes_label(norm=norm, depth=depth).strip()
        res = {p: held_out_best(sweep.select(placement=p, norm=norm, depth=depth), setting, bpb) for p in ("post", "pre")}
        diff = paired(res["post"][0], res["pre"][0])
        missing = "; ".join(f"{p}: no trained cell" for p in ("post", "pre") if res[p][2] is None) or None
        tests.append(sign_test(label, f"eval bits/byte, post minus pre, each at its best {tuned_over} chosen on the "
                                      f"other seeds (held out)", diff, -1, missing=missing))
        if res["post"][2] is not None and res["pre"][2] is not None:
            insample = paired(res["post"][3], res["pre"][3])
            e_in, e_out = estimate(insample.values()), estimate(diff.values())
            best = {p: full.axes_label(warmup=res[p][2][0], lr=res[p][2][1]).strip() or "the only setting"
                    for p in ("post", "pre")}
            bias = (f"; selection bias of choosing on the same seeds: {e_in.mean - e_out.mean:+.3f} bits/byte"
                    if e_in.mean is not None and e_out.mean is not None else "")
            f.lines.append(f"{label}: best on all seeds: post {best['post']}, pre {best['pre']}; post minus pre there "
                           f"{e_in.format('+.3f')} (in-sample){bias}")
    return decide(f, tests, f"rule: same-norm pairs, post's bits/byte below pre's, each tuned over {tuned_over} on "
                            f"held-out seeds (leave one seed out), collapsed cells left out")


def findings(sweep: Sweep) -> tuple[list[Finding], dict]:
    """The twelve findings. Effects are computed on the trained cells only; the claims that read
    training outcomes (1, 8) also see the collapsed and diverged cells to say which arm failed."""
    t = sweep.trained_view()
    growth, growth_table = claim_residual_growth(t, sweep)
    outliers, corr = claim_outliers_predict(t, sweep)
    out = [
        claim_warmup(t, sweep),
        claim_grad_at_init(t, sweep),
        claim_perturbation(t, sweep),
        growth,
        claim_massive(t, sweep),
        claim_peri_vs_pre(t, sweep),
        claim_collapse(t, sweep),
        claim_deepnorm(t, sweep),
        claim_rms_speed(t, sweep),
        claim_layer_friendlier(t, sweep),
        outliers,
        claim_post_best(t, sweep),
    ]
    return out, {"growth": growth_table, "spearman": corr}


# ----------------------------------------------------------------------------------------- report


def _manifest_line(sweep: Sweep) -> list[str]:
    m = sweep.manifest or {}
    out = []
    commands = m.get("commands") or ([m["command"]] if m.get("command") else [])
    if len(commands) == 1:
        out.append(f"Reproduce: `{commands[0]}`  ")
    elif commands:
        out += [f"Reproduce: this directory was grown by {len(commands)} invocations; run them in this order "
                f"(each skips the cells already finished):", ""]
        out += [f"{i}. `{c}`" for i, c in enumerate(commands, 1)] + [""]
    s = m.get("settings") or {}
    if s:
        out.append(f"Settings: d_model {s.get('d_model')}, heads {s.get('heads')}, context {s.get('context')}, "
                   f"{s.get('steps')} steps x batch {s.get('batch_size')}, lr {s.get('lr')}, corpus {s.get('corpus')}.  ")
    if m.get("jobs"):
        out.append(f"Executor: {m.get('executor', 'local')}, {m['jobs']} cell(s) at a time"
                   + (" (latency and throughput measured while other cells ran)." if m["jobs"] > 1 else "."))
    return out


def status_section(sweep: Sweep) -> list[str]:
    """``## Training status``: the first thing a reader of a sweep needs to know."""
    from .report import _table

    counts = {s: sum(c.status == s for c in sweep.cells) for s in STATUSES}
    unigrams = sorted({round(c.unigram, 3) for c in sweep.cells if c.unigram is not None})
    derived = sum(c.status_derived for c in sweep.cells)
    L = ["## Training status", "",
         f"{counts[TRAINED]} of {len(sweep.cells)} cells trained, {counts['collapsed']} collapsed, "
         f"{counts[DIVERGED]} diverged. A run is *trained* when its eval bits/byte is at least "
         f"{sweep.collapse_margin:g} bits/byte below the unigram baseline (the evaluation range's bits/byte under the "
         f"training range's byte frequencies: {', '.join(f'{u:.3f}' for u in unigrams) or '?'} here), *collapsed* "
         f"when it is not (a model on the unigram plateau and one that barely left it alike), *diverged* on a NaN/inf "
         f"loss or gradient. Collapsed and diverged cells are left out of every mean, ranking, plot and finding below: "
         f"their INT8 numbers say nothing about INT8.", ""]
    if derived:
        L += [f"{derived} cells were written before training recorded its status: theirs is derived from the "
              f"corpus and byte ranges recorded in their results.json.", ""]
    rows = []
    for g, cells in sweep.groups().items():
        rows.append([sweep.label(g), len(cells), sum(c.trained for c in cells),
                     sum(c.status == "collapsed" for c in cells), sum(c.status == DIVERGED for c in cells),
                     group_estimate(cells, lambda c: c.bits_per_byte).format(".3f")])
    L += _table(["setting", "cells", "trained", "collapsed", "diverged", "eval bits/byte (every cell)"], rows)
    bad = sweep.not_trained
    if bad:
        L += ["", f"Left out ({len(bad)}): " + ", ".join(
            f"`{c.name}` ({c.status}" + (f", {c.bits_per_byte:.3f}" if c.bits_per_byte is not None else "") + ")"
            for c in bad) + "."]
    return L + [""]


def tuned_comparison(sweep: Sweep) -> list[dict]:
    """Placements at their own best learning rate, per (norm, depth, warm-up): for each seed the rate
    is chosen on the other seeds and the held-out seed's bits/byte is kept (:func:`held_out_best`).
    Trained cells only (pass the trained view)."""
    out = []
    bpb = lambda c: c.bits_per_byte  # noqa: E731
    for norm, depth, warmup in strata(sweep.cells, "norm", "depth", "warmup"):
        rows = []
        for p in _placements(sweep, sweep.select(norm=norm, depth=depth, warmup=warmup)):
            held, chosen, best, insample = held_out_best(sweep.select(placement=p, norm=norm, depth=depth,
                                                                      warmup=warmup), lambda c: c.lr, bpb)
            rows.append({"placement": p, "best_lr": best, "chosen": chosen, "held_out": held,
                         "held_out_est": estimate(held.values()), "in_sample_est": estimate(insample.values())})
        out.append({"norm": norm, "depth": depth, "warmup": warmup, "rows": rows})
    return out


def lr_section(sweep: Sweep) -> list[str]:
    """The per-learning-rate table and the tuned comparison (trained view; only with an lr axis)."""
    from .report import _table

    lrs = sweep.lrs
    L = ["## Learning rate", "", "### Eval bits/byte per learning rate (trained cells)", ""]
    rows = {}
    for (p, n, d, w, lr), cells in sweep.groups().items():
        rows.setdefault((p, n, d, w), {})[lr] = group_estimate(cells, lambda c: c.bits_per_byte)
    L += _table(["setting", *[f"lr {x:g}" for x in lrs]],
                [[f"{p}/{n}" + sweep.axes_label(depth=d, warmup=w), *[r[x].format(".3f") if x in r else "–"
                                                                      for x in lrs]]
                 for (p, n, d, w), r in rows.items()])
    L += ["", "### Placements at their own best learning rate", "",
          "For each seed, a placement's learning rate is the one with the lowest mean bits/byte on the *other* seeds "
          "(leave one seed out), and its bits/byte at that held-out seed is kept: choosing and comparing on the same "
          "seeds would reward seed luck. *In-sample* is the rate best on all seeds; its optimism is the bias column.",
          ""]
    for block in tuned_comparison(sweep):
        title = sweep.axes_label(norm=block["norm"], depth=block["depth"], warmup=block["warmup"]).strip()
        items = [((r["placement"],), r["placement"], "", r["held_out_est"]) for r in block["rows"]]
        by_p = {r["placement"]: r for r in block["rows"]}
        ranked = rank(items)
        best_p = ranked[0].label if ranked and ranked[0].est.mean is not None else None
        table = []
        for r in ranked:
            row = by_p[r.label]
            vs = estimate(paired(row["held_out"], by_p[best_p]["held_out"]).values()) if best_p else None
            bias = (row["in_sample_est"].mean - row["held_out_est"].mean
                    if row["in_sample_est"].mean is not None and row["held_out_est"].mean is not None else None)
            table.append([r.rank, r.label, "–" if row["best_lr"] is None else f"{row['best_lr']:g}",
                          ", ".join(f"seed {s}: {v:g}" for s, v in sorted(row["chosen"].items())) or "–",
                          r.est.format(".3f"), "" if r.label == best_p or vs is None else vs.format("+.3f"),
                          row["in_sample_est"].format(".3f"), "–" if bias is None else f"{bias:+.3f}"])
        L += [f"**{title or 'all cells'}**", ""]
        L += _table(["rank", "placement", "best lr (all seeds)", "lr chosen for each held-out seed",
                     "bits/byte (held out)", "minus the best (paired)", "bits/byte (in-sample)", "bias"], table) + [""]
    return L


def render(sweep: Sweep, plots: dict[str, str] | None = None) -> str:
    from .report import _table

    full = sweep
    sweep = full.trained_view()   # every table below: trained cells only (the status section shows them all)
    groups = {g: [c for c in cells if c.trained] for g, cells in full.groups().items()}
    groups = {g: cells for g, cells in groups.items() if cells}
    recipes = sweep.recipes()
    first = next((c.results for c in full.cells if c.results), None) or {}
    hw = first.get("hardware", {})
    seeds = full.seeds
    L = [f"# quantnorm sweep: {full.path.name}", ""]
    L += _manifest_line(full)
    L += [f"{len(full.cells)} finished cells ({len(sweep.cells)} trained) in {len(full.groups())} settings, seeds "
          f"{', '.join(map(str, seeds))}; {len(full.problems)} cells left out (listed at the end).  ",
          f"Hardware: {hw.get('cpu', '?')}, VNNI {hw.get('vnni')}, ONNX Runtime threads {hw.get('threads') or 'default'}, "
          f"onnxruntime {hw.get('onnxruntime')}, torch {hw.get('torch')}.", "",
          "Every figure is the mean over seeds with its 95% Student-t interval in brackets ((n=1): one seed, "
          "no interval). Rankings mark a row *not significant* when its interval overlaps the row above's.", ""]
    L += status_section(full)

    L += ["## Training and FP32 quality (trained cells)", ""]
    rows = []
    for g, cells in groups.items():
        rows.append([sweep.label(g), len(cells),
                     group_estimate(cells, lambda c: c.bits_per_byte).format(".3f"),
                     group_estimate(cells, lambda c: c.train.get("gradient_spikes")).format(".2g"),
                     group_estimate(cells, lambda c: c.train.get("tokens_per_s")).format(",.0f")])
    L += _table(["setting", "trained seeds", "eval bits/byte (PyTorch)", "gradient spikes", "train tokens/s"], rows)

    batch = None
    for name in recipes:
        L += ["", f"## INT8 recipe `{name}` (trained cells)", ""]
        rows = []
        for g, cells in groups.items():
            lat = [c.latency_ratio(name) for c in cells]
            batch = batch or next((b for _, b in lat if b), None)
            top1 = [c.accuracy(name, "top1_agreement") for c in cells]
            rows.append([sweep.label(g), estimate(c.accuracy(name, "ppl_ratio") for c in cells).format(".4f"),
                         estimate(c.accuracy(name, "kld_mean") for c in cells).format(".2e"),
                         estimate(None if t is None else 100 * t for t in top1).format(".2f", "%"),
                         estimate(r for r, _ in lat).format(".2f", "x")])
        L += _table(["setting", "PPL ratio (int8/fp32)", "KL mean (nats)", "top-1 agreement",
                     f"p50 int8/fp32 (CPU, batch {batch or '?'})"], rows)

    L += ["", "## Ranking (trained cells)", "", "### INT8 survival: best recipe's PPL ratio (lower is better)", ""]
    items = []
    for g, cells in groups.items():
        name, est = best_recipe(sweep, cells)
        items.append((g, sweep.label(g), name or "–", est))
    L += _table(["rank", "setting", "best recipe", "PPL ratio", "vs the row above"],
                [[r.rank, r.label, f"`{r.what}`" if r.what != "–" else "–", r.est.format(".4f"),
                  "not significant" if r.not_significant else ("" if r.rank == 1 or r.est.mean is None else "separated")]
                 for r in rank(items)])
    L += ["", "### FP32 quality: eval bits/byte (lower is better)", ""]
    items = [(g, sweep.label(g), "", group_estimate(cells, lambda c: c.bits_per_byte)) for g, cells in groups.items()]
    L += _table(["rank", "setting", "bits/byte", "vs the row above"],
                [[r.rank, r.label, r.est.format(".3f") if r.est.mean is not None else "diverged",
                  "not significant" if r.not_significant else ("" if r.rank == 1 or r.est.mean is None else "separated")]
                 for r in rank(items)])
    if len(sweep.lrs) > 1:
        L += [""] + lr_section(sweep)

    layer_table = _layer_tables(sweep, groups)
    if layer_table:
        L += ["", "## Residual stream per layer", ""] + layer_table

    sq = [(g, cells) for g, cells in groups.items() if any((c.results or {}).get("smoothquant") for c in cells)]
    if sq:
        L += ["", "## SmoothQuant foldability", "",
              "MatMuls whose smoothing scale folds into the preceding norm's weight vs those that need an explicit "
              "Mul (count per model).", ""]
        rows = []
        for g, cells in sq:
            sqs = [(c.results or {}).get("smoothquant") or {} for c in cells]
            folded = estimate(len(s.get("folded") or []) for s in sqs if s)
            explicit = estimate(len(s.get("explicit_scale") or []) for s in sqs if s)
            frac = estimate(len(s.get("folded") or []) / max(1, len(s.get("folded") or []) + len(s.get("explicit_scale") or []))
                            for s in sqs if s)
            rows.append([sweep.label(g), folded.format(".3g"), explicit.format(".3g"), frac.format(".2f")])
        L += _table(["setting", "folded", "explicit scale", "folded fraction"], rows)

    L += [""] + findings_section(full, plots)

    if plots:
        L += ["## Plots", ""] + [f"![{title}]({path})" for title, path in plots.items()] + [""]
    if full.problems:
        L += ["## Cells left out", ""] + [f"- {p}" for p in full.problems] + [""]
    return "\n".join(L)


# which plot of make_plots (by title) illustrates which claim
CLAIM_PLOTS = {3: ("Perturbation sensitivity per depth",), 4: ("Residual-stream RMS per layer",),
               7: ("Cosine similarity of block output and input",)}


def findings_section(sweep: Sweep, plots: dict[str, str] | None = None,
                     found: list[Finding] | None = None) -> list[str]:
    """The Markdown lines of the findings section (``## Findings``): which cells are left out, one
    subsection per claim, a summary line and the table of the twelve verdicts. ``plots`` (title ->
    path relative to the sweep directory, as from :func:`make_plots`) adds the pictures to the claims
    they illustrate."""
    from .report import _table

    found = found if found is not None else findings(sweep)[0]
    for item in found:
        item.plots = {t: (plots or {})[t] for t in CLAIM_PLOTS.get(item.number, ()) if t in (plots or {})}
    bad = sweep.not_trained
    L = ["## Findings", "",
         "Each claim of the literature (shared CLAIMS.md) as measured by this sweep. The seed is the unit of "
         "replication: a claim is split into sub-tests, one per setting of the other axes (norm, depth, warm-up, "
         "learning rate) and per half of the claim; each sub-test's values are one per seed (paired on the seed where "
         "the design pairs the arms), with a 95% t-interval and a p-value over n = seeds. The p-values of one claim's "
         "sub-tests are corrected together with Holm's step-down method (family-wise error 5%); the intervals shown "
         "are uncorrected. A sub-test holds here when its Holm-corrected p is below 0.05 in the claimed direction, "
         "does not hold here when it is below 0.05 the other way, is not significant otherwise, and is not tested "
         "with one seed or without data. A claim holds when every tested sub-test holds, does not hold when any "
         "does not hold, and is not significant otherwise. Small models on a CPU need not reproduce what large "
         "models show.", "",
         (f"{len(bad)} of {len(sweep.cells)} cells did not train (margin {sweep.collapse_margin:g} bits/byte below "
          f"the unigram baseline) and are left out of every effect: " +
          ", ".join(f"`{c.name}` ({c.status})" for c in bad) + ".") if bad else
         f"All {len(sweep.cells)} cells trained (margin {sweep.collapse_margin:g} bits/byte below the unigram "
         f"baseline).", ""]
    for item in found:
        L += item.render()
    L += ["Summary: " + "; ".join(f"claim {x.number}: {x.verdict}" for x in found) + ".", ""]
    L += _table(["#", "claim", "verdict", "why"],
                [[x.number, x.claim, f"**{x.verdict}**", x.why.replace("|", "/")] for x in found]) + [""]
    return L


FINDINGS_JSON = "findings.json"


def findings_data(sweep: Sweep, found: list[Finding]) -> dict:
    """The machine-readable findings (``findings.json``): status of every cell, every verdict and sub-test."""
    data = {
        "sweep": sweep.path.name,
        "collapse_margin": sweep.collapse_margin,
        "unigram_bits_per_byte": sorted({c.unigram for c in sweep.cells if c.unigram is not None}),
        "cells": {c.name: {"status": c.status, "eval_bits_per_byte": c.bits_per_byte,
                           "status_derived": c.status_derived}
                  for c in sorted(sweep.cells, key=lambda c: c.name)},
        "claims": [{"number": f.number, "claim": f.claim, "verdict": f.verdict, "why": f.why,
                    "tests": [t.to_dict() for t in f.tests]} for f in found],
    }
    t = sweep.trained_view()
    if len(t.lrs) > 1:
        data["tuned_learning_rate"] = [
            {**{k: b[k] for k in ("norm", "depth", "warmup")},
             "placements": [{"placement": r["placement"], "best_lr": r["best_lr"],
                             "chosen_lr": {str(s): v for s, v in sorted(r["chosen"].items())},
                             "held_out_bits_per_byte": r["held_out_est"].to_dict(),
                             "in_sample_bits_per_byte": r["in_sample_est"].to_dict()} for r in b["rows"]]}
            for b in tuned_comparison(t)]
    return data


def _write_findings_json(sweep: Sweep, found: list[Finding]) -> Path:
    target = sweep.path / FINDINGS_JSON
    write_text_atomic(target, json.dumps(findings_data(sweep, found), indent=2) + "\n")
    return target


def write_findings(sweep_dir: str | Path, margin: float | None = None) -> tuple[Path, str]:
    """Write ``sweep_dir/findings.md`` and ``findings.json`` (the findings section of the report,
    with its plots under ``sweep_dir/plots``); returns the Markdown's path and text."""
    sweep = load_sweep(sweep_dir, margin)
    found = findings(sweep)[0]
    text = "\n".join(findings_section(sweep, make_plots(sweep), found))
    target = Path(sweep_dir) / FINDINGS_FILE
    write_text_atomic(target, text)
    _write_findings_json(sweep, found)
    return target, text


def _layer_tables(sweep: Sweep, groups: dict) -> list[str]:
    from .report import _table

    out: list[str] = []
    for key, title, spec in (("ratio", "max/median |a| ratio", ".1f"), ("rms", "RMS", ".3g")):
        layers: list[str] = []
        for cells in groups.values():
            for c in cells:
                for lab in _residual_series(c, key)[0]:
                    if lab not in layers:
                        layers.append(lab)
        if not layers:
            return out
        rows = []
        for g, cells in groups.items():
            row = [sweep.label(g)]
            for lab in layers:
                vals = []
                for c in cells:
                    labels, values = _residual_series(c, key)
                    vals.append(values[labels.index(lab)] if lab in labels else None)
                row.append(estimate(vals).format(spec))
            rows.append(row)
        out += [f"### {title} of the residual stream (after the embedding, then after each block)", ""]
        out += _table(["setting", *layers], rows) + [""]
    return out


def make_plots(sweep: Sweep) -> dict[str, str]:
    """The sweep's PNGs, from its trained cells only."""
    from . import plots

    sweep = sweep.trained_view()

    out_dir = sweep.path / PLOTS_DIR
    groups = sweep.groups()
    labels = [sweep.label(g) for g in groups]
    made: dict[str, str] = {}

    def triple(e: Estimate) -> tuple:
        return (e.mean, e.lo, e.hi)

    bpb = [triple(group_estimate(cells, lambda c: c.bits_per_byte)) for cells in groups.values()]
    if any(m is not None for m, _, _ in bpb):
        path = plots.plot_interval_series(labels, {"eval bits/byte": bpb}, out_dir / "bits_per_byte.png",
                                          "Eval bits/byte per setting (mean, 95% interval over seeds)", "bits/byte")
        made["Eval bits/byte per setting"] = str(path.relative_to(sweep.path))
    series = {name: [triple(group_estimate(cells, lambda c, n=name: c.accuracy(n, "ppl_ratio"))) for cells in groups.values()]
              for name in sweep.recipes()}
    if any(m is not None for s in series.values() for m, _, _ in s):
        path = plots.plot_interval_series(labels, series, out_dir / "ppl_ratio.png",
                                          "INT8 PPL ratio per setting (mean, 95% interval over seeds)",
                                          "PPL(int8) / PPL(fp32)", reference=1.0)
        made["INT8 PPL ratio per setting"] = str(path.relative_to(sweep.path))
    # residual RMS: one line per placement x norm (x depth), pooled over seeds and warm-ups;
    # colour = placement, line style = norm
    pooled: dict[tuple, list[CellResult]] = {}
    for (p, n, d, _w, _lr), cells in groups.items():
        pooled.setdefault((p, n, d), []).extend(cells)
    layer_series, styles = {}, {}
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
    placements = list(dict.fromkeys(p for p, _, _ in pooled))
    norm_styles = ["-", "--", ":", "-."]
    norms = list(dict.fromkeys(n for _, n, _ in pooled))
    for (p, n, d), cells in pooled.items():
        layers: list[str] = []
        for c in cells:
            for lab in _residual_series(c, "rms")[0]:
                if lab not in layers:
                    layers.append(lab)
        if not layers:
            continue
        points = []
        for lab in layers:
            vals = []
            for c in cells:
                labs, values = _residual_series(c, "rms")
                vals.append(values[labs.index(lab)] if lab in labs else None)
            points.append(triple(estimate(vals)))
        label = f"{p}/{n}" + (f" L{d}" if len(sweep.depths) > 1 else "")
        layer_series[label] = (layers, points)
        styles[label] = {"color": colours[placements.index(p) % len(colours)],
                         "linestyle": norm_styles[norms.index(n) % len(norm_styles)]}
    if layer_series:
        pooled_over = "seeds and warm-ups" if len(sweep.warmups) > 1 else "seeds"
        path = plots.plot_layer_series(layer_series, out_dir / "residual_rms.png",
                                       f"Residual-stream RMS per layer (mean, 95% interval over {pooled_over})", "RMS",
                                       styles=styles)
        made["Residual-stream RMS per layer"] = str(path.relative_to(sweep.path))
    cos_series, cos_styles = {}, {}
    for (p, n, d), cells in pooled.items():
        width = max((len(c.block_cosine or []) for c in cells), default=0)
        if not width:
            continue
        points = [triple(estimate((c.block_cosine or [])[i] if i < len(c.block_cosine or []) else None
                                  for c in cells)) for i in range(width)]
        label = f"{p}/{n}" + (f" L{d}" if len(sweep.depths) > 1 else "")
        cos_series[label] = ([str(i) for i in range(width)], points)
        cos_styles[label] = {"color": colours[placements.index(p) % len(colours)],
                             "linestyle": norm_styles[norms.index(n) % len(norm_styles)]}
    if cos_series:
        path = plots.plot_layer_series(cos_series, out_dir / "block_cosine.png",
                                       "Cosine similarity of each block's output with its input (mean, 95% interval)",
                                       "cosine similarity", log=False, styles=cos_styles)
        made["Cosine similarity of block output and input"] = str(path.relative_to(sweep.path))
    if len(sweep.depths) > 1:
        path = _plot_perturbation_depth(sweep, out_dir / "perturbation_depth.png")
        if path is not None:
            made["Perturbation sensitivity per depth"] = str(path.relative_to(sweep.path))
    return made


def _plot_perturbation_depth(sweep: Sweep, out_png: Path) -> Path | None:
    """Relative logit change (smallest noise level) over depth, one line per placement x norm."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    from .plots import _save

    levels = sorted({lv for c in sweep.cells for lv in c.noise_levels()})
    if not levels:
        return None
    level = levels[0]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    drawn = False
    for p in _placements(sweep):
        for n in NORM_ORDER + tuple(sorted({c.norm for c in sweep.cells} - set(NORM_ORDER))):
            xs, mean, err_lo, err_hi = [], [], [], []
            for d in sweep.depths:
                e = group_estimate(sweep.select(placement=p, norm=n, depth=d), lambda c: c.logit_change(level))
                if e.mean is None:
                    continue
                xs.append(d)
                mean.append(e.mean)
                err_lo.append(e.mean - e.lo if e.has_interval else 0.0)
                err_hi.append(e.hi - e.mean if e.has_interval else 0.0)
            if xs:
                ax.errorbar(xs, mean, yerr=[err_lo, err_hi], marker="o", capsize=3, linewidth=1, markersize=3,
                            label=f"{p}/{n}")
                drawn = True
    if not drawn:
        return None
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(sweep.depths, [str(d) for d in sweep.depths])
    ax.set_xlabel("depth (blocks)")
    ax.set_ylabel(f"relative logit change (noise {level:g})")
    ax.set_title("Perturbation sensitivity over depth (mean, 95% interval over seeds and warm-ups)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=2)
    return _save(fig, out_png)


def write_comparison(sweep_dir: str | Path, margin: float | None = None) -> Path:
    """Write ``sweep_dir/report.md``, ``findings.json`` and ``sweep_dir/plots/*.png``; returns the report's path."""
    sweep = load_sweep(sweep_dir, margin)
    plots = make_plots(sweep)
    target = Path(sweep_dir) / REPORT_FILE
    write_text_atomic(target, render(sweep, plots))
    _write_findings_json(sweep, findings(sweep)[0])
    return target
