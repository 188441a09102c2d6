"""The token embedding in 8 bits (quantize/embedding.py, recipes named <recipe>-emb8): ORT's
GatherBlockQuantized against this module's dequantization, the tables it leaves float and why,
and the recipe names."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantnorm.errors import ConfigError
from quantnorm.quantize import get_recipe
from quantnorm.quantize.embedding import EMBEDDING_BLOCK, dequantized, embedding_codes, quantize_embedding

VOCAB, D = 300, 64


def _table(rng) -> np.ndarray:
    table = rng.normal(size=(VOCAB, D)).astype(np.float32)
    table[7] = 0.0                                # a row of zeros: scale 0, not NaN
    table[11, 3] = 80.0                           # one large weight: its block's step, not the others'
    return table


def _model(path, table: np.ndarray, *, tied_head: bool = False) -> None:
    """input_ids -> Gather(table) * 2 -> out; with ``tied_head``, also logits = out @ table^T."""
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["x"], name="embed"),
             helper.make_node("Mul", ["x", "two"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if tied_head:
        nodes += [helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["out", "table_t"], ["logits"])]
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                              outputs, [numpy_helper.from_array(table, "table"),
                                        numpy_helper.from_array(np.float32(2.0), "two")])
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _run(path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["out"], {"input_ids": ids})[0]


def test_the_operator_returns_the_codes_times_their_block_scale(tmp_path):
    table = _table(np.random.default_rng(0))
    path = tmp_path / "m.onnx"
    _model(path, table)
    ids = np.array([[0, 7, 11, 299], [5, 5, 150, 1]], dtype=np.int64)
    before = _run(path, ids)
    done = quantize_embedding(path)
    assert (done["dtype"], done["shape"], done["block_size"]) == ("int8", [VOCAB, D], EMBEDDING_BLOCK)
    assert done["bytes_float32"] == VOCAB * D * 4 and done["bytes_int8"] == VOCAB * D + VOCAB * D // EMBEDDING_BLOCK * 4
    graph = onnx.load(str(path)).graph
    assert [n.op_type for n in graph.node] == ["GatherBlockQuantized", "Mul"]
    assert "table" not in {t.name for t in graph.initializer}
    after = _run(path, ids)
    codes, scales = embedding_codes(table)
    np.testing.assert_array_equal(after, 2.0 * dequantized(codes, scales)[ids])   # ORT's zero point 128: symmetric
    assert np.all(after[0, 1] == 0.0) and np.isfinite(after).all()
    # within half a step of each block's own grid: the large weight coarsens its block only
    step = np.repeat(scales, EMBEDDING_BLOCK, axis=1)[ids]
    assert np.all(np.abs(after - before) <= 2.0 * step / 2 + 1e-6)
    assert step[0, 2, 0] > 0.5 and step[0, 2, -1] < 0.05


@pytest.mark.parametrize("make, why", [
    (lambda p, t: _model(p, t, tied_head=True), "also read by another node"),
    (lambda p, t: _model(p, t[:, :48]), "not a whole number of blocks of 32"),
    (lambda p, t: _model(p, t.astype(np.float16)), "not float32"),
])
def test_a_table_that_cannot_be_stored_in_8_bits_stays_float_and_says_why(tmp_path, make, why):
    path = tmp_path / "m.onnx"
    make(path, _table(np.random.default_rng(1)))
    before = path.read_bytes()
    done = quantize_embedding(path)
    assert done["dtype"] == "float32" and why in done["why"]
    assert path.read_bytes() == before


def test_a_graph_without_a_token_embedding_is_left_alone(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["out"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert "no Gather of a float initializer" in quantize_embedding(path)["why"]


def test_any_integer_recipe_takes_the_suffix_once():
    r = get_recipe("rotated-pertoken-fused-gptq-emb8")
    base = get_recipe("rotated-pertoken-fused-gptq")
    assert (r.embedding_bits, base.embedding_bits) == (8, None)
    assert r.settings(vnni=True)["embedding"].startswith("int8") and base.settings(vnni=True)["embedding"].startswith(
        "float32")
    assert "token embedding in int8" in r.describe() and "token embedding" not in base.describe()
    assert get_recipe("wo-int8-b64-acc4-gptq-emb8").settings(vnni=True)["embedding"].startswith("int8")
    assert get_recipe("smoothquant@0.7-emb8").smoothquant_alpha == 0.7
    for name, message in [("fp16-emb8", "integer recipe"), ("dynamic-emb8-emb8", "one already"),
                          ("no-such-recipe-emb8", "unknown recipe")]:
        with pytest.raises(ConfigError, match=message):
            get_recipe(name)


CALIB = np.random.default_rng(2).integers(0, 256, size=(8, 32))


@pytest.mark.parametrize("name", ["wo-int8-b32", "pertoken-fused", "static-minmax-matmul"])
def test_every_kind_of_recipe_stores_its_embedding_in_8_bits(zoo_exported, tmp_path, name):
    from quantnorm.quantize import quantize

    _, fp32 = zoo_exported("pre")
    plain = quantize(fp32, get_recipe(name), CALIB, tmp_path / "plain.onnx", vnni=True, probe_inputs=CALIB[:2])
    small = quantize(fp32, get_recipe(f"{name}-emb8"), CALIB, tmp_path / "emb8.onnx", vnni=True,
                     probe_inputs=CALIB[:2])
    assert plain.ok and small.ok, (plain.status, small.status)
    done = small.settings["embedding"]
    assert done["dtype"] == "int8" and plain.settings["embedding"].startswith("float32")
    ops = [n.op_type for n in onnx.load(str(small.path)).graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "Gather" not in ops[:ops.index("GatherBlockQuantized")]
    saved = plain.path.stat().st_size - small.path.stat().st_size
    assert saved == pytest.approx(done["bytes_float32"] - done["bytes_int8"], abs=1024)   # names and metadata aside
    ids = CALIB[:2]
    a, b = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(["logits"], {"input_ids": ids})[0]
            for p in (plain.path, small.path))
    assert 0 < np.abs(a - b).max() < 0.02 * np.abs(a).max()
