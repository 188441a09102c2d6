"""Without --recipes, evaluate probes the FP32 model first and, when the probe finds massive
activations in a language model, quantizes with the recipes that survive them instead of the
default set (quantnorm.evaluate.choose_recipes); the report's verdict says why. A sweep never swaps."""

import json
from pathlib import Path

import click
import pytest
from gguf_helpers import write_tiny_llama_gguf

from quantnorm.cli import main
from quantnorm.cli_flags import evaluate_config, evaluate_options
from quantnorm.quantize import DEFAULT_RECIPES, MASSIVE_DEFAULT_RECIPES, get_recipe

SMALL = ["--context", "16", "--eval-tokens", "96", "--calib-samples", "4", "--batches", "1", "--iters", "2",
         "--providers", "cpu", "--threads", "1", "--quiet", "--no-generation"]


def evaluate_without_recipes(tmp_path: Path, massive) -> dict:
    gguf = write_tiny_llama_gguf(tmp_path / "Tiny-Llama.F32.gguf", massive=massive)
    out = tmp_path / "run"
    assert main(["evaluate", "--model", str(gguf), "--out", str(out), *SMALL]) == 0
    results = json.loads((out / "results.json").read_text())
    return results | {"report_text": (out / "report.md").read_text()}


def test_massive_activations_swap_in_the_recipes_that_survive_them(tmp_path):
    results = evaluate_without_recipes(tmp_path, massive=(3, 300.0))   # BOS carries 300 in channel 3
    choice = results["recipe_choice"]
    assert choice["by"] == "probe" and choice["massive_total"] > 0
    assert choice["recipes"] == list(MASSIVE_DEFAULT_RECIPES) and choice["default_recipes"] == list(DEFAULT_RECIPES)
    assert [r["name"] for r in results["recipes"]] == list(MASSIVE_DEFAULT_RECIPES)
    assert all(r["status"] == "ok" for r in results["recipes"]), [(r["name"], r["status"]) for r in results["recipes"]]
    # the probe ran once, before quantizing; its answer is the outliers section
    assert "probe" in results["stage_seconds"]
    assert results["outliers"]["massive_total"] == choice["massive_total"]
    assert results["outliers"]["massive"][0]["channel"] == 3
    verdict = results["report_text"].split("## Verdict", 1)[1].split("\n## ", 1)[0]
    assert f"the probe found {choice['massive_total']} massive activation(s)" in verdict
    assert "`online-rotated-pertoken-fused-gptq`" in verdict and "instead of the default set" in verdict


def test_without_massive_activations_the_default_set_stands(tmp_path):
    results = evaluate_without_recipes(tmp_path, massive=None)
    choice = results["recipe_choice"]
    assert choice["massive_total"] == 0 and choice["recipes"] == list(DEFAULT_RECIPES)
    assert [r["name"] for r in results["recipes"]] == list(DEFAULT_RECIPES)
    assert "instead of the default set" not in results["report_text"]


def _flags(**given) -> dict:
    """evaluate's flags at their defaults, with ``given`` on top."""
    command = click.command()(evaluate_options(lambda **_: None))
    return {p.name: () if getattr(p, "multiple", False) else p.default for p in command.params} | given


@pytest.mark.parametrize("recipes, sweep, picks", [(None, False, True), ("dynamic", False, False),
                                                   (None, True, False)])
def test_only_an_evaluate_without_named_recipes_lets_the_probe_pick(recipes, sweep, picks):
    flags = _flags(recipes=recipes)
    cfg = evaluate_config(flags, progress=False, probe_picks_recipes=not sweep)
    assert cfg.probe_picks_recipes is picks


def test_the_massive_set_is_in_the_registry():
    for name in MASSIVE_DEFAULT_RECIPES:
        get_recipe(name)
    assert not set(MASSIVE_DEFAULT_RECIPES) & set(DEFAULT_RECIPES)


def test_scores_past_float64_are_a_broken_recipe_not_a_crash(tmp_path):
    # 3000 on BOS drives the tiny model's NLL past exp's range (PPL inf) and its INT8 scores to NaN
    gguf = write_tiny_llama_gguf(tmp_path / "Tiny-Llama.F32.gguf", massive=(3, 3000.0))
    out = tmp_path / "run"
    assert main(["evaluate", "--model", str(gguf), "--out", str(out), "--recipes", "dynamic,pertoken", *SMALL]) == 0
    recipes = json.loads((out / "results.json").read_text())["recipes"]   # validated when read back
    assert recipes and all(r["status"].startswith("broken: its scores are not finite") and "accuracy" not in r
                           and "FP32 inf;" in r["status"] and r["problems"] for r in recipes), recipes
