"""The twelve claim verdicts of the sweep findings on synthetic inputs, and `quantnorm findings`.

All numbers here are fabricated test data.

tests/test_compare.py checks the statistics, the shared verdict rules and a whole synthetic sweep
that agrees (or not) with the literature. Here every claim gets its own small synthetic sweep per
verdict -- holds here, does not hold here, not significant, not tested -- built in memory as
CellResult objects (no files, no training), so each rule is pinned to the numbers it reads. The
CLI test writes cell directories the loader reads (results.json with ``diagnostics``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quantnorm.cli import main
from quantnorm.report.findings import (
    FINDINGS_FILE,
    depth_exponent,
    depth_shape,
    findings,
    findings_section,
    held_out_best,
    log_reference_exponent,
)
from quantnorm.report.stats import (
    DOES_NOT_HOLD,
    HOLDS,
    NOT_SIGNIFICANT,
    NOT_TESTED,
    estimate,
    holm,
    sign_test,
    within_test,
)
from quantnorm.report.sweep import (
    CellResult,
    Sweep,
    load_sweep,
)

JITTER = (0.0, 0.01, -0.01)   # per seed: three seeds, mean unchanged, a small spread
SEEDS = range(3)
RECIPE = "static-minmax-matmul"


def cell(placement: str, norm: str = "rms", seed: int = 0, *, depth: int = 4, warmup: int = 30, bpb: float = 3.0,
         diverged: bool = False, spikes: int = 0, tokens_per_s: float = 1000.0, fp32_ms: float = 10.0,
         ppl_ratio: float = 1.01, rms: list[float] | None = None, ratio: float | None = 5.0, massive: int = 0,
         grad0: dict | None = None, perturbation: dict[float, float] | None = None,
         cosine: list[float] | None = None, status: str | None = None, grad_ffn: dict | None = None,
         lr: float = 3e-3, extra_recipes: list[dict] | None = None) -> CellResult:
    """A finished (or diverged) cell with just the numbers the findings read; ``ratio`` None means
    no outlier probe."""
    name = f"{placement}-{norm}-L{depth}-w{warmup}-seed{seed}"
    train = {"eval_bits_per_byte": None if diverged else bpb, "diverged": diverged, "gradient_spikes": spikes,
             "tokens_per_s": tokens_per_s, "config": {"lr": lr, "warmup": warmup, "seed": seed}}
    results = None
    if not diverged:
        results = {
            "recipes": [{"name": RECIPE, "accuracy": {"ppl_ratio": ppl_ratio}}, *(extra_recipes or [])],
            "latency": [{"provider": "CPUExecutionProvider", "variant": v, "batch": 8, "status": "measured",
                         "p50_ms": fp32_ms} for v in ("fp32", RECIPE)],
        }
        if ratio is not None:
            rms = rms or [1.0] * (depth + 1)
            results["outliers"] = {
                "residual": [{"layer": lay, "ratio": ratio, "kurtosis": ratio / 2, "rms": r}
                             for lay, r in zip(["embed", *range(depth)], rms, strict=True)],
                "massive": [{"layer": depth - 1}] * massive}
    rows = None if perturbation is None else [
        {"relative_noise": k, "relative_logit_change": v, "std": 0.0, "repeats": 3} for k, v in perturbation.items()]
    return CellResult(name, Path(name), placement, norm, depth, warmup, seed, diverged, train, results, grad0,
                      perturbation=None if diverged else rows, block_cosine=None if diverged else cosine,
                      status=status, grad_ffn0=grad_ffn)


def sweep(cells: list[CellResult], jobs: int | None = None) -> Sweep:
    return Sweep(Path("synthetic"), cells, {"jobs": jobs} if jobs else None)


def verdict(s: Sweep, number: int):
    found = {f.number: f for f in findings(s)}
    assert len(found) == 15
    return found[number]


# --------------------------------------------------------------------------- shared rules


def test_holm_step_down_by_hand():
    tests = [sign_test("a", "x", [1.0, 1.1, 0.9], +1), sign_test("b", "x", [1.0, 1.5, 0.5], +1),
             sign_test("c", "x", [0.1], +1)]
    for t, p in zip(tests[:2], (0.01, 0.04), strict=True):
        t.p = p
    holm(tests)
    # m = 2 tested: 0.01 * 2 = 0.02; max(0.02, 0.04 * 1) = 0.04
    assert tests[0].p_holm == pytest.approx(0.02) and tests[1].p_holm == pytest.approx(0.04)
    assert tests[0].verdict == tests[1].verdict == HOLDS
    assert tests[2].verdict == NOT_TESTED and tests[2].why == "one seed"   # one seed: no interval, not tested
    tests[1].p = 0.03
    tests.append(sign_test("d", "x", [1.0, 1.1, 0.9], +1))
    tests[3].p = 0.02
    holm(tests)   # 0.01*3 = 0.03, 0.02*2 = 0.04, max(0.04, 0.03) = 0.04 -> all below 0.05
    assert [t.verdict for t in tests] == [HOLDS, HOLDS, NOT_TESTED, HOLDS]
    tests[0].p, tests[3].p = 0.02, 0.04    # 0.06 -> nothing survives
    holm(tests)
    assert {t.verdict for t in tests[:2] + tests[3:]} == {NOT_SIGNIFICANT}


def test_sign_and_within_tests():
    assert sign_test("s", "x", [-0.5, -0.6, -0.4], +1).direction == DOES_NOT_HOLD
    t = within_test("s", "x", [0.01, 0.0, -0.01], 0.1)
    assert t.direction == HOLDS and t.p < 0.01
    t = within_test("s", "x", [0.5, 0.6, 0.55], 0.1)
    assert t.direction == DOES_NOT_HOLD and t.p < 0.05


def test_held_out_best_chooses_on_the_other_seeds():
    # setting A is best on seeds 0 and 1; B is best only at seed 2 (luck)
    cells = [cell("pre", seed=s, warmup=w, bpb=v) for w, vals in ((0, (2.0, 2.0, 2.4)), (30, (2.5, 2.5, 2.1)))
             for s, v in enumerate(vals)]
    held, chosen, best, insample = held_out_best(cells, lambda c: c.warmup, lambda c: c.bits_per_byte)
    assert chosen == {0: 0, 1: 0, 2: 0}     # at seed 2 the choice is made on seeds 0 and 1: A, not B's lucky 2.1
    assert held == {0: 2.0, 1: 2.0, 2: 2.4} and best == 0 and insample == held
    one = held_out_best([cell("pre", seed=0)], lambda c: c.warmup, lambda c: c.bits_per_byte)
    assert one[0] == {}                      # one seed: nothing to choose on


def test_a_collapsed_cell_is_left_out_of_every_effect_and_named():
    cells = []
    for p in ("pre", "post"):
        for seed in SEEDS:
            j = JITTER[seed] / 10
            cells.append(cell(p, "layer", seed, ppl_ratio=1.01 + j))
            cells.append(cell(p, "rms", seed, ppl_ratio=1.02 + j))        # rms loses 0.01: holds
    planted = cell("pre", "rms", 2, ppl_ratio=0.90, bpb=4.69, status="collapsed")   # would flip the effect
    cells = [c for c in cells if c.name != planted.name] + [planted]
    s = sweep(cells)
    f = verdict(s, 10)
    pre = next(t for t in f.tests if t.label.startswith("pre"))
    assert pre.est.n == 2 and pre.est.mean == pytest.approx(0.01)           # seeds 0 and 1 only
    assert f.verdict == HOLDS
    text = "\n".join(findings_section(s))
    assert "1 of 12 cells did not train" in text and "`pre-rms-L4-w30-seed2` (collapsed)" in text
    assert s.not_trained == [planted]


# --------------------------------------------------------------------------- claim 1: warm-up


def _warmup_sweep(case: str) -> Sweep:
    cells = []
    for p in ("post", "pre"):
        for seed in SEEDS:
            j = JITTER[seed]
            for w in ((30,) if case == "untested" else (0, 30)):
                bpb, status = 3.0 + j, None
                if p == "post" and w == 0:
                    bpb = {"holds": 3.5 + 2 * j, "fails": 2.8 + 2 * j, "unclear": 3.0 + (0.1, -0.1, 0.05)[seed],
                           "untested": 3.0, "collapsed": 3.5}[case]
                if case == "collapsed" and p == "post" and w == 30:
                    bpb, status = 4.69, "collapsed"
                cells.append(cell(p, seed=seed, warmup=w, bpb=bpb, status=status))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD), ("unclear", NOT_SIGNIFICANT),
                                            ("untested", NOT_TESTED), ("collapsed", NOT_TESTED)])
def test_claim1_warmup(case, expected):
    f = verdict(_warmup_sweep(case), 1)
    assert f.verdict == expected
    if case == "untested":
        assert "--warmups" in f.why
    if case == "collapsed":
        assert "post w30: 0 of 3 trained, 3 collapsed" in f.why
    if case == "holds":
        assert "Holm's correction over 2 sub-tests" in f.why


# ----------------------------------------------------------------------- claim 2: gradients at init


def _grad_sweep(case: str, warmups=(30,)) -> Sweep:
    cells = []
    for p in ("post", "pre"):
        for seed in SEEDS:
            j = JITTER[seed]
            last = 1.0 + j
            if p == "post":
                last = {"holds": 8.0 * (1 + j), "fails": 0.25 * (1 + j), "unclear": (1.2, 0.8, 1.1)[seed],
                        "untested": 1.0, "blocks": 1.0}[case]
            ffn = {"block0": 1.0, "block1": 1.0, "block2": 1.0, "block3": last}
            for w in warmups:
                cells.append(cell(p, seed=seed, warmup=w, grad_ffn=None if case in ("untested", "blocks") else ffn,
                                  grad0={"block0": 1.0, "block3": 2.0} if case == "blocks" else None))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED),
                                            ("blocks", NOT_TESTED)])
def test_claim2_ffn_gradients_at_init_both_halves(case, expected):
    f = verdict(_grad_sweep(case), 2)
    assert f.verdict == expected
    if case == "untested":
        assert "train_log.jsonl" in f.why and "grad_norm_ffn_per_layer" in f.why
    if case == "blocks":
        assert "not the FFN weights" in f.why
    if case == "holds":
        assert len(f.tests) == 2 and "pre: the same ratio within x0.67..x1.5 (even)" in f.tests[1].what
        assert f.tests[0].verdict == HOLDS and f.tests[1].verdict == HOLDS


def test_claim2_counts_each_run_once():
    # warm-up 0 and 30 cells share the step-0 gradient: one value per seed, n = 3, not 6
    f = verdict(_grad_sweep("holds", warmups=(0, 30)), 2)
    assert [t.est.n for t in f.tests] == [3, 3]


# ------------------------------------------------------------------ claim 3: perturbation sensitivity


def _perturbation_sweep(case: str, depths=(4,)) -> Sweep:
    cells = []
    for p in ("post", "pre"):
        for seed in SEEDS:
            j = JITTER[seed]
            for d in depths:
                base = 0.01 * (1 + j)
                if case in ("holds", "collapsed") and p == "post":
                    base *= 5 * (1 + j)
                if case == "fails" and p == "pre":
                    base *= 5 * (1 + j)
                if case == "unclear" and p == "post":
                    base *= (1.1, 0.9, 1.05)[seed]
                if case == "depth":   # post ~ N, pre ~ log N; the exponent differs a little per seed
                    e = (0.0, 0.02, -0.02)[seed]
                    base = 0.01 * (d if p == "post" else math.log(d)) * d ** e
                pert = None if case == "untested" else {1e-3: base, 1e-2: 10 * base}
                cells.append(cell(p, seed=seed, depth=d, perturbation=pert))
                if case == "collapsed" and p == "post":   # a collapsed arm at warm-up 0: its pairs are left out
                    cells.append(cell(p, seed=seed, depth=d, warmup=0, bpb=4.69, status="collapsed",
                                      perturbation={1e-3: 1e-6, 1e-2: 1e-5}))
                if case == "collapsed" and p == "pre":
                    cells.append(cell(p, seed=seed, depth=d, warmup=0, perturbation=pert))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD), ("unclear", NOT_SIGNIFICANT),
                                            ("untested", NOT_TESTED), ("collapsed", HOLDS)])
def test_claim3_perturbation_on_trained_pairs(case, expected):
    f = verdict(_perturbation_sweep(case), 3)
    assert f.verdict == expected
    if case == "untested":
        assert f.why.startswith("results.json holds no")
    else:
        assert "noise 0.001" in f.why and "no depth axis" in f.why
    if case == "holds":
        assert "x5 [" in f.tests[0].line()
    if case == "collapsed":
        w0 = next(t for t in f.tests if "w0" in t.label)
        assert w0.verdict == NOT_TESTED and "collapsed" in w0.why


def test_claim3_depth_axis_tells_linear_from_logarithmic_growth():
    f = verdict(_perturbation_sweep("depth", depths=(2, 4, 8)), 3)
    assert f.verdict == HOLDS                          # post's change is larger at every depth
    text = "\n".join(f.lines)
    assert "about linear in depth, O(N)" in text and "about logarithmic in depth, O(log N)" in text
    assert "post's depth exponent k minus pre's" in text and "no depth axis" not in f.why


def test_depth_exponent_and_its_words():
    assert depth_exponent({2: 0.02, 4: 0.04, 8: 0.08}) == pytest.approx(1.0)
    assert depth_exponent({2: 0.02}) is None and depth_exponent({2: 0.0, 4: 1.0}) is None
    ref = log_reference_exponent([2, 4, 8])
    assert 0.7 < ref < 0.9 and log_reference_exponent([1, 4]) is None
    assert depth_exponent({d: math.log(d) for d in (2, 4, 8)}) == pytest.approx(ref)
    assert depth_shape(estimate([0.99, 1.0, 1.01]), ref) == "about linear in depth, O(N)"
    assert depth_shape(estimate([ref - 0.01, ref, ref + 0.01]), ref) == "about logarithmic in depth, O(log N)"
    assert depth_shape(estimate([0.5, 1.0, 1.2]), ref) == "linear and logarithmic growth not told apart"
    assert depth_shape(estimate([1.5, 1.6, 1.7]), ref) == "grows faster than linearly"
    assert depth_shape(estimate([-0.5, -0.4, -0.3]), ref) == "shrinks with depth"
    assert depth_shape(estimate([1.0]), ref) == "one series: no interval"


# ------------------------------------------------------------------------ claim 4: residual growth
# (holds / does not hold: tests/test_compare.py's literature sweeps)


@pytest.mark.parametrize("case, expected", [("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim4_residual_growth(case, expected):
    cells = []
    for seed in SEEDS:
        g = (1.05, 1.10, 1.15)[seed]                   # post's growth per block straddles the x1.1 bound
        cells.append(cell("post", seed=seed, rms=[0.05, *(g ** i for i in range(4))],
                          ratio=None if case == "untested" else 5.0))
    f = verdict(sweep(cells), 4)
    assert f.verdict == expected
    if case == "unclear":
        assert "pre: no trained cell with a fit: not tested" in f.lines


# ---------------------------------------------------------------------- claim 5: massive activations


def _massive_sweep(case: str) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        pre_ratio, pre_massive = {"holds": (400 * (1 + j), 3 + seed), "none": (400 * (1 + j), 0),
                                  "fails": (5 * (1 + j), 0), "unclear": ((9.0, 10.0, 30.0)[seed], (1, 0, 0)[seed]),
                                  "untested": (400.0, 3)}[case]
        cells.append(cell("pre", seed=seed, ratio=pre_ratio, massive=pre_massive))
        if case != "untested":
            cells.append(cell("peri", seed=seed, ratio=(10.0, 11.0, 12.0)[seed]))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("none", NOT_SIGNIFICANT), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim5_ratio_and_massive_test_over_seeds(case, expected):
    f = verdict(_massive_sweep(case), 5)
    assert f.verdict == expected
    if case == "none":   # scale alone no longer decides: the ratio half holds, the massive half is not significant
        assert [t.verdict for t in f.tests] == [HOLDS, NOT_SIGNIFICANT]
        assert "no pre or peri cell has a massive activation" in f.why


# --------------------------------------------------------------------------- claim 6: Peri vs Pre


def _peri_sweep(case: str, seeds=SEEDS) -> Sweep:
    cells = []
    for seed in seeds:
        j = JITTER[seed]
        cells.append(cell("pre", seed=seed, bpb=2.8 + 10 * j, spikes=3 + seed))
        if case != "untested":
            peri = {"holds": 2.0 + 0.1 * j, "fails": 3.5 + 0.1 * j, "unclear": 2.8 + j + (0.05, -0.05, 0.01)[seed]}[case]
            cells.append(cell("peri", seed=seed, bpb=peri, spikes=0 if case == "holds" else 3 + seed))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim6_loss_spikes_and_variance(case, expected):
    f = verdict(_peri_sweep(case), 6)
    assert f.verdict == expected
    if case == "holds":
        assert [t.what.split(",")[0] for t in f.tests] == ["eval bits/byte", "gradient spikes",
                                                          "seed-to-seed sd of bits/byte"]
        assert all(t.verdict == HOLDS for t in f.tests)
        assert "Holm's correction over 3 sub-tests" in f.why


def test_one_seed_gives_no_interval_and_not_tested():
    f = verdict(_peri_sweep("holds", seeds=(0,)), 6)
    assert f.verdict == NOT_TESTED and "one seed" in f.why
    assert "(n=1)" in f.tests[0].line()


# ---------------------------------------------------------------------- claim 7: representation collapse


def _collapse_sweep(case: str, depths=(4,)) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        for d in depths:
            rising = [0.95 - 0.45 * (d - 1 - i) / max(1, d - 1) + j * (1 + i) for i in range(d)]   # 0.5 -> 0.95
            flat = [0.5 + j] * d
            falling = [0.8 - 0.1 * i / max(1, d - 1) + j for i in range(d)]
            if case in ("holds", "deep"):
                pre, post, peri = rising, flat, [0.6 + j] * d
            elif case == "fails":
                pre, post, peri = [0.4 + j + 0.01 * j * i for i in range(d)], falling, falling
            else:                                       # pre = others, with a slope across zero
                tilt = (0.01, -0.01, 0.005)[seed]
                pre, post, peri = [0.5 + tilt * i for i in range(d)], [0.5 + (0.01, -0.01, 0.0)[seed]] * d, flat
            if case == "untested":
                pre = post = peri = None
            for p, cos in (("pre", pre), ("post", post), ("peri", peri)):
                cells.append(cell(p, seed=seed, depth=d, cosine=cos))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim7_representation_collapse(case, expected):
    f = verdict(_collapse_sweep(case), 7)
    assert f.verdict == expected
    if case == "untested":
        assert f.why.startswith("results.json holds no similarity")
    else:
        assert "pre's late-block cosine minus the mean of post, peri" in "\n".join(f.lines)


def test_claim7_uses_the_deepest_stack_and_reports_each_depth():
    f = verdict(_collapse_sweep("deep", depths=(2, 8)), 7)
    assert f.verdict == HOLDS and "depth 8, the deepest" in f.why
    assert f.lines[0].startswith("depth 2:") and f.lines[1].startswith("depth 8:")


def test_claim7_without_other_placements_tests_only_the_slope_and_says_so():
    s = sweep([c for c in _collapse_sweep("holds").cells if c.placement == "pre"])
    f = verdict(s, 7)
    assert f.tests[0].verdict == NOT_TESTED and "no other trained placement" in f.tests[0].why
    assert f.verdict == HOLDS and "1 of 2 sub-tests not tested" in f.why


# --------------------------------------------------------------------------------- claim 8: DeepNorm


def _deepnorm_sweep(case: str) -> Sweep:
    cells = []
    for p in ("post", "deepnorm"):
        if case == "untested" and p == "deepnorm":
            continue
        for seed in SEEDS:
            j = JITTER[seed]
            for d in (2, 8):
                bpb = 3.0 + j + {"holds": -0.3 + j, "fails": 0.3 + j, "unclear": 0.1 * (0.5, -0.5, 0.2)[seed],
                                 "untested": 0.0, "collapsed": 0.0}[case] * (p == "deepnorm")
                status = "collapsed" if case == "collapsed" and d == 8 else None
                cells.append(cell(p, seed=seed, depth=d, bpb=4.69 if status else bpb, status=status))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD), ("unclear", NOT_SIGNIFICANT),
                                            ("untested", NOT_TESTED), ("collapsed", NOT_SIGNIFICANT)])
def test_claim8_deepnorm(case, expected):
    f = verdict(_deepnorm_sweep(case), 8)
    assert f.verdict == expected
    if case == "untested":
        assert "deepnorm" in f.why
    if case == "collapsed":   # both arms collapsed: as many seeds trained in each, a tested non-difference
        assert "depth 8: deepnorm 0 of 3 trained, 3 collapsed" in f.lines[1]
        assert f.tests[0].what == "seeds trained, deepnorm vs post" and f.tests[0].p == 1.0
        assert "0 of 3 vs 0 of 3" in f.tests[0].line()


@pytest.mark.parametrize("seeds, trained, expected, p", [
    (3, ("deepnorm",), NOT_SIGNIFICANT, 0.1),      # 3 of 3 vs 0 of 3: Fisher's exact p = 0.1
    (6, ("deepnorm",), HOLDS, 0.0022),              # 6 of 6 vs 0 of 6
    (6, ("post",), DOES_NOT_HOLD, 0.0022),          # post trains, deepnorm collapses
])
def test_claim8_where_an_arm_collapsed_counts_the_seeds_that_trained(seeds, trained, expected, p):
    cells = [cell(pl, "layer", seed=s, depth=d, bpb=3.0 + 0.01 * s,
                  status=None if d == 4 or pl in trained else "collapsed")
             for pl in ("post", "deepnorm") for s in range(seeds) for d in (4, 8)]
    f = verdict(sweep(cells), 8)
    assert f.verdict == expected, f.lines
    (t,) = f.tests
    assert t.what == "seeds trained, deepnorm vs post" and t.p == pytest.approx(p, abs=1e-4)
    won, lost = (seeds, 0) if trained == ("deepnorm",) else (0, seeds)
    assert f"{won} of {seeds} vs {lost} of {seeds}" in t.line() and "Fisher" in f.why


# ----------------------------------------------------------------------------- claim 9: RMSNorm speed


def _speed_sweep(case: str, jobs: int | None = None) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        cells.append(cell("pre", "rms", seed, tokens_per_s=1000 * (1 + j) * {
            "holds": 1.1 + j, "fails": 0.9 + j, "unclear": (1.05, 0.95, 1.01)[seed], "untested": 1.0}[case],
            fp32_ms=9.0 * (1 + j)))
        if case != "untested":
            cells.append(cell("pre", "layer", seed, tokens_per_s=1000 * (1 + j), fp32_ms=10.0))
    return sweep(cells, jobs)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim9_rms_speed(case, expected):
    f = verdict(_speed_sweep(case), 9)
    assert f.verdict == expected   # "fails": slower in training decides, though faster in ONNX Runtime
    if case == "holds":
        assert "+10.0% [" in f.tests[0].line() and "+11.1% [" in f.tests[1].line()   # 10 ms / 9 ms


def test_claim9_cells_timed_concurrently_are_not_a_speed_test():
    f = verdict(_speed_sweep("holds", jobs=2), 9)
    assert f.verdict == NOT_TESTED and "timed 2 at a time" in f.why
    assert "+10.0% [" in f.tests[0].line()    # the numbers are still shown


# ------------------------------------------------------------------ claim 10: LayerNorm quantizes better


def _friendly_sweep(case: str) -> Sweep:
    cells = []
    for p in ("pre", "post"):
        for seed in SEEDS:
            j = JITTER[seed] / 10
            rms = 1.01 + 2 * j + {"holds": 0.01, "fails": -0.005, "unclear": (0.002, -0.002, 0.001)[seed],
                                  "untested": 0.0}[case]
            cells.append(cell(p, "rms", seed, ppl_ratio=rms))
            if case != "untested":
                cells.append(cell(p, "layer", seed, ppl_ratio=1.01 + j))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim10_layernorm_friendlier(case, expected):
    f = verdict(_friendly_sweep(case), 10)
    assert f.verdict == expected
    if case == "untested":
        assert "--norms layer,rms" in f.why
    else:
        assert [t.label for t in f.tests] == ["post", "pre"]    # one sub-test per placement, n = seeds


# --------------------------------------------------------------------- claim 11: outliers predict error


def _outlier_sweep(case: str, seeds=SEEDS) -> Sweep:
    ratios = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0]
    cells = []
    for seed in seeds:
        noise = [0.001 * ((i * (seed + 3)) % 5) for i in range(8)]
        ppl = {"holds": [1.0 + r / 1000 + e for r, e in zip(ratios, noise, strict=True)],
               "fails": [1.1 - r / 1000 + e for r, e in zip(ratios, noise, strict=True)],
               "unclear": [[1.03, 1.01, 1.05, 1.02, 1.02, 1.06, 1.01, 1.03], [1.01, 1.03, 1.01, 1.06, 1.02, 1.01,
                                                                              1.04, 1.01],
                           [1.05, 1.02, 1.01, 1.01, 1.04, 1.02, 1.03, 1.0]][seed],
               "untested": [1.01] * 8}[case]
        # one seed's cells are the settings (here: depths) of the sweep
        cells += [cell("pre", seed=seed, depth=d + 1, ratio=None if case == "untested" else r, ppl_ratio=q)
                  for d, (r, q) in enumerate(zip(ratios, ppl, strict=True))]
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD), ("unclear", NOT_SIGNIFICANT),
                                            ("untested", NOT_TESTED)])
def test_claim11_outliers_predict_int8_error_per_seed(case, expected):
    f = verdict(_outlier_sweep(case), 11)
    assert f.verdict == expected
    if case == "holds":
        assert f.tests[0].est.n == 3     # one rank correlation per seed


def test_claim11_one_seed_is_not_tested():
    f = verdict(_outlier_sweep("holds", seeds=(0,)), 11)
    assert f.verdict == NOT_TESTED and "one seed" in f.why


# ----------------------------------------------------------------------- claim 12: Post-LN can be best


def _best_sweep(case: str) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        post = {"holds": 2.5 + 2 * j, "fails": 3.0 + 2 * j, "unclear": 2.8 + (0.1, -0.1, 0.05)[seed],
                "untested": 2.5}[case]
        cells.append(cell("post", seed=seed, bpb=post, diverged=case == "untested"))
        cells.append(cell("post", seed=seed, warmup=0, bpb=3.5 + j))          # a worse warm-up setting
        cells.append(cell("pre", seed=seed, bpb=2.8 + j))
        cells.append(cell("post", "layer", seed, bpb=2.0 + j))                # another norm: never paired with rms
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT)])
def test_claim12_same_norm_pairs_tuned_on_held_out_seeds(case, expected):
    f = verdict(_best_sweep(case), 12)
    assert f.verdict == expected
    assert [t.label for t in f.tests] == ["layer", "rms"]
    assert f.tests[0].verdict == NOT_TESTED and "pre: no trained cell" in f.tests[0].why   # no pre/layer cells
    if case == "holds":
        assert "best on all seeds: post w30, pre w30" in "\n".join(f.lines)


def test_claim12_untested_when_every_post_cell_diverged():
    f = verdict(_best_sweep("untested"), 12)
    assert f.tests[1].verdict == NOT_TESTED or f.tests[1].est.n == 3   # post w0 still trained
    cells = [c for c in _best_sweep("untested").cells if not (c.placement == "post" and c.warmup == 0)]
    f = verdict(sweep(cells), 12)
    assert f.verdict == NOT_TESTED and "post: no trained cell" in f.why


# ----------------------------------------------------------------------------- section and command


def test_findings_section_has_every_claim_and_a_verdict_table():
    text = "\n".join(findings_section(_perturbation_sweep("holds"), {"Perturbation sensitivity per depth": "plots/x.png"}))
    assert text.startswith("## Findings")
    for n in range(1, 16):
        assert f"### Claim {n}:" in text and f"claim {n}: " in text
    assert "| # | claim | verdict | why |" in text
    assert "| 3 | Post-LN amplifies" in text and "**holds here**" in text
    assert "![Perturbation sensitivity per depth](plots/x.png)" in text


def _results(placement: str, seed: int, change: float, cosine: list[float]) -> dict:
    return {
        "schema_version": 1, "hardware": {}, "recipes": [], "latency": [],
        "model": {"placement": placement, "norm": "rms", "n_layers": len(cosine)},
        "train": {"eval_bits_per_byte": 3.0 + seed / 100, "diverged": False, "gradient_spikes": 0,
                  "tokens_per_s": 1000.0, "unigram_bits_per_byte": 4.688, "config": {"warmup": 30, "seed": seed}},
        "diagnostics": {"perturbation": [{"relative_noise": 0.001, "relative_logit_change": change, "std": 0.0,
                                          "repeats": 3}],
                        "block_cosine": cosine},
    }


def _write_sweep(root: Path) -> Path:
    for placement in ("post", "pre"):
        for seed in SEEDS:
            j = JITTER[seed]
            change = (0.05 if placement == "post" else 0.01) * (1 + j)
            cosine = [0.5 + j, 0.7 + j, 0.9 + j] if placement == "pre" else [0.5 + j] * 3
            cell_dir = root / f"{placement}-rms-L3-w30-seed{seed}"
            cell_dir.mkdir(parents=True)
            (cell_dir / "results.json").write_text(json.dumps(_results(placement, seed, change, cosine)))
            ffn = {"block0": 1.0, "block1": 1.0, "block2": (4.0 if placement == "post" else 1.0) * (1 + j)}
            (cell_dir / "train_log.jsonl").write_text(json.dumps(
                {"step": 0, "grad_norm_per_layer": {"block0": 1.0, "block1": 1.0, "block2": 1.0},
                 "grad_norm_ffn_per_layer": ffn}) + "\n")
    return root


def test_loader_reads_the_diagnostics(tmp_path):
    s = load_sweep(_write_sweep(tmp_path))
    c = next(c for c in s.cells if c.placement == "pre" and c.seed == 0)
    assert c.noise_levels() == [0.001] and c.logit_change(0.001) == pytest.approx(0.01)
    assert c.block_cosine == [0.5, 0.7, 0.9] and c.late_cosine() == pytest.approx(0.8)
    assert c.cosine_slope() == pytest.approx(0.2)
    assert c.logit_change(0.01) is None


def test_findings_command_prints_and_writes_the_report_section(tmp_path, capsys):
    root = _write_sweep(tmp_path / "sweep")
    assert main(["findings", str(root)]) == 0
    out = capsys.readouterr().out
    written = (root / FINDINGS_FILE).read_text()
    assert out.strip() == written.strip()
    assert out.startswith("## Findings")
    assert "### Claim 3:" in out and "### Claim 7:" in out
    found = {f.number: f for f in findings(load_sweep(root))}
    assert found[3].verdict == HOLDS and found[7].verdict == HOLDS
    assert (root / "plots" / "block_cosine.png").is_file()
    # the same section is in the sweep's report
    assert main(["compare", str(root)]) == 0
    assert written in (root / "report.md").read_text()
    assert not list(root.glob(".findings.md.*"))     # the atomic write left no temporary file


def test_findings_command_one_line_errors(tmp_path, capsys):
    assert main(["findings", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "not a directory" in err
    assert main(["findings", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no finished cell" in err
    assert not (tmp_path / FINDINGS_FILE).exists()


def test_every_verdict_says_why(tmp_path):
    """The verdict table's "why" column is never empty, whatever the verdict."""
    text = "\n".join(findings_section(load_sweep(_write_sweep(tmp_path))))
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2:4].strip().isdigit()]
    assert len(rows) == 15
    assert "| 2 | At initialization" in text and "**not tested**" not in rows[1]  # claim 2 measured here
    assert all(not line.rstrip().endswith("|  |") for line in rows)


# ----------------------------------------------------------------------------- claim 13


def _rotation_cells(rot_kl: float, rot_ppl: float, collapsed_peri: bool = False) -> list[CellResult]:
    out = []
    for p in ("pre", "peri"):
        for s in SEEDS:
            extra = [{"name": "pertoken-fused", "accuracy": {"ppl_ratio": 1.02, "kld_mean": 0.02 * (1 + JITTER[s])}},
                     {"name": "online-rotated-pertoken-fused",
                      "accuracy": {"ppl_ratio": rot_ppl + JITTER[s] / 10, "kld_mean": rot_kl * (1 + JITTER[s])}}]
            status = "collapsed" if collapsed_peri and p == "peri" else None
            out.append(cell(p, seed=s, extra_recipes=extra, status=status))
    return out


def test_claim_13_holds_when_rotation_lowers_kl_and_is_near_lossless():
    f = verdict(sweep(_rotation_cells(rot_kl=0.002, rot_ppl=1.002)), 13)
    assert f.verdict == "holds here", f.lines
    assert len(f.tests) == 4 and "Holm" in f.why and "online form" in f.lines[0]


def test_claim_13_does_not_hold_when_rotation_hurts():
    f = verdict(sweep(_rotation_cells(rot_kl=0.08, rot_ppl=1.05)), 13)
    assert f.verdict == "does not hold here", f.lines


def test_claim_13_leaves_a_collapsed_arm_out_and_needs_both_recipes():
    f = verdict(sweep(_rotation_cells(rot_kl=0.002, rot_ppl=1.002, collapsed_peri=True)), 13)
    peri = [t for t in f.tests if t.label.startswith("peri")]
    assert peri and all(t.p is None and "collapsed" in t.why for t in peri)
    assert all(t.p is not None for t in f.tests if t.label.startswith("pre"))
    plain = verdict(sweep([cell(p, seed=s) for p in ("pre", "peri") for s in SEEDS]), 13)
    assert plain.verdict == "not tested" and "--recipes pertoken-fused,online-rotated-pertoken-fused" in plain.why
