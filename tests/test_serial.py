"""EvaluateConfig and RunConfig to and from JSON (quantnorm.serial): what a sweep cell is given.

The round trip must be exact through JSON text, an unknown key (a misspelling, a retired setting)
must be refused naming it, and a mistyped value must fail naming its key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import pytest

from quantnorm.config import EvaluateConfig
from quantnorm.data import DataConfig
from quantnorm.errors import ConfigError
from quantnorm.models import ModelConfig
from quantnorm.train import DEFAULT_WARMUP, RunConfig, TrainConfig, default_warmup


def _through_json(d: dict) -> dict:
    return json.loads(json.dumps(d))


def _unusual_evaluate() -> EvaluateConfig:
    """Every field away from its default, so that a field the round trip drops cannot go unseen."""
    return EvaluateConfig(
        recipes=("auto", "dynamic", "smoothquant"), providers=("cpu",), calib_samples=7, opset=23,
        graph_optimization_level="basic", threads=3, latency_batches=(2, 4), latency_iters=9, latency_warmup=1, latency_seconds=7.5,
        eval_batch_size=5, parity_windows=2, probe_windows=6, outliers=False, progress=False, sq_alpha=0.35,
        max_ppl_ratio=1.02, min_top1=0.97, max_kld=0.004, max_kld_p99=0.05, search_pick="first", search_space=("dynamic",),
        search_budget_min=12.5, exclude=("head/*", "blocks.0.mlp.down/*"), generation=True, gen_batches=(2,), gen_prompt_tokens=32,
        gen_new_tokens=16, gen_rounds=3, agreement_prompts=5, agreement_new_tokens=12, gen_prefill_recipe="dynamic",
        engines=("llamacpp",),
        llamacpp_types=("Q8_0",), probe_picks_recipes=True,
    )


def test_every_evaluate_field_is_away_from_its_default_in_the_fixture():
    default, unusual = EvaluateConfig(), _unusual_evaluate()
    assert [f.name for f in fields(EvaluateConfig) if getattr(default, f.name) == getattr(unusual, f.name)] == []


def test_evaluate_config_round_trips_exactly_through_json():
    cfg = _unusual_evaluate()
    d = cfg.to_dict()
    assert set(d) == {f.name for f in fields(EvaluateConfig)}
    assert d["exclude"] == ["head/*", "blocks.0.mlp.down/*"] and d["providers"] == ["CPUExecutionProvider"]
    back = EvaluateConfig.from_dict(_through_json(d))
    assert back == cfg and isinstance(back.exclude, tuple) and isinstance(back.latency_batches, tuple)
    assert EvaluateConfig.from_dict(_through_json(EvaluateConfig().to_dict())) == EvaluateConfig()


def test_run_config_round_trips_exactly_and_keeps_the_layout_its_hash_is_taken_over():
    run = RunConfig(ModelConfig(placement="deepnorm", norm="layer", n_layers=2, d_model=48, n_heads=3, context=16),
                    TrainConfig(steps=50, batch_size=4, lr=1.234e-3, warmup=7, min_lr_ratio=0.2, weight_decay=0.05,
                                grad_clip=0.5, seed=11),
                    DataConfig(corpus="/tmp/c.txt", calibration_fraction=0.2, evaluation_fraction=0.15))
    assert RunConfig.from_dict(_through_json(run.to_dict())) == run
    # config.json and the checkpoint-reuse hash were written from this layout before serial existed
    assert run.to_dict() == {"model": asdict(run.model), "train": asdict(run.train), "data": asdict(run.data)}


@pytest.mark.parametrize("build, data, key", [
    (EvaluateConfig.from_dict, {"opt_level": "all"}, "'opt_level'"),
    (EvaluateConfig.from_dict, {"recipes": ["dynamic"], "exclude_nodes": ["head/*"]}, "'exclude_nodes'"),
    (RunConfig.from_dict, {"model": {"placement": "pre"}, "optimizer": {}}, "'optimizer'"),
    (RunConfig.from_dict, {"train": {"stepz": 10}}, "'stepz'"),
])
def test_an_unknown_key_is_refused_naming_it(build, data, key):
    with pytest.raises(ConfigError, match=f"unknown key {key}"):
        build(data)


@pytest.mark.parametrize("data, where", [
    ({"calib_samples": "8"}, "calib_samples must be an integer"),
    ({"outliers": 1}, "outliers must be true or false"),
    ({"exclude": "head/*"}, "exclude must be a list"),
    ({"latency_batches": [1, "8"]}, "latency_batches[1] must be an integer"),
    ({"min_top1": "high"}, "min_top1 must be a number or null"),
])
def test_a_mistyped_value_is_refused_naming_its_key(data, where):
    with pytest.raises(ConfigError) as exc:
        EvaluateConfig.from_dict(data)
    assert where in str(exc.value)


def test_a_key_left_out_takes_its_default_and_the_values_are_still_validated():
    assert EvaluateConfig.from_dict({"recipes": ["dynamic"]}) == EvaluateConfig(recipes=("dynamic",))
    with pytest.raises(ConfigError, match="unknown recipe|nope"):
        EvaluateConfig.from_dict({"recipes": ["nope"]})
    with pytest.raises(ConfigError, match="not divisible"):
        RunConfig.from_dict({"model": {"d_model": 30, "n_heads": 4}})


def test_the_warmup_rule():
    assert default_warmup(400) == DEFAULT_WARMUP == TrainConfig().warmup
    assert default_warmup(8) == 2 and default_warmup(0) == 0
