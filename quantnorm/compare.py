"""The comparison report of a sweep: statistics over seeds, a ranking, and findings with verdicts.

Reads only what the cells wrote (``<cell>/results.json``, its ``diagnostics`` included;
``train.json``/``config.json`` of a cell whose training diverged; ``train_log.jsonl`` for the
step-0 gradient norms; ``sweep.json`` for the command), so ``quantnorm compare DIR`` can
regenerate the report, and ``quantnorm findings DIR`` its findings section, at any time.

Statistics (all over seeds, one value per cell):

- mean and 95% Student-t interval ``mean +/- t(0.975, n-1) * sd / sqrt(n)`` (no interval with n = 1);
- two groups are *not significant*ly different when their 95% intervals overlap (conservative);
- a difference between two conditions is taken over cells matched on everything else (same
  seed, so same initialisation and batch order), with the t-interval of the differences; Welch's
  interval when fewer than two cells match;
- a rank correlation across cells is Spearman's rho with a Fisher-z interval (se = sqrt(1.06/(n-3))).

Verdicts come from one rule (:func:`verdict_sign`, :func:`verdict_order`, :func:`verdict_within`):
an interval on the claimed side of zero -> *holds here*, on the other side -> *does not hold
here*, across zero (or overlapping intervals) -> *not significant*; missing data -> *not tested*
with the reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from .errors import RunDirError
from .fileio import write_text_atomic
from .runs import CONFIG_FILE, PLOTS_DIR, REPORT_FILE, RESULTS_FILE, TRAIN_LOG_FILE, TRAIN_SUMMARY_FILE

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
    """One finished cell: its results.json (None when training diverged) and training summary."""

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

    @property
    def group(self) -> tuple:
        return (self.placement, self.norm, self.depth, self.warmup)

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

    @property
    def depths(self) -> list[int]:
        return sorted({c.depth for c in self.cells})

    @property
    def warmups(self) -> list[int]:
        return sorted({c.warmup for c in self.cells})

    def groups(self) -> dict[tuple, list[CellResult]]:
        out: dict[tuple, list[CellResult]] = {}
        for c in sorted(self.cells, key=lambda c: (_order_key(c.group), c.seed)):
            out.setdefault(c.group, []).append(c)
        return out

    def label(self, group: tuple) -> str:
        placement, norm, depth, warmup = group
        text = f"{placement}/{norm}"
        if len(self.depths) > 1:
            text += f" L{depth}"
        if len(self.warmups) > 1:
            text += f" w{warmup}"
        return text

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
    placement, norm, depth, warmup = group
    p = PLACEMENT_ORDER.index(placement) if placement in PLACEMENT_ORDER else len(PLACEMENT_ORDER)
    n = NORM_ORDER.index(norm) if norm in NORM_ORDER else len(NORM_ORDER)
    return (p, placement, n, norm, depth, warmup)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _grad0(cell_dir: Path) -> dict | None:
    try:
        with open(cell_dir / TRAIN_LOG_FILE, encoding="utf-8") as log:
            first = json.loads(log.readline())
        return first.get("grad_norm_per_layer")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


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


def load_cell(cell_dir: Path) -> CellResult | None:
    """A finished cell, or None when the directory holds no finished cell. Raises RunDirError for
    a results.json that cannot be used (corrupt, other schema)."""
    from .report import load_results

    cell_dir = Path(cell_dir)
    if (cell_dir / RESULTS_FILE).is_file():
        results = load_results(cell_dir / RESULTS_FILE)
        try:
            m, t = results["model"], results["train"]
            tc = t["config"]
            perturbation, block_cosine = _diagnostics(results)
            return CellResult(cell_dir.name, cell_dir, m["placement"], m["norm"], int(m["n_layers"]),
                              int(tc["warmup"]), int(tc["seed"]), bool(t.get("diverged")), t, results,
                              _grad0(cell_dir), perturbation=perturbation, block_cosine=block_cosine)
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
                                  int(tc["warmup"]), int(tc["seed"]), True, train, None, _grad0(cell_dir))
            except (KeyError, TypeError, ValueError) as exc:
                raise RunDirError(f"{cell_dir / CONFIG_FILE} lacks {exc}") from None
    return None


def load_sweep(sweep_dir: str | Path) -> Sweep:
    """Every finished cell under ``sweep_dir``; unusable and unfinished cells are listed as problems."""
    from .manifest import MANIFEST_FILE, read_manifest

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise RunDirError(f"{sweep_dir} is not a directory: pass the --out directory of `quantnorm sweep`")
    manifest = read_manifest(sweep_dir) if (sweep_dir / MANIFEST_FILE).is_file() else None
    cells, problems = [], []
    for cell_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name != PLOTS_DIR):
        try:
            cell = load_cell(cell_dir)
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
        raise RunDirError(f"{sweep_dir} holds no finished cell (no <cell>/results.json): run `quantnorm sweep` first")
    return Sweep(sweep_dir, cells, manifest, problems)


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
    """Why a claim is not tested when placements it compares have no cells; None when all are there."""
    missing = _missing(sweep, placements)
    return f"no {' and '.join(missing)} cells in the sweep" if missing else None


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


def claim_warmup(sweep: Sweep) -> Finding:
    f = Finding(1, "Post-LN needs learning-rate warm-up; Pre-LN trains without it", "Xiong et al. 2020", NOT_TESTED)
    if 0 not in sweep.warmups or len(sweep.warmups) < 2:
        f.why = "the sweep has no warm-up axis with 0 and a positive value: run with --warmups 0,30"
        return f
    if why := _missing_why(sweep, ("post", "pre")):
        f.why = why
        return f
    w = max(sweep.warmups)
    key = lambda c: (c.norm, c.depth, c.seed)  # noqa: E731
    bpb = lambda c: c.bits_per_byte  # noqa: E731
    deltas, divs = {}, {}
    for p in ("post", "pre"):
        no, yes = sweep.select(placement=p, warmup=0), sweep.select(placement=p, warmup=w)
        deltas[p] = (_keyed(no, key, bpb), _keyed(yes, key, bpb))
        d = matched_difference(*deltas[p])
        divs[p] = (sum(c.diverged for c in no), len(no), sum(c.diverged for c in yes), len(yes))
        f.lines.append(f"{p}: eval bits/byte without warm-up minus with {w} steps: {d.format('+.3f')} "
                       f"(positive = warm-up helps); diverged {divs[p][0]}/{divs[p][1]} without, "
                       f"{divs[p][2]}/{divs[p][3]} with")
    # interaction: how much more post gains from warm-up than pre, matched on (norm, depth, seed)
    gain = {p: {k: deltas[p][0][k] - deltas[p][1][k] for k in deltas[p][0]
                if k in deltas[p][1] and _finite([deltas[p][0][k]]) and _finite([deltas[p][1][k]])}
            for p in ("post", "pre")}
    inter = matched_difference(gain["post"], gain["pre"])
    f.lines.append(f"post's warm-up gain minus pre's: {inter.format('+.3f')} bits/byte")
    post_div, pre_div = divs["post"][0], divs["pre"][0]
    if post_div > pre_div and divs["post"][2] == 0:
        f.verdict = HOLDS
        f.why = (f"post diverged without warm-up in {post_div} of {divs['post'][1]} cells, pre in {pre_div} of "
                 f"{divs['pre'][1]}")
    elif pre_div > post_div:
        f.verdict = DOES_NOT_HOLD
        f.why = f"pre diverged without warm-up in {pre_div} cells, post in {post_div}"
    else:
        f.verdict = verdict_sign(inter, +1)
        f.why = ("no matched post/pre cells with both warm-ups finished" if f.verdict == NOT_TESTED else
                 "no difference in divergences; verdict on post's warm-up gain minus pre's, matched on norm, depth "
                 "and seed")
    return f


def claim_grad_at_init(sweep: Sweep) -> Finding:
    f = Finding(2, "At initialization Post-LN's gradients are largest near the output and shrink toward the "
                   "input; Pre-LN's are even", "Xiong et al. 2020", NOT_TESTED)
    if why := _missing_why(sweep, ("post", "pre")):
        f.why = why
        return f

    def slope(c: CellResult) -> float | None:
        g = c.grad0 or {}
        blocks = sorted((int(k[5:]), v) for k, v in g.items() if k.startswith("block") and k[5:].isdigit())
        if len(blocks) < 2 or blocks[0][1] <= 0 or blocks[-1][1] <= 0:
            return None
        return math.log(blocks[-1][1] / blocks[0][1])

    key = lambda c: (c.norm, c.depth, c.warmup, c.seed)  # noqa: E731
    post, pre = _keyed(sweep.select(placement="post"), key, slope), _keyed(sweep.select(placement="pre"), key, slope)
    e_post, e_pre = estimate(post.values()), estimate(pre.values())
    if e_post.mean is None or e_pre.mean is None:
        f.why = "needs depth >= 2 and train_log.jsonl with step 0's per-layer gradient norms"
        return f
    diff = matched_difference(post, pre)
    f.lines += [f"log(gradient norm of the last block / the first block) at step 0: post {e_post.format('+.3f')}, "
                f"pre {e_pre.format('+.3f')} (0 = even; > 0 = larger near the output)",
                f"post minus pre: {diff.format('+.3f')}"]
    f.verdict = combine([verdict_sign(e_post, +1), verdict_sign(diff, +1)])
    f.why = ("rule: post's log(last block / first block) gradient norm above 0 and above pre's, matched on norm, "
             "depth, warm-up and seed (95% intervals)")
    return f


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


def claim_perturbation(sweep: Sweep) -> Finding:
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
        f.why = "no post and pre cells measured at the same noise level"
        return f
    key = lambda c: (c.norm, c.depth, c.warmup, c.seed)  # noqa: E731
    diffs: dict[float, Estimate] = {}
    for lv in levels:
        metric = lambda c, lv=lv: c.log_logit_change(lv)  # noqa: E731
        diffs[lv] = matched_difference(_keyed(post, key, metric), _keyed(pre, key, metric))
        e_post = group_estimate(post, lambda c, lv=lv: c.logit_change(lv))
        e_pre = group_estimate(pre, lambda c, lv=lv: c.logit_change(lv))
        f.lines.append(f"noise {lv:g} x each weight's RMS: relative logit change post {e_post.format('.3g')}, "
                       f"pre {e_pre.format('.3g')}; post/pre {_fmt_factor(diffs[lv])} (geometric, matched on norm, "
                       f"depth, warm-up and seed)")
    level = next((lv for lv in levels if diffs[lv].mean is not None), levels[0])
    depth_note = ""
    if len(sweep.depths) >= 2:
        ref = log_reference_exponent(sweep.depths)
        series_key = lambda c: (c.norm, c.warmup, c.seed)  # noqa: E731
        exponents: dict[str, dict] = {}
        for p in _placements(sweep, [c for c in sweep.cells if c.perturbation]):
            series: dict[tuple, dict[int, float]] = {}
            for c in sweep.select(placement=p):
                series.setdefault(series_key(c), {})[c.depth] = c.logit_change(level)
            exponents[p] = {k: depth_exponent(v) for k, v in series.items()}
            k = estimate(exponents[p].values())
            f.lines.append(f"{p}: relative logit change at noise {level:g} grows as depth^k over depths "
                           f"{', '.join(map(str, sweep.depths))}, k = {k.format('.2f')} (log-log fit per norm, "
                           f"warm-up and seed) -> {_depth_shape(k, ref)}")
        if ref is not None:
            f.lines.append(f"k = 1 is O(N); a change growing as log(depth) would give k = {ref:.2f} over these depths")
        if "post" in exponents and "pre" in exponents:
            dk = matched_difference(exponents["post"], exponents["pre"])
            f.lines.append(f"post's k minus pre's (matched on norm, warm-up and seed): {dk.format('+.2f')} "
                           f"(> 0 = post's change grows faster with depth)")
    else:
        depth_note = "; no depth axis, so the O(N) vs O(log N) growth is not tested (run with --depths 2,8)"
    f.verdict = verdict_sign(diffs[level], +1)
    f.why = (f"verdict on log(post's relative logit change / pre's) at the smallest noise level ({level:g}), matched "
             f"on norm, depth, warm-up and seed" + depth_note)
    if f.verdict == NOT_TESTED:
        f.why = "no post and pre cells with a positive relative logit change at the same noise level"
    return f


def claim_residual_growth(sweep: Sweep) -> tuple[Finding, dict[str, dict]]:
    f = Finding(4, "Pre-LN hidden-state variance grows fast (exponentially) with depth; Peri-LN about linearly; "
                   "Post-LN stays constant", "Peri-LN paper (Kim et al. 2025)", NOT_TESTED)
    table: dict[str, dict] = {}
    for p in [p for p in PLACEMENT_ORDER if sweep.select(placement=p)] + \
             sorted({c.placement for c in sweep.cells} - set(PLACEMENT_ORDER)):
        fits = [growth_fit([r.get("rms") for r in c.residual() if r.get("layer") != "embed"])
                for c in sweep.select(placement=p)]
        fits = [x for x in fits if x is not None]
        if not fits:
            continue
        table[p] = {
            "n": len(fits),
            "growth": estimate(x["growth_factor"] for x in fits),
            "log_growth": estimate(x["log_growth"] for x in fits),
            "relative_slope": estimate(x["relative_slope"] for x in fits),
            "r2_exp": estimate(x["r2_exp"] for x in fits),
            "r2_lin": estimate(x["r2_lin"] for x in fits),
            "delta_r2": estimate(x["delta_r2"] for x in fits),
        }
        t = table[p]
        better = verdict_sign(t["delta_r2"], +1)
        shape = {HOLDS: "exponential fits better", DOES_NOT_HOLD: "linear fits better"}.get(better, "fits not told apart")
        f.lines.append(f"{p}: residual RMS over the block outputs grows x{t['growth'].format('.3f')} per block "
                       f"(log-linear fit), linear slope {t['relative_slope'].format('+.3f')} of block 0's RMS per "
                       f"block; R^2 exponential {t['r2_exp'].format('.3f')}, linear {t['r2_lin'].format('.3f')}, "
                       f"exponential minus linear {t['delta_r2'].format('+.4f')} -> {shape} (cells: {t['n']})")
    if not table:
        f.why = "needs the outlier probe (no --no-outliers) and depth >= 3 (3 block outputs per fit)"
        return f, table
    parts, untested = [], []
    if "pre" in table:  # grows, and the exponential fits better
        parts += [verdict_sign(table["pre"]["log_growth"], +1), verdict_sign(table["pre"]["delta_r2"], +1)]
    else:
        untested.append("pre")
    if "peri" in table:  # grows, and the straight line fits better
        parts += [verdict_sign(table["peri"]["relative_slope"], +1), verdict_sign(table["peri"]["delta_r2"], -1)]
    else:
        untested.append("peri")
    if "post" in table:
        parts.append(verdict_within(table["post"]["log_growth"], math.log(CONSTANT_GROWTH)))
    else:
        untested.append("post")
    f.verdict = combine(parts)
    reasons = ["rule: pre grows and its exponential fit is better, peri grows and its linear fit is better, "
               "post's growth within "
               f"x{1 / CONSTANT_GROWTH:.2f}..x{CONSTANT_GROWTH:.2f} per block (95% intervals)"]
    if untested:
        reasons.append(f"not in the sweep: {', '.join(untested)}")
    f.why = "; ".join(reasons)
    return f, table


def claim_massive(sweep: Sweep) -> Finding:
    f = Finding(5, "Pre-LN develops massive activations; Peri-LN keeps them bounded", "Sun et al. 2024; Peri-LN paper",
                NOT_TESTED)
    if why := _missing_why(sweep, ("pre", "peri")):
        f.why = why
        return f
    pre, peri = sweep.select(placement="pre"), sweep.select(placement="peri")
    e_pre, e_peri = group_estimate(pre, CellResult.max_ratio), group_estimate(peri, CellResult.max_ratio)
    if e_pre.mean is None or e_peri.mean is None:
        f.why = "needs the outlier probe (run without --no-outliers)"
        return f
    m_pre = sum(c.massive_count() or 0 for c in pre)
    m_peri = sum(c.massive_count() or 0 for c in peri)
    f.lines += [f"largest residual max/median ratio over layers: pre {e_pre.format('.1f')}, peri {e_peri.format('.1f')}",
                f"massive activations (Sun et al.: |a| > 100 and >= 1000x the median): pre {m_pre} in {len(pre)} cells, "
                f"peri {m_peri} in {len(peri)} cells"]
    if m_pre == 0:
        f.verdict = DOES_NOT_HOLD
        f.why = "Pre-LN developed no massive activation here (small models: see PITFALLS 8)"
    else:
        f.verdict = verdict_order(e_peri, e_pre)
    return f


def claim_peri_vs_pre(sweep: Sweep) -> Finding:
    f = Finding(6, "Peri-LN reaches lower loss with fewer gradient spikes and less seed-to-seed variance than Pre-LN",
                "Peri-LN paper", NOT_TESTED)
    if why := _missing_why(sweep, ("pre", "peri")):
        f.why = why
        return f
    key = lambda c: (c.norm, c.depth, c.warmup, c.seed)  # noqa: E731
    pre, peri = sweep.select(placement="pre"), sweep.select(placement="peri")
    diff = matched_difference(_keyed(peri, key, lambda c: c.bits_per_byte), _keyed(pre, key, lambda c: c.bits_per_byte))
    spikes = matched_difference(_keyed(peri, key, lambda c: c.train.get("gradient_spikes")),
                                _keyed(pre, key, lambda c: c.train.get("gradient_spikes")))
    f.lines.append(f"eval bits/byte, peri minus pre (matched cells): {diff.format('+.3f')}")
    f.lines.append(f"gradient spikes, peri minus pre: {spikes.format('+.2f')}")
    sds = []
    for (p, n, d, w), cells in sweep.groups().items():
        if p in ("pre", "peri"):
            e = group_estimate(cells, lambda c: c.bits_per_byte)
            sds.append(f"{sweep.label((p, n, d, w))} {e.sd:.3f}" if e.sd is not None else f"{sweep.label((p, n, d, w))} –")
    f.lines.append("seed-to-seed sd of bits/byte: " + ", ".join(sds))
    f.verdict = verdict_sign(diff, -1)
    f.why = "verdict on the loss (bits/byte) difference; spikes and spread reported above"
    return f


def claim_collapse(sweep: Sweep) -> Finding:
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
    others = [p for p in _placements(sweep, measured) if p != "pre"]
    if not any(c.placement == "pre" for c in measured):
        f.why = "no pre cell has the block-similarity measurement"
        return f
    if not others:
        f.why = "no other placement with the block-similarity measurement to compare pre with"
        return f
    depths = sorted({c.depth for c in measured if c.placement == "pre"})
    for d in depths:
        parts = [f"{p} {group_estimate(sweep.select(placement=p, depth=d), CellResult.late_cosine).format('.3f')}"
                 for p in ["pre", *others] if sweep.select(placement=p, depth=d)]
        f.lines.append(f"depth {d}: mean cosine(block output, block input) over the last half of the blocks: "
                       + ", ".join(parts))
    depth = depths[-1]
    key = lambda c: (c.norm, c.warmup, c.seed)  # noqa: E731
    pre = _keyed(sweep.select(placement="pre", depth=depth), key, CellResult.late_cosine)
    pooled: dict[tuple, list[float]] = {}
    for p in others:
        for k, v in _keyed(sweep.select(placement=p, depth=depth), key, CellResult.late_cosine).items():
            if _finite([v]):
                pooled.setdefault(k, []).append(v)
    rest = {k: sum(v) / len(v) for k, v in pooled.items()}
    diff = matched_difference(pre, rest)
    f.lines.append(f"depth {depth}: pre minus the mean of {', '.join(others)} (matched on norm, warm-up and seed): "
                   f"{diff.format('+.3f')} (> 0 = pre's late blocks change the stream less)")
    slopes = [f"{p} {group_estimate(sweep.select(placement=p, depth=depth), CellResult.cosine_slope).format('+.4f')}"
              for p in ["pre", *others] if sweep.select(placement=p, depth=depth)]
    f.lines.append(f"depth {depth}: change of that cosine per block within the stack (least-squares slope over the "
                   f"block index; > 0 = later blocks more alike): " + ", ".join(slopes))
    slope = group_estimate(sweep.select(placement="pre", depth=depth), CellResult.cosine_slope)
    f.verdict = combine([verdict_sign(diff, +1), verdict_sign(slope, +1)])
    f.why = (f"rule at depth {depth}, the deepest: pre's late-block cosine above the others' and rising over pre's "
             f"blocks (95% intervals)")
    if slope.mean is None:
        f.why += "; one block per stack, so no slope"
    return f


def claim_deepnorm(sweep: Sweep) -> Finding:
    f = Finding(8, "DeepNorm trains much deeper stacks stably", "DeepNet (Wang et al. 2022)", NOT_TESTED)
    if len(sweep.depths) < 2:
        f.why = "the sweep has no depth axis: run with --depths 2,8 (or deeper)"
        return f
    if why := _missing_why(sweep, ("deepnorm", "post")):
        f.why = why
        return f
    key = lambda c: (c.norm, c.warmup, c.seed)  # noqa: E731
    for d in sweep.depths:
        dn, po = sweep.select(placement="deepnorm", depth=d), sweep.select(placement="post", depth=d)
        diff = matched_difference(_keyed(dn, key, lambda c: c.bits_per_byte), _keyed(po, key, lambda c: c.bits_per_byte))
        f.lines.append(f"depth {d}: diverged deepnorm {sum(c.diverged for c in dn)}/{len(dn)}, post "
                       f"{sum(c.diverged for c in po)}/{len(po)}; bits/byte deepnorm minus post {diff.format('+.3f')}")
    d = max(sweep.depths)
    dn, po = sweep.select(placement="deepnorm", depth=d), sweep.select(placement="post", depth=d)
    dn_div, po_div = sum(c.diverged for c in dn), sum(c.diverged for c in po)
    if dn_div < po_div:
        f.verdict, f.why = HOLDS, f"at depth {d} post diverged in {po_div} cells, deepnorm in {dn_div}"
    elif dn_div > po_div:
        f.verdict, f.why = DOES_NOT_HOLD, f"at depth {d} deepnorm diverged in {dn_div} cells, post in {po_div}"
    else:
        diff = matched_difference(_keyed(dn, key, lambda c: c.bits_per_byte), _keyed(po, key, lambda c: c.bits_per_byte))
        f.verdict = verdict_sign(diff, -1)
        f.why = f"no difference in divergences at depth {d}; verdict on bits/byte vs post there"
    return f


def _norm_difference(sweep: Sweep, metric: Callable[[CellResult], float | None], first: str = "rms",
                     second: str = "layer") -> Estimate:
    """``metric`` of the ``first`` norm minus the ``second``'s, matched on placement, depth, warm-up and seed."""
    key = lambda c: (c.placement, c.depth, c.warmup, c.seed)  # noqa: E731
    return matched_difference(_keyed(sweep.select(norm=first), key, metric),
                              _keyed(sweep.select(norm=second), key, metric))


def claim_rms_speed(sweep: Sweep) -> Finding:
    f = Finding(9, "RMSNorm is faster than LayerNorm (7-64% reported); optimized LayerNorm closes the gap",
                "Zhang & Sennrich 2019; Costello et al. 2025", NOT_TESTED)
    if {c.norm for c in sweep.cells} < {"layer", "rms"}:
        f.why = "the sweep needs both norms: --norms layer,rms"
        return f
    log_tps = lambda c: math.log(c.train["tokens_per_s"]) if (c.train.get("tokens_per_s") or 0) > 0 else None  # noqa: E731
    train_speed = _norm_difference(sweep, log_tps)

    def log_p50(c: CellResult) -> float | None:
        v = c.fp32_p50()[0]
        return math.log(v) if v else None

    ort_speed = _norm_difference(sweep, log_p50, first="layer", second="rms")
    f.lines.append(f"training tokens/s, RMSNorm vs LayerNorm: {_fmt_pct(train_speed)}")
    f.lines.append(f"ONNX Runtime FP32 p50 latency, LayerNorm vs RMSNorm (CPU, largest batch; > 0 = RMSNorm faster): "
                   f"{_fmt_pct(ort_speed)}")
    jobs = (sweep.manifest or {}).get("jobs")
    if jobs and jobs > 1:
        f.lines.append(f"cells ran {jobs} at a time, so timings share the CPU: read speed figures with care")
    f.verdict = verdict_sign(train_speed, +1)
    f.why = "verdict on training throughput; ONNX Runtime latency reported above"
    return f


def claim_layer_friendlier(sweep: Sweep) -> Finding:
    f = Finding(10, "LayerNorm's zero-mean output makes it friendlier to low-precision quantization than RMSNorm",
                "seed article (claim without a source)", NOT_TESTED)
    if {c.norm for c in sweep.cells} < {"layer", "rms"}:
        f.why = "the sweep needs both norms: --norms layer,rms"
        return f
    recipes = sweep.recipes()
    if not recipes:
        f.why = "no recipe was measured"
        return f
    verdicts = {}
    for name in recipes:
        diff = _norm_difference(sweep, lambda c, n=name: c.accuracy(n, "ppl_ratio"))
        verdicts[name] = verdict_sign(diff, +1)
        f.lines.append(f"`{name}`: PPL ratio RMSNorm minus LayerNorm {diff.format('+.4f')} (> 0 = LayerNorm quantizes better)")
    f.verdict = verdicts[recipes[0]]
    f.why = f"verdict on the primary recipe `{recipes[0]}`, matched on placement, depth, warm-up and seed"
    return f


def claim_outliers_predict(sweep: Sweep) -> tuple[Finding, dict[str, Correlation]]:
    f = Finding(11, "Outlier size predicts INT8 error", "Bondarenko et al. 2023; He et al. 2024", NOT_TESTED)
    corr: dict[str, Correlation] = {}
    recipes = sweep.recipes()
    cells = [c for c in sweep.cells if c.results is not None]
    if not any(c.max_ratio() is not None for c in cells):
        f.why = "needs the outlier probe (run without --no-outliers)"
        return f, corr
    for name in recipes:
        xs = [c.max_ratio() for c in cells]
        ys = [c.accuracy(name, "ppl_ratio") for c in cells]
        corr[name] = spearman_interval(xs, ys)
        k = spearman_interval([c.max_kurtosis() for c in cells], ys)
        f.lines.append(f"`{name}`: Spearman rho across cells of the largest residual max/median ratio vs PPL ratio "
                       f"{corr[name].format()}; of the largest kurtosis {k.format()}")
    within: dict[str, list[float]] = {}
    for c in cells:
        for name, s in ((c.results or {}).get("sqnr_summary") or {}).items():
            if s.get("spearman_ratio_sqnr") is not None:
                within.setdefault(name, []).append(s["spearman_ratio_sqnr"])
    for name, values in within.items():
        f.lines.append(f"`{name}`: within each cell, Spearman rho of tensor max/median ratio vs SQNR, mean over cells "
                       f"{estimate(values).format('+.2f')} (negative = bigger outliers, lower SQNR)")
    primary = recipes[0] if recipes else None
    if primary is None or corr[primary].rho is None:
        f.why = f"too few cells with both numbers (n={corr[primary].n if primary else 0}; needs >= 4)"
        return f, corr
    if not corr[primary].has_interval:
        f.verdict, f.why = NOT_SIGNIFICANT, f"n={corr[primary].n} cells: too few for an interval (needs >= 4)"
        return f, corr
    f.verdict = verdict_sign(corr[primary], +1)
    f.why = f"across cells, primary recipe `{primary}`, Fisher-z 95% interval of rho"
    return f, corr


def claim_post_best(sweep: Sweep) -> Finding:
    f = Finding(12, "Post-LN, trained well, can end with better accuracy than Pre-LN", "seed articles", NOT_TESTED)
    if why := _missing_why(sweep, ("post", "pre")):
        f.why = why
        return f
    best = {}
    for p in ("post", "pre"):
        cands = [(g, group_estimate(cells, lambda c: c.bits_per_byte)) for g, cells in sweep.groups().items()
                 if g[0] == p]
        cands = [x for x in cands if x[1].mean is not None]
        if not cands:
            f.why = f"every {p} cell diverged"
            return f
        best[p] = min(cands, key=lambda x: x[1].mean)
        f.lines.append(f"best {p} setting {sweep.label(best[p][0])}: {best[p][1].format('.3f')} bits/byte")
    f.verdict = verdict_order(best["post"][1], best["pre"][1])
    f.why = "best setting of each over the warm-up (and norm, depth) axes; overlapping intervals are not significant"
    return f


def findings(sweep: Sweep) -> tuple[list[Finding], dict]:
    growth, growth_table = claim_residual_growth(sweep)
    outliers, corr = claim_outliers_predict(sweep)
    out = [
        claim_warmup(sweep),
        claim_grad_at_init(sweep),
        claim_perturbation(sweep),
        growth,
        claim_massive(sweep),
        claim_peri_vs_pre(sweep),
        claim_collapse(sweep),
        claim_deepnorm(sweep),
        claim_rms_speed(sweep),
        claim_layer_friendlier(sweep),
        outliers,
        claim_post_best(sweep),
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


def render(sweep: Sweep, plots: dict[str, str] | None = None) -> str:
    from .report import _table

    groups = sweep.groups()
    recipes = sweep.recipes()
    first = next((c.results for c in sweep.cells if c.results), None) or {}
    hw = first.get("hardware", {})
    n_div = sum(c.diverged for c in sweep.cells)
    seeds = sorted({c.seed for c in sweep.cells})
    L = [f"# quantnorm sweep: {sweep.path.name}", ""]
    L += _manifest_line(sweep)
    L += [f"{len(sweep.cells)} finished cells ({n_div} diverged) in {len(groups)} settings, seeds "
          f"{', '.join(map(str, seeds))}; {len(sweep.problems)} cells left out (listed at the end).  ",
          f"Hardware: {hw.get('cpu', '?')}, VNNI {hw.get('vnni')}, ONNX Runtime threads {hw.get('threads') or 'default'}, "
          f"onnxruntime {hw.get('onnxruntime')}, torch {hw.get('torch')}.", "",
          "Every figure is the mean over seeds with its 95% Student-t interval in brackets ((n=1): one seed, "
          "no interval). Rankings mark a row *not significant* when its interval overlaps the row above's.", ""]

    L += ["## Training and FP32 quality", ""]
    rows = []
    for g, cells in groups.items():
        rows.append([sweep.label(g), len(cells), f"{sum(c.diverged for c in cells)}/{len(cells)}",
                     group_estimate(cells, lambda c: c.bits_per_byte).format(".3f"),
                     group_estimate(cells, lambda c: c.train.get("gradient_spikes")).format(".2g"),
                     group_estimate(cells, lambda c: c.train.get("tokens_per_s")).format(",.0f")])
    L += _table(["setting", "seeds", "diverged", "eval bits/byte (PyTorch)", "gradient spikes", "train tokens/s"], rows)

    batch = None
    for name in recipes:
        L += ["", f"## INT8 recipe `{name}`", ""]
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

    L += ["", "## Ranking", "", "### INT8 survival: best recipe's PPL ratio (lower is better)", ""]
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

    L += [""] + findings_section(sweep, plots)

    if plots:
        L += ["## Plots", ""] + [f"![{title}]({path})" for title, path in plots.items()] + [""]
    if sweep.problems:
        L += ["## Cells left out", ""] + [f"- {p}" for p in sweep.problems] + [""]
    return "\n".join(L)


# which plot of make_plots (by title) illustrates which claim
CLAIM_PLOTS = {3: ("Perturbation sensitivity per depth",), 4: ("Residual-stream RMS per layer",),
               7: ("Cosine similarity of block output and input",)}


def findings_section(sweep: Sweep, plots: dict[str, str] | None = None) -> list[str]:
    """The Markdown lines of the findings section (``## Findings``): one subsection per claim, a
    summary line and the table of the twelve verdicts. ``plots`` (title -> path relative to the
    sweep directory, as from :func:`make_plots`) adds the pictures to the claims they illustrate."""
    from .report import _table

    found, _ = findings(sweep)
    for item in found:
        item.plots = {t: (plots or {})[t] for t in CLAIM_PLOTS.get(item.number, ()) if t in (plots or {})}
    L = ["## Findings", "",
         "Each claim of the literature (shared CLAIMS.md) as measured by this sweep. Verdict rule: a 95% interval "
         "on the claimed side -> holds here; on the other side -> does not hold here; across zero or overlapping "
         "-> not significant; no data -> not tested. Small models on a CPU need not reproduce what large models show.",
         ""]
    for item in found:
        L += item.render()
    L += ["Summary: " + "; ".join(f"claim {x.number}: {x.verdict}" for x in found) + ".", ""]
    L += _table(["#", "claim", "verdict", "why"],
                [[x.number, x.claim, f"**{x.verdict}**", x.why.replace("|", "/")] for x in found]) + [""]
    return L


def write_findings(sweep_dir: str | Path) -> tuple[Path, str]:
    """Write ``sweep_dir/findings.md`` (the findings section of the report, with its plots under
    ``sweep_dir/plots``); returns its path and text."""
    sweep = load_sweep(sweep_dir)
    text = "\n".join(findings_section(sweep, make_plots(sweep)))
    target = Path(sweep_dir) / FINDINGS_FILE
    write_text_atomic(target, text)
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
    from . import plots

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
    for (p, n, d, _w), cells in groups.items():
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


def write_comparison(sweep_dir: str | Path) -> Path:
    """Write ``sweep_dir/report.md`` and ``sweep_dir/plots/*.png``; returns the report's path."""
    sweep = load_sweep(sweep_dir)
    plots = make_plots(sweep)
    target = Path(sweep_dir) / REPORT_FILE
    write_text_atomic(target, render(sweep, plots))
    return target
