"""The claims about generation (shared CLAIMS.md 14, 15), on one run and on a sweep.

- 14: weight-only ``MatMulNBits`` at ``accuracy_level`` 4 (int8 activations per block) changes greedy
  generations where level 0 (float activations, same weights) does not. Each level-4 recipe is paired
  with its level-0 twin (same bits, block, rounding, head and rotation) and their generation agreement
  against FP32 is compared: how soon the greedy tokens leave FP32's.
- 15: mean KL predicts how soon a quantized model's greedy generation leaves FP32's better than the
  perplexity ratio does: Spearman's rank correlation, across the recipes (and other engines) of one
  model, of KL and of the PPL ratio's distance from 1 (|ln ratio|, so a ratio below 1 is not read as
  better than lossless) with the mean first-divergence position.

On one run (a real checkpoint: :func:`level4_answer`, :func:`kl_answer`) the prompts and the recipes
are what varies; on a sweep (:func:`claim_level4`, :func:`claim_kl_predicts`) the seed is the unit of
replication, as for every other claim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np

from .. import results as results_file
from .evidence import Finding, arm_why, by_seed, decide, paired, strata
from .markdown import table
from .sections import level0_twin
from .stats import DOES_NOT_HOLD, HOLDS, NOT_SIGNIFICANT, NOT_TESTED, estimate, finite, holm, scipy_stats, sign_test
from .sweep import CellResult, Sweep, placements_in

ALPHA = 0.05
RESAMPLES = 2000   # bootstrap over recipes for one model's rank-correlation difference


# ------------------------------------------------------------------------------------ claim 14


@dataclass(frozen=True)
class LevelPair:
    """A level-4 weight-only recipe and its level-0 twin, with their accuracy and agreement."""
    level4: results_file.Recipe
    level0: results_file.Recipe
    agreement4: dict | None
    agreement0: dict | None

    @property
    def label(self) -> str:
        s = self.level4.settings
        rot = f", {s['rotation']} rotation" if s.get("rotation") else ""
        return f"int{s.get('bits')} b{s.get('block_size')} {s.get('weight_rounding', 'rtn')}{rot}"


def level_pairs(results: dict | None) -> list[LevelPair]:
    """Every weight-only recipe at accuracy_level 4 that has a level-0 twin in the same run."""
    recipes = results_file.recipes(results)
    agreement = {m.name: m.agreement for m in results_file.generation_models(results)}
    pairs = []
    for r in recipes:
        if r.settings.get("format") != "MatMulNBits" or r.settings.get("accuracy_level") != 4 or not r.accuracy:
            continue
        if (twin := level0_twin(recipes, r)) is not None:
            pairs.append(LevelPair(r, twin, agreement.get(r.name), agreement.get(twin.name)))
    return pairs


def _agreement(results: dict | None, name: str) -> dict | None:
    model = results_file.generation_model(results, name)
    return None if model is None else model.agreement


def _first(agreement: dict | None) -> float | None:
    v = (agreement or {}).get("first_divergence_mean")
    return float(v) if finite([v]) else None


def level4_test(pair: LevelPair) -> dict:
    """One checkpoint's answer for one pair: does level 4 leave FP32's greedy tokens sooner than level 0?
    Paired on the prompt (Wilcoxon's signed-rank test on the first-divergence positions) where both
    runs recorded them per prompt, else Fisher's exact test on the prompts that generated FP32's
    tokens exactly. ``direction`` is the claim's (holds) when level 4 is the worse."""
    a4, a0 = pair.agreement4 or {}, pair.agreement0 or {}
    out = {"level4": pair.level4.name, "level0": pair.level0.name, "label": pair.label,
           "kld4": pair.level4.metric("kld_mean"), "kld0": pair.level0.metric("kld_mean"),
           "first4": _first(a4), "first0": _first(a0), "new_tokens": a4.get("new_tokens"),
           "identical4": a4.get("identical_prompts"), "identical0": a0.get("identical_prompts"),
           "prompts": a4.get("prompts"), "test": None, "p": None, "verdict": NOT_TESTED}
    if out["first4"] is None or out["first0"] is None or a4.get("prompts") != a0.get("prompts"):
        out["why"] = "no generation agreement for both recipes (evaluate with --generation)"
        return out
    f4, f0 = a4.get("first_divergence"), a0.get("first_divergence")
    if isinstance(f4, list) and isinstance(f0, list) and len(f4) == len(f0) > 0:
        d = np.asarray(f4, float) - np.asarray(f0, float)
        out["test"] = "Wilcoxon signed-rank on the first divergence, paired on the prompt"
        out["p"] = 1.0 if not d.any() else float(scipy_stats().wilcoxon(d, zero_method="zsplit").pvalue)
        worse = float(np.mean(d)) < 0
    else:
        n = int(a4["prompts"])
        table = [[out["identical4"], n - out["identical4"]], [out["identical0"], n - out["identical0"]]]
        out["test"] = "Fisher's exact test on the prompts generated identically"
        out["p"] = float(scipy_stats().fisher_exact(table).pvalue)
        worse = out["identical4"] < out["identical0"] or (out["identical4"] == out["identical0"]
                                                        and out["first4"] < out["first0"])
    out["verdict"] = NOT_SIGNIFICANT if out["p"] >= ALPHA else (HOLDS if worse else DOES_NOT_HOLD)
    return out


def level4_answer(results: dict | None) -> dict:
    """Claim 14 on one run: each level pair's test, Holm-corrected together, and the premise (how many
    quantized inputs the probe found carrying a massive activation)."""
    tests = [level4_test(p) for p in level_pairs(results)]
    tested = sorted((t for t in tests if t["p"] is not None), key=lambda t: t["p"])
    running = 0.0
    for i, t in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - i) * t["p"]))
        t["p_holm"] = running
        if running >= ALPHA:
            t["verdict"] = NOT_SIGNIFICANT
    verdicts = [t["verdict"] for t in tests if t["verdict"] != NOT_TESTED]
    verdict = (NOT_TESTED if not verdicts else DOES_NOT_HOLD if DOES_NOT_HOLD in verdicts
               else HOLDS if all(v == HOLDS for v in verdicts) else NOT_SIGNIFICANT)
    probe = results_file.outliers(results) or {}
    massive = probe.get("massive_total", results_file.massive_count(results))   # the list is capped; the total is not
    carriers = sum(1 for x in probe.get("matmul_inputs") or [] if x.get("carries_massive")) if probe else None
    return {"pairs": tests, "verdict": verdict, "massive": massive, "carriers": carriers,
            "why": "" if tests else "the run has no weight-only recipe at accuracy_level 4 with its level-0 twin "
                                    "(e.g. --recipes wo-int8-b32,wo-int8-b32-acc4)"}


def level4_sentence(answer: dict) -> str:
    """The Markdown of :func:`level4_answer`."""
    if not answer["pairs"]:
        return f"Claim 14 (accuracy_level 4 changes greedy generations): **{NOT_TESTED}** ({answer['why']})."
    parts = []
    for t in answer["pairs"]:
        if t["p"] is None:
            parts.append(f"`{t['level4']}` against `{t['level0']}`: {NOT_TESTED} ({t['why']})")
            continue
        parts.append(f"`{t['level4']}` against `{t['level0']}`: first divergence at token {t['first4']:.1f} against "
                     f"{t['first0']:.1f} of {t['new_tokens']}, {t['identical4']} against {t['identical0']} of "
                     f"{t['prompts']} prompts identical to FP32's, KL {t['kld4']:.4f} against {t['kld0']:.4f} "
                     f"({t['test']}: p = {t['p']:.2g}, Holm p = {t['p_holm']:.2g}) -> {t['verdict']}")
    massive, carriers = answer["massive"], answer.get("carriers")
    premise = ("the probe found no massive activation" if massive == 0 else
               f"the probe found {massive} massive activation{'s' if massive != 1 else ''}" if massive else
               "the model was not probed")
    if massive and carriers is not None:
        premise += f", {carriers} quantized MatMul input{'s' if carriers != 1 else ''} carrying one"
    return (f"Claim 14 (accuracy_level 4 changes greedy generations where level 0 does not; {premise}): "
            + "; ".join(parts) + f". **{answer['verdict']}**.")


def claim_level4(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(14, "Weight-only quantization with int8 activations per block (MatMulNBits accuracy_level 4) "
                    "changes greedy generations on models with massive activations, where float activations do not",
                "onnxruntime issue #29849", NOT_TESTED)
    if not any(level_pairs(c.results) for c in full.cells if c.results):
        f.why = ("the cells have no weight-only recipe at accuracy_level 4 beside its level-0 twin: sweep with "
                 "--recipes ...,wo-int8-b32,wo-int8-b32-acc4 --generation")
        return f
    if not any(_first(p.agreement4) is not None for c in full.cells if c.results for p in level_pairs(c.results)):
        f.why = "the cells carry no generation agreement: sweep with --generation"
        return f
    tests = []
    for p, norm, depth, warmup, lr in strata(full.cells, "placement", "norm", "depth", "warmup", "lr"):
        where = dict(placement=p, norm=norm, depth=depth, warmup=warmup, lr=lr)
        label = full.axes_label(**where).strip()
        cells = sweep.select(**where)
        bad = arm_why(full, p, **where)
        missing = bad if "collapsed" in bad or "diverged" in bad else None
        names = sorted({(x.level4.name, x.level0.name) for c in full.select(**where) if c.results
                        for x in level_pairs(c.results)})
        massive = by_seed(cells, lambda c: c.massive_count())
        if massive:
            f.lines.append(f"{label}: massive activations found by the probe per seed: "
                           + ", ".join(f"{int(v)}" for _, v in sorted(massive.items())))
        for four, zero in names:
            tests.append(sign_test(label, f"first divergence from FP32's greedy tokens, `{four}` minus `{zero}` "
                                          f"(tokens; < 0: level 4 leaves sooner)",
                                   paired(by_seed(cells, partial(first_divergence, name=four)),
                                          by_seed(cells, partial(first_divergence, name=zero))), -1,
                                   missing=missing))
    return decide(f, tests, "rule: level 4's greedy tokens leave FP32's sooner than its level-0 twin's, paired on the "
                            "seed, per placement, norm and setting")


# ------------------------------------------------------------------------------------ claim 15


def predictor_rows(results: dict | None, *, engines: bool = True) -> list[dict]:
    """The recipes (and, with ``engines``, other engines' rows) with KL, PPL ratio and first divergence."""
    rows = []
    for m in results_file.generation_models(results):
        r = results_file.recipe(results, m.name)
        if r is None or not m.ok or _first(m.agreement) is None:
            continue
        rows.append({"name": m.name, "kld": r.metric("kld_mean"), "ppl_ratio": r.metric("ppl_ratio"),
                     "first": _first(m.agreement)})
    if engines:
        for e in results_file.engine_rows(results):
            acc, agree = e.get("accuracy") or {}, e.get("agreement")
            if e.get("status") == "ok" and _first(agree) is not None:
                rows.append({"name": f"{e.get('engine')} {e.get('format')}", "kld": acc.get("kld_mean"),
                             "ppl_ratio": acc.get("ppl_ratio"), "first": _first(agree)})
    return [r for r in rows if finite([r["kld"], r["ppl_ratio"], r["first"]]) and r["ppl_ratio"] > 0]


def _strengths(rows: list[dict]) -> tuple[float | None, float | None]:
    """(-rho(KL, first divergence), -rho(|ln PPL ratio|, first divergence)): > 0 when the measure rises
    as generation leaves FP32's sooner; None where a correlation is undefined."""
    if len(rows) < 3:
        return None, None
    first = [r["first"] for r in rows]
    out = []
    for x in ([r["kld"] for r in rows], [abs(math.log(r["ppl_ratio"])) for r in rows]):
        if len(set(x)) < 2 or len(set(first)) < 2:
            out.append(None)
        else:
            rho = float(scipy_stats().spearmanr(x, first).statistic)
            out.append(None if math.isnan(rho) else -rho)
    return out[0], out[1]


def kl_answer(results: dict | None, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Claim 15 on one model: both predictors' strength across its recipes and engines, and a 95%
    bootstrap interval (recipes resampled) of the difference KL minus PPL ratio."""
    rows = predictor_rows(results)
    s_kl, s_ppl = _strengths(rows)
    out = {"rows": rows, "n": len(rows), "kl": s_kl, "ppl": s_ppl, "lo": None, "hi": None, "verdict": NOT_TESTED,
           "why": ""}
    if s_kl is None or s_ppl is None:
        out["why"] = ("fewer than 3 recipes and engines with generation agreement, or no spread in a measure"
                      if len(rows) < 3 else "no spread in KL, PPL ratio or first divergence")
        return out
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(resamples):
        k, p = _strengths([rows[i] for i in rng.integers(0, len(rows), len(rows))])
        if k is not None and p is not None:
            diffs.append(k - p)
    if len(diffs) < resamples // 2:
        out["why"] = "too few resamples with a defined correlation"
        return out
    out["lo"], out["hi"] = (float(v) for v in np.percentile(diffs, [2.5, 97.5]))
    out["verdict"] = HOLDS if out["lo"] > 0 else DOES_NOT_HOLD if out["hi"] < 0 else NOT_SIGNIFICANT
    return out


def kl_sentence(answer: dict) -> str:
    if answer["verdict"] == NOT_TESTED:
        return f"Claim 15 (KL predicts generation better than the PPL ratio): **{NOT_TESTED}** ({answer['why']})."
    return (f"Claim 15 (KL predicts how soon greedy generation leaves FP32's better than the PPL ratio): across "
            f"{answer['n']} recipes and engines, -Spearman rho with the first divergence is {answer['kl']:+.2f} for KL "
            f"and {answer['ppl']:+.2f} for |ln PPL ratio|; KL minus PPL {answer['kl'] - answer['ppl']:+.2f}, 95% "
            f"bootstrap interval over the recipes [{answer['lo']:+.2f}, {answer['hi']:+.2f}]. **{answer['verdict']}**.")


def claim_kl_predicts(sweep: Sweep, full: Sweep | None = None) -> Finding:
    full = full or sweep
    f = Finding(15, "Mean KL predicts how soon a quantized model's greedy generation leaves FP32's better than the "
                    "perplexity ratio does", "llama.cpp PRs #5076, #5081; ik_llama.cpp PR #325", NOT_TESTED)
    if not any(len(predictor_rows(c.results)) >= 3 for c in full.cells if c.results):
        f.why = "the cells carry no generation agreement for 3 or more recipes: sweep with --generation"
        return f
    f.lines.append("per cell: -Spearman rho, across its recipes, of KL and of |ln PPL ratio| with the mean "
                   "first-divergence position; the value per seed is KL's minus the PPL ratio's")

    def difference(c: CellResult) -> float | None:
        k, p = _strengths(predictor_rows(c.results))
        return None if k is None or p is None else k - p
    tests = []
    for p, norm, depth, warmup, lr in strata(full.cells, "placement", "norm", "depth", "warmup", "lr"):
        where = dict(placement=p, norm=norm, depth=depth, warmup=warmup, lr=lr)
        bad = arm_why(full, p, **where)
        tests.append(sign_test(full.axes_label(**where).strip(), "rank-correlation strength, KL minus PPL ratio "
                                                                 "(> 0: KL predicts better)",
                               by_seed(sweep.select(**where), difference), +1,
                               missing=bad if "collapsed" in bad or "diverged" in bad else None))
    return decide(f, tests, "rule: KL's rank correlation with the first divergence stronger than the PPL ratio's, "
                            "per seed, per placement, norm and setting")


# ------------------------------------------------------------------------------------ sweep section


def first_divergence(c: CellResult, name: str) -> float | None:
    """A cell's mean first divergence from FP32's greedy tokens under recipe ``name`` (None: not measured)."""
    return _first(_agreement(c.results, name))


def generation_section(sweep: Sweep) -> list[str]:
    """``## Generation``: for each recipe, every placement's greedy tokens against FP32's (mean first
    divergence over seeds, 95% interval), and each placement against Pre-LN, paired on the seed with
    Holm's correction over the section's comparisons. Empty when no trained cell measured generation."""
    names = [n for n in sweep.recipes() if any(first_divergence(c, n) is not None for c in sweep.cells)]
    if not names:
        return []
    new = next((a.get("new_tokens") for c in sweep.cells for m in results_file.generation_models(c.results)
                if (a := m.agreement)), None)
    L = ["", "## Generation: does the placement change what INT8 generates? (trained cells)", "",
         f"Greedy generation from the same prompts by each recipe's with-past model and by FP32's, {new} new tokens "
         "each: the mean position of the first token that differs from FP32's (higher: the quantized model keeps "
         "generating FP32's text for longer). Then each placement against Pre-LN, paired on the seed (> 0: the "
         "placement's INT8 keeps FP32's tokens longer), Holm-corrected over the section's comparisons.", ""]
    tests = []
    for name in names:
        rows = []
        for norm, depth, warmup, lr in strata(sweep.cells, "norm", "depth", "warmup", "lr"):
            where = dict(norm=norm, depth=depth, warmup=warmup, lr=lr)
            of_recipe = partial(first_divergence, name=name)
            pre = by_seed(sweep.select(placement="pre", **where), of_recipe)
            for p in placements_in(sweep, sweep.select(**where)):
                mine = by_seed(sweep.select(placement=p, **where), of_recipe)
                if not mine:
                    continue
                rows.append([sweep.axes_label(placement=p, **where).strip(), estimate(mine.values()).format(".1f")])
                if p != "pre" and pre:
                    tests.append(sign_test(sweep.axes_label(placement=p, **where).strip(),
                                           f"`{name}`: first divergence, {p} minus pre (tokens)",
                                           paired(mine, pre), +1))
        L += [f"### `{name}`", ""] + table(["setting", f"first divergence (of {new} tokens)"], rows) + [""]
    if tests:
        holm(tests)
        L += ["### Each placement against Pre-LN", ""] + [f"- {t.line()}" for t in tests] + [""]
    return L
