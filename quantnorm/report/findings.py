"""The findings of a sweep: each claim of the literature (shared CLAIMS.md) as a function that
tests it on the sweep's cells, the table of those functions (:data:`CLAIMS`), and the findings
section and findings.json that present them.

A claim function takes the trained view of the sweep (every effect is computed on trained cells
only) and the whole sweep (to say which arm of the design collapsed or diverged), splits the
claim into sub-tests over seeds (quantnorm.report.stats) and returns a :class:`Finding` with its
verdict. Tuning (best warm-up, best learning rate) chooses on the other seeds and measures on the
held-out one (:func:`held_out_best`), so the comparison is not biased by the choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .. import results as results_file
from ..results import STATUS_TRAINED as TRAINED
from ..results import STATUSES
from .markdown import table
from .stats import (
    NOT_TESTED,
    Estimate,
    SubTest,
    combine,
    estimate,
    finite,
    fmt_factor,
    fmt_pct,
    growth_fit,
    holm,
    line_fit,
    sign_test,
    spearman_interval,
    variance_test,
    within_test,
)
from .sweep import CellResult, Sweep, group_estimate, placements_in

CONSTANT_GROWTH = 1.10   # "stays constant": per-layer RMS growth factor within [1/1.1, 1.1]
EVEN_FACTOR = 1.5   # "Pre-LN's gradients are even": last block's FFN gradient within x1/1.5..x1.5 of the first's
FINDINGS_FILE = "findings.md"
FINDINGS_JSON = "findings.json"


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
    if len(blocks) < 2 or not finite([blocks[0][1], blocks[-1][1]]) or blocks[0][1] <= 0 or blocks[-1][1] <= 0:
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
                                      "(> 0: larger near the output)", post, +1, fmt=fmt_factor))
        tests.append(within_test(label, f"pre: the same ratio within x{1 / EVEN_FACTOR:.2f}..x{EVEN_FACTOR:g} "
                                        f"(even)", pre, bound, fmt=fmt_factor))
    return decide(f, tests, "rule: post's last/first FFN gradient ratio > 1 and pre's within "
                            f"x{1 / EVEN_FACTOR:.2f}..x{EVEN_FACTOR:g}, one value per run and seed")


def depth_exponent(points: dict[int, float]) -> float | None:
    """Slope of log(value) over log(depth), the k of value ~ depth^k (>= 2 depths, values > 0)."""
    pts = sorted((d, v) for d, v in points.items() if d > 0 and finite([v]) and v > 0)
    if len(pts) < 2:
        return None
    return line_fit([math.log(d) for d, _ in pts], [math.log(v) for _, v in pts])[0]


def log_reference_exponent(depths: Sequence[int]) -> float | None:
    """The k a change growing as log(depth) would show over these depths (None with depth 1 in them)."""
    ds = sorted(set(depths))
    if len(ds) < 2 or ds[0] < 2:
        return None
    return depth_exponent({d: math.log(d) for d in ds})


def depth_shape(k: Estimate, ref: float | None) -> str:
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
                               paired(a, b), +1, missing=bad or None, fmt=fmt_factor))
    if len(sweep.depths) >= 2:
        ref = log_reference_exponent(sweep.depths)
        exps: dict[str, dict[tuple, dict[int, float]]] = {}
        for p in ("post", "pre"):
            series: dict[tuple, dict[int, dict[int, float]]] = {}
            for c in sweep.select(placement=p):
                v = c.logit_change(level)
                if finite([v]):
                    series.setdefault((c.norm, c.warmup, c.lr), {}).setdefault(c.seed, {})[c.depth] = v
            exps[p] = {k: {s: e for s, pts in by.items() if (e := depth_exponent(pts)) is not None}
                       for k, by in series.items()}
            for k, ks in exps[p].items():
                if ks:
                    est = estimate(ks.values())
                    f.lines.append(f"{p}{full.axes_label(norm=k[0], warmup=k[1], lr=k[2])}: change ~ depth^k over "
                                   f"depths {', '.join(map(str, sweep.depths))}, k = {est.format('.2f')} -> "
                                   f"{depth_shape(est, ref)}")
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


def claim_residual_growth(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(4, "Pre-LN hidden-state variance grows fast (exponentially) with depth; Peri-LN about linearly; "
                   "Post-LN stays constant", "Peri-LN paper (Kim et al. 2025)", NOT_TESTED)
    fit = lambda c: growth_fit([r.get("rms") for r in c.residual() if r.get("layer") != "embed"])  # noqa: E731
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
            if p == "pre":
                tests.append(sign_test(label, "residual RMS growth per block (log-linear fit)",
                                       vals("log_growth"), +1, fmt=fmt_factor))
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
                                         fmt=fmt_factor))
    if not tests:
        f.why = ("needs trained pre, peri or post cells with the outlier probe (no --no-outliers) and depth >= 3 "
                 "(3 block outputs per fit)")
        return f
    for p in ("pre", "peri", "post"):
        if not any(t.label.startswith(p + " ") for t in tests):
            f.lines.append(f"{p}: no trained cell with a fit: not tested")
    decide(f, tests, "rule: pre grows and its exponential fit is better, peri grows and its linear fit is better, "
                     f"post's growth within x{1 / CONSTANT_GROWTH:.2f}..x{CONSTANT_GROWTH:.2f} per block, over seeds "
                     "per setting")
    return f


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
                               missing=missing, fmt=fmt_factor))
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
                 for p in placements_in(sweep, [c for c in measured if c.depth == d])]
        f.lines.append(f"depth {d}: mean cosine(block output, block input) over the last half of the blocks "
                       f"(trained cells): " + ", ".join(parts))
    tests = []
    for norm, warmup, lr in strata([c for c in pre_measured if c.depth == depth], "norm", "warmup", "lr"):
        where = dict(norm=norm, depth=depth, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip() or f"L{depth}"
        pre = by_seed(sweep.select(placement="pre", **where), CellResult.late_cosine)
        others = [p for p in placements_in(sweep) if p != "pre" and sweep.select(placement=p, **where)]
        pooled: dict[int, list[float]] = {}
        for p in others:
            for s, v in by_seed(sweep.select(placement=p, **where), CellResult.late_cosine).items():
                pooled.setdefault(s, []).append(v)
        rest = {s: sum(v) / len(v) for s, v in pooled.items()}
        missing = None if others else "no other trained placement at this depth and setting: " + "; ".join(
            _arm_why(full, p, placement=p, **where) for p in placements_in(full) if p != "pre"
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
                               fmt=fmt_pct if "%" in what else None))
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


def claim_outliers_predict(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(11, "Outlier size predicts INT8 error", "Bondarenko et al. 2023; He et al. 2024", NOT_TESTED)
    recipes = sweep.recipes()
    cells = [c for c in sweep.cells if c.results is not None]
    if not any(c.max_ratio() is not None for c in cells) or not recipes:
        f.why = "needs the outlier probe (run without --no-outliers) on trained cells"
        return f

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
        f.lines.append(f"`{name}`: Spearman rho of the largest residual max/median ratio vs PPL ratio across the "
                       f"trained settings of each seed: {', '.join(shown) or '–'}")
    within: dict[str, dict[int, list[float]]] = {}
    for c in cells:
        for name, s in (results_file.section(c.results, "sqnr_summary") or {}).items():
            if finite([s.get("spearman_ratio_sqnr")]):
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
    return f


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


PLAIN_PERTOKEN = "pertoken-fused"
ROTATED_PERTOKEN = "online-rotated-pertoken-fused"
NEAR_LOSSLESS = 0.01   # "near-lossless" W8A8: the PPL ratio within 1 +- 1%


def claim_rotation(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(13, "Rotating the residual stream (QuaRot, SpinQuant) removes outliers and makes W8A8 near-lossless",
                "Ashkboos et al. 2024; Liu et al. 2024 (evaluated on Pre-LN Llama models)", NOT_TESTED)
    if not {PLAIN_PERTOKEN, ROTATED_PERTOKEN} <= set(full.recipes()):
        f.why = f"the sweep needs both per-token recipes: --recipes {PLAIN_PERTOKEN},{ROTATED_PERTOKEN}"
        return f
    if why := _missing_why(full, ("pre", "peri")):
        f.why = why.replace("trained ", "")
        return f
    f.lines.append("a zoo model takes the rotation's online form (every Linear's input rotated by a Hadamard in the "
                   "graph, exact for every placement); the stream rotation folds Pre-RMSNorm Llama weights and is "
                   "measured on the real checkpoints (reports/real-models)")
    kl = lambda name: (lambda c: _log(c.accuracy(name, "kld_mean")))  # noqa: E731
    tests = []
    for p, norm, depth, warmup, lr in strata(full.select(placement="pre") + full.select(placement="peri"),
                                             "placement", "norm", "depth", "warmup", "lr"):
        where = dict(placement=p, norm=norm, depth=depth, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip()
        cells = sweep.select(**where)
        bad = _arm_why(full, p, **where)
        missing = bad if "collapsed" in bad or "diverged" in bad else None
        tests.append(sign_test(label, f"KL mean, `{PLAIN_PERTOKEN}` / `{ROTATED_PERTOKEN}` (> x1: rotation helps)",
                               paired(by_seed(cells, kl(PLAIN_PERTOKEN)), by_seed(cells, kl(ROTATED_PERTOKEN))), +1,
                               missing=missing, fmt=fmt_factor))
        tests.append(within_test(label, f"`{ROTATED_PERTOKEN}` PPL ratio minus 1 (near-lossless: within "
                                        f"+-{NEAR_LOSSLESS:g})",
                                 by_seed(cells, lambda c: (c.accuracy(ROTATED_PERTOKEN, "ppl_ratio") or math.nan) - 1),
                                 NEAR_LOSSLESS, missing=missing))
    return decide(f, tests, f"rule: per-token W8A8's KL lower after the rotation (paired on the seed) and the rotated "
                            f"model's PPL ratio within 1 +- {NEAR_LOSSLESS:g}, per placement, norm and setting")


# The claims in CLAIMS.md's order: each takes (trained view, whole sweep) and returns its Finding.
CLAIMS: tuple[Callable[[Sweep, Sweep], Finding], ...] = (
    claim_warmup,
    claim_grad_at_init,
    claim_perturbation,
    claim_residual_growth,
    claim_massive,
    claim_peri_vs_pre,
    claim_collapse,
    claim_deepnorm,
    claim_rms_speed,
    claim_layer_friendlier,
    claim_outliers_predict,
    claim_post_best,
    claim_rotation,
)


def findings(sweep: Sweep) -> list[Finding]:
    """The findings of every claim in :data:`CLAIMS`. Effects are computed on the trained cells only;
    the claims that read training outcomes (1, 8) also see the collapsed and diverged cells to say
    which arm failed."""
    trained = sweep.trained_view()
    return [claim(trained, sweep) for claim in CLAIMS]


def tuned_comparison(sweep: Sweep) -> list[dict]:
    """Placements at their own best learning rate, per (norm, depth, warm-up): for each seed the rate
    is chosen on the other seeds and the held-out seed's bits/byte is kept (:func:`held_out_best`).
    Trained cells only (pass the trained view)."""
    out = []
    bpb = lambda c: c.bits_per_byte  # noqa: E731
    for norm, depth, warmup in strata(sweep.cells, "norm", "depth", "warmup"):
        rows = []
        for p in placements_in(sweep, sweep.select(norm=norm, depth=depth, warmup=warmup)):
            held, chosen, best, insample = held_out_best(sweep.select(placement=p, norm=norm, depth=depth,
                                                                      warmup=warmup), lambda c: c.lr, bpb)
            rows.append({"placement": p, "best_lr": best, "chosen": chosen, "held_out": held,
                         "held_out_est": estimate(held.values()), "in_sample_est": estimate(insample.values())})
        out.append({"norm": norm, "depth": depth, "warmup": warmup, "rows": rows})
    return out



# which plot of make_plots (by title) illustrates which claim
CLAIM_PLOTS = {3: ("Perturbation sensitivity per depth",), 4: ("Residual-stream RMS per layer",),
               7: ("Cosine similarity of block output and input",)}


def findings_section(sweep: Sweep, plots: dict[str, str] | None = None,
                     found: list[Finding] | None = None) -> list[str]:
    """The Markdown lines of the findings section (``## Findings``): which cells are left out, one
    subsection per claim, a summary line and the table of the thirteen verdicts. ``plots`` (title ->
    path relative to the sweep directory, as quantnorm.report.comparison.make_plots returns them)
    adds the pictures to the claims they illustrate."""
    found = found if found is not None else findings(sweep)
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
    L += table(["#", "claim", "verdict", "why"],
                [[x.number, x.claim, f"**{x.verdict}**", x.why.replace("|", "/")] for x in found]) + [""]
    return L


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
