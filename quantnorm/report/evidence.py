"""How a claim of the literature is measured on a sweep: a :class:`Finding` and the tools each
claim function is built from: its verdict from sub-tests over seeds (:func:`decide`, Holm's
correction), values per seed (:func:`by_seed`, :func:`paired`), the strata of the design, the
training status of each arm, held-out tuning (:func:`held_out_best`) and the norm contrast.

Tuning (best warm-up, best learning rate) chooses on the other seeds and measures on the
held-out one, so the comparison is not biased by the choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..results import STATUS_TRAINED as TRAINED
from ..results import STATUSES
from .stats import NOT_TESTED, SubTest, combine, finite, fmt_pct, holm, sign_test
from .sweep import CellResult, Sweep


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


def missing_why(sweep: Sweep, placements: Iterable[str]) -> str | None:
    """Why a claim is not tested when placements it compares have no trained cells; None when all are there."""
    missing = _missing(sweep, placements)
    return f"no trained {' and '.join(missing)} cells in the sweep" if missing else None


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
        if finite([v]):
            out[c.seed] = float(v)
    return out


def paired(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """a - b per seed, over the seeds both have."""
    return {s: a[s] - b[s] for s in sorted(a) if s in b}


def strata(cells: Iterable[CellResult], *axes: str) -> list[tuple]:
    """The distinct values of ``axes`` among ``cells``, sorted."""
    return sorted({tuple(getattr(c, a) for a in axes) for c in cells},
                  key=lambda k: tuple((0, v) if isinstance(v, (int, float)) else (1, str(v)) for v in k))


def arm_status(full: Sweep, **where) -> str:
    """'3 of 3 seeds collapsed' etc. for one arm of the design (all cells, trained or not)."""
    cells = full.select(**where)
    if not cells:
        return "no cells"
    counts = {s: sum(c.status == s for c in cells) for s in STATUSES}
    bad = [f"{counts[s]} collapsed" if s == "collapsed" else f"{counts[s]} {s}" for s in STATUSES[1:] if counts[s]]
    return f"{counts[TRAINED]} of {len(cells)} trained" + (f", {', '.join(bad)}" if bad else "")


def arm_why(full: Sweep, label: str, **where) -> str:
    return f"{label}: {arm_status(full, **where)}"


def log_or_none(v: float | None) -> float | None:
    return math.log(v) if v is not None and finite([v]) and v > 0 else None


def held_out_best(cells: Iterable[CellResult], setting: Callable[[CellResult], tuple],
                  metric: Callable[[CellResult], float | None]) -> tuple[dict[int, float], dict[int, tuple],
                                                                          tuple | None, dict[int, float]]:
    """Tuning without the selection bias: for each seed s, the setting with the lowest mean
    ``metric`` over the *other* seeds is chosen and its value at s is kept (leave one seed out).
    Returns (held-out value per seed, setting chosen per seed, the setting best on all seeds, that
    setting's values per seed: the in-sample, optimistically biased choice)."""
    by_setting: dict[tuple, dict[int, float]] = {}
    for c in cells:
        v = metric(c)
        if finite([v]):
            by_setting.setdefault(setting(c), {})[c.seed] = float(v)
    seeds = sorted({s for t in by_setting.values() for s in t})
    held, chosen = {}, {}
    for s in seeds:
        cands = [(sum(v for k, v in t.items() if k != s) / sum(1 for k in t if k != s), st)
                 for st, t in by_setting.items() if s in t and any(k != s for k in t)]
        if cands:
            _, best = min(cands, key=lambda x: (x[0], str(x[1])))
            held[s], chosen[s] = by_setting[best][s], best
    if not by_setting:
        return held, chosen, None, {}
    best_all = min(by_setting, key=lambda st: (sum(by_setting[st].values()) / len(by_setting[st]), str(st)))
    return held, chosen, best_all, by_setting[best_all]


def norm_tests(sweep: Sweep, full: Sweep, what: str, metric: Callable[[CellResult], float | None],
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
        bad = "; ".join(x for x in (arm_why(full, n, norm=n, **where) for n in (first, second))
                        if "collapsed" in x or "diverged" in x)
        tests.append(sign_test(label, what, paired(a, b), expected, missing=bad or None,
                               fmt=fmt_pct if "%" in what else None))
    return tests


def best_rates_line(sweep: Sweep, placements: Iterable[str], **where) -> str | None:
    """'best learning rate on held-out seeds: post 0.001, pre 0.003' over the cells matching ``where``
    (trained cells: pass the trained view); None when the sweep has one rate."""
    if len(sweep.lrs) < 2:
        return None
    parts = []
    for p in placements:
        _, chosen, best, _ = held_out_best(sweep.select(placement=p, **where), lambda c: (c.lr,),
                                           lambda c: c.bits_per_byte)
        if best is not None:
            picks = sorted({v[0] for v in chosen.values()})
            parts.append(f"{p} {best[0]:g}" + (f" (held-out picks {', '.join(f'{x:g}' for x in picks)})"
                                               if len(picks) > 1 else ""))
    return ("each placement's best learning rate (lowest bits/byte, chosen on held-out seeds): " + ", ".join(parts)
            + "; each sub-test compares the arms at one rate") if parts else None
