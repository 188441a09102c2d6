"""The claims about training (shared CLAIMS.md 1, 2, 6, 8, 9, 12): warm-up, gradients at
initialization, Peri-LN against Pre-LN, DeepNorm's depth, RMSNorm's speed, a tuned Post-LN.
Each takes the trained view of the sweep and the whole sweep (``quantnorm.report.findings``)."""

from __future__ import annotations

import math

from .evidence import (
    Finding,
    arm_status,
    arm_why,
    best_rates_line,
    by_seed,
    decide,
    held_out_best,
    log_or_none,
    missing_why,
    norm_tests,
    paired,
    strata,
)
from .stats import NOT_TESTED, estimate, finite, fmt_factor, fraction_test, sign_test, variance_test, within_test
from .sweep import CellResult, Sweep

EVEN_FACTOR = 1.5   # "Pre-LN's gradients are even": last block's FFN gradient within x1/1.5..x1.5 of the first's


def claim_warmup(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(1, "Post-LN needs learning-rate warm-up; Pre-LN trains without it", "Xiong et al. 2020", NOT_TESTED)
    if 0 not in full.warmups or len(full.warmups) < 2:
        f.why = "the sweep has no warm-up axis with 0 and a positive value: run with --warmups 0,30"
        return f
    if why := missing_why(full, ("post", "pre")):
        f.why = why
        return f
    w = max(full.warmups)
    bpb = lambda c: c.bits_per_byte  # noqa: E731
    if line := best_rates_line(sweep, ("post", "pre"), warmup=w, depth=min(full.depths)):
        f.lines.append(line)
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
                whys.append(arm_why(full, f"{p} w{wu}", **where))
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
    if why := missing_why(sweep, ("post", "pre")):
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


def claim_peri_vs_pre(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(6, "Peri-LN reaches lower loss with fewer gradient spikes and less seed-to-seed variance than Pre-LN",
                "Peri-LN paper", NOT_TESTED)
    if why := missing_why(sweep, ("pre", "peri")):
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
        missing = "; ".join(x for x in (arm_why(full, p, placement=p, **where) for p in ("pre", "peri"))
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


def claim_deepnorm(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(8, "DeepNorm trains much deeper stacks stably", "DeepNet (Wang et al. 2022)", NOT_TESTED)
    if len(full.depths) < 2:
        f.why = "the sweep has no depth axis: run with --depths 2,8 (or deeper)"
        return f
    if why := missing_why(full, ("deepnorm", "post")):
        f.why = why.replace("trained ", "")
        return f
    for d in full.depths:
        f.lines.append(f"depth {d}: deepnorm {arm_status(full, placement='deepnorm', depth=d)}; post "
                       f"{arm_status(full, placement='post', depth=d)}")
    d = max(full.depths)
    if line := best_rates_line(sweep, ("deepnorm", "post"), depth=d):
        f.lines.append(line)
    tests = []
    for norm, warmup, lr in strata(full.select(placement="deepnorm", depth=d) + full.select(placement="post", depth=d),
                                   "norm", "warmup", "lr"):
        where = dict(norm=norm, depth=d, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip() or f"L{d}"
        arms = {p: full.select(placement=p, **where) for p in ("deepnorm", "post")}
        if all(cells and all(c.trained for c in cells) for cells in arms.values()):
            tests.append(sign_test(label, "eval bits/byte, deepnorm minus post", paired(
                by_seed(sweep.select(placement="deepnorm", **where), lambda c: c.bits_per_byte),
                by_seed(sweep.select(placement="post", **where), lambda c: c.bits_per_byte)), -1))
        else:   # a collapsed or diverged arm: its loss says nothing, whether its seeds trained says it all
            trained = {p: (sum(c.trained for c in cells), len(cells)) for p, cells in arms.items()}
            tests.append(fraction_test(label, "seeds trained, deepnorm vs post", *trained["deepnorm"],
                                       *trained["post"], +1))
    return decide(f, tests, f"rule at depth {d}, the deepest: where both arms trained in every seed, deepnorm's "
                            f"bits/byte below post's, paired on the seed; elsewhere more deepnorm seeds trained "
                            f"than post seeds (Fisher's exact test)")


def claim_rms_speed(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(9, "RMSNorm is faster than LayerNorm (7-64% reported); optimized LayerNorm closes the gap",
                "Zhang & Sennrich 2019; Costello et al. 2025", NOT_TESTED)
    if {c.norm for c in full.cells} < {"layer", "rms"}:
        f.why = "the sweep needs both norms: --norms layer,rms"
        return f
    log_tps = lambda c: log_or_none(c.train.get("tokens_per_s"))  # noqa: E731
    tests = norm_tests(sweep, full, "training tokens/s, RMSNorm vs LayerNorm (%)", log_tps, +1)
    tests += norm_tests(sweep, full, "ONNX Runtime FP32 p50 (CPU, largest batch), LayerNorm vs RMSNorm (%; > 0: "
                                      "RMSNorm faster)", lambda c: log_or_none(c.fp32_p50()[0]), +1, "layer", "rms")
    f.lines.append("the second half (optimized LayerNorm closes the gap) needs native vs decomposed norm kernels: "
                   "benchmarks/, not this sweep")
    jobs = (sweep.manifest or {}).get("jobs")
    if jobs and jobs > 1:
        for t in tests:   # two processes on one CPU: a timing measures the neighbour as much as the model
            t.p, t.direction, t.why = None, None, f"cells were timed {jobs} at a time, sharing the CPU"
    return decide(f, tests, "rule: RMSNorm faster in training throughput and in ONNX Runtime latency, paired on "
                            "the seed, per placement and depth")


def claim_post_best(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(12, "Post-LN, trained well, can end with better accuracy than Pre-LN", "seed articles", NOT_TESTED)
    if why := missing_why(full, ("post", "pre")):
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
