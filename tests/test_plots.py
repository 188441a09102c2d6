"""Plots render to real, non-trivial PNGs from the probe's own output shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from quantnorm.data import BOS
from quantnorm.measure.outliers import heatmap_for_layer, probe
from quantnorm.models import CausalLM, ModelConfig
from quantnorm.report.plots import plot_activation_heatmap, plot_layer_outliers, plot_sqnr_vs_outlier

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_png(path, min_bytes=8_000):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > min_bytes
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert image[..., :3].std() > 0.01  # not a blank canvas
    assert not list(path.parent.glob(".*.tmp"))  # the atomic write left no temporary file
    assert b"Software" not in data and b"matplotlib" not in data   # no tool version: same numbers, same bytes


@pytest.fixture(scope="module")
def tiny_probe():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement="pre", norm="rms", n_layers=2, d_model=32, n_heads=2, context=16)).eval()
    x = np.random.default_rng(0).integers(0, 256, size=(4, 16))
    x[:, 0] = BOS
    return model, x, probe(model, x)


def test_layer_outliers_plot(tiny_probe, tmp_path):
    _, _, report = tiny_probe
    out = plot_layer_outliers(report.residual, tmp_path / "plots" / "layers.png", "pre / rms")
    assert out == tmp_path / "plots" / "layers.png"
    _check_png(out)


def test_heatmap_plot_with_zeros(tiny_probe, tmp_path):
    model, x, _ = tiny_probe
    heat = heatmap_for_layer(model, x[0], None)
    heat[0, 0] = 0.0  # zeros must not break the log colour scale
    _check_png(plot_activation_heatmap(heat, tmp_path / "heat.png", "residual |a|"))


def test_sqnr_scatter(tmp_path):
    rng = np.random.default_rng(0)
    ratio = 10 ** rng.uniform(0.5, 3, size=20)
    rows = [{"tensor": f"t{i}", "ratio": float(r), "sqnr_db": float(45 - 8 * np.log10(r) + rng.normal())}
            for i, r in enumerate(ratio)]
    rows.append({"tensor": "exact", "ratio": 3.0, "sqnr_db": None})  # skipped, not a crash
    _check_png(plot_sqnr_vs_outlier(rows, tmp_path / "sqnr.png", "static-minmax-matmul"))
