"""Statistics over seeds for the sweep report and its findings.

The seed is the unit of replication. An :class:`Estimate` is a mean with its 95% Student-t
interval ``mean +/- t(0.975, n-1) * sd / sqrt(n)`` (no interval with n = 1); a :class:`SubTest`
is one stratum of a claim with one value per seed and a t-test over n = seeds (equivalence by
two one-sided tests for "about zero", the F-test for "less seed-to-seed variance"); the
sub-tests of one claim are corrected together with Holm's step-down method (:func:`holm`), and
:func:`combine` makes a claim's verdict from its parts. Nothing here knows what a cell is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np


def scipy_stats():
    """scipy.stats, imported on first use: its import takes ~0.7 s, which every start of the CLI
    (a gate in CI, each sweep cell) would otherwise pay without computing a statistic."""
    from scipy import stats

    return stats

LEVEL = 0.95
HOLDS = "holds here"
DOES_NOT_HOLD = "does not hold here"
NOT_SIGNIFICANT = "not significant"
NOT_TESTED = "not tested"
VERDICTS = (HOLDS, DOES_NOT_HOLD, NOT_SIGNIFICANT, NOT_TESTED)


# ------------------------------------------------------------------------------------ statistics


def t_quantile(df: float, level: float = LEVEL) -> float:
    """Two-sided Student-t critical value (4.303 for df = 2 at 95%)."""
    return float(scipy_stats().t.ppf(0.5 + level / 2, df))


def finite(values: Iterable) -> list[float]:
    """The values that are finite numbers, as floats (None, booleans, text, NaN and inf are left out)."""
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
    xs = finite(values)
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
    xa, xb = finite(a), finite(b)
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
    common = [k for k in a if k in b and finite([a[k]]) and finite([b[k]])]
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
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if finite([x]) and finite([y])]
    n = len(pairs)
    if n < 3:
        return Correlation(None, None, None, n)
    a, b = np.array(pairs, dtype=float).T
    if np.all(a == a[0]) or np.all(b == b[0]):
        return Correlation(None, None, None, n)
    rho = float(scipy_stats().spearmanr(a, b).statistic)
    if n < 4:
        return Correlation(rho, None, None, n)
    z = math.atanh(max(-0.999999, min(0.999999, rho)))
    half = float(scipy_stats().norm.ppf(0.5 + level / 2)) * math.sqrt(1.06 / (n - 3))
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


def line_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares line ``y = a + b x``: ``(b, a)``, np.polyfit's order. Written with exactly
    rounded sums (``math.fsum``) because np.polyfit goes through LAPACK, whose kernels differ by
    CPU in the last digits, and the committed findings must regenerate byte for byte anywhere."""
    xs, ys = [float(v) for v in x], [float(v) for v in y]
    n = len(xs)
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxx = math.fsum((a - mx) ** 2 for a in xs)
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(xs, ys))
    slope = sxy / sxx
    return slope, my - slope * mx


def growth_fit(rms: Sequence[float]) -> dict | None:
    """Fit RMS over depth (x = 0, 1, ... for consecutive outputs) as exponential (log-linear) and
    as linear; R^2 of both in RMS units (so they compare). None with fewer than 3 points.

    The embedding output is not a point of the fit: its scale is the initialisation's, not the
    blocks' growth (a small embedding makes every placement look exponential at the first step)."""
    y = np.array(finite(rms), dtype=float)
    if len(y) < 3 or len(y) != len(rms) or np.any(y <= 0):
        return None
    x = np.arange(len(y), dtype=float)
    # scalar libm and exact sums (see line_fit): numpy's vectorized log/exp may differ by CPU
    mean = math.fsum(y) / len(y)
    sst = math.fsum((v - mean) ** 2 for v in y)
    b_log, a_log = line_fit(x, [math.log(v) for v in y])
    pred_exp = [math.exp(a_log + b_log * v) for v in x]
    b_lin, a_lin = line_fit(x, y)
    pred_lin = [a_lin + b_lin * v for v in x]

    def r2(pred: list[float]) -> float:
        return 1.0 - math.fsum((a - b) ** 2 for a, b in zip(y, pred)) / sst if sst > 0 else 1.0

    return {"growth_factor": float(math.exp(b_log)), "log_growth": float(b_log), "slope": float(b_lin),
            "relative_slope": float(b_lin / y[0]), "r2_exp": r2(pred_exp), "r2_lin": r2(pred_lin),
            "delta_r2": r2(pred_exp) - r2(pred_lin)}


def fmt_pct(est: Estimate) -> str:
    """A log-ratio estimate as a percentage change."""
    if est.mean is None:
        return "–"
    f = lambda v: f"{100 * (math.exp(v) - 1):+.1f}%"  # noqa: E731
    return f"{f(est.mean)} [{f(est.lo)}, {f(est.hi)}]" if est.has_interval else f"{f(est.mean)} (n={est.n})"


def fmt_factor(est: Estimate) -> str:
    """A log-ratio estimate as a factor (x1.00 = equal)."""
    if est.mean is None:
        return "–"
    f = lambda v: f"x{math.exp(v):.3g}"  # noqa: E731
    return f"{f(est.mean)} [{f(est.lo)}, {f(est.hi)}]" if est.has_interval else f"{f(est.mean)} (n={est.n})"


# ------------------------------------------------------------- sub-tests over seeds, Holm's correction
#
# The seed is the unit of replication: a sub-test is one stratum of the design (one value of every
# other axis: norm, depth, warm-up, learning rate), its values are one per seed (a paired difference
# where the design pairs the two arms on the seed: same initialisation and batch order), and its
# interval and p-value use n = the number of seeds. Other axes are separate sub-tests, never
# replicates. The sub-tests of one claim are corrected together with Holm's step-down method
# (family-wise error 5%); the 95% intervals shown are the uncorrected ones.

ALPHA = 1 - LEVEL


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
    return float(2 * scipy_stats().t.sf(abs(t), est.n - 1))


def _p_one_sided(est: Estimate, null: float, greater: bool) -> float | None:
    """p of H0: mean <= null (greater=True) or mean >= null (greater=False)."""
    if est.n < 2 or est.sd is None or est.mean is None:
        return None
    if est.sd == 0:
        return 0.0 if (est.mean > null if greater else est.mean < null) else 1.0
    t = (est.mean - null) / (est.sd / math.sqrt(est.n))
    return float(scipy_stats().t.sf(t, est.n - 1) if greater else scipy_stats().t.cdf(t, est.n - 1))


def _untested_why(n: int, missing: str | None) -> str:
    if n == 1:
        return "one seed" + (f"; {missing}" if missing else "")
    return missing or "no trained cell with this measurement"


def sign_test(label: str, what: str, values: dict | Iterable, expected: int, *, missing: str | None = None,
              fmt: Callable[[Estimate], str] | None = None) -> SubTest:
    """The claim says the per-seed values are > 0 (expected +1) or < 0 (-1): a one-sample t-test."""
    xs = finite(values.values() if isinstance(values, dict) else values)
    est = estimate(xs)
    if est.n < 2:
        return SubTest(label, what, est, None, None, _untested_why(est.n, missing), fmt)
    direction = None if est.mean == 0 else (HOLDS if (est.mean > 0) == (expected > 0) else DOES_NOT_HOLD)
    return SubTest(label, what, est, _p_two_sided(est), direction, "", fmt)


def within_test(label: str, what: str, values: dict | Iterable, bound: float, *, missing: str | None = None,
                fmt: Callable[[Estimate], str] | None = None) -> SubTest:
    """The claim says the per-seed values are about 0: inside [-bound, bound] by two one-sided tests
    (holds), or outside it by a one-sided test against the nearer bound (does not hold)."""
    xs = finite(values.values() if isinstance(values, dict) else values)
    est = estimate(xs)
    if est.n < 2:
        return SubTest(label, what, est, None, None, _untested_why(est.n, missing), fmt)
    if -bound <= est.mean <= bound:
        p = max(_p_one_sided(est, -bound, True), _p_one_sided(est, bound, False))
        return SubTest(label, what, est, p, HOLDS, "", fmt)
    above = est.mean > bound
    return SubTest(label, what, est, _p_one_sided(est, bound if above else -bound, above), DOES_NOT_HOLD, "", fmt)


def fraction_test(label: str, what: str, hits_a: int, n_a: int, hits_b: int, n_b: int, expected: int) -> SubTest:
    """The claim says arm a's fraction of seeds with an outcome (e.g. trained) is above b's (expected
    +1) or below (-1): Fisher's exact test, two-sided like the t-tests beside it (3 of 3 seeds
    against 0 of 3: p = 0.1). The estimate is the difference of fractions, shown with the counts."""
    counts = f"{hits_a} of {n_a} vs {hits_b} of {n_b}"
    fmt = lambda e: f"{counts} ({e.mean * 100:+.0f} points)"  # noqa: E731
    if n_a < 1 or n_b < 1:
        return SubTest(label, what, Estimate(None, None, None, min(n_a, n_b)), None, None,
                       "an arm has no cells", fmt)
    diff = hits_a / n_a - hits_b / n_b
    est = Estimate(diff, None, None, min(n_a, n_b))
    if diff == 0:
        return SubTest(label, what, est, 1.0, None, "", fmt)
    table = [[hits_a, n_a - hits_a], [hits_b, n_b - hits_b]]
    p = float(scipy_stats().fisher_exact(table, alternative="two-sided").pvalue)
    direction = HOLDS if (diff > 0) == (expected > 0) else DOES_NOT_HOLD
    return SubTest(label, what, est, p, direction, "", fmt)


def variance_test(label: str, what: str, a: Iterable, b: Iterable, expected: int) -> SubTest:
    """The claim says a's seed-to-seed variance is below b's (expected -1) or above (+1): the F-test.
    The estimate is log(sd_a / sd_b) with its F-distribution interval."""
    xa, xb = finite(a), finite(b)
    n = min(len(xa), len(xb))
    if len(xa) < 2 or len(xb) < 2:
        return SubTest(label, what, Estimate(None, None, None, n), None, None, _untested_why(n, None), fmt_factor)
    va, vb = float(np.var(xa, ddof=1)), float(np.var(xb, ddof=1))
    if va == 0 or vb == 0:
        return SubTest(label, what, Estimate(None, None, None, n), None, None,
                       "no seed-to-seed spread in an arm", fmt_factor)
    d1, d2 = len(xa) - 1, len(xb) - 1
    r = va / vb
    lo, hi = r / scipy_stats().f.ppf(0.5 + LEVEL / 2, d1, d2), r / scipy_stats().f.ppf(0.5 - LEVEL / 2, d1, d2)
    est = Estimate(0.5 * math.log(r), 0.5 * math.log(lo), 0.5 * math.log(hi), n)
    p = float(min(1.0, 2 * min(scipy_stats().f.cdf(r, d1, d2), scipy_stats().f.sf(r, d1, d2))))
    direction = HOLDS if (r < 1) == (expected < 0) else DOES_NOT_HOLD
    return SubTest(label, what, est, p, direction, "", fmt_factor)


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
