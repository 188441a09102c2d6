"""Outlier probe: known answers on tiny models (planted outliers, uniform attention) and the math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quantnorm.data import BOS
from quantnorm.measure.outliers import (
    MASSIVE_ABS,
    MASSIVE_RATIO,
    TensorAccumulator,
    find_massive,
    heatmap_for_layer,
    largest_ratio_layer,
    per_sample_stats,
    probe,
)
from quantnorm.models import CausalLM, ModelConfig

SEQ = 16
PLANT_LAYER, PLANT_POS, PLANT_CHANNEL, PLANT_VALUE = 1, 0, 7, 500.0


def tiny(placement: str = "pre", norm: str = "layer", n_layers: int = 2, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(placement=placement, norm=norm, n_layers=n_layers, d_model=32,
                                n_heads=2, context=SEQ)).eval()


def windows(n: int = 6, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).integers(0, 256, size=(n, SEQ))
    x[:, 0] = BOS
    return x


def plant(model: CausalLM) -> None:
    """Add a massive activation to block PLANT_LAYER's output at one (position, channel)."""
    def hook(mod, args, out):
        x = out[0].clone()
        x[:, PLANT_POS, PLANT_CHANNEL] += PLANT_VALUE
        return (x, *out[1:])
    model.blocks[PLANT_LAYER].register_forward_hook(hook)


def test_planted_outlier_is_massive():
    model = tiny()
    plant(model)
    report = probe(model, windows(), batch_size=4)  # 2 batches: sample indices must carry over
    assert report.massive, "the planted entry was not flagged"
    assert {(r["layer"], r["position"], r["channel"]) for r in report.massive} == {(PLANT_LAYER, PLANT_POS, PLANT_CHANNEL)}
    assert sorted(r["sample"] for r in report.massive) == list(range(6))
    assert all(r["ratio"] >= MASSIVE_RATIO and abs(r["value"]) > MASSIVE_ABS for r in report.massive)
    row = next(r for r in report.residual if r["layer"] == PLANT_LAYER)
    assert (row["top"][0]["position"], row["top"][0]["channel"]) == (PLANT_POS, PLANT_CHANNEL)
    assert row["ratio"] >= MASSIVE_RATIO
    assert largest_ratio_layer(report.residual) == PLANT_LAYER
    heat = heatmap_for_layer(model, windows(1)[0])
    assert heat.shape == (SEQ, 32)
    assert np.unravel_index(np.argmax(heat), heat.shape) == (PLANT_POS, PLANT_CHANNEL)


def test_clean_model_has_no_massive_and_full_shape():
    model = tiny()
    report = probe(model, windows())
    assert report.massive == [] and report.massive_total == 0
    assert [r["layer"] for r in report.residual] == ["embed", 0, 1]
    assert report.residual_skip == []
    assert [r["tensor"] for r in report.matmul_inputs][:4] == ["blocks.0.attn.q", "blocks.0.attn.k",
                                                               "blocks.0.attn.v", "blocks.0.attn.proj"]
    assert report.matmul_inputs[-1]["tensor"] == "head"
    assert [r["tensor"] for r in report.norm_outputs] == [
        "blocks.0.attn_norms.norm", "blocks.0.mlp_norms.norm",
        "blocks.1.attn_norms.norm", "blocks.1.mlp_norms.norm", "final_norm"]
    d = report.to_dict()
    assert set(d) >= {"residual", "matmul_inputs", "massive", "bos_attention"}
    assert len(d["bos_attention"]) == 2
    # Hooks are gone and the mode is restored.
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_embed_row_matches_hand_computation():
    model = tiny()
    x = windows()
    emb = model.embed(torch.from_numpy(x)).detach().numpy()
    row = probe(model, x, batch_size=4).residual[0]
    hand_inf = np.mean([np.max(np.abs(emb[s])) for s in range(len(x))])
    assert row["inf_norm"] == pytest.approx(hand_inf, rel=1e-6)
    assert row["median_abs"] == pytest.approx(float(np.median(np.abs(emb))), rel=1e-6)
    assert row["ratio"] == pytest.approx(np.abs(emb).max() / np.median(np.abs(emb)), rel=1e-6)
    assert row["rms"] == pytest.approx(float(np.sqrt(np.mean(emb.astype(np.float64) ** 2))), rel=1e-6)


def test_residual_skip_stream():
    model = tiny(placement="residual")
    report = probe(model, windows())
    assert [r["layer"] for r in report.residual_skip] == [0, 1]


def test_uniform_attention_bos_weight():
    model = tiny()
    with torch.no_grad():
        for block in model.blocks:  # q = k = 0: every score is 0, attention is uniform
            for lin in (block.attn.q, block.attn.k):
                lin.weight.zero_()
                lin.bias.zero_()
    expected = np.mean([1.0 / (i + 1) for i in range(1, SEQ)])
    assert probe(model, windows()).bos_attention == pytest.approx([expected, expected], rel=1e-5)


def test_find_massive_uses_each_samples_median():
    x = np.full((2, 4, 8), 0.05, dtype=np.float32)
    x[0, 1, 2] = -150.0   # 150 / 0.05 = 3000x: massive
    x[1] += 1.0           # sample 1's median is 1.05: 150 would be only ~143x
    x[1, 3, 5] = 150.0
    rows = find_massive(x, layer=3, first_sample=10)
    assert [(r["sample"], r["position"], r["channel"], r["value"]) for r in rows] == [(10, 1, 2, -150.0)]


@settings(max_examples=25, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 6)),
              elements=st.floats(-1e3, 1e3, width=32)))
def test_inf_norm_matches_a_loop(x):
    inf_norm, _ = per_sample_stats(x)
    for s in range(x.shape[0]):
        best = 0.0
        for v in x[s].reshape(-1):
            best = max(best, abs(float(v)))
        assert inf_norm[s] == best


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.1, 50.0), st.floats(-20.0, 20.0))
def test_kurtosis_gaussian_and_affine_invariant(seed, scale, shift):
    x = np.random.default_rng(seed).standard_normal((3, 8000))
    _, k = per_sample_stats(x)
    assert np.all(np.abs(k - 3.0) < 0.5)  # std of the estimate is sqrt(24/n) ~ 0.05
    _, k2 = per_sample_stats(x * scale + shift)
    np.testing.assert_allclose(k2, k, rtol=1e-6)


def test_kurtosis_of_constant_sample_is_skipped():
    x = np.stack([np.ones(10), np.r_[np.zeros(9), 1.0]])
    _, k = per_sample_stats(x)
    assert np.isnan(k[0]) and k[1] == pytest.approx(np.mean((x[1] - 0.1) ** 4) / np.var(x[1]) ** 2)
    acc = TensorAccumulator("t")
    acc.add(x[:, None, :])
    assert acc.finish().kurtosis == pytest.approx(k[1])


def test_accumulator_over_batches_equals_whole():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 5, 4)).astype(np.float32)
    x[3, 2, 1] = 9.0
    x[5, 0, 3] = -7.0
    acc = TensorAccumulator("t")
    for chunk in (x[:2], x[2:5], x[5:]):
        acc.add(chunk)
    st_ = acc.finish()
    assert st_.median_abs == pytest.approx(float(np.median(np.abs(x))))
    assert st_.ratio == pytest.approx(9.0 / float(np.median(np.abs(x))))
    assert st_.top[0] == {"value": 9.0, "position": 2, "channel": 1, "sample": 3}
    assert st_.top[1] == {"value": -7.0, "position": 0, "channel": 3, "sample": 5}
    assert st_.outlier_features == 2 and st_.outlier_entries == 2
    assert st_.n_samples == 7
