"""The claims about the residual stream, its outliers and INT8 (shared CLAIMS.md 3, 4, 5, 7, 10,
11, 13): perturbation sensitivity over depth, hidden-state growth, massive activations,
representation collapse, the norm's effect on quantization, outliers against INT8 error and the
rotation. Each takes the trained view of the sweep and the whole sweep (``quantnorm.report.findings``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .. import results as results_file
from .evidence import Finding, arm_why, by_seed, decide, log_or_none, missing_why, norm_tests, paired, strata
from .stats import (
    NOT_TESTED,
    Estimate,
    SubTest,
    estimate,
    finite,
    fmt_factor,
    growth_fit,
    line_fit,
    sign_test,
    spearman_interval,
    within_test,
)
from .sweep import CellResult, Sweep, group_estimate, placements_in

CONSTANT_GROWTH = 1.10   # "stays constant": per-layer RMS growth factor within [1/1.1, 1.1]
PLAIN_PERTOKEN = "pertoken-fused"
ROTATED_PERTOKEN = "online-rotated-pertoken-fused"
NEAR_LOSSLESS = 0.01   # "near-lossless" W8A8: the PPL ratio within 1 +- 1%


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
    if why := missing_why(sweep, ("post", "pre")):
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
        bad = "; ".join(x for x in (arm_why(full, "post", placement="post", **where),
                                    arm_why(full, "pre", placement="pre", **where)) if " 0 of" in x
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
    if why := missing_why(sweep, ("pre", "peri")):
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
        missing = "; ".join(x for x in (arm_why(full, p, placement=p, **where) for p in ("pre", "peri"))
                            if "collapsed" in x or "diverged" in x) or None
        tests.append(sign_test(label, "largest residual max/median ratio, pre / peri",
                               paired(by_seed(pre, lambda c: log_or_none(c.max_ratio())),
                                      by_seed(peri, lambda c: log_or_none(c.max_ratio()))), +1,
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


def claim_collapse(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(7, "Deep Pre-LN stacks lose representation diversity (later layers' outputs become alike)",
                "ResiDual paper (Xie et al. 2023)", NOT_TESTED)
    if why := missing_why(sweep, ("pre",)):
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
            arm_why(full, p, placement=p, **where) for p in placements_in(full) if p != "pre"
            and full.select(placement=p, **where))
        tests.append(sign_test(label, f"pre's late-block cosine minus the mean of {', '.join(others) or 'the others'} "
                                      f"(> 0: pre's late blocks change the stream less)", paired(pre, rest), +1,
                               missing=missing))
        tests.append(sign_test(label, "slope of pre's cosine over the block index (> 0: later blocks more alike)",
                               by_seed(sweep.select(placement="pre", **where), CellResult.cosine_slope), +1,
                               missing="one block per stack, so no slope" if depth < 2 else None))
    return decide(f, tests, f"rule at depth {depth}, the deepest trained pre stack: pre's late-block cosine above the "
                            f"other placements' and rising over its blocks, paired on the seed")


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
                 norm_tests(sweep, full, "", lambda c, n=name: c.accuracy(n, "ppl_ratio"), +1)
                 if t.est.mean is not None]
        f.lines.append(f"`{name}` (reported, not a sub-test): PPL ratio RMSNorm minus LayerNorm: " + "; ".join(parts))
    tests = norm_tests(sweep, full, f"`{recipes[0]}` PPL ratio, RMSNorm minus LayerNorm (> 0: LayerNorm quantizes "
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


def claim_rotation(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(13, "Rotating the residual stream (QuaRot, SpinQuant) removes outliers and makes W8A8 near-lossless",
                "Ashkboos et al. 2024; Liu et al. 2024 (evaluated on Pre-LN Llama models)", NOT_TESTED)
    if not {PLAIN_PERTOKEN, ROTATED_PERTOKEN} <= set(full.recipes()):
        f.why = f"the sweep needs both per-token recipes: --recipes {PLAIN_PERTOKEN},{ROTATED_PERTOKEN}"
        return f
    if why := missing_why(full, ("pre", "peri")):
        f.why = why.replace("trained ", "")
        return f
    f.lines.append("a zoo model takes the rotation's online form (every Linear's input rotated by a Hadamard in the "
                   "graph, exact for every placement); the stream rotation folds Pre-RMSNorm Llama weights and is "
                   "measured on the real checkpoints (reports/real-models)")
    kl = lambda name: (lambda c: log_or_none(c.accuracy(name, "kld_mean")))  # noqa: E731
    tests = []
    for p, norm, depth, warmup, lr in strata(full.select(placement="pre") + full.select(placement="peri"),
                                             "placement", "norm", "depth", "warmup", "lr"):
        where = dict(placement=p, norm=norm, depth=depth, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip()
        cells = sweep.select(**where)
        bad = arm_why(full, p, **where)
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
