"""accuracy_level 4's input quantization measured in numpy (quantnorm.measure.block_sqnr): the
emulation against ONNX Runtime's own kernel, and a planted massive activation's block."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from quantnorm.measure.block_sqnr import activation_block_sqnr, block_int8
from quantnorm.quantize import get_recipe, quantize, weight_matmuls
from quantnorm.quantize.recipes import Recipe
from quantnorm.quantize.weight_only import _ort_quantizer

sys.path.insert(0, str(Path(__file__).parent))
from test_massive import BOS, planted_llama  # noqa: E402
from test_weight_only import _matmul_model  # noqa: E402


@pytest.mark.parametrize("bits, block", [(8, 32), (4, 128)])
def test_block_int8_is_what_accuracy_level_4_computes(bits, block):
    """ORT's accuracy_level 4 output equals our int8-per-block input times the dequantized weight,
    and differs from the float input times it (a planted 300 in one row makes the gap visible)."""
    rng = np.random.default_rng(0)
    k, n = 256, 48
    weight = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    model = _matmul_model(weight)
    recipe = Recipe("x", "weight-only", None, True, "matmul", False, False, weight_bits=bits, block_size=block,
                    accuracy_level=4)
    q = _ort_quantizer(model, recipe, keep=[])
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    stored, scales = inits[f"W_Q{bits}"], inits["W_scales"]
    if bits == 4:
        stored = np.stack([stored & 15, stored >> 4], axis=-1).reshape(n, -1, block)
    dequantized = ((stored.astype(np.float32) - (1 << (bits - 1))) * scales[..., None]).reshape(n, -1)[:, :k].T
    x = rng.standard_normal((16, k)).astype(np.float32)
    x[0, 5] = 300.0
    y = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(y - block_int8(x, block) @ dequantized).max() < 1e-3
    assert np.abs(y - x @ dequantized).max() > 0.1


def test_block_int8_grid():
    x = np.array([[100.0, 1.0, 0.3, -0.2, 2.0, -4.0, 1.0, 0.5]], dtype=np.float32)
    q = block_int8(x, 4)
    np.testing.assert_allclose(q[0, :4], [100.0, 100 / 127, 0.0, 0.0], rtol=1e-6)   # the 100 sets the step
    np.testing.assert_allclose(q[0, 4:], np.rint(x[0, 4:] * 127 / 4) * 4 / 127, rtol=1e-6)


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, np.ndarray]:
    from quantnorm.sources.hf_export import export_hf_onnx, make_wrapper
    from quantnorm.sources.hf_loader import ARCHITECTURES

    loaded = SimpleNamespace(model=planted_llama(), spec=ARCHITECTURES["llama"],
                             files=SimpleNamespace(pooling="mean", mlm_head=False))
    path = tmp_path_factory.mktemp("planted") / "planted.onnx"
    export_hf_onnx(make_wrapper(loaded), path, np.full((2, 12), 3), outputs=("logits",), max_positions=64)
    windows = np.random.default_rng(0).integers(2, 64, size=(4, 12))
    windows[:, 0] = BOS
    return path, windows


def test_a_massive_value_erases_the_rest_of_its_block(planted):
    path, windows = planted
    report = activation_block_sqnr(path, windows, 32, weight_matmuls(onnx.load(str(path)).graph))
    carriers = [r for r in report["inputs"] if r["carries_massive"]]
    (down,) = carriers
    assert down["modules"] == ["model.layers.1.mlp.down_proj/MatMul"]
    assert down["max_abs"] > 100 and down["max_abs_position"] == 0
    # the massive value keeps its own SQNR (it sets the step); its neighbours lose theirs
    assert down["max_row_input_sqnr_db"] > 60 and down["max_row_rest_sqnr_db"] < 3
    assert report["summary"]["carriers"]["inputs"] == 1 and report["summary"]["others"]["median_rest_db"] > 30
    assert report["summary"]["others"]["median_output_db"] > 30


def test_accuracy_level_4_recipes_record_it(planted, tmp_path):
    path, windows = planted
    q = quantize(path, get_recipe("wo-int8-b32-acc4"), windows, tmp_path / "q.onnx", vnni=False,
                 probe_inputs=windows[:2])
    blocks = q.settings["activation_blocks"]
    assert q.ok and blocks["status"] == "measured" and blocks["block_size"] == 32
    assert blocks["summary"]["carriers"]["inputs"] == 1
    q0 = quantize(path, get_recipe("wo-int8-b32"), windows, tmp_path / "q0.onnx", vnni=False, probe_inputs=windows[:2])
    assert "activation_blocks" not in q0.settings   # float activations: nothing to measure
    bare = quantize(path, get_recipe("wo-int8-b32-acc4"), windows, tmp_path / "q4.onnx", vnni=False,
                    probe_inputs=windows[:2], diagnostics=False)   # the generation stage's call
    assert bare.ok and "activation_blocks" not in bare.settings
