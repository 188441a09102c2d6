"""The twelve claim verdicts of the sweep findings on synthetic inputs, and `quantnorm findings`.

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
from quantnorm.compare import (
    DOES_NOT_HOLD,
    FINDINGS_FILE,
    HOLDS,
    NOT_SIGNIFICANT,
    NOT_TESTED,
    CellResult,
    Sweep,
    _depth_shape,
    depth_exponent,
    estimate,
    findings,
    findings_section,
    load_sweep,
    log_reference_exponent,
)

JITTER = (0.0, 0.01, -0.01)   # per seed: three seeds, mean unchanged, a small spread
SEEDS = range(3)
RECIPE = "static-minmax-matmul"


def cell(placement: str, norm: str = "rms", seed: int = 0, *, depth: int = 4, warmup: int = 30, bpb: float = 3.0,
         diverged: bool = False, spikes: int = 0, tokens_per_s: float = 1000.0, fp32_ms: float = 10.0,
         ppl_ratio: float = 1.01, rms: list[float] | None = None, ratio: float | None = 5.0, massive: int = 0,
         grad0: dict | None = None, perturbation: dict[float, float] | None = None,
         cosine: list[float] | None = None) -> CellResult:
    """A finished (or diverged) cell with just the numbers the findings read; ``ratio`` None means
    no outlier probe."""
    name = f"{placement}-{norm}-L{depth}-w{warmup}-seed{seed}"
    train = {"eval_bits_per_byte": None if diverged else bpb, "diverged": diverged, "gradient_spikes": spikes,
             "tokens_per_s": tokens_per_s}
    results = None
    if not diverged:
        results = {
            "recipes": [{"name": RECIPE, "accuracy": {"ppl_ratio": ppl_ratio}}],
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
                      perturbation=None if diverged else rows, block_cosine=None if diverged else cosine)


def sweep(cells: list[CellResult]) -> Sweep:
    return Sweep(Path("synthetic"), cells)


def verdict(s: Sweep, number: int):
    found = {f.number: f for f in findings(s)[0]}
    assert len(found) == 12
    return found[number]


# --------------------------------------------------------------------------- claim 1: warm-up


def _warmup_sweep(case: str) -> Sweep:
    cells = []
    for p in ("post", "pre"):
        for seed in SEEDS:
            j = JITTER[seed]
            for w in ((30,) if case == "untested" else (0, 30)):
                div = (case == "holds" and p == "post" and w == 0 and seed == 2) or \
                      (case == "fails" and p == "pre" and w == 0 and seed == 2)
                bpb = 3.0 + j
                if case == "unclear" and p == "post" and w == 0:
                    bpb += (0.1, -0.1, 0.05)[seed]      # post's warm-up gain across zero
                cells.append(cell(p, seed=seed, warmup=w, bpb=bpb, diverged=div))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim1_warmup(case, expected):
    f = verdict(_warmup_sweep(case), 1)
    assert f.verdict == expected
    if case == "untested":
        assert "--warmups" in f.why


# ----------------------------------------------------------------------- claim 2: gradients at init


def _grad_sweep(case: str) -> Sweep:
    cells = []
    for p in ("post", "pre"):
        for seed in SEEDS:
            j = JITTER[seed]
            last = 1.0 + j
            if p == "post":
                last = {"holds": 8.0 * (1 + j), "fails": 0.25 * (1 + j), "unclear": (1.2, 0.8, 1.1)[seed],
                        "untested": 1.0}[case]
            grad0 = None if case == "untested" else {"embed": 1.0, "block0": 1.0, "block1": 1.0, "block2": 1.0,
                                                      "block3": last}
            cells.append(cell(p, seed=seed, grad0=grad0))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim2_gradients_at_init(case, expected):
    f = verdict(_grad_sweep(case), 2)
    assert f.verdict == expected
    if case != "untested":
        assert any("post minus pre" in line for line in f.lines)


# ------------------------------------------------------------------ claim 3: perturbation sensitivity


def _perturbation_sweep(case: str, depths=(4,)) -> Sweep:
    cells = []
    for p in ("post", "pre"):
        for seed in SEEDS:
            j = JITTER[seed]
            for d in depths:
                base = 0.01 * (1 + j)
                if case == "holds" and p == "post":
                    base *= 5
                if case == "fails" and p == "pre":
                    base *= 5
                if case == "unclear" and p == "post":
                    base *= (1.1, 0.9, 1.05)[seed]
                if case == "depth":   # post ~ N, pre ~ log N; the exponent differs a little per seed
                    e = (0.0, 0.02, -0.02)[seed]
                    base = 0.01 * (d if p == "post" else math.log(d)) * d ** e
                pert = None if case == "untested" else {1e-3: base, 1e-2: 10 * base}
                cells.append(cell(p, seed=seed, depth=d, perturbation=pert))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim3_perturbation(case, expected):
    f = verdict(_perturbation_sweep(case), 3)
    assert f.verdict == expected
    if case == "untested":
        assert f.why.startswith("results.json holds no")
    else:
        assert "smallest noise level (0.001)" in f.why and "no depth axis" in f.why
        assert len(f.lines) == 2 and "post/pre" in f.lines[0]
    if case == "holds":
        assert "x5 [" in f.lines[0]


def test_claim3_depth_axis_tells_linear_from_logarithmic_growth():
    f = verdict(_perturbation_sweep("depth", depths=(2, 4, 8)), 3)
    assert f.verdict == HOLDS                          # post's change is larger at every depth
    text = "\n".join(f.lines)
    assert "post: relative logit change" in text and "about linear in depth, O(N)" in text
    assert "pre: relative logit change" in text and "about logarithmic in depth, O(log N)" in text
    assert "post's k minus pre's" in text and "no depth axis" not in f.why


def test_depth_exponent_and_its_words():
    assert depth_exponent({2: 0.02, 4: 0.04, 8: 0.08}) == pytest.approx(1.0)
    assert depth_exponent({2: 0.02}) is None and depth_exponent({2: 0.0, 4: 1.0}) is None
    ref = log_reference_exponent([2, 4, 8])
    assert 0.7 < ref < 0.9 and log_reference_exponent([1, 4]) is None
    assert depth_exponent({d: math.log(d) for d in (2, 4, 8)}) == pytest.approx(ref)
    assert _depth_shape(estimate([0.99, 1.0, 1.01]), ref) == "about linear in depth, O(N)"
    assert _depth_shape(estimate([ref - 0.01, ref, ref + 0.01]), ref) == "about logarithmic in depth, O(log N)"
    assert _depth_shape(estimate([0.5, 1.0, 1.2]), ref) == "linear and logarithmic growth not told apart"
    assert _depth_shape(estimate([1.5, 1.6, 1.7]), ref) == "grows faster than linearly"
    assert _depth_shape(estimate([-0.5, -0.4, -0.3]), ref) == "shrinks with depth"
    assert _depth_shape(estimate([1.0]), ref) == "one series: no interval"


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
        assert "not in the sweep: pre, peri" in f.why


# ---------------------------------------------------------------------- claim 5: massive activations


def _massive_sweep(case: str) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        pre_ratio, pre_massive = {"holds": (400 * (1 + j), 3), "fails": (400 * (1 + j), 0),
                                  "unclear": ((9.0, 10.0, 30.0)[seed], 1), "untested": (400.0, 3)}[case]
        cells.append(cell("pre", seed=seed, ratio=pre_ratio, massive=pre_massive))
        if case != "untested":
            cells.append(cell("peri", seed=seed, ratio=(10.0, 11.0, 12.0)[seed]))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim5_massive_activations(case, expected):
    f = verdict(_massive_sweep(case), 5)
    assert f.verdict == expected
    if case == "fails":
        assert "no massive activation" in f.why


# --------------------------------------------------------------------------- claim 6: Peri vs Pre


def _peri_sweep(case: str) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        cells.append(cell("pre", seed=seed, bpb=2.8 + j))
        if case != "untested":
            peri = {"holds": 2.7 + j, "fails": 2.9 + j, "unclear": 2.8 + j + (0.05, -0.05, 0.01)[seed]}[case]
            cells.append(cell("peri", seed=seed, bpb=peri))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim6_peri_vs_pre(case, expected):
    f = verdict(_peri_sweep(case), 6)
    assert f.verdict == expected
    if case == "holds":
        assert "-0.100 [" in f.lines[0]


# ---------------------------------------------------------------------- claim 7: representation collapse


def _collapse_sweep(case: str, depths=(4,)) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        for d in depths:
            rising = [0.95 - 0.45 * (d - 1 - i) / max(1, d - 1) + j for i in range(d)]   # 0.5 -> 0.95
            flat = [0.5 + j] * d
            falling = [0.8 - 0.1 * i / max(1, d - 1) + j for i in range(d)]
            if case in ("holds", "deep"):
                pre, post, peri = rising, flat, [0.6 + j] * d
            elif case == "fails":
                pre, post, peri = [0.4 + j] * d, falling, falling
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
        assert "pre minus the mean of post, peri" in "\n".join(f.lines)


def test_claim7_uses_the_deepest_stack_and_reports_each_depth():
    f = verdict(_collapse_sweep("deep", depths=(2, 8)), 7)
    assert f.verdict == HOLDS and "depth 8, the deepest" in f.why
    assert f.lines[0].startswith("depth 2:") and f.lines[1].startswith("depth 8:")
    one = verdict(_collapse_sweep("holds", depths=(1,)), 7)    # one block: no slope, the comparison decides
    assert one.verdict == HOLDS and "no slope" in one.why


def test_claim7_without_other_placements_is_not_tested():
    s = sweep([c for c in _collapse_sweep("holds").cells if c.placement == "pre"])
    f = verdict(s, 7)
    assert f.verdict == NOT_TESTED and "no other placement" in f.why


# --------------------------------------------------------------------------------- claim 8: DeepNorm


def _deepnorm_sweep(case: str) -> Sweep:
    cells = []
    for p in ("post", "deepnorm"):
        if case == "untested" and p == "deepnorm":
            continue
        for seed in SEEDS:
            j = JITTER[seed]
            for d in (2, 8):
                div = d == 8 and seed == 2 and ((case == "holds" and p == "post") or
                                                (case == "fails" and p == "deepnorm"))
                bpb = 3.0 + j + (0.1 * (0.5, -0.5, 0.2)[seed] if p == "deepnorm" else 0.0)
                cells.append(cell(p, seed=seed, depth=d, bpb=bpb, diverged=div))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim8_deepnorm(case, expected):
    f = verdict(_deepnorm_sweep(case), 8)
    assert f.verdict == expected
    if case == "untested":
        assert "deepnorm" in f.why


# ----------------------------------------------------------------------------- claim 9: RMSNorm speed


def _speed_sweep(case: str) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        cells.append(cell("pre", "rms", seed, tokens_per_s=1000 * (1 + j) * {
            "holds": 1.1, "fails": 0.9, "unclear": (1.05, 0.95, 1.01)[seed], "untested": 1.0}[case], fp32_ms=9.0))
        if case != "untested":
            cells.append(cell("pre", "layer", seed, tokens_per_s=1000 * (1 + j), fp32_ms=10.0))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim9_rms_speed(case, expected):
    f = verdict(_speed_sweep(case), 9)
    assert f.verdict == expected
    if case == "holds":
        assert "+10.0% [" in f.lines[0] and "+11.1%" in f.lines[1]   # 10 ms / 9 ms


# ------------------------------------------------------------------ claim 10: LayerNorm quantizes better


def _friendly_sweep(case: str) -> Sweep:
    cells = []
    for p in ("pre", "post"):
        for seed in SEEDS:
            j = JITTER[seed] / 10
            rms = 1.01 + j + {"holds": 0.01, "fails": -0.005, "unclear": (0.002, -0.002, 0.001)[seed],
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


# --------------------------------------------------------------------- claim 11: outliers predict error


def _outlier_sweep(case: str) -> Sweep:
    ratios = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0]
    ppl = {"holds": [1.0 + r / 1000 for r in ratios], "fails": [1.1 - r / 1000 for r in ratios],
           "unclear": [1.03, 1.01, 1.05, 1.02, 1.02, 1.06, 1.01, 1.03], "few": [1.01, 1.02, 1.03],
           "untested": [1.01] * 8}[case]
    return sweep([cell("pre", seed=i, ratio=None if case == "untested" else r, ppl_ratio=q)
                  for i, (r, q) in enumerate(zip(ratios, ppl, strict=False))])


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD), ("unclear", NOT_SIGNIFICANT),
                                            ("few", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim11_outliers_predict_int8_error(case, expected):
    f = verdict(_outlier_sweep(case), 11)
    assert f.verdict == expected
    if case == "few":
        assert "too few for an interval" in f.why


# ----------------------------------------------------------------------- claim 12: Post-LN can be best


def _best_sweep(case: str) -> Sweep:
    cells = []
    for seed in SEEDS:
        j = JITTER[seed]
        post = {"holds": 2.5 + j, "fails": 3.0 + j, "unclear": 2.8 + (0.1, -0.1, 0.05)[seed], "untested": 2.5}[case]
        cells.append(cell("post", seed=seed, bpb=post, diverged=case == "untested"))
        cells.append(cell("pre", seed=seed, bpb=2.8 + j))
    return sweep(cells)


@pytest.mark.parametrize("case, expected", [("holds", HOLDS), ("fails", DOES_NOT_HOLD),
                                            ("unclear", NOT_SIGNIFICANT), ("untested", NOT_TESTED)])
def test_claim12_post_can_be_best(case, expected):
    f = verdict(_best_sweep(case), 12)
    assert f.verdict == expected
    if case == "untested":
        assert "every post cell diverged" in f.why


# ----------------------------------------------------------------------------- section and command


def test_findings_section_has_every_claim_and_a_verdict_table():
    text = "\n".join(findings_section(_perturbation_sweep("holds"), {"Perturbation sensitivity per depth": "plots/x.png"}))
    assert text.startswith("## Findings")
    for n in range(1, 13):
        assert f"### Claim {n}:" in text and f"claim {n}: " in text
    assert "| # | claim | verdict | why |" in text
    assert "| 3 | Post-LN amplifies" in text and "**holds here**" in text
    assert "![Perturbation sensitivity per depth](plots/x.png)" in text


def _results(placement: str, seed: int, change: float, cosine: list[float]) -> dict:
    return {
        "schema_version": 1, "hardware": {}, "recipes": [], "latency": [],
        "model": {"placement": placement, "norm": "rms", "n_layers": len(cosine)},
        "train": {"eval_bits_per_byte": 3.0 + seed / 100, "diverged": False, "gradient_spikes": 0,
                  "tokens_per_s": 1000.0, "config": {"warmup": 30, "seed": seed}},
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
            (cell_dir / "train_log.jsonl").write_text(json.dumps(
                {"step": 0, "grad_norm_per_layer": {"block0": 1.0, "block1": 1.0, "block2": 1.0}}) + "\n")
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
    found = {f.number: f for f in findings(load_sweep(root))[0]}
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
    assert len(rows) == 12
    assert "| 2 | At initialization" in text and "**not tested**" not in rows[1]  # claim 2 measured here
    assert all(not line.rstrip().endswith("|  |") for line in rows)
