"""The sweep comparison: statistics against hand computations, the verdict rule on synthetic
inputs, and the report of a synthetic sweep (no training: results.json files written here)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quantnorm.cli import main
from quantnorm.report.comparison import (
    write_comparison,
)
from quantnorm.report.findings import (
    findings,
)
from quantnorm.report.stats import (
    DOES_NOT_HOLD,
    HOLDS,
    NOT_SIGNIFICANT,
    NOT_TESTED,
    Estimate,
    combine,
    estimate,
    growth_fit,
    matched_difference,
    spearman_interval,
    t_quantile,
    verdict_order,
    verdict_sign,
    verdict_within,
    welch_difference,
)
from quantnorm.report.sweep import (
    load_sweep,
    rank,
)

T2 = 4.302652729911275   # t(0.975, df=2), from tables


# ------------------------------------------------------------------------------- synthetic cells


def make_results(placement: str, norm: str, seed: int, *, depth: int = 4, warmup: int = 30, bpb: float = 3.0,
                 ppl_ratio: float = 1.01, rms: list[float] | None = None, ratio: list[float] | None = None,
                 massive: int = 0, tokens_per_s: float = 1000.0, fp32_ms: float = 10.0, int8_ms: float = 8.0,
                 recipes: tuple[str, ...] = ("static-minmax-matmul",), lr: float = 0.003) -> dict:
    """A results.json with the keys the comparison reads (RESULTS.md core keys)."""
    rms = rms or [1.0] * (depth + 1)
    ratio = ratio or [5.0] * (depth + 1)
    layers = ["embed", *range(depth)]
    residual = [{"layer": lay, "top": [{"value": ra * 0.1, "position": 0, "channel": 1}], "median_abs": 0.1,
                 "ratio": ra, "kurtosis": ra / 2, "inf_norm": ra * 0.1, "rms": r}
                for lay, r, ra in zip(layers, rms, ratio, strict=True)]
    latency = [{"provider": "CPUExecutionProvider", "variant": "fp32", "batch": 8, "seq": 32, "status": "measured",
                "p50_ms": fp32_ms}]
    latency += [{"provider": "CPUExecutionProvider", "variant": name, "batch": 8, "seq": 32, "status": "measured",
                 "p50_ms": int8_ms} for name in recipes]
    return {
        "schema_version": 1, "quantnorm_version": "0.1.0", "command": "synthetic", "created": "2026-01-01T00:00:00Z",
        "hardware": {"cpu": "test CPU", "vnni": False, "threads": 2, "onnxruntime": "x", "torch": "y"},
        "model": {"placement": placement, "norm": norm, "n_layers": depth, "d_model": 32, "n_heads": 2,
                  "context": 32, "vocab_size": 257, "n_params": 1000, "source": "trained"},
        "data": {}, "export": {},
        "train": {"steps": 100, "final_train_loss": 2.0, "eval_bits_per_byte": bpb, "diverged": False,
                  "unigram_bits_per_byte": 4.688, "collapse_margin": 0.8,
                  "diverged_at": None, "gradient_spikes": 0, "tokens_per_s": tokens_per_s, "wall_s": 1.0,
                  "config": {"steps": 100, "batch_size": 8, "lr": lr, "warmup": warmup, "seed": seed}},
        "recipes": [{"name": name, "status": "ok",
                     "accuracy": {"ppl_fp32": 7.0, "ppl_int8": 7.0 * ppl_ratio, "ppl_ratio": ppl_ratio,
                                  "kld_mean": 1e-3, "kld_p99": 1e-2, "kld_max": 0.1, "top1_agreement": 0.98}}
                    for name in recipes],
        "latency": latency,
        "outliers": {"residual": residual, "massive": [{"layer": depth - 1}] * massive, "matmul_inputs": []},
    }


def write_cell(root: Path, results: dict, grad0: dict | None = None, lr_in_name: bool = False) -> Path:
    m, t = results["model"], results["train"]["config"]
    lr = f"-lr{t['lr']:g}" if lr_in_name else ""
    cell = root / f"{m['placement']}-{m['norm']}-L{m['n_layers']}-w{t['warmup']}{lr}-seed{t['seed']}"
    cell.mkdir(parents=True)
    (cell / "results.json").write_text(json.dumps(results))
    if grad0 is not None:
        (cell / "train_log.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0, "grad_norm_per_layer": grad0,
                                                          "grad_norm_ffn_per_layer": grad0}) + "\n")
    return cell


def write_diverged_cell(root: Path, placement: str, norm: str, seed: int, depth: int = 4, warmup: int = 0) -> Path:
    cell = root / f"{placement}-{norm}-L{depth}-w{warmup}-seed{seed}"
    cell.mkdir(parents=True)
    (cell / "config.json").write_text(json.dumps({"model": {"placement": placement, "norm": norm, "n_layers": depth},
                                                  "train": {"warmup": warmup, "seed": seed}}))
    (cell / "train.json").write_text(json.dumps({"steps": 7, "diverged": True, "diverged_at": 7,
                                                 "eval_bits_per_byte": None, "gradient_spikes": 2}))
    return cell


# ------------------------------------------------------------------------------------- statistics


def test_t_quantile_matches_tables():
    assert t_quantile(2) == pytest.approx(T2, rel=1e-9)
    assert t_quantile(1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile(30) == pytest.approx(2.042, abs=1e-3)


def test_estimate_n3_by_hand():
    e = estimate([1.0, 2.0, 3.0])
    half = T2 * 1.0 / math.sqrt(3)   # sd = 1
    assert (e.mean, e.n, e.sd) == (2.0, 3, pytest.approx(1.0))
    assert e.lo == pytest.approx(2.0 - half) and e.hi == pytest.approx(2.0 + half)
    assert e.lo == pytest.approx(-0.48414, abs=1e-5)
    # missing and non-finite values are left out, one value has no interval, none has no mean
    assert estimate([1.0, None, float("nan"), float("inf"), 2.0, 3.0]) == e
    one = estimate([5.0])
    assert (one.mean, one.lo, one.hi, one.n, one.has_interval) == (5.0, None, None, 1, False)
    assert estimate([]).mean is None and estimate([None]).n == 0
    assert "(n=1)" in one.format() and e.format(".2f") == "2.00 [-0.48, 4.48]"


def test_overlapping_intervals_are_not_significant():
    a, b = estimate([1.0, 2.0, 3.0]), estimate([4.0, 5.0, 6.0])   # [-0.48, 4.48] and [2.52, 6.48]
    assert a.overlaps(b) and verdict_order(a, b) == NOT_SIGNIFICANT
    c, d = estimate([0.9, 1.0, 1.1]), estimate([1.9, 2.0, 2.1])   # 1 +/- 0.248 and 2 +/- 0.248
    assert c.hi == pytest.approx(1.0 + T2 * 0.1 / math.sqrt(3))
    assert not c.overlaps(d)
    assert verdict_order(c, d) == HOLDS and verdict_order(d, c) == DOES_NOT_HOLD
    assert verdict_order(estimate([1.0]), d) == NOT_SIGNIFICANT      # one seed: no interval, never separated
    assert verdict_order(estimate([]), d) == NOT_TESTED


def test_ranking_marks_neighbours_whose_intervals_overlap():
    items = [("g1", "worst", "r", estimate([1.9, 2.0, 2.1])), ("g2", "best", "r", estimate([0.9, 1.0, 1.1])),
             ("g3", "close", "r", estimate([0.95, 1.05, 1.15])), ("g4", "none", "r", estimate([]))]
    rows = rank(items)
    assert [r.label for r in rows] == ["best", "close", "worst", "none"]
    assert [r.rank for r in rows] == [1, 2, 3, 4]
    assert [r.not_significant for r in rows] == [False, True, False, False]


def test_matched_and_welch_differences_by_hand():
    paired = matched_difference({1: 1.0, 2: 2.0, 3: 3.0}, {1: 0.5, 2: 1.4, 3: 2.6})   # diffs 0.5, 0.6, 0.4
    assert paired.mean == pytest.approx(0.5) and paired.n == 3
    assert paired.hi - paired.mean == pytest.approx(T2 * 0.1 / math.sqrt(3))
    w = welch_difference([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    va, vb = 1.0 / 3, 4.0 / 3
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    assert df == pytest.approx(2.9412, abs=1e-4)
    assert w.mean == pytest.approx(-2.0)
    assert w.hi - w.mean == pytest.approx(t_quantile(df) * math.sqrt(va + vb))
    # fewer than two matched pairs: Welch over everything
    assert matched_difference({1: 1.0, 2: 2.0, 3: 3.0}, {7: 2.0, 8: 4.0, 9: 6.0}) == w


def test_spearman_interval_by_hand():
    c = spearman_interval([1, 2, 3, 4, 5, 6], [2, 1, 4, 3, 6, 5])
    # rank differences d = (1, -1, 1, -1, 1, -1): rho = 1 - 6 * 6 / (6 * 35)
    assert c.rho == pytest.approx(1 - 36 / 210)
    half = 1.959963984540054 * math.sqrt(1.06 / 3)
    assert c.lo == pytest.approx(math.tanh(math.atanh(c.rho) - half))
    assert c.hi == pytest.approx(math.tanh(math.atanh(c.rho) + half))
    assert spearman_interval([1, 2, 3], [1, 2, 3]).lo is None                 # n = 3: no interval
    assert spearman_interval([1, 2], [1, 2]).rho is None
    assert spearman_interval([1, 2, 3, 4], [1, None, 3, float("nan")]).n == 2


# ---------------------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize("values, expected, verdict", [
    ([0.9, 1.0, 1.1], +1, HOLDS),
    ([0.9, 1.0, 1.1], -1, DOES_NOT_HOLD),
    ([-1.1, -1.0, -0.9], -1, HOLDS),
    ([-1.0, 0.5, 1.0], +1, NOT_SIGNIFICANT),
    ([1.0], +1, NOT_SIGNIFICANT),
    ([], +1, NOT_TESTED),
])
def test_verdict_sign(values, expected, verdict):
    assert verdict_sign(estimate(values), expected) == verdict


def test_verdict_within_and_combine():
    assert verdict_within(estimate([-0.01, 0.0, 0.01]), 0.1) == HOLDS
    assert verdict_within(estimate([0.5, 0.6, 0.7]), 0.1) == DOES_NOT_HOLD
    assert verdict_within(estimate([0.0, 0.1, 0.2]), 0.1) == NOT_SIGNIFICANT
    assert combine([HOLDS, HOLDS]) == HOLDS
    assert combine([HOLDS, NOT_SIGNIFICANT]) == NOT_SIGNIFICANT
    assert combine([HOLDS, DOES_NOT_HOLD, NOT_SIGNIFICANT]) == DOES_NOT_HOLD
    assert combine([HOLDS, NOT_TESTED]) == HOLDS
    assert combine([NOT_TESTED, NOT_TESTED]) == NOT_TESTED


def test_growth_fit_tells_exponential_from_linear():
    exp = growth_fit([1.0, 2.0, 4.0, 8.0, 16.0])
    assert exp["growth_factor"] == pytest.approx(2.0) and exp["r2_exp"] == pytest.approx(1.0)
    assert exp["delta_r2"] > 0
    lin = growth_fit([1.0, 2.0, 3.0, 4.0, 5.0])
    assert lin["r2_lin"] == pytest.approx(1.0) and lin["delta_r2"] < 0
    assert growth_fit([1.0, 2.0]) is None


# ------------------------------------------------------------------------------- synthetic sweeps


def _literature_sweep(root: Path, agree: bool) -> Path:
    """post/pre/peri x layer/rms x 3 seeds x warm-ups 0/30, depth 4, built to agree (or not) with
    the literature."""
    jitter = [0.0, 0.01, -0.01]
    for placement in ("post", "pre", "peri"):
        for norm in ("layer", "rms"):
            for seed in range(3):
                j = jitter[seed]
                for warmup in (0, 30):
                    if placement == "post" and warmup == 0 and agree and seed == 2:
                        write_diverged_cell(root, placement, norm, seed)
                        continue
                    if placement == "pre":
                        rms = [0.05, *(1.0 * 2.0 ** (i * (1 + j)) for i in range(4))]       # exponential
                        ratio = [5.0, 20, 60, 150, 400 * (1 + j)]
                    elif placement == "peri":
                        rms = [0.05, *(1.0 + 1.0 * i * (1 + j) for i in range(4))]          # linear
                        ratio = [5.0, 6, 7, 8, 9 * (1 + j)]
                    else:
                        rms = [0.05, *(1.0 + 0.002 * i * (1 + j) for i in range(4))]        # constant
                        ratio = [5.0, 4, 4, 4, 4 * (1 + j)]
                    if not agree:
                        rms = [0.05, *reversed(rms[1:])]
                    base = {"post": 2.5, "pre": 2.8, "peri": 2.7}[placement]
                    if placement == "post" and warmup == 0:
                        base += 1.0 if agree else -0.3
                    ppl = 1.0 + ratio[-1] / 1000 + (0.001 if norm == "rms" else 0.0) + j / 1000
                    if not agree:
                        ppl = 1.0 + 1.0 / ratio[-1] + j / 1000
                    write_cell(root, make_results(placement, norm, seed, warmup=warmup, bpb=base + j, ppl_ratio=ppl,
                                                  rms=rms, ratio=ratio, massive=3 if placement == "pre" else 0,
                                                  tokens_per_s=1000 * (1.1 if norm == "rms" else 1.0) * (1 + j),
                                                  fp32_ms=10.0 * (0.9 if norm == "rms" else 1.0) * (1 + j)),
                               grad0={"embed": 1.0, **{f"block{i}": (2.0 ** i if placement == "post" else 1.0) * (1 + j)
                                                       for i in range(4)}})
    return root


def test_findings_on_a_sweep_that_agrees_with_the_literature(tmp_path):
    sweep = load_sweep(_literature_sweep(tmp_path, agree=True))
    assert len(sweep.cells) == 36 and sum(c.diverged for c in sweep.cells) == 2
    found = {f.number: f for f in findings(sweep)}
    assert found[1].verdict == HOLDS          # post gains 1 bit/byte from warm-up, pre nothing
    assert found[2].verdict == HOLDS          # post's step-0 gradients grow toward the output
    assert found[3].verdict == NOT_TESTED and found[3].why
    assert found[4].verdict == HOLDS          # pre exponential, peri linear, post constant
    assert found[5].verdict == HOLDS          # pre has massive activations and larger ratios than peri
    assert found[6].verdict == NOT_SIGNIFICANT   # peri's lower loss holds; its spikes and spread are equal
    assert found[7].verdict == NOT_TESTED
    assert found[8].verdict == NOT_TESTED and "depth" in found[8].why
    assert found[9].verdict == HOLDS          # RMSNorm cells trained 10% faster, ran 10% faster in ORT
    assert found[10].verdict == HOLDS         # RMSNorm's PPL ratio 0.001 higher in every matched pair
    assert found[11].verdict == HOLDS         # bigger outliers, bigger PPL ratio across cells
    assert found[12].verdict == HOLDS         # post (with warm-up) beats pre
    for f in found.values():
        assert f.verdict in (HOLDS, DOES_NOT_HOLD, NOT_SIGNIFICANT, NOT_TESTED)


def test_findings_on_a_sweep_that_contradicts_the_literature(tmp_path):
    sweep = load_sweep(_literature_sweep(tmp_path, agree=False))
    found = {f.number: f for f in findings(sweep)}
    assert found[1].verdict == DOES_NOT_HOLD      # post did better without warm-up
    assert found[4].verdict == DOES_NOT_HOLD      # RMS shrinks with depth
    assert found[11].verdict == DOES_NOT_HOLD     # bigger outliers, smaller PPL ratio


def test_report_of_a_synthetic_sweep(tmp_path, capsys):
    root = _literature_sweep(tmp_path / "sweep", agree=True)
    (root / "broken-rms-L4-w0-seed0").mkdir()
    (root / "broken-rms-L4-w0-seed0" / "results.json").write_text("{ not json")
    (root / "unfinished-cell").mkdir()
    assert main(["compare", str(root)]) == 0
    report = (root / "report.md").read_text()
    for text in ("## Ranking", "## Findings", "not significant", "post/layer w0", "pre/rms w30",
                 "static-minmax-matmul", "**Verdict: holds here**", "**Verdict: not tested** (results.json holds no",
                 "broken-rms-L4-w0-seed0` left out", "unfinished-cell` not finished", "## Training status",
                 "`post-layer-L4-w0-seed2` (diverged)", "34 of 36 cells trained, 0 collapsed, 2 diverged"):
        assert text in report, text
    for png in ("bits_per_byte.png", "ppl_ratio.png", "residual_rms.png"):
        assert (root / "plots" / png).stat().st_size > 1000
    assert str(root / "report.md") in capsys.readouterr().out


def test_compare_of_a_directory_without_cells_is_a_one_line_error(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "no finished cell" in err
    assert main(["compare", str(tmp_path / "missing")]) == 2


def test_other_schema_version_is_left_out_and_named(tmp_path):
    write_cell(tmp_path, make_results("pre", "rms", 0))
    other = make_results("peri", "rms", 0)
    other["schema_version"] = 99
    write_cell(tmp_path, other)
    sweep = load_sweep(tmp_path)
    assert [c.placement for c in sweep.cells] == ["pre"]
    assert any("schema_version 99" in p for p in sweep.problems)
    assert write_comparison(tmp_path).is_file()


def test_estimate_is_plain_data():
    e = Estimate(1.0, 0.5, 1.5, 3, 0.2)
    assert e.to_dict() == {"mean": 1.0, "lo": 0.5, "hi": 1.5, "n": 3, "sd": 0.2}
    assert e.scaled(-1.0) == Estimate(-1.0, -1.5, -0.5, 3, 0.2)


# --------------------------------------------------------------------------- learning-rate axis


def test_learning_rate_axis_compares_placements_at_their_own_rate_on_held_out_seeds(tmp_path):
    """A fabricated 2 placements x 3 rates x 4 seeds sweep (test data, no training): post is best at
    1e-3, pre at 3e-3; at 1e-2 post collapses. Seed 3 is 'lucky' for pre at 1e-2."""
    root = tmp_path / "lrsweep"
    bpb = {("post", 1e-3): 2.6, ("post", 3e-3): 2.9, ("post", 1e-2): 4.69,
           ("pre", 1e-3): 3.0, ("pre", 3e-3): 2.7, ("pre", 1e-2): 2.9}
    for (p, lr), base in bpb.items():
        for seed in range(4):
            value = base + 0.01 * seed
            if (p, lr) == ("pre", 1e-2) and seed == 3:
                value = 1.9                                   # luck: makes 1e-2 look best in-sample
            write_cell(root, make_results(p, "rms", seed, bpb=value, lr=lr), lr_in_name=True)
    assert main(["compare", str(root)]) == 0
    report = (root / "report.md").read_text()
    for text in ("## Learning rate", "### Eval bits/byte per learning rate", "| setting | lr 0.001 | lr 0.003 | lr 0.01 |",
                 "### Placements at their own best learning rate", "leave one seed out",
                 "`post-rms-L4-w30-lr0.01-seed0` (collapsed, 4.690)"):
        assert text in report, text
    data = json.loads((root / "findings.json").read_text())
    (block,) = data["tuned_learning_rate"]
    rows = {r["placement"]: r for r in block["placements"]}
    assert rows["post"]["best_lr"] == 1e-3
    assert rows["pre"]["best_lr"] == 1e-2        # in-sample, seed 3's luck wins: mean 2.6575 (optimistic)
    assert rows["pre"]["in_sample_bits_per_byte"]["mean"] == pytest.approx(2.6575)
    # held out, the lucky seed cannot vote for itself: at seed 3 the rate is chosen on seeds 0-2 (3e-3)
    assert rows["pre"]["chosen_lr"] == {"0": 1e-2, "1": 1e-2, "2": 1e-2, "3": 3e-3}
    assert rows["pre"]["held_out_bits_per_byte"]["mean"] == pytest.approx((2.9 + 2.91 + 2.92 + 2.73) / 4)
    assert rows["post"]["held_out_bits_per_byte"]["mean"] == pytest.approx(2.615)
    assert "| -0.208 |" in report   # pre: in-sample minus held-out, the optimism of choosing on the same seeds
    found = {c["number"]: c for c in data["claims"]}
    assert "tuned over warm-up and learning rate" in found[12]["why"]
    assert found[12]["verdict"] == HOLDS          # post at 1e-3 beats pre at 3e-3 on every held-out seed
