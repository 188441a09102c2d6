"""The accuracy-aware search: INC drives the trials, it stops where asked, honours the target,
falls back to FP32 tensors when nothing passes, and picks the fastest passing model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from quantnorm.errors import ConfigError
from quantnorm.export import export_onnx
from quantnorm.measure.sessions import SessionSpec
from quantnorm.models import CausalLM, ModelConfig
from quantnorm.policy import Policy
from quantnorm.quantize import get_recipe
from quantnorm.search import SearchConfig, default_space, fallback_ks, recipe_space_config, search_recipes
from quantnorm.search_space import MASSIVE_ORDER, probe_ordered, pruned_by
from quantnorm.transforms.smoothquant import SmoothedModels

CONTEXT = 16
RNG = np.random.default_rng(1)
CALIB = RNG.integers(0, 256, size=(8, CONTEXT))
EVAL = RNG.integers(0, 256, size=(6, CONTEXT))
CALIB[:, 0] = EVAL[:, 0] = 256  # BOS
TARGETS = RNG.integers(0, 256, size=(6, CONTEXT))
SPEC = SessionSpec(threads=1)
THREE = ("static-minmax-matmul", "dynamic", "smoothquant")


def ppl_only(max_ppl_ratio: float, **thresholds) -> Policy:
    """A policy of the PPL ratio alone (and ``thresholds``): the tests below steer the search by it."""
    return Policy(**{"max_ppl_ratio": max_ppl_ratio, "max_kld": None, "min_top1": None, **thresholds})


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny pre/rms model, its FP32 export, and the SmoothQuant exports made on demand."""
    root = tmp_path_factory.mktemp("search")
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement="pre", norm="rms", n_layers=1, d_model=32, n_heads=2, context=CONTEXT))
    fp32 = root / "model.fp32.onnx"
    export_onnx(model, fp32, EVAL[:2])
    smoothed = SmoothedModels(model, CALIB, EVAL[:2], root)
    return root, fp32, smoothed


def run(lm, tmp_path, cfg: SearchConfig, latency=None):
    root, fp32, smoothed = lm
    return search_recipes(fp32, tmp_path / "work", CALIB, EVAL, TARGETS, cfg=cfg, spec=SPEC, vnni=False,
                          fp32_for=lambda r: smoothed.fp32_for(r, fp32),
                          latency_fn=latency or (lambda path, name: 1.0))


def test_target_mapping_to_inc_tolerable_loss():
    cfg = SearchConfig(policy=ppl_only(1.01))
    assert cfg.tolerable_loss == pytest.approx(1 - 1 / 1.01)
    for ratio in (0.9, 1.0, 1.005, 1.0099, 1.0101, 1.2):  # INC's rule on 1/ratio == "ratio <= target"
        assert (1 / ratio >= 1.0 * (1 - cfg.tolerable_loss)) == (ratio <= 1.01)


def test_inc_expands_the_recipe_space():
    configs = recipe_space_config(recipe=list(THREE)).expand()
    assert [c.recipe for c in configs] == list(THREE)
    configs = recipe_space_config(recipe="dynamic", exclude_worst=[1, 2, 4]).expand()
    assert [(c.recipe, c.exclude_worst) for c in configs] == [("dynamic", 1), ("dynamic", 2), ("dynamic", 4)]
    space = default_space()
    assert space[0] == "static-minmax-matmul" and "smoothquant" in space and "dynamic" in space
    assert "static-minmax-all" not in space


def test_fallback_ks():
    assert fallback_ks(1) == []
    assert fallback_ks(5) == [1, 2, 4]          # 1 block: qkv, proj, up, down, head inputs
    assert fallback_ks(9) == [1, 2, 4, 8]
    assert fallback_ks(13) == [1, 2, 4, 8, 12]  # never all: that would be the FP32 model


def test_config_errors():
    with pytest.raises(ConfigError):
        SearchConfig(pick="slowest")
    with pytest.raises(ConfigError):
        SearchConfig(policy=ppl_only(0))
    with pytest.raises(ConfigError):
        SearchConfig(space=("static-minmax-all",))
    with pytest.raises(ConfigError):
        SearchConfig(max_trials=0)


def test_generous_target_passes_on_the_first_trial_with_pick_first(lm, tmp_path):
    result = run(lm, tmp_path, SearchConfig(policy=ppl_only(10.0), pick="first", space=THREE))
    assert len(result.trials) == 1 and result.stopped_by == "target"
    assert result.status == "passed" and result.chosen.index == 1 and result.chosen.recipe == THREE[0]
    t = result.trials[0]
    assert t.status == "ok" and t.passed and t.metric == pytest.approx(1 / t.ppl_ratio)
    assert 0.9 < t.ppl_ratio < 1.1 and 0 <= t.top1_agreement <= 1


def test_search_stops_at_max_trials(lm, tmp_path):
    result = run(lm, tmp_path, SearchConfig(policy=ppl_only(0.5), space=THREE + ("static-entropy-matmul",), max_trials=2))
    assert [t.recipe for t in result.trials] == list(THREE[:2])  # no fallback: the budget is spent
    assert result.stopped_by == "max_trials" and result.status == "no passing model" and result.chosen is None
    # the best of the failed trials is the one with the highest metric (1 / PPL ratio)
    assert result.best is max(result.trials, key=lambda t: t.metric) and result.best.status == "ok"
    assert result.best.metric == pytest.approx(1 / min(t.ppl_ratio for t in result.trials))
    json.dumps(result.to_dict())


def test_impossible_target_falls_back_then_records_no_passing_model(lm, tmp_path):
    result = run(lm, tmp_path, SearchConfig(policy=ppl_only(0.5), space=("static-minmax-matmul",)))
    assert result.status == "no passing model" and result.chosen is None
    assert [t.phase for t in result.trials] == ["recipe", "fallback", "fallback", "fallback"]
    worst = result.worst_tensors
    assert len(worst) == 5  # inputs of q/k/v (one tensor), proj, up, down, head
    dbs = [w["sqnr_db"] for w in worst]
    assert dbs == sorted(dbs)
    assert sorted(n for w in worst for n in w["matmuls"]) == sorted(
        f"{m}/MatMul" for m in ("blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.attn.proj",
                                "blocks.0.mlp.up", "blocks.0.mlp.down", "head"))
    previous: set[str] = set()
    for trial, k in zip(result.trials[1:], (1, 2, 4), strict=True):
        assert trial.exclude_worst == k and trial.status == "ok"
        nodes = set(trial.excluded_nodes)
        assert nodes == {n for w in worst[:k] for n in w["matmuls"]} and previous < nodes
        previous = nodes
        # the excluded MatMuls really stayed FP32: no DequantizeLinear feeds them
        graph = onnx.load(str(trial.path)).graph
        dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
        quantized = {n.name for n in graph.node if n.op_type == "MatMul" and any(i in dq for i in n.input)}
        assert not (quantized & nodes) and quantized
    json.dumps(result.to_dict())


def test_pick_fastest_takes_the_fastest_passing_model(lm, tmp_path):
    fake_ms = {"static-minmax-matmul": 5.0, "dynamic": 3.0, "smoothquant": 1.0}
    result = run(lm, tmp_path, SearchConfig(policy=ppl_only(10.0), pick="fastest", space=THREE),
                 latency=lambda path, name: fake_ms[name])
    assert len(result.trials) == 3 and all(t.passed for t in result.trials)  # all timed before picking
    assert result.chosen.recipe == "smoothquant" and result.chosen.latency_p50_ms == 1.0
    assert result.trials[2].settings["smoothquant_alpha"] == 0.5
    # the same trials with pick="first" would have stopped at the first one
    assert run(lm, tmp_path, SearchConfig(policy=ppl_only(10.0), pick="first", space=THREE),
               latency=lambda path, name: fake_ms[name]).chosen.recipe == "static-minmax-matmul"


def test_pick_fastest_retimes_the_passing_models_side_by_side(lm, tmp_path):
    """Each trial is timed once, minutes apart; the pick re-times the passing ones in interleaved
    rounds and takes each one's lowest round: a first timing that flattered one model does not
    decide, nor does one round a neighbour slowed down."""
    calls: dict[str, int] = {}

    def drifting(path, name):   # the search's own timing of smoothquant caught a fast moment
        calls[name] = calls.get(name, 0) + 1
        if name == "smoothquant":
            return 1.0 if calls[name] == 1 else 9.0
        if name == "dynamic":   # its first round is slowed; the median of its rounds would be 3.5
            return {1: 3.0, 2: 20.0, 3: 3.0, 4: 3.5}[calls[name]]
        return 5.0

    result = run(lm, tmp_path, SearchConfig(policy=ppl_only(10.0), pick="fastest", space=THREE), latency=drifting)
    assert all(calls[n] == 1 + 3 for n in THREE)     # once in the search, then three rounds
    by_name = {t.recipe: t for t in result.trials}
    assert by_name["smoothquant"].latency_p50_ms == 1.0 and by_name["smoothquant"].latency_side_by_side_ms == 9.0
    assert result.chosen.recipe == "dynamic" and result.chosen.latency_side_by_side_ms == 3.0
    assert result.to_dict()["chosen"]["latency_side_by_side_ms"] == 3.0


def test_evaluate_wiring_keeps_the_chosen_model_as_auto_entry(lm, tmp_path):
    """evaluate's --recipes auto and SmoothQuant sections, without training a model."""
    from quantnorm.evaluate import AUTO, EvaluateConfig, run_search, smoothquant_section
    from quantnorm.measure.accuracy import compare
    from quantnorm.measure.sessions import make_session
    from quantnorm.sources import SearchScoring

    root, fp32, smoothed = lm
    cfg = EvaluateConfig(recipes=(AUTO, "smoothquant"), max_ppl_ratio=10.0, min_top1=None, max_kld=None,
                         search_pick="first", threads=1,
                         latency_iters=2, latency_warmup=1, progress=False)
    with pytest.raises(ConfigError):
        EvaluateConfig(recipes=(AUTO,), search_pick="slowest")
    with pytest.raises(ConfigError):
        EvaluateConfig(recipes=("smoothquant",), sq_alpha=2.0)
    assert EvaluateConfig(recipes=("smoothquant",), sq_alpha=0.75).recipe("smoothquant").smoothquant_alpha == 0.75

    recipes_out, int8_paths, sources = [], {}, {}
    fp32_session = make_session(fp32, SPEC)
    search = run_search(tmp_path, cfg, fp32, smoothed, CALIB, SearchScoring(EVAL, TARGETS, "byte"), SPEC, False,
                        recipes_out, int8_paths, sources, measure=lambda path: compare(fp32_session, make_session(path, SPEC), EVAL,
                                                              TARGETS).to_dict())
    assert search["status"] == "passed" and search["chosen"]["index"] == 1 and len(search["trials"]) == 1
    (entry,) = recipes_out
    assert entry["name"] == "auto:static-minmax-matmul" and entry["search_passed"] is True
    assert entry["accuracy"]["n_scored"] == EVAL.size  # re-measured on the whole evaluation range
    assert (tmp_path / entry["path"]).is_file() and not (tmp_path / "search").exists()
    assert int8_paths == {"auto:static-minmax-matmul": tmp_path / "model.int8.auto.onnx"}

    # evaluate quantizes the smoothquant recipe (making its smoothed export) before this section;
    # do it here too rather than rely on an earlier test of the module having made it
    assert smoothed.fp32_for(cfg.recipe("smoothquant"), fp32) != fp32 and smoothed.exports
    section = smoothquant_section(root, cfg, fp32, smoothed, CONTEXT)
    assert section["folded"] and section["explicit_scale"] and section["fp32_latency"]["batch"] == 8
    assert section["fp32_latency_ratio"] > 0 and "statement" in section
    json.dumps(search), json.dumps(section)


def test_min_top1_is_a_second_target(lm, tmp_path):
    """A generous PPL target still fails a trial whose top-1 agreement is below the floor: the
    search goes on to the per-tensor fallback instead of stopping at the first recipe."""
    loose = run(lm, tmp_path / "a", SearchConfig(policy=ppl_only(10.0), pick="first", space=("static-minmax-matmul",)))
    top1 = loose.trials[0].top1_agreement
    assert loose.trials[0].passed and top1 < 1.0
    strict = run(lm, tmp_path / "b", SearchConfig(policy=ppl_only(10.0, min_top1=1.0), pick="first",
                                                   space=("static-minmax-matmul",)))
    first = strict.trials[0]
    assert first.top1_agreement == pytest.approx(top1) and not first.passed and first.metric == 0.0
    assert len(strict.trials) > 1 and strict.trials[1].phase == "fallback"
    with pytest.raises(ConfigError):
        SearchConfig(policy=Policy(min_top1=1.5))


def test_a_trial_that_misses_the_policy_by_far_on_the_screening_windows_is_neither_timed_nor_scored_further(lm, tmp_path):
    timed: list[str] = []

    def latency(path, name):
        timed.append(name)
        return 1.0
    # a mean KL of 1e-12: every INT8 trial misses it by far more than 4x, on 2 windows
    strict = run(lm, tmp_path / "strict", SearchConfig(policy=ppl_only(10.0, max_kld=1e-12), space=THREE[:2],
                                                       screen_windows=2, fallback=False), latency)
    assert [t.screened_windows for t in strict.trials] == [2, 2] and timed == []
    assert all(t.status == "ok" and not t.passed and t.latency_p50_ms is None and t.kld_mean > 4e-12
               for t in strict.trials)
    assert strict.chosen is None and strict.best is not None
    generous = run(lm, tmp_path / "generous", SearchConfig(policy=ppl_only(10.0), space=THREE[:2], screen_windows=2),
                   latency)
    assert [t.screened_windows for t in generous.trials] == [None, None] and timed[:2] == list(THREE[:2])
    assert all(t.passed and t.seconds > 0 for t in generous.trials)
    assert generous.to_dict()["trials"][0]["seconds"] == generous.trials[0].seconds
    # the screening bound: each threshold's distance from lossless, times 4
    loose = SearchConfig(policy=Policy(max_ppl_ratio=1.01, max_kld=0.007, min_top1=0.95)).screen_policy()
    assert (loose.max_ppl_ratio, loose.max_kld, loose.min_top1) == pytest.approx((1.04, 0.028, 0.8))
    assert SearchConfig(policy=ppl_only(0.5)).screen_policy() is None      # a target past FP32's: no screening
    assert SearchConfig(screen_windows=None).screen_policy() is None


def test_the_time_budget_stops_the_search_after_the_trial_that_spent_it(lm, tmp_path):
    result = run(lm, tmp_path, SearchConfig(policy=ppl_only(10.0), space=THREE, time_budget_s=1e-6))
    assert len(result.trials) == 1 and result.stopped_by == "time budget" and result.chosen is result.trials[0]
    with pytest.raises(ConfigError, match="--search-budget"):
        SearchConfig(time_budget_s=0)


def test_massive_activations_order_the_default_space_and_a_named_space_stays_as_named():
    space = default_space()
    assert SearchConfig().recipes() == space == probe_ordered(space, False)
    ordered = SearchConfig(massive=True).recipes()
    assert sorted(ordered) == sorted(space)
    first = [n for n in MASSIVE_ORDER if n in space]
    assert list(ordered[:len(first)]) == first and ordered[0] == "rotated-pertoken-fused-calnorm"
    assert ordered.index("smoothquant") < min(ordered.index(n) for n in space if n.startswith("static-") or n == "dynamic")
    assert SearchConfig(massive=True, space=THREE).recipes() == THREE


@pytest.mark.parametrize("candidate, passed, massive, pruned", [
    ("pertoken-fused-gptq", "pertoken-fused", False, True),              # GPTQ: other codes, the same graph
    ("online-rotated-pertoken-fused", "pertoken-fused", False, True),    # more Hadamards
    ("pertoken", "pertoken-fused", False, True),                         # the unfused rescale adds work
    ("pertoken-fused", "online-rotated-pertoken-fused", False, False),   # less work: could be faster
    ("pertoken", "online-rotated-pertoken-fused", False, False),         # unfused but no Hadamard: unknown
    ("rotated-pertoken-fused-calnorm", "rotated-pertoken-fused", False, False),   # calibrated norm scales: faster
    ("rotated-pertoken-fused", "rotated-pertoken-fused-calnorm", False, True),
    ("static-minmax-matmul", "pertoken-fused", True, True),              # massive: per-tensor scales break
    ("dynamic", "pertoken-fused", True, True),
    ("smoothquant", "pertoken-fused", True, True),
    ("static-minmax-matmul", "pertoken-fused", False, False),            # no massive activations: try it
    ("static-minmax-matmul", "dynamic", True, False),                    # only a per-token pass prunes
])
def test_a_passing_trial_prunes_what_cannot_be_faster(candidate, passed, massive, pruned):
    why = pruned_by(get_recipe(candidate), [get_recipe(passed)], massive)
    assert (why is not None) == pruned
    if pruned:
        assert passed in why


def test_with_massive_activations_the_search_stops_when_the_pick_can_no_longer_change(lm, tmp_path):
    """The default space in the probe's order: the per-token recipes first; once one passes,
    the recipes running the same kernels or more and every per-tensor one are not tried, and the
    result says which and why."""
    cfg = SearchConfig(policy=ppl_only(10.0), pick="fastest", massive=True, fallback=False)
    result = run(lm, tmp_path, cfg)   # the test's transforms smooth only: rotated trials are errors here
    order = list(cfg.recipes())
    tried = [t.recipe for t in result.trials]
    pruned = {p["recipe"]: p["why"] for p in result.pruned}
    assert sorted(tried + list(pruned)) == sorted(order) and tried == [n for n in order if n in tried]
    first_pass = next(t for t in result.trials if t.passed)
    assert first_pass.recipe == "pertoken-fused"
    assert all(order.index(n) > order.index("pertoken-fused") for n in pruned)
    assert {n for n in default_space() if n.startswith("static-")} | {"dynamic", "smoothquant"} <= set(pruned)
    assert "pertoken-fused-gptq" in pruned and "pertoken-fused passed" in pruned["pertoken-fused-gptq"]
    assert result.chosen is not None and result.order == "probe: massive activations"
    assert result.to_dict()["pruned"] == list(result.pruned)


def test_the_report_says_the_order_and_what_was_not_tried(lm, tmp_path):
    from quantnorm.report.sections import search as search_section

    result = run(lm, tmp_path, SearchConfig(policy=ppl_only(10.0), pick="fastest", massive=True, fallback=False))
    text = "\n".join(search_section({"search": result.to_dict()}))
    assert "Order of the space: probe: massive activations" in text
    assert "Not tried (" in text and "- `pertoken-fused-gptq`: pertoken-fused passed" in text
