"""Placement-aware SmoothQuant: the scale formula, the fold rule per placement, exact FP32 outputs,
outliers moved into the weights, and Mul nodes in the ONNX graph only where a fold is impossible."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from quantnorm.errors import ConfigError, QuantizeError
from quantnorm.measure.sessions import SessionSpec
from quantnorm.models import PLACEMENTS, CausalLM, ModelConfig
from quantnorm.quantize import get_recipe
from quantnorm.transforms import smoothquant as sq
from quantnorm.transforms.smoothquant import (
    SmoothedLinear,
    export_smoothed,
    fp32_latency_cost,
    linear_input_absmax,
    smooth_model,
    smoothing_scales,
)

CONTEXT = 16
RNG = np.random.default_rng(0)
CALIB = RNG.integers(0, 256, size=(6, CONTEXT))
CALIB[:, 0] = 256  # BOS first, as calibration_windows gives
HELD_OUT = RNG.integers(0, 256, size=(3, CONTEXT))  # parity is checked on text the scales never saw


def tiny(placement: str, norm: str, n_layers: int = 2, seed: int = 0) -> CausalLM:
    """A random tiny model whose norm weights/biases are not 1/0, so a wrong fold shows."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(placement=placement, norm=norm, n_layers=n_layers, d_model=32, n_heads=2,
                                 context=CONTEXT)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, tuple(sq.NORMS.values())):
                module.weight.uniform_(0.5, 2.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.uniform_(-0.5, 0.5)
    return model


def expected_kinds(placement: str, n_layers: int) -> tuple[set[str], set[str]]:
    """The fold table of the smoothquant module docstring, written out independently."""
    per_block = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.up", "mlp.down")
    names = {f"blocks.{i}.{p}" for i in range(n_layers) for p in per_block} | {"head"}
    if placement in ("pre", "peri"):
        folded = {f"blocks.{i}.{p}" for i in range(n_layers) for p in ("attn.q", "attn.k", "attn.v", "mlp.up")}
        folded.add("head")
    elif placement in ("post", "deepnorm"):
        folded = {"head"}  # the last block's MLP norm feeds nothing but the head
    else:  # residual: the head reads x_a + N(x_d)
        folded = set()
    return folded, names - folded


def logits(model, inputs) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(inputs)).numpy().astype(np.float64)


# --- the formula ------------------------------------------------------------------------------


def test_scale_formula_guards_and_clamp():
    s = smoothing_scales(np.array([4.0, 1.0, 0.0, 9.0]), np.array([1.0, 4.0, 2.0, 0.0]), alpha=0.5)
    np.testing.assert_allclose(s, [2.0, 0.5, 1.0, 1.0])  # sqrt(4)/sqrt(1), sqrt(1)/sqrt(4); zeros -> 1
    s = smoothing_scales(np.array([1e12, 1e-12]), np.array([1e-12, 1e12]), alpha=0.5)
    np.testing.assert_allclose(s, [sq.SCALE_MAX, sq.SCALE_MIN])
    # alpha = 1: all the difficulty to the weights, s = max|X|; alpha = 0: s = 1 / max|W|
    np.testing.assert_allclose(smoothing_scales(np.array([3.0]), np.array([5.0]), 1.0), [3.0])
    np.testing.assert_allclose(smoothing_scales(np.array([3.0]), np.array([5.0]), 0.0), [0.2])


def test_qkv_share_one_scale_from_all_three_weights():
    model = tiny("pre", "rms", n_layers=1)
    _, plan = smooth_model(model, CALIB)
    q, k, v = (plan.scales[f"blocks.0.attn.{n}"] for n in "qkv")
    assert q is k is v
    x = linear_input_absmax(model, CALIB, ["blocks.0.attn.q"])["blocks.0.attn.q"]
    attn = model.blocks[0].attn
    w = torch.stack([m.weight.abs().amax(0) for m in (attn.q, attn.k, attn.v)]).amax(0).detach().numpy()
    np.testing.assert_allclose(q, np.sqrt(x) / np.sqrt(w), rtol=1e-5)


# --- the fold rule and exact FP32 outputs -----------------------------------------------------


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_smoothing_keeps_fp32_outputs_and_follows_the_fold_rule(placement, norm):
    model = tiny(placement, norm)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    smoothed, plan = smooth_model(model, CALIB)

    np.testing.assert_allclose(logits(smoothed, HELD_OUT), logits(model, HELD_OUT), atol=1e-4, rtol=0)
    folded, explicit = expected_kinds(placement, 2)
    assert set(plan.folded) == folded
    assert set(plan.explicit_scale) == explicit
    for name in plan.explicit_scale:
        assert isinstance(smoothed.get_submodule(name), SmoothedLinear)
    for name in plan.folded:
        assert type(smoothed.get_submodule(name)) is torch.nn.Linear
    # the scales did something (a no-op smoothing would pass the parity check trivially)
    assert any(not np.allclose(s, 1.0, atol=1e-2) for s in plan.scales.values())
    # the caller's model is untouched
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    d = plan.to_dict()
    assert d["alpha"] == 0.5 and set(d["folded"]) == folded and set(d["explicit_scale"]) == explicit
    assert placement in d["statement"]


def test_pre_rms_folds_qkv_up_head_into_their_norms():
    _, plan = smooth_model(tiny("pre", "rms", n_layers=1), CALIB)
    assert plan.folded == ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.mlp.up", "head"]
    assert plan.explicit_scale == ["blocks.0.attn.proj", "blocks.0.mlp.down"]
    assert plan.folded_into() == {"blocks.0.attn.q": "blocks.0.attn_norms.norm", "blocks.0.attn.k": "blocks.0.attn_norms.norm",
                                  "blocks.0.attn.v": "blocks.0.attn_norms.norm", "blocks.0.mlp.up": "blocks.0.mlp_norms.norm",
                                  "head": "final_norm"}


def test_post_layer_needs_explicit_scales_except_the_head():
    _, plan = smooth_model(tiny("post", "layer", n_layers=1), CALIB)
    assert plan.folded == ["head"]
    assert set(plan.explicit_scale) == {f"blocks.0.{p}" for p in
                                        ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.up", "mlp.down")}
    groups = {g.linears[0]: g for g in plan.groups}
    assert "residual" in groups["blocks.0.mlp.up"].reason  # a norm output that is also the stream


def test_folding_where_the_rule_forbids_it_changes_the_outputs(monkeypatch):
    """The rule is needed: fold a post-norm that also feeds the skip and the parity check fails."""
    real = sq.input_groups

    def fold_everything(model, example):
        return [sq.InputGroup(g.linears, g.source, g.source is not None, "forced") for g in real(model, example)]

    monkeypatch.setattr(sq, "input_groups", fold_everything)
    with pytest.raises(QuantizeError, match="changed the FP32 model"):
        smooth_model(tiny("post", "layer", n_layers=1), CALIB)


def test_alpha_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError):
        smooth_model(tiny("pre", "rms", n_layers=1), CALIB, alpha=1.5)


# --- outliers move into the weights -----------------------------------------------------------


def test_planted_outlier_channel_is_shrunk():
    model = tiny("pre", "rms", n_layers=1)
    with torch.no_grad():
        model.blocks[0].attn_norms["norm"].weight[5] = 60.0   # q/k/v input: folded group
        model.blocks[0].mlp.up.bias[7] = 40.0                  # GELU(40) = 40 in channel 7 of down's input: explicit
    x_before = linear_input_absmax(model, CALIB, ["blocks.0.attn.q", "blocks.0.mlp.down"])
    smoothed, plan = smooth_model(model, CALIB)
    x_after = linear_input_absmax(smoothed, CALIB, ["blocks.0.attn.q", "blocks.0.mlp.down"])
    for name, channel in (("blocks.0.attn.q", 5), ("blocks.0.mlp.down", 7)):
        before, after = x_before[name], x_after[name]
        assert int(before.argmax()) == channel
        s = plan.scales[name]
        np.testing.assert_allclose(after, before / s, rtol=1e-4, atol=1e-6)  # s really applied
        assert after[channel] < before[channel] / 3
        ratio = lambda a: a.max() / np.median(a)  # noqa: E731
        assert ratio(after) < ratio(before) / 3
    assert "blocks.0.attn.q" in plan.folded and "blocks.0.mlp.down" in plan.explicit_scale
    np.testing.assert_allclose(logits(smoothed, HELD_OUT), logits(model, HELD_OUT), atol=1e-3, rtol=0)


# --- ONNX ------------------------------------------------------------------------------------


def test_exported_smoothed_model_has_a_mul_only_before_explicit_matmuls(tmp_path):
    model = tiny("pre", "rms", n_layers=1)
    out = export_smoothed(model, CALIB, HELD_OUT, tmp_path / "model.fp32.smoothquant.onnx")
    assert out.path.is_file() and out.onnx_vs_original_max_abs_logit_diff < 1e-3
    graph = onnx.load(str(out.path)).graph
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    producer = {o: node for node in graph.node for o in node.output}
    scale_muls = [n for n in graph.node if n.op_type == "Mul" and n.name.split("/")[0] in linears]
    # one Mul per explicit group: q/k/v share none (folded), proj and down have one each
    assert sorted(n.name.split("/")[0] for n in scale_muls) == ["blocks.0.attn.proj", "blocks.0.mlp.down"]
    for node in graph.node:
        if node.op_type != "MatMul" or node.name.split("/")[0] not in linears:
            continue
        module = node.name.split("/")[0]
        feeding = producer.get(node.input[0])
        fed_by_scale = feeding is not None and feeding in scale_muls
        assert fed_by_scale == (module in out.plan.explicit_scale), node.name
    d = out.to_dict()
    assert d["path"] == "model.fp32.smoothquant.onnx" and d["export"]["max_abs_logit_diff"] <= 1e-4

    # mechanics only (the same file on both sides): evaluate measures the real pair at batch 8
    cost = fp32_latency_cost(out.path, out.path, SessionSpec(threads=1),
                             seq=CONTEXT, batch=2, warmup=1, iters=3, rounds=1)
    assert cost["status"] == "measured" and cost["fp32_latency_ratio"] > 0


def test_smoothquant_recipe_is_registered():
    r = get_recipe("smoothquant")
    assert (r.mode, r.calibration, r.per_channel, r.op_scope, r.smoothquant_alpha) == ("static", "minmax", True,
                                                                                       "matmul", 0.5)
    assert r.settings(vnni=False)["smoothquant_alpha"] == 0.5
    assert get_recipe("static-minmax-matmul").smoothquant_alpha is None
    from dataclasses import replace

    with pytest.raises(ConfigError):
        replace(r, smoothquant_alpha=-0.1)
