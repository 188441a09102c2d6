"""The run report's engines section (quantnorm.report.engines): quantnorm's rows beside other
engines' in one table, the picks a user asks for, the Pareto front and the plot.

The results are built here: quantnorm's rows as the pipeline writes them (recipes, generation,
file sizes) and an engines section of the fixed schema with made-up numbers. This tests the
renderer, not an engine (tests/test_engine_ortgenai.py runs one for real).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from quantnorm import results as results_file
from quantnorm.report import engines as report_engines
from quantnorm.report import write_report
from quantnorm.report.run import render

CPU = "CPUExecutionProvider"
REPORTS = Path(__file__).resolve().parents[1] / "reports"


def decode(prompt: float, gen: float) -> list[dict]:
    return [{"provider": CPU, "batch": 1, "prompt_tokens": 128, "new_tokens": 128, "status": "measured",
             "prompt_tokens_per_s": prompt, "gen_tokens_per_s": gen},
            {"provider": CPU, "batch": 4, "status": "measured", "prompt_tokens_per_s": 9 * prompt,
             "gen_tokens_per_s": 3 * gen}]   # batch 4: not what the table shows


def accuracy(ppl: float, kld: float, top1: float) -> dict:
    return {"ppl_ratio": ppl, "kld_mean": kld, "kld_p99": 10 * kld, "top1_agreement": top1}


def agreement(identical: float) -> dict:
    return {"identical_before_divergence": identical, "first_divergence_mean": 40.0, "identical_prompts": 2,
            "prompts": 8, "kl_mean": 0.01, "top1_along_fp32": 0.97, "new_tokens": 64}


def engine_row(fmt: str, size: int, acc: dict, identical: float, prompt: float, gen: float) -> dict:
    return {"format": fmt, "status": "ok", "path": f"engines/x/{fmt}", "size_bytes": size,
            "settings": {"threads": 2, "type": fmt}, "accuracy": {**acc, "n_scored": 4000},
            "agreement": agreement(identical),
            "speed": {"prompt_tokens": 128, "new_tokens": 128, "prompt_tok_s": prompt, "gen_tok_s": gen, "rounds": 2,
                      "token_ms_p50": 1000 / gen}}


ENGINES = {"status": "ok", "engines": [
    {"engine": "llamacpp", "version": "0.3.36", "rows": [
        engine_row("F32", 540_000_000, accuracy(1.0, 2e-5, 0.999), 1.0, 700.0, 60.0),
        engine_row("Q8_0", 145_000_000, accuracy(1.0057, 0.004, 0.985), 0.8, 531.0, 136.5),
        engine_row("Q4_K_M", 105_000_000, accuracy(1.0702, 0.0534, 0.88), 0.3, 446.0, 128.0),
        {"format": "Q4_0", "status": "not measured: llama-quantize exited 1"}]},
    {"engine": "ortgenai", "version": "0.18.0", "rows": [
        engine_row("int4-b32-acc4", 120_000_000, accuracy(1.08, 0.06, 0.87), 0.25, 800.0, 160.0)]}]}


def make_results(with_engines: bool = True) -> dict:
    results = {
        "schema_version": 2, "command": "quantnorm evaluate --model m.gguf", "model": {"source": "hf:../ckpt"},
        "policy": {"max_ppl_ratio": 1.01, "max_kld": 0.01, "max_kld_p99": None, "min_top1": 0.98},
        "recipes": [
            {"name": "dynamic", "status": "ok", "size_bytes": 250_000_000, "accuracy": accuracy(1.004, 0.003, 0.985)},
            {"name": "static", "status": "ok", "accuracy": accuracy(1.05, 0.04, 0.93)},
            {"name": "smooth", "status": "broken: PPL ratio 9.1", "damage": accuracy(9.1, 2.0, 0.2)}],
        "file_sizes_bytes": {"fp32": 540_000_000, "dynamic": 250_000_000, "static": 249_000_000},
        "generation": {"status": "measured", "settings": {}, "models": [
            {"name": "fp32", "status": "ok", "decode": decode(1000.0, 100.0)},
            {"name": "dynamic", "status": "ok", "agreement": agreement(0.9), "decode": decode(900.0, 90.0)},
            {"name": "static", "status": "ok", "agreement": agreement(0.5), "decode": decode(1200.0, 130.0)}]},
    }
    if with_engines:
        results["engines"] = copy.deepcopy(ENGINES)
    return results


def table_rows(lines: list[str]) -> list[list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith("| engine |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_one_table_holds_quantnorms_rows_then_each_engines():
    lines = report_engines.engines(make_results())
    assert lines[1] == "## Other engines, same checkpoint"
    rows = table_rows(lines)
    assert [(r[0], r[1]) for r in rows] == [
        ("quantnorm", "`fp32`"), ("quantnorm", "`dynamic`"), ("quantnorm", "`static`"),   # the broken one is left out
        ("llamacpp 0.3.36", "`F32`"), ("llamacpp 0.3.36", "`Q8_0`"), ("llamacpp 0.3.36", "`Q4_K_M`"),
        ("ortgenai 0.18.0", "`int4-b32-acc4`")]
    fp32, dynamic, static, _, q8, _, ort = rows
    assert fp32 == ["quantnorm", "`fp32`", "1.0000", "0", "100.00%", "reference", "1,000", "100.0", "540.00 MB",
                    "reference"]
    # quantnorm's rows: accuracy from the recipes, agreement and batch-1 CPU speed from generation
    assert dynamic == ["quantnorm", "`dynamic`", "1.0040", "0.003", "98.50%", "90.00%", "900", "90.0", "250.00 MB",
                       "yes"]
    assert static[2:9] == ["1.0500", "0.04", "93.00%", "50.00%", "1,200", "130.0", "249.00 MB"]  # file_sizes_bytes
    assert static[9] == "no: ppl_ratio 1.05 not <= 1.01; kld_mean 0.04 not <= 0.01; top1_agreement 0.93 not >= 0.98"
    assert q8 == ["llamacpp 0.3.36", "`Q8_0`", "1.0057", "0.004", "98.50%", "80.00%", "531", "136.5", "145.00 MB",
                  "yes"]
    assert ort[9].startswith("no: ppl_ratio 1.08")
    text = "\n".join(lines)
    assert "Accuracy goal (the run's policy): ppl_ratio <= 1.01, kld_mean <= 0.01, top1_agreement >= 0.98." in text


def test_the_picks_the_front_and_what_was_not_measured():
    text = "\n".join(report_engines.engines(make_results()))
    # faster than FP32's 100 tok/s: static, Q8_0, Q4_K_M, int4; the lowest KL of those is Q8_0
    assert "- **Most accurate at FP32's generation speed or faster** (KL mean): `llamacpp Q8_0`: KL 0.004, " \
           "PPL ratio 1.0057, top-1 98.50%, generation agreement 80.00%, 136.5 generation tok/s, 531 prompt tok/s, " \
           "145.00 MB." in text
    # within the goal: FP32, dynamic (90), F32 (60), Q8_0 (136.5)
    assert "- **Fastest within the accuracy goal** (generation tok/s): `llamacpp Q8_0`: KL 0.004" in text
    assert "- **Pareto front** (no other row has both a lower KL and more generation tok/s): " \
           "`ortgenai int4-b32-acc4`, `llamacpp Q8_0`, `dynamic`, `llamacpp F32`." in text
    assert "- `llamacpp Q4_0`: not measured: llama-quantize exited 1" in text
    assert "- `ortgenai int4-b32-acc4` (ortgenai 0.18.0): threads `2`, type `int4-b32-acc4`" in text
    assert "Plot: [KL mean against generation tokens/s](plots/engines.png)." in text


def test_pareto_front_keeps_only_rows_nothing_beats_on_both():
    rows = [report_engines.Row("e", "1", name, "ok", {"kld_mean": kl}, gen_tok_s=speed)
            for name, kl, speed in [("a", 0.1, 200.0), ("b", 0.2, 150.0), ("c", 0.01, 150.0), ("d", 0.01, 100.0),
                                    ("e", 0.001, 50.0), ("f", 0.5, 300.0), ("g", 0.5, 250.0)]]
    rows.append(report_engines.Row("quantnorm", None, "fp32", "ok", {"kld_mean": 0.0}, gen_tok_s=400.0, reference=True))
    rows.append(report_engines.Row("e", "1", "off", "not measured: x", {}))
    assert [r.format for r in report_engines.pareto_front(rows)] == ["f", "a", "c", "e"]


def test_picks_say_when_fp32_is_the_answer_or_nothing_is_fast_enough():
    results = make_results()
    results["policy"]["max_kld"] = 1e-6   # nothing quantized meets it; FP32 does
    for engine in results["engines"]["engines"]:
        for row in engine["rows"]:
            if "speed" in row:
                row["speed"]["gen_tok_s"] = 50.0
    results["generation"]["models"][2]["decode"] = decode(1200.0, 70.0)
    text = "\n".join(report_engines.engines(results))
    assert "(KL mean): none: no model generates at FP32's 100.0 tok/s or faster." in text
    assert "(generation tok/s): `fp32`: KL 0, PPL ratio 1.0000, top-1 100.00%, 100.0 generation tok/s" in text
    assert "(FP32 itself: no quantized model is both faster and within the goal)." in text


def test_plot_is_written_and_a_run_without_engines_gets_neither_table_nor_plot(tmp_path):
    made = report_engines.plot(tmp_path, make_results(), tmp_path / "plots")
    assert made == {"KL mean against generation tokens/s": "plots/engines.png"}
    png = tmp_path / "plots" / "engines.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "plots").glob("*.tmp"))
    without = make_results(with_engines=False)
    assert report_engines.engines(without) == []
    assert report_engines.plot(tmp_path / "other", without, tmp_path / "other" / "plots") == {}
    assert not (tmp_path / "other").exists()
    real = json.loads((REPORTS / "real-models" / "minilm" / "results.json").read_text())   # a run without engines
    assert "engines" not in real and "Other engines" not in render(real, {})


def test_an_engines_section_that_measured_nothing_says_why():
    results = make_results()
    results["engines"] = {"status": "not measured: no engine installed (pip install 'quantnorm[llamacpp]')",
                          "engines": []}
    assert report_engines.engines(results)[3:] == [
        "Other engines: not measured: no engine installed (pip install 'quantnorm[llamacpp]').", ""]
    assert results_file.engine_rows(results) == []


def test_the_run_report_of_a_real_run_carries_the_table_and_the_plot(tmp_path):
    """The committed SmolLM2 run (its recipes, generation and sizes as measured) with an engines section."""
    run = tmp_path / "run"
    run.mkdir()
    results = json.loads((REPORTS / "real-models" / "smollm2" / "results.json").read_text())
    results["engines"] = copy.deepcopy(ENGINES)
    report = write_report(run, results).read_text()
    section = report[report.index("## Other engines, same checkpoint"):]
    rows = table_rows(section.splitlines())
    fp32 = next(m for m in results["generation"]["models"] if m["name"] == "fp32")
    b1 = next(d for d in fp32["decode"] if d["batch"] == 1 and d["provider"] == "CPUExecutionProvider")
    assert rows[0][:2] == ["quantnorm", "`fp32`"] and rows[0][7] == f"{b1['gen_tokens_per_s']:,.1f}"   # batch-1 CPU
    scored = [r["name"] for r in results["recipes"] if r.get("status") == "ok" and r.get("accuracy")]
    assert [r[1] for r in rows[1:1 + len(scored)]] == [f"`{n}`" for n in scored]
    assert rows[-1][:2] == ["ortgenai 0.18.0", "`int4-b32-acc4`"]
    assert "![KL mean against generation tokens/s](plots/engines.png)" in report
    assert (run / "plots" / "engines.png").is_file()


def test_the_goal_against_llamacpp_is_read_as_ratios_of_the_same_run():
    text = "\n".join(report_engines.engines(make_results()))
    # dynamic (KL 0.003) is the only recipe at Q8_0's KL (0.004) or lower: 90 against 136.5 generated tok/s
    assert ("- **Against llama.cpp Q8_0**, same CPU, threads and tokens, in this run: `dynamic` (of the quantnorm "
            "rows at Q8_0's KL or lower, the one meeting the most goals, then the fastest: 0.0030 against 0.0040): generation 90.0 against 136.5 tok/s = 0.66x (goal "
            "1x: missed by 34%); prompt 900.0 against 531.0 tok/s = 1.69x (goal 2x: missed by 15%).") in text
    assert "- **Against llama.cpp Q4_K_M** (KL 0.0534): generation 90.0 against 128.0 tok/s = 0.70x; prompt" in text
    results = make_results()
    results["recipes"][0]["accuracy"]["kld_mean"] = 0.005
    assert "no quantnorm recipe in this run is as accurate" in "\n".join(report_engines.engines(results))
    results["engines"]["engines"][0]["rows"] = results["engines"]["engines"][0]["rows"][:1]   # F32 only
    assert "Against llama.cpp" not in "\n".join(report_engines.engines(results))


def test_the_row_read_against_llamacpp_meets_the_most_goals_then_generates_fastest():
    """Among the rows at Q8_0's KL or lower: the most goals met (both beat a faster generation that
    misses the prompt goal; of one, the generation goal first), then the fastest generation."""
    from quantnorm.report.engines import QUANTNORM, Row, versus_llamacpp

    def row(name, kld, prompt, gen, engine=QUANTNORM):
        return Row(engine, None, name, "ok", {"kld_mean": kld}, None, prompt, gen)
    q8 = row("Q8_0", 0.005, 800.0, 100.0, engine="llamacpp")
    wo, split, slow = row("wo", 0.002, 1200.0, 110.0), row("wo+prefill-pt", 0.003, 1700.0, 105.0), \
        row("pt", 0.001, 2000.0, 90.0)
    inaccurate = row("int4", 0.05, 3000.0, 200.0)
    assert versus_llamacpp([q8, wo, split, slow, inaccurate]).ours is split
    split_slow = row("wo+prefill-pt", 0.003, 1700.0, 95.0)
    assert versus_llamacpp([q8, wo, split_slow, slow]).ours is wo          # only wo meets the generation goal
    assert versus_llamacpp([q8, slow, split_slow]).ours is split_slow      # the prompt goal each: the fastest generation
    none = row("wo", 0.002, 1200.0, 99.0)
    assert versus_llamacpp([q8, none, split_slow]).ours is split_slow      # one goal beats none, however fast
    assert versus_llamacpp([q8, inaccurate]).ours is None
