"""The verdict a run report opens with (quantnorm.report.verdict): judged by the run's own policy,
the fastest passing recipe shipped, or the closest named with why it fails and what to run next."""

from __future__ import annotations

import json
from pathlib import Path

from quantnorm.report.verdict import next_command, run_policy, verdict

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def _recipe(name: str, ppl: float, kld: float, top1: float) -> dict:
    return {"name": name, "status": "ok", "accuracy": {"ppl_ratio": ppl, "kld_mean": kld, "top1_agreement": top1}}


def _latency(variant: str, p50: float) -> dict:
    return {"provider": "CPUExecutionProvider", "variant": variant, "batch": 8, "seq": 128, "status": "measured",
            "p50_ms": p50}


def _results(recipes: list[dict], p50: dict[str, float], **extra) -> dict:
    return {"command": "quantnorm evaluate --model m.gguf --recipes static-minmax-matmul,dynamic --out runs/x",
            "recipes": recipes, "latency": [_latency("fp32", 10.0)] + [_latency(k, v) for k, v in p50.items()],
            **extra}


def test_the_fastest_recipe_within_the_policy_is_shipped():
    r = _results([_recipe("slow-good", 1.001, 0.001, 0.99), _recipe("fast-good", 1.005, 0.005, 0.985),
                  _recipe("fastest-bad", 1.2, 0.3, 0.7)],
                 {"slow-good": 8.0, "fast-good": 5.0, "fastest-bad": 3.0})
    text = "\n".join(verdict(r))
    assert "**Ship `fast-good`**" in text and "0.50x FP32's CPU latency at batch 8" in text
    assert "Also within the policy: `slow-good`" in text
    assert "fastest-bad" not in text
    # a run that recorded no policy is judged by the defaults of its time (top-1 0.98, not today's 0.95)
    assert "Policy (the default): PPL ratio <= 1.01, KL <= 0.01, top-1 >= 98.00%" in text


def test_the_run_s_recorded_policy_is_the_one_applied():
    r = _results([_recipe("a", 1.005, 0.005, 0.985)], {"a": 5.0},
                 policy={"max_ppl_ratio": 1.002, "max_kld": 0.01, "max_kld_p99": None, "min_top1": 0.98})
    policy, where = run_policy(r)
    assert where == "the run's" and policy.max_ppl_ratio == 1.002
    text = "\n".join(verdict(r))
    assert "No INT8 recipe of this run meets the policy" in text
    assert "ppl_ratio 1.005 not <= 1.002" in text


def test_none_passing_names_the_closest_and_the_search_command():
    r = _results([_recipe("static-minmax-matmul", 2.1, 0.8, 0.55), _recipe("dynamic", 1.05, 0.06, 0.87)],
                 {"static-minmax-matmul": 4.0, "dynamic": 5.0},
                 outliers={"massive": [{}, {}, {}]})
    text = "\n".join(verdict(r))
    assert "The closest, `dynamic`" in text and "kld_mean 0.06 not <= 0.01" in text
    assert "The probe found 3 massive activation(s)" in text
    assert "Next: `quantnorm evaluate --model m.gguf --recipes auto --out runs/x`" in text
    assert next_command({"command": "quantnorm evaluate --model m.gguf"}) == "quantnorm evaluate --model m.gguf --recipes auto"


def test_a_search_that_found_nothing_says_so_instead_of_suggesting_itself():
    r = _results([_recipe("dynamic", 1.05, 0.06, 0.87)], {"dynamic": 5.0},
                 search={"status": "failed", "target_max_ppl_ratio": 1.01, "target_max_kld": 0.007,
                         "target_min_top1": 0.95, "trials": [{}, {}, {}]})
    text = "\n".join(verdict(r))
    assert "Policy (the search's): PPL ratio <= 1.01, KL <= 0.007, top-1 >= 95.00%" in text
    assert "tried 3 candidates and none passed" in text and "Next:" not in text


def test_no_scored_recipe_and_an_encoder_and_a_collapsed_model():
    broken = _results([{"name": "x", "status": "broken: NaN", "accuracy": None}], {})
    assert "No INT8 model was scored" in "\n".join(verdict(broken))
    encoder = json.loads((REPORTS / "real-models" / "minilm" / "results.json").read_text())
    text = "\n".join(verdict(encoder))
    assert "No verdict: the acceptance policy's thresholds are language-model metrics" in text
    assert "Most faithful: `" in text and "cosine mean" in text
    collapsed = [json.loads(p.read_text()) for p in sorted((REPORTS / "reference" / "cells").glob("*/results.json"))]
    texts = ["\n".join(verdict(r)) for r in collapsed]
    assert sum("the model is collapsed" in t for t in texts) == 19   # reports/README: 19 of 102 collapsed
