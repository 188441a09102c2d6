"""Weight-only recipes (com.microsoft.MatMulNBits): the registry and its name grammar, the graph
ORT's quantizer and our GPTQ write, accuracy against FP32 on a trained zoo model, the with-past
graph through the generation stage, the search, and `quantnorm recipes`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from quantnorm.cli import cli, main
from quantnorm.errors import ConfigError
from quantnorm.measure.latency import quant_format
from quantnorm.quantize import RECIPES, Recipe, get_recipe, quantize, weight_matmuls, with_exclusions
from quantnorm.quantize.sanity import check_quant_params
from quantnorm.quantize.weight_only import _ort_quantizer, pack_nbits
from quantnorm.results import generation_models, validate
from quantnorm.search import SearchConfig, default_space
from quantnorm.transforms.gptq import gptq_block_codes

WEIGHT_ONLY = [name for name, r in RECIPES.items() if r.mode == "weight-only"]
RNG = np.random.default_rng(0)
CALIB = RNG.integers(0, 256, size=(8, 32))


def nbits_nodes(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def logits(path: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input_ids": ids})[0]


# --- the registry ----------------------------------------------------------------------------------

def test_registry_names_say_what_each_recipe_does():
    assert {"wo-int8-b128", "wo-int4-b32-acc4", "wo-int4-b128-gptq", "wo-int4-b32-hqq", "wo-int4-b32-fphead",
            "online-rotated-wo-int4-b32-acc4", "rotated-wo-int4-b32-acc4"} <= set(WEIGHT_ONLY)
    for name in WEIGHT_ONLY:   # each entry is what its name's grammar builds
        assert get_recipe(name) == RECIPES[name]
    r = get_recipe("online-rotated-wo-int8-b64-acc4-gptq-fphead")   # off the list: built from the name
    assert (r.weight_bits, r.block_size, r.accuracy_level, r.weight_rounding, r.quantize_head, r.rotation) == \
        (8, 64, 4, "gptq", False, "online")
    s = r.settings(vnni=False)
    assert (s["format"], s["bits"], s["block_size"], s["accuracy_level"], s["weight_rounding"], s["head"]) == \
        ("MatMulNBits", 8, 64, 4, "gptq", "float32")
    assert s["rotation"] == "online" and "int8" in s["activation_type"]
    assert "accuracy_level 4" in r.describe() and "kept float32" in r.describe()
    b = get_recipe("block-rotated-wo-int8-b32-acc4-gptq")   # form (c): a Hadamard inside each activation block
    assert b.rotation == "block32" and "inside each activation block of 32" in b.describe()
    with pytest.raises(ConfigError, match="per block .accuracy_level 4, -acc4"):
        get_recipe("block-rotated-wo-int8-b32")
    d = get_recipe("stream-block-rotated-wo-int8-b64-acc4-gptq-emb8")   # form (d): the stream, then blocks
    assert (d.rotation, d.block_size, d.embedding_bits) == ("stream-block64", 64, 8) and d.rotates_stream
    assert "each head's values inside those blocks" in d.describe() and not b.rotates_stream
    with pytest.raises(ConfigError, match="-acc4"):
        get_recipe("stream-block-rotated-wo-int8-b64")
    # not in the default search space (another deployment), accepted by name
    assert not set(WEIGHT_ONLY) & set(default_space()) and "static-minmax-matmul" in default_space()
    assert SearchConfig(space=("wo-int4-b32", "wo-int8-b32-acc4-gptq")).recipes() == ("wo-int4-b32",
                                                                                       "wo-int8-b32-acc4-gptq")


def _wo(**kw) -> Recipe:
    return Recipe("x", "weight-only", None, True, "matmul", False, False, **{"weight_bits": 4, "block_size": 32, **kw})


@pytest.mark.parametrize("make, message", [
    (lambda: _wo(weight_bits=3), "weight_bits must be one of"),
    (lambda: _wo(block_size=48), "block_size must be one of"),
    (lambda: _wo(accuracy_level=2), "accuracy_level must be one of"),
    (lambda: _wo(weight_rounding="hqq", weight_bits=8), "HQQ is 4-bit at accuracy_level 0 only"),
    (lambda: _wo(weight_rounding="hqq", accuracy_level=4), "HQQ is 4-bit at accuracy_level 0 only"),
    (lambda: Recipe("x", "weight-only", None, True, "matmul", False, "auto", weight_bits=4, block_size=32),
     "reduce_range False"),
    (lambda: Recipe("x", "weight-only", "minmax", True, "matmul", False, False, weight_bits=4, block_size=32),
     "no calibration method"),
    (lambda: Recipe("x", "static", "minmax", True, "matmul", False, "auto", weight_bits=4),
     "apply to weight-only recipes only"),
    (lambda: Recipe("x", "pertoken", None, True, "matmul", False, "auto", weight_rounding="hqq"),
     "HQQ rounding is for the weight-only recipes only"),
    (lambda: get_recipe("wo-int4-b32-hqq-acc4"), "unknown recipe"),
    (lambda: get_recipe("wo-int4-b32-asym-gptq"), "asymmetric weights are round-to-nearest only"),
    (lambda: get_recipe("wo-int2-b32"), "weight_bits must be one of"),
])
def test_bad_settings_are_one_line(make, message):
    with pytest.raises(ConfigError, match=message) as err:
        make()
    assert "\n" not in str(err.value)


def test_quantnorm_recipes_lists_them():
    result = CliRunner().invoke(cli, ["recipes"])
    assert result.exit_code == 0
    # the first column marks the default set (*) and the massive-activation set (m)
    lines = {line[2:].split()[0]: line for line in result.output.splitlines() if line[:2] in ("  ", "m ")}
    assert set(WEIGHT_ONLY) <= set(lines)
    assert "int4 weights per block of 32" in lines["wo-int4-b32-acc4"] and "accuracy_level 4" in lines["wo-int4-b32-acc4"]
    assert "wo-int<4|8>-b<block>" in result.output


# --- the graph ---------------------------------------------------------------------------------------

def _matmul_model(weight: np.ndarray) -> onnx.ModelProto:
    k, n = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                              [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("bits, block", [(4, 32), (8, 32), (4, 128)])
def test_our_packing_is_ort_round_to_nearest_code_for_code(bits, block):
    """GPTQ with an identity Hessian pushes no error anywhere: round-to-nearest on the same grid.
    Packed by us, it must be ORT's own quantizer's B and scales byte for byte (K = 80: a padded block)."""
    weight = (np.random.default_rng(bits).standard_normal((80, 24)) * 0.1).astype(np.float32)
    ort_model = _ort_quantizer(_matmul_model(weight), _wo(weight_bits=bits, block_size=block), keep=[])
    (node,) = [n for n in ort_model.graph.node if n.op_type == "MatMulNBits"]
    inits = {i.name: numpy_helper.to_array(i) for i in ort_model.graph.initializer}
    codes, scales = gptq_block_codes(weight, np.eye(80), bits, block)
    packed, scales = pack_nbits(codes, scales, bits, block)
    np.testing.assert_array_equal(packed, inits[node.input[1]])
    np.testing.assert_array_equal(scales, inits[node.input[2]])
    assert len(node.input) == 3   # symmetric: the default zero point, no input


@pytest.mark.parametrize("name, bits, block, level, inputs", [
    ("wo-int4-b32-acc4", 4, 32, 4, 3), ("wo-int8-b128-gptq", 8, 128, 0, 3), ("wo-int4-b32-hqq", 4, 32, 0, 4),
    ("wo-int4-b32-asym-acc4", 4, 32, 4, 4)])   # inputs: a zero point per block where the codes are not symmetric
def test_every_weight_matmul_becomes_matmulnbits(zoo_exported, tmp_path, name, bits, block, level, inputs):
    _, fp32 = zoo_exported("pre")
    q = quantize(fp32, get_recipe(name), CALIB, tmp_path / "q.onnx", vnni=False, probe_inputs=CALIB[:2])
    assert q.ok, q.status
    graph = onnx.load(str(q.path)).graph
    assert weight_matmuls(graph) == []          # the only MatMuls left multiply two activations
    nodes = nbits_nodes(q.path)
    assert len(nodes) == len(weight_matmuls(onnx.load(str(fp32)).graph)) == len(q.settings["quantized_nodes"])
    for node in nodes:
        a = attrs(node)
        assert (a["bits"], a["block_size"], a.get("accuracy_level", 0)) == (bits, block, level)
        assert len(node.input) == inputs
    assert q.settings["head_nodes"] == ["head/MatMul"] and q.settings["format"] == "MatMulNBits"
    assert quant_format(q.path) == "operator"   # a quantized kernel: not "simulated INT8" on CUDA


def test_the_head_kept_float_and_accuracy_level_4_changes_the_outputs(zoo_exported, tmp_path):
    _, fp32 = zoo_exported("pre")
    paths = {}
    for name in ("wo-int8-b32", "wo-int8-b32-acc4", "wo-int4-b32-fphead"):
        q = quantize(fp32, get_recipe(name), CALIB, tmp_path / f"{name}.onnx", vnni=False, probe_inputs=CALIB[:2])
        assert q.ok, q.status
        paths[name] = q.path
    assert weight_matmuls(onnx.load(str(paths["wo-int4-b32-fphead"])).graph) == ["head/MatMul"]
    # --exclude (mixed precision) keeps matching nodes float in a weight-only recipe as in any other
    mixed = quantize(fp32, with_exclusions(get_recipe("wo-int4-b32"), "blocks.0.*"), CALIB, tmp_path / "mixed.onnx",
                     vnni=False, probe_inputs=CALIB[:2])
    assert mixed.ok and weight_matmuls(onnx.load(str(mixed.path)).graph) == [
        n for n in weight_matmuls(onnx.load(str(fp32)).graph) if n.startswith("blocks.0.")]
    ids = RNG.integers(0, 256, size=(2, 32))
    ref, level0, level4 = logits(fp32, ids), logits(paths["wo-int8-b32"], ids), logits(paths["wo-int8-b32-acc4"], ids)
    # int8 activations per block are another computation than float ones, and both are close to FP32
    assert np.abs(level4 - level0).max() > 1e-5
    for out in (level0, level4):
        assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()


def test_sanity_catches_a_non_finite_block_scale(zoo_exported, tmp_path):
    _, fp32 = zoo_exported("pre")
    q = quantize(fp32, get_recipe("wo-int4-b32"), CALIB, tmp_path / "q.onnx", vnni=False, probe_inputs=CALIB[:2])
    model = onnx.load(str(q.path))
    assert check_quant_params(model) == []      # signed block scales are fine
    scale_name = nbits_nodes(q.path)[0].input[2]
    init = next(i for i in model.graph.initializer if i.name == scale_name)
    values = numpy_helper.to_array(init).copy()
    values.flat[0] = np.inf
    init.CopyFrom(numpy_helper.from_array(values, scale_name))
    assert scale_name in check_quant_params(model)[0]


# --- end to end: a trained zoo model, evaluate's recipe loop, the search, the generation stage ----------

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "32", "--batch-size", "8", "--steps", "40"]
FAST = ["--batches", "1", "--iters", "2", "--calib-samples", "8", "--quiet", "--threads", "1", "--providers", "cpu",
        "--no-outliers"]
GEN = ["--gen-tokens", "12,8", "--gen-batches", "1", "--agreement", "4,8"]
RECIPES_RUN = ["wo-int8-b32", "wo-int4-b32", "wo-int4-b32-acc4", "wo-int4-b32-gptq", "online-rotated-wo-int4-b32-acc4",
               "rotated-wo-int4-b32", "block-rotated-wo-int4-b32-acc4", "stream-block-rotated-wo-int8-b16-acc4"]
EMB8 = "wo-int8-b32-emb8"   # the token embedding in 8 bits too (tests/test_embedding.py), through the cache


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("wo") / "run"
    assert main(["evaluate", "--placement", "pre", "--norm", "rms", *TINY, *FAST, *GEN, "--out", str(out),
                 "--recipes", ",".join([*RECIPES_RUN, EMB8, "auto"]), "--search-space", "wo-int4-b32,wo-int8-b32",
                 "--max-ppl-ratio", "1.003", "--search-pick", "first"]) == 0
    results = json.loads((out / "results.json").read_text())
    validate(results)
    return {"dir": out, "results": results}


def test_int8_is_closer_to_fp32_than_int4_and_gptq_closer_than_nearest(run):
    entries = {r["name"]: r for r in run["results"]["recipes"]}
    kl = {n: entries[n]["accuracy"]["kld_mean"] for n in RECIPES_RUN[:5]}
    assert all(np.isfinite(v) and 0 <= v < 0.05 for v in kl.values()), kl
    assert kl["wo-int8-b32"] < kl["wo-int4-b32"] / 10
    assert kl["wo-int4-b32-gptq"] < kl["wo-int4-b32"]
    assert entries["wo-int4-b32-gptq"]["settings"]["gptq"]["calibration_positions"] == 8 * 32
    assert entries["rotated-wo-int4-b32"]["status"].startswith("not applicable: ")
    # the stream forms fold a Pre-RMSNorm checkpoint's norms: a zoo model is told which forms it takes
    stream = entries["stream-block-rotated-wo-int8-b16-acc4"]["status"]
    assert stream.startswith("not applicable: ") and "forms a and d" in stream and "block-rotated-wo" in stream
    assert entries["online-rotated-wo-int4-b32-acc4"]["settings"]["rotation"] == "online"
    assert entries["block-rotated-wo-int4-b32-acc4"]["settings"]["rotation"] == "block32"
    assert entries["block-rotated-wo-int4-b32-acc4"]["status"] == "ok"
    # accuracy_level 4 records what its int8 inputs lose per block (tests/test_block_sqnr.py)
    blocks = entries["wo-int4-b32-acc4"]["settings"]["activation_blocks"]
    assert blocks["status"] == "measured" and blocks["windows"] == 8 and blocks["inputs"]
    assert "activation_blocks" not in entries["wo-int4-b32"]["settings"]
    report = (run["dir"] / "report.md").read_text()
    assert "### accuracy_level 4: the int8 inputs per block" in report
    assert "| `wo-int4-b32-acc4` | 32 |" in report and f"{kl['wo-int4-b32']:.2e} (`wo-int4-b32`)" in report
    assert "MatMulNBits int4 block 32, accuracy_level 4, nearest, head quantized" in report


def test_the_search_takes_weight_only_recipes(run):
    search = run["results"]["search"]
    assert [t["recipe"] for t in search["trials"]] == ["wo-int4-b32", "wo-int8-b32"]
    assert [t["passed"] for t in search["trials"]] == [False, True] and search["status"] == "passed"


def test_with_past_graphs_quantize_and_decode(run):
    models = {m.name: m for m in generation_models(run["results"])}
    # every ok recipe of the run, the search's pick included, on the with-past graph
    ok = [n for n in RECIPES_RUN if "stream" not in n and n != "rotated-wo-int4-b32"]   # not applicable to a zoo model
    assert set(models) == {"fp32", *ok, EMB8, "auto:wo-int8-b32"}
    for name in [*ok, EMB8, "auto:wo-int8-b32"]:
        m = models[name]
        assert m.ok, m.entry
        assert nbits_nodes(run["dir"] / m.path) and m.cache_check["relative_diff"] <= 1e-4
        assert m.agreement["prompts"] == 4 and all(r["gen_tokens_per_s"] > 0 for r in m.decode)
    # the 8-bit table in both graphs, a smaller file, and accuracy within reach of the float table's
    for path in (run["dir"] / models[EMB8].path, run["dir"] / f"model.int8.{EMB8}.onnx"):
        assert [n.op_type for n in onnx.load(str(path)).graph.node].count("GatherBlockQuantized") == 1
    assert models[EMB8].entry["size_bytes"] < models["wo-int8-b32"].entry["size_bytes"]
    entries = {r["name"]: r for r in run["results"]["recipes"]}
    assert entries[EMB8]["settings"]["embedding"]["dtype"] == "int8"
    kl = entries[EMB8]["accuracy"]["kld_mean"], entries["wo-int8-b32"]["accuracy"]["kld_mean"]
    assert kl[0] != kl[1] and kl[0] < kl[1] + 2e-3, kl
