"""Claims 14 (accuracy_level 4 changes greedy generations) and 15 (KL predicts generation better than
the PPL ratio): on one run's results and on a sweep of cells, with synthetic numbers chosen so each
verdict is known (no engine runs here: the generation stage's own tests measure agreement)."""

from __future__ import annotations

from pathlib import Path

from quantnorm.report.claims_generation import (
    kl_answer,
    kl_sentence,
    level4_answer,
    level4_sentence,
    level_pairs,
)
from quantnorm.report.findings import findings
from quantnorm.report.stats import DOES_NOT_HOLD, HOLDS, NOT_SIGNIFICANT, NOT_TESTED
from quantnorm.report.sweep import CellResult, Sweep

NEW = 64
PROMPTS = 16


def wo(name: str, level: int, kld: float, ppl: float, *, bits: int = 8, rotation: str | None = None) -> dict:
    return {"name": name, "status": "ok", "accuracy": {"kld_mean": kld, "ppl_ratio": ppl},
            "settings": {"format": "MatMulNBits", "accuracy_level": level, "bits": bits, "block_size": 32,
                         "weight_rounding": "rtn", "head": "quantized", "rotation": rotation}}


def agreement(firsts: list[int]) -> dict:
    return {"prompts": len(firsts), "new_tokens": NEW, "first_divergence": firsts,
            "first_divergence_mean": sum(firsts) / len(firsts), "identical_prompts": sum(f == NEW for f in firsts)}


def run(recipes: list[dict], firsts: dict[str, list[int] | None], *, massive: int = 3, engines=()) -> dict:
    models = [{"name": "fp32", "status": "ok", "agreement": None}]
    for name, f in firsts.items():
        a = agreement(f) if f is not None else None
        if a is not None and name.endswith("-summary"):   # a run written before per-prompt positions
            a.pop("first_divergence")
        models.append({"name": name.removesuffix("-summary"), "status": "ok", "agreement": a})
    r = {"recipes": recipes, "generation": {"status": "measured", "models": models},
         "outliers": {"residual": [], "massive": [{}] * massive}}
    if engines:
        r["engines"] = {"status": "ok", "engines": [{"engine": "llamacpp", "version": "0", "rows": list(engines)}]}
    return r


def test_level_pairs_match_the_twin_with_the_same_weights():
    r = run([wo("a0", 0, 0.001, 1.001), wo("a4", 4, 0.004, 1.004), wo("b4", 4, 0.01, 1.01, bits=4),
             wo("r4", 4, 0.002, 1.002, rotation="stream")], {})
    pairs = level_pairs(r)
    assert [(p.level4.name, p.level0.name) for p in pairs] == [("a4", "a0")]   # b4 and r4 have no level-0 twin


def test_claim_14_on_one_run_paired_on_the_prompt():
    early = [10 + i for i in range(PROMPTS)]
    late = [NEW] * PROMPTS
    holds = level4_answer(run([wo("a0", 0, 0.001, 1.001), wo("a4", 4, 0.004, 1.004)], {"a0": late, "a4": early}))
    assert holds["verdict"] == HOLDS and "Wilcoxon" in holds["pairs"][0]["test"]
    assert holds["pairs"][0]["p"] < 0.01 and holds["massive"] == 3
    text = level4_sentence(holds)
    assert "first divergence at token 17.5 against 64.0 of 64" in text and "3 massive activations" in text
    reverse = level4_answer(run([wo("a0", 0, 0.001, 1.001), wo("a4", 4, 0.004, 1.004)], {"a0": early, "a4": late}))
    assert reverse["verdict"] == DOES_NOT_HOLD
    same = level4_answer(run([wo("a0", 0, 0.001, 1.001), wo("a4", 4, 0.004, 1.004)], {"a0": late, "a4": late}))
    assert same["verdict"] == NOT_SIGNIFICANT and same["pairs"][0]["p"] == 1.0


def test_claim_14_on_a_run_without_per_prompt_positions_uses_the_identical_prompts():
    r = run([wo("a0", 0, 0.001, 1.001), wo("a4", 4, 0.004, 1.004)],
            {"a0-summary": [NEW] * 10 + [40] * 6, "a4-summary": [NEW] * 6 + [30] * 10})
    answer = level4_answer(r)
    assert "Fisher" in answer["pairs"][0]["test"] and answer["verdict"] == NOT_SIGNIFICANT   # 6 vs 10 of 16
    assert "6 against 10 of 16 prompts" in level4_sentence(answer)
    none = level4_answer(run([wo("a0", 0, 0.001, 1.001)], {}))
    assert none["verdict"] == NOT_TESTED and "wo-int8-b32,wo-int8-b32-acc4" in level4_sentence(none)
    missing = level4_answer(run([wo("a0", 0, 0.001, 1.001), wo("a4", 4, 0.004, 1.004)], {}))
    assert missing["verdict"] == NOT_TESTED and "--generation" in level4_sentence(missing)


def ladder(order_kl: list[float], order_ppl: list[float], firsts: list[float]) -> dict:
    recipes = [{"name": f"r{i}", "status": "ok", "accuracy": {"kld_mean": k, "ppl_ratio": p}}
               for i, (k, p) in enumerate(zip(order_kl, order_ppl, strict=True))]
    return run(recipes, {f"r{i}": [int(f)] * 4 for i, f in enumerate(firsts)})


def test_claim_15_on_one_run_kl_ranks_and_ppl_does_not():
    firsts = [60, 50, 40, 30, 20, 10, 5, 2]
    kl = [0.001, 0.002, 0.004, 0.008, 0.016, 0.03, 0.06, 0.12]        # rises as generation leaves sooner
    ppl = [1.05, 0.97, 1.04, 1.001, 1.03, 1.002, 1.02, 1.003]           # unrelated to it
    answer = kl_answer(ladder(kl, ppl, firsts))
    assert answer["n"] == 8 and answer["kl"] == 1.0 and answer["ppl"] < 0.5
    assert answer["verdict"] == HOLDS and answer["lo"] > 0, answer
    assert "across 8 recipes and engines" in kl_sentence(answer)
    tie = kl_answer(ladder(kl, [1 + k for k in kl], firsts))   # the same ranking: nothing to tell them apart
    assert tie["verdict"] == NOT_SIGNIFICANT
    few = kl_answer(ladder(kl[:2], ppl[:2], firsts[:2]))
    assert few["verdict"] == NOT_TESTED and "fewer than 3" in kl_sentence(few)


def test_claim_15_counts_other_engines_rows():
    engine = {"format": "Q8_0", "status": "ok", "accuracy": {"kld_mean": 0.005, "ppl_ratio": 1.002},
              "agreement": agreement([30] * 4)}
    r = run([{"name": "r0", "status": "ok", "accuracy": {"kld_mean": 0.001, "ppl_ratio": 1.001}}],
            {"r0": [60] * 4}, engines=[engine])
    assert [x["name"] for x in kl_answer(r)["rows"]] == ["r0", "llamacpp Q8_0"]


def cell(placement: str, seed: int, results: dict) -> CellResult:
    name = f"{placement}-rms-L4-w30-seed{seed}"
    return CellResult(name, Path(name), placement, "rms", 4, 30, seed, False,
                      {"eval_bits_per_byte": 3.0, "config": {"lr": 3e-3}}, results)


def test_claims_14_and_15_on_a_sweep():
    cells = []
    for s in range(3):
        jitter = s - 1
        r = ladder([0.001, 0.004, 0.01, 0.05], [1.03, 1.001, 1.02, 1.002], [60 + jitter, 40, 20, 5])
        r["recipes"] += [wo("wo0", 0, 0.001, 1.001), wo("wo4", 4, 0.004, 1.004)]
        r["generation"]["models"] += [{"name": "wo0", "status": "ok", "agreement": agreement([60 + jitter] * 4)},
                                      {"name": "wo4", "status": "ok", "agreement": agreement([30 + 2 * jitter] * 4)}]
        cells.append(cell("pre", s, r))
    found = {f.number: f for f in findings(Sweep(Path("synthetic"), cells, None))}
    assert found[14].verdict == HOLDS, found[14].lines
    assert "`wo4` minus `wo0`" in found[14].lines[-1] and "massive activations" in found[14].lines[0]
    assert found[15].verdict == HOLDS, found[15].lines
    plain = {f.number: f for f in findings(Sweep(Path("synthetic"), [cell("pre", s, {"recipes": []})
                                                                       for s in range(3)], None))}
    assert plain[14].verdict == NOT_TESTED and "wo-int8-b32-acc4 --generation" in plain[14].why
    assert plain[15].verdict == NOT_TESTED and "--generation" in plain[15].why


def test_the_sweep_report_compares_placements_by_generation():
    from quantnorm.report.claims_generation import generation_section
    cells = []
    for p, base in (("pre", 20), ("peri", 50)):
        for s in range(3):
            r = ladder([0.01], [1.01], [base + s])
            cells.append(cell(p, s, r))
    text = "\n".join(generation_section(Sweep(Path("synthetic"), cells, None)))
    assert "## Generation: does the placement change what INT8 generates?" in text
    assert "| pre rms | 21.0 [" in text and "| peri rms | 51.0 [" in text
    assert "`r0`: first divergence, peri minus pre (tokens): +30" in text and "**holds here**" in text
    assert generation_section(Sweep(Path("synthetic"), [cell("pre", 0, {"recipes": []})], None)) == []
