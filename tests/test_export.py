"""ONNX export: interface, parity, atomic failure, opsets, and the norm-op count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx_helpers import onnx_logits

from quantnorm.errors import ConfigError, ExportError
from quantnorm.export import ExportResult, count_norm_ops, export_onnx, find_decomposed_norms
from quantnorm.models import CausalLM, ModelConfig

CONTEXT = 16


def tiny_model(placement: str, norm: str, n_layers: int, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(placement=placement, norm=norm, n_layers=n_layers, d_model=32, n_heads=2,
                                context=CONTEXT))


def parity_ids(n: int = 3, seq: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 257, size=(n, seq))


def exported(tmp_path_factory, placement: str, norm: str, n_layers: int, opset: int) -> ExportResult:
    """Export once per pytest session (test_quantize.py shares this cache directory)."""
    cache = tmp_path_factory.getbasetemp() / "onnx-cache"
    path = cache / f"{placement}-{norm}-L{n_layers}-op{opset}.onnx"
    if path not in _RESULTS:
        _RESULTS[path] = export_onnx(tiny_model(placement, norm, n_layers), path, parity_ids(), opset=opset)
    return _RESULTS[path]


_RESULTS: dict[Path, ExportResult] = {}


@pytest.mark.parametrize(
    "norm, opset, expected",
    [
        ("rms", 18, {"LayerNormalization": 0, "RMSNormalization": 0, "decomposed": 9}),
        ("rms", 23, {"LayerNormalization": 0, "RMSNormalization": 9, "decomposed": 0}),
        ("layer", 18, {"LayerNormalization": 9, "RMSNormalization": 0, "decomposed": 0}),
    ],
)
def test_pre_ln_4_layers_norm_counts_and_parity(tmp_path_factory, norm, opset, expected):
    # pre placement, 4 layers: 2 norms per block + the final norm = 9.
    result = exported(tmp_path_factory, "pre", norm, 4, opset)
    assert result.norm_ops == expected
    assert result.opset == opset
    assert 0.0 <= result.max_abs_logit_diff < 1e-4
    model = onnx.load(str(result.path))
    assert {o.domain or "ai.onnx": o.version for o in model.opset_import}["ai.onnx"] == opset
    assert count_norm_ops(result.path) == expected


def test_interface_dynamic_axes_and_readable_names(tmp_path_factory):
    result = exported(tmp_path_factory, "pre", "rms", 4, 18)
    model = onnx.load(str(result.path))
    (inp,), (out,) = model.graph.input, model.graph.output
    assert inp.name == "input_ids" and inp.type.tensor_type.elem_type == TensorProto.INT64
    assert out.name == "logits" and out.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [d.dim_param for d in inp.type.tensor_type.shape.dim] == ["batch", "seq"]
    assert out.type.tensor_type.shape.dim[2].dim_value == 257
    names = {n.name for n in model.graph.node}
    assert {"head/MatMul", "blocks.0.attn.q/MatMul", "blocks.3.mlp.down/MatMul"} <= names
    assert len(names) == len(model.graph.node)
    # Other batch and sequence sizes than the export example and the parity inputs.
    for shape in [(1, 5), (4, CONTEXT)]:
        logits = onnx_logits(result.path, parity_ids(*shape, seed=1))
        assert logits.shape == (*shape, 257)


def test_parity_failure_raises_and_leaves_no_file(tmp_path):
    out = tmp_path / "model.fp32.onnx"
    model = tiny_model("post", "layer", 1)
    with pytest.raises(ExportError, match="does not match PyTorch"):
        export_onnx(model, out, parity_ids(), tolerance=1e-12)  # exact equality is not achievable
    assert list(tmp_path.iterdir()) == [], "a failed export left files behind"
    assert model.training, "export_onnx must restore the model's training mode"


def test_an_exported_module_is_not_kept_alive_by_the_exporter(tmp_path):
    """After the export returns and the caller lets the module go, its parameters are freed: the
    dynamo exporter's rewrite rules kept the last graph they matched, whose initializers are the
    module's own tensors (a whole checkpoint resident for the rest of a run)."""
    import gc
    import weakref

    model = tiny_model("pre", "rms", 2)
    weight = weakref.ref(model.lm_head.weight if hasattr(model, "lm_head") else next(model.parameters()))
    export_onnx(model, tmp_path / "m.onnx", parity_ids())   # dynamo: its rewrite pass held the graph
    del model
    gc.collect()
    assert weight() is None


def test_bad_arguments():
    model = tiny_model("pre", "rms", 1)
    with pytest.raises(ConfigError, match="opset 16"):
        export_onnx(model, Path("unused.onnx"), parity_ids(), opset=16)
    with pytest.raises(ConfigError, match="context"):
        export_onnx(model, Path("unused.onnx"), parity_ids(seq=CONTEXT + 1))
    with pytest.raises(ConfigError, match="outside"):
        export_onnx(model, Path("unused.onnx"), np.full((1, 4), 257))


def test_to_dict_relative_path(tmp_path):
    result = ExportResult(tmp_path / "run" / "model.fp32.onnx", 18, 1e-6, 1e-4,
                          {"LayerNormalization": 0, "RMSNormalization": 0, "decomposed": 9})
    d = result.to_dict(tmp_path / "run")
    assert d == {"path": "model.fp32.onnx", "opset": 18, "max_abs_logit_diff": 1e-6, "tolerance": 1e-4,
                 "norm_ops": {"LayerNormalization": 0, "RMSNormalization": 0, "decomposed": 9}}


# --- pattern recognition on hand-built graphs (no export needed) ---------------------------------


def _graph(nodes, consts: dict[str, float]):
    inits = [numpy_helper.from_array(np.asarray(v, dtype=np.float32), k) for k, v in consts.items()]
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inits)


def test_decomposed_layernorm_and_rmsnorm_patterns():
    node = helper.make_node
    layer = [
        node("ReduceMean", ["x"], ["mu"], name="mean"),
        node("Sub", ["x", "mu"], ["d"], name="sub"),
        node("Pow", ["d", "two"], ["d2"], name="pow"),
        node("ReduceMean", ["d2"], ["var"], name="var"),
        node("Add", ["var", "eps"], ["ve"], name="add"),
        node("Sqrt", ["ve"], ["sd"], name="sqrt"),
        node("Div", ["d", "sd"], ["y"], name="div"),
    ]
    found = find_decomposed_norms(_graph(layer, {"two": 2.0, "eps": 1e-5}))
    assert [f["kind"] for f in found] == ["layer"]
    assert found[0]["nodes"] == ["mean", "sub", "pow", "var", "add", "sqrt", "div"]

    rms = [
        node("Mul", ["x", "x"], ["x2"], name="sq"),
        node("ReduceMean", ["x2"], ["ms"], name="ms"),
        node("Add", ["ms", "eps"], ["mse"], name="add"),
        node("Sqrt", ["mse"], ["r"], name="sqrt"),
        node("Reciprocal", ["r"], ["inv"], name="recip"),
        node("Mul", ["x", "inv"], ["y"], name="scale"),
    ]
    assert [f["kind"] for f in find_decomposed_norms(_graph(rms, {"eps": 1e-6}))] == ["rms"]

    # Not a norm: a cube instead of a square, and a normalization of a different tensor.
    cube = [node("Pow", ["x", "three"], ["x3"])] + rms[1:]
    cube[1] = node("ReduceMean", ["x3"], ["ms"])
    assert find_decomposed_norms(_graph(cube, {"three": 3.0, "eps": 1e-6})) == []
    other = rms[:-1] + [node("Mul", ["z", "inv"], ["y"])]
    g = _graph(other, {"eps": 1e-6, "z": np.ones((2, 8))})
    assert count_norm_ops(helper.make_model(g)) == {"LayerNormalization": 0, "RMSNormalization": 0, "decomposed": 0}


def test_a_graph_past_the_external_data_threshold_is_written_with_external_data(tmp_path, monkeypatch,
                                                                                  small_corpus):
    """Protobuf stops at 2 GB; past the threshold (lowered here, as these models stay under it) the
    export writes its weights to model.fp32.onnx.data, and the whole pipeline still runs on it."""
    import json

    from quantnorm.cli import main

    monkeypatch.setenv("QUANTNORM_EXTERNAL_DATA_BYTES", "20000")
    run = tmp_path / "run"
    assert main(["train", "--placement", "pre", "--norm", "rms", "--layers", "1", "--d-model", "32", "--heads", "2",
                 "--context", "16", "--steps", "2", "--corpus", str(small_corpus), "--out", str(run), "--quiet"]) == 0
    assert main(["evaluate", "--checkpoint", str(run), "--recipes", "static-minmax-matmul,pertoken",
                 "--providers", "cpu", "--iters", "2", "--batches", "1", "--calib-samples", "4", "--quiet",
                 "--threads", "1"]) == 0
    fp32 = run / "model.fp32.onnx"
    data = run / "model.fp32.onnx.data"
    assert data.is_file() and data.stat().st_size > 20000
    header = onnx.load(str(fp32), load_external_data=False)
    assert any(init.data_location == onnx.TensorProto.EXTERNAL for init in header.graph.initializer)
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temporaries left
    results = json.loads((run / "results.json").read_text())
    assert [r["status"] for r in results["recipes"]] == ["ok", "ok"]
