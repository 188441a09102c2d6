"""Recipes, the ORT backend, the sanity check, and the -inf mask trap (PITFALLS.md 1)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx_helpers import onnx_logits
from torch import nn

from quantnorm.calibration import calibration_windows
from quantnorm.data import evaluation_windows, load_corpus, make_splits, sample_train_batch
from quantnorm.errors import ConfigError, QuantizeError
from quantnorm.export import export_onnx
from quantnorm.models import CausalLM, ModelConfig
from quantnorm.quantize import (
    DEFAULT_RECIPES,
    RECIPES,
    Recipe,
    get_recipe,
    quantize,
    sanity_check,
    with_exclusions,
)

CONTEXT = 16
RNG = np.random.default_rng(0)
CALIB = RNG.integers(0, 257, size=(8, CONTEXT))
PROBE = RNG.integers(0, 257, size=(2, CONTEXT))


def zoo_onnx(tmp_path_factory, placement: str, norm: str, n_layers: int, opset: int) -> Path:
    """A random-init zoo model as ONNX, exported once per session (shared with test_export.py)."""
    path = tmp_path_factory.getbasetemp() / "onnx-cache" / f"{placement}-{norm}-L{n_layers}-op{opset}.onnx"
    if not path.exists():
        torch.manual_seed(0)
        model = CausalLM(ModelConfig(placement=placement, norm=norm, n_layers=n_layers, d_model=32, n_heads=2,
                                     context=CONTEXT))
        export_onnx(model, path, np.random.default_rng(0).integers(0, 257, size=(3, 12)), opset=opset)
    return path


def qdq_weight_matmuls(path: Path) -> tuple[set[str], set[str]]:
    """(MatMuls fed by a DequantizeLinear, all MatMuls) of a QDQ model."""
    graph = onnx.load(str(path)).graph
    dq_outputs = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    return {n.name for n in matmuls if any(i in dq_outputs for i in n.input)}, {n.name for n in matmuls}


# --- recipes -------------------------------------------------------------------------------------


def test_recipe_table_and_defaults():
    assert set(DEFAULT_RECIPES) <= set(RECIPES)
    assert {RECIPES[n].calibration for n in DEFAULT_RECIPES} >= {"minmax", "entropy", "percentile", None}
    assert {RECIPES[n].op_scope for n in DEFAULT_RECIPES} == {"matmul", "all"}
    assert "dynamic" in DEFAULT_RECIPES
    for name, recipe in RECIPES.items():
        # every INT8 recipe resolves its weight range by the CPU; the FP16 variant and the
        # weight-only ones (MatMulNBits' own int8/int4 kernels) have none
        assert recipe.name == name and recipe.reduce_range == ("auto" if recipe.mode not in ("fp16", "weight-only")
                                                               else False)
    with pytest.raises(ConfigError, match="static-minmax-matmul"):
        get_recipe("static-minmax")


def test_recipe_settings_resolve_reduce_range():
    recipe = get_recipe("static-minmax-matmul")
    no_vnni, vnni = recipe.settings(vnni=False), recipe.settings(vnni=True)
    assert no_vnni["reduce_range"] is True and vnni["reduce_range"] is False
    assert vnni == {**no_vnni, "reduce_range": False}
    assert vnni["format"] == "QDQ" and vnni["op_types"] == ["MatMul"] and vnni["calibration"] == "minmax"
    assert vnni["per_channel"] is True and vnni["excluded_nodes"] == []
    assert get_recipe("static-percentile-matmul").settings(True)["percentile"] == 99.999
    assert "Softmax" in get_recipe("static-minmax-all").settings(True)["op_types"]
    symact = get_recipe("static-minmax-matmul-symact").settings(True)
    assert symact["activation_type"] == "QInt8" and symact["symmetric_activations"] is True
    assert get_recipe("dynamic").settings(True)["calibration"] is None


def test_recipe_validation():
    with pytest.raises(ConfigError, match="calibration"):
        Recipe("x", "static", "kl", True, "matmul", False, "auto")
    with pytest.raises(ConfigError, match="dynamic"):
        Recipe("x", "dynamic", "minmax", True, "matmul", False, "auto")
    with pytest.raises(ConfigError, match="op_scope"):
        Recipe("x", "static", "minmax", True, "everything", False, "auto")
    with pytest.raises(ConfigError, match="reduce_range"):
        Recipe("x", "static", "minmax", True, "matmul", False, "yes")
    with pytest.raises(ConfigError, match="file name"):
        Recipe("a/b", "static", "minmax", True, "matmul", False, "auto")


def test_with_exclusions_names_the_variant():
    base = get_recipe("static-minmax-matmul")
    mixed = with_exclusions(base, ["head/*"])
    assert mixed.excluded == ("head/*",) and mixed.name.startswith("static-minmax-matmul-mixed-")
    assert mixed.settings(True)["excluded_nodes"] == ["head/*"]
    assert with_exclusions(base, "head/*").name == mixed.name  # same patterns, same name
    assert with_exclusions(base, ["blocks.0*"]).name != mixed.name
    assert with_exclusions(base, ["head/*"], name="keep-head").name == "keep-head"
    with pytest.raises(ConfigError):
        with_exclusions(base, [])


def qdq_model(path: Path, scale: float) -> Path:
    """input_ids [b, s] -> Cast -> Unsqueeze -> Mul(w[257]) -> Q/DQ(scale) -> logits [b, s, 257]."""
    node = helper.make_node
    inits = [
        numpy_helper.from_array(np.linspace(-1, 1, 257, dtype=np.float32) / 256, "w"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "axis"),
        numpy_helper.from_array(np.array(scale, dtype=np.float32), "s"),
        numpy_helper.from_array(np.array(128, dtype=np.uint8), "zp"),
    ]
    graph = helper.make_graph(
        [node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT), node("Unsqueeze", ["f", "axis"], ["u"]),
         node("Mul", ["u", "w"], ["m"]), node("QuantizeLinear", ["m", "s", "zp"], ["q"], name="q"),
         node("DequantizeLinear", ["q", "s", "zp"], ["logits"], name="dq")],
        "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 257])], inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(path))
    return path


def test_sanity_check_known_answers(tmp_path):
    assert sanity_check(qdq_model(tmp_path / "ok.onnx", 0.01), PROBE) == []
    problems = sanity_check(qdq_model(tmp_path / "inf.onnx", float("inf")), PROBE)
    assert "scale" in problems[0] and "not finite" in problems[0]
    assert any("NaN" in p for p in problems), problems  # (q - zp) * inf = NaN at q == zp
    zero = sanity_check(qdq_model(tmp_path / "zero.onnx", 0.0), PROBE)
    assert "not > 0" in zero[0]
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    assert "cannot read" in sanity_check(garbage, PROBE)[0]


# --- the zoo quantizes, and to the expected structure ---------------------------------------------


def test_every_recipe_quantizes_pre_rms_ok(tmp_path_factory, tmp_path):
    fp32 = zoo_onnx(tmp_path_factory, "pre", "rms", 2, 18)
    for name, recipe in RECIPES.items():
        if recipe.mode == "weight-only":   # their grid of graphs: tests/test_weight_only.py
            continue
        out = tmp_path / f"model.int8.{name}.onnx"
        result = quantize(fp32, recipe, CALIB, out, vnni=False, probe_inputs=PROBE)
        assert result.status == "ok", (name, result.problems)
        assert result.path == out and out.is_file()
        if recipe.mode == "fp16":  # no integers: every weight float16, no quantize node
            graph = onnx.load(str(out)).graph
            assert {i.data_type for i in graph.initializer if i.data_type in (1, 10)} == {TensorProto.FLOAT16}
            assert not [n for n in graph.node if "Quant" in n.op_type or "Integer" in n.op_type]
            continue
        # no VNNI: ONNX Runtime's quantizer reduces the range, per-token INT8 stores its 8-bit codes unsigned
        per_token = recipe.mode == "pertoken"
        assert result.settings["reduce_range"] is not per_token, name
        assert result.settings["unsigned_pertoken_weights"] is (per_token or recipe.carriers == "pertoken"), name
        if recipe.mode == "static" and recipe.op_scope == "matmul":
            quantized, matmuls = qdq_weight_matmuls(out)
            # 6 weight MatMuls per block and the head; q@k^T and probs@v (2 per block) stay FP32.
            assert len(quantized) == 2 * 6 + 1 and len(matmuls - quantized) == 2 * 2, name
            assert "head/MatMul" in quantized and "blocks.0.attn/MatMul" not in quantized
            # MatMul outputs stay float: in particular the logits are never squeezed into 8 bits.
            graph = onnx.load(str(out)).graph
            assert not [n for n in graph.node if n.op_type == "QuantizeLinear" and "logits" in n.input[0]], name
            assert [n.op_type for n in graph.node if "logits" in n.output] == ["MatMul"], name
        elif recipe.mode == "dynamic":
            ops = [n.op_type for n in onnx.load(str(out)).graph.node]
            assert ops.count("MatMulInteger") == 13 and ops.count("MatMul") == 4
        elif recipe.mode == "pertoken":  # the 13 weight MatMuls per token, the attention ones FP32
            ops = [n.op_type for n in onnx.load(str(out)).graph.node]
            kernel = "MatMulIntegerToFloat" if recipe.pertoken_kernel == "ort-fused" else "MatMulInteger"
            assert ops.count(kernel) == 13 and ops.count("MatMul") == 4, name
        else:  # "all": the attention MatMuls, the adds and the norms' Muls are quantized too
            quantized, matmuls = qdq_weight_matmuls(out)
            assert quantized == matmuls
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"model.int8.{n}.onnx" for n, r in RECIPES.items()
                                                                if r.mode != "weight-only")


@pytest.mark.parametrize("placement, norm, n_layers, opset", [("pre", "layer", 2, 18), ("residual", "rms", 2, 23)])
def test_zoo_recipe_families_ok(tmp_path_factory, tmp_path, placement, norm, n_layers, opset):
    fp32 = zoo_onnx(tmp_path_factory, placement, norm, n_layers, opset)
    for name in ("static-minmax-matmul", "static-minmax-all", "dynamic"):
        result = quantize(fp32, get_recipe(name), CALIB, tmp_path / f"{name}.onnx", vnni=True, probe_inputs=PROBE)
        assert result.status == "ok", (placement, norm, name, result.problems)
        assert result.settings["reduce_range"] is False


def test_exclusions_keep_nodes_in_fp32(tmp_path_factory, tmp_path):
    fp32 = zoo_onnx(tmp_path_factory, "pre", "rms", 2, 18)
    recipe = with_exclusions(get_recipe("static-minmax-matmul"), ["head/*", "blocks.0.mlp.*"])
    result = quantize(fp32, recipe, CALIB, tmp_path / "mixed.onnx", vnni=True, probe_inputs=PROBE)
    assert result.status == "ok"
    assert result.settings["excluded_nodes_resolved"][-1] == "head/MatMul"
    quantized, _ = qdq_weight_matmuls(result.path)
    assert len(quantized) == 13 - 3
    assert not {"head/MatMul", "blocks.0.mlp.up/MatMul", "blocks.0.mlp.down/MatMul"} & quantized
    with pytest.raises(ConfigError, match="matches no node"):
        quantize(fp32, with_exclusions(recipe, ["lm_head*"]), CALIB, tmp_path / "x.onnx", vnni=True,
                 probe_inputs=PROBE)


def test_argument_and_ort_errors(tmp_path_factory, tmp_path):
    fp32 = zoo_onnx(tmp_path_factory, "pre", "rms", 2, 18)
    with pytest.raises(ConfigError, match="not found"):
        quantize(tmp_path / "none.onnx", get_recipe("dynamic"), None, tmp_path / "o.onnx", vnni=True,
                 probe_inputs=PROBE)
    with pytest.raises(ConfigError, match="calibration windows"):
        quantize(fp32, get_recipe("static-minmax-matmul"), None, tmp_path / "o.onnx", vnni=True, probe_inputs=PROBE)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    with pytest.raises(QuantizeError):
        quantize(garbage, get_recipe("dynamic"), None, tmp_path / "o.onnx", vnni=True, probe_inputs=PROBE)
    assert not (tmp_path / "o.onnx").exists()


# --- the -inf mask, built on purpose (PITFALLS.md 1) -----------------------------------------------


class InfMaskedAttention(nn.Module):
    """One attention layer with the usual masked_fill(-inf) before Softmax: the trap."""

    def __init__(self, d: int = 16, fill: float = float("-inf")):
        super().__init__()
        self.fill = fill
        self.cfg = types.SimpleNamespace(context=CONTEXT, vocab_size=257)  # what export_onnx reads
        self.emb = nn.Embedding(257, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 257)
        self.register_buffer("future", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), 1))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        t = input_ids.shape[1]
        scores = (self.q(x) @ self.k(x).transpose(-2, -1)) * 0.25
        scores = scores.masked_fill(self.future[:t, :t], self.fill)
        return self.head(torch.softmax(scores, dim=-1) @ self.v(x))


def test_inf_mask_is_reported_broken_not_crashed(tmp_path):
    torch.manual_seed(0)
    fp32 = export_onnx(InfMaskedAttention(), tmp_path / "inf.onnx", PROBE).path

    minmax_all = get_recipe("static-minmax-all")
    result = quantize(fp32, minmax_all, CALIB, tmp_path / "minmax-all.onnx", vnni=True, probe_inputs=PROBE)
    assert result.status.startswith("broken: ") and "not finite" in result.status
    assert any("invalid value encountered in divide" in p for p in result.problems), result.problems
    assert result.path is not None and result.path.is_file()  # kept, so the damage can be measured
    # The damage is real: the FP32 and INT8 models disagree although every logit is finite.
    fp, q = onnx_logits(fp32, CALIB), onnx_logits(result.path, CALIB)
    assert np.isfinite(q).all() and (fp.argmax(-1) == q.argmax(-1)).mean() < 0.5

    entropy_all = Recipe("static-entropy-all", "static", "entropy", True, "all", False, "auto")
    result = quantize(fp32, entropy_all, CALIB, tmp_path / "entropy-all.onnx", vnni=True, probe_inputs=PROBE)
    assert result.status.startswith("broken: calibration failed") and "not finite" in result.status
    assert result.path is None and not (tmp_path / "entropy-all.onnx").exists()

    # The fix: weight MatMuls only; the scores never get a quantizer.
    result = quantize(fp32, get_recipe("static-minmax-matmul"), CALIB, tmp_path / "mm.onnx", vnni=True,
                      probe_inputs=PROBE)
    assert result.status == "ok", result.problems


def test_finite_mask_constant_in_a_softmax_input_is_reported_broken(tmp_path):
    """A finite mask (here finfo.min, as Hugging Face uses) keeps every scale finite, yet the
    softmax input gets an enormous INT8 step: the sanity check must still call it broken."""
    torch.manual_seed(0)
    fp32 = export_onnx(InfMaskedAttention(fill=torch.finfo(torch.float32).min), tmp_path / "fmin.onnx", PROBE).path
    result = quantize(fp32, get_recipe("static-minmax-all"), CALIB, tmp_path / "all.onnx", vnni=True,
                      probe_inputs=PROBE)
    assert result.status.startswith("broken: attention scores quantized"), result.status
    result = quantize(fp32, get_recipe("static-minmax-matmul"), CALIB, tmp_path / "mm.onnx", vnni=True,
                      probe_inputs=PROBE)
    assert result.status == "ok", result.problems


# --- accuracy on a briefly trained model ----------------------------------------------------------


def test_static_minmax_matmul_keeps_top1_on_a_trained_model(tmp_path):
    corpus = load_corpus().array()
    window = CONTEXT
    splits = make_splits(len(corpus), window)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = CausalLM(ModelConfig(placement="pre", norm="rms", n_layers=1, d_model=32, n_heads=2, context=window))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a d32 model gains nothing from more; the 2 shared cores stay free
    try:
        for _ in range(250):
            x, y = sample_train_batch(corpus, splits.train, window, 16, rng)
            logits = model(torch.from_numpy(x))
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 3.2  # below the byte unigram entropy (3.26 nats): it uses context

    eval_x, _ = evaluation_windows(corpus, splits.evaluation, window)
    eval_x = eval_x[:32]
    fp32 = export_onnx(model, tmp_path / "trained.onnx", eval_x[:4]).path
    calib = calibration_windows(corpus, splits.calibration, window, 32)
    result = quantize(fp32, get_recipe("static-minmax-matmul"), calib, tmp_path / "int8.onnx", vnni=True,
                      probe_inputs=eval_x[:2])
    assert result.status == "ok"
    ref, q = onnx_logits(fp32, eval_x), onnx_logits(result.path, eval_x)
    agreement = float((ref.argmax(-1) == q.argmax(-1)).mean())
    assert agreement > 0.9, agreement  # 0.988 seen (train loss 2.79)


def test_a_shared_preprocess_cache_prepares_each_fp32_model_once_and_changes_nothing(tmp_path_factory, tmp_path,
                                                                                       monkeypatch):
    from quantnorm.quantize import PreprocessCache, ort_backend

    fp32 = tmp_path / "model.fp32.onnx"
    fp32.write_bytes(zoo_onnx(tmp_path_factory, "pre", "rms", 2, 18).read_bytes())
    calls = []
    real = ort_backend._preprocess
    monkeypatch.setattr(ort_backend, "_preprocess", lambda src, dst: calls.append(src) or real(src, dst))
    names = ("static-minmax-matmul", "dynamic", "pertoken", "static-minmax-matmul-pertensor")
    alone = {n: quantize(fp32, get_recipe(n), CALIB, tmp_path / f"a.{n}.onnx", vnni=True, probe_inputs=PROBE)
             for n in names}
    assert len(calls) == 4          # without a cache: once per call
    with PreprocessCache() as cache:
        shared = {n: quantize(fp32, get_recipe(n), CALIB, tmp_path / f"s.{n}.onnx", vnni=True, probe_inputs=PROBE,
                              preprocessed=cache) for n in names}
        assert len(calls) == 5      # one more, for all four recipes
        # MinMax with per-tensor weights calibrates the activations per-channel MinMax did: reused
        assert cache.ranges_reused == 1
        kept = cache.get(fp32)
        assert kept.is_file()
        fp32.write_bytes(zoo_onnx(tmp_path_factory, "pre", "layer", 2, 18).read_bytes())   # the file changed
        assert cache.get(fp32) != kept and len(calls) == 6
    assert not kept.exists()        # the cache's directory is gone with it
    for n in names:
        assert alone[n].status == shared[n].status == "ok"
        assert (tmp_path / f"a.{n}.onnx").read_bytes() == (tmp_path / f"s.{n}.onnx").read_bytes(), n


def test_gptq_taken_a_slice_of_columns_at_a_time_gives_the_codes_and_error_of_the_whole(monkeypatch):
    """A wide weight (Gemma 3's 262k-column head) is rounded and measured a slice of output columns
    at a time, to bound memory: each column is rounded on its own, so the codes, the block codes
    and the error are those of the whole weight taken at once (a slice that does not divide N too)."""
    from quantnorm.transforms import gptq

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((40, 50)) * 0.1).astype(np.float32)
    x = rng.standard_normal((300, 40)).astype(np.float32) @ (np.eye(40) + 0.3 * rng.standard_normal((40, 40)))
    h = (x.T @ x).astype(np.float32)
    h[3, :] = h[:, 3] = 0.0   # an input that never fires: dropped in every slice
    whole, scale = gptq.gptq_quantize(w, h, 127, block=16)
    whole_blocks = gptq.gptq_block_codes(w, h, 4, 16)
    whole_error = gptq.output_error(w, whole, scale, h)
    monkeypatch.setattr(gptq, "COLUMN_SLICE", 7)
    sliced, sliced_scale = gptq.gptq_quantize(w, h, 127, block=16)
    assert np.array_equal(sliced, whole) and np.array_equal(sliced_scale, scale)
    assert not np.array_equal(whole, gptq.gptq_quantize(w, np.eye(40, dtype=np.float32), 127, block=16)[0])
    sliced_blocks = gptq.gptq_block_codes(w, h, 4, 16)
    assert all(np.array_equal(a, b) for a, b in zip(sliced_blocks, whole_blocks, strict=True))
    assert gptq.output_error(w, sliced, scale, h) == pytest.approx(whole_error, rel=1e-12)


def test_gptq_rounding_lowers_the_weight_error_the_calibration_activations_see(tmp_path_factory, tmp_path):
    """pertoken-fused-gptq: the same grid and kernel as pertoken-fused, other codes; its X-weighted
    weight error is below round-to-nearest's for every MatMul, and so is its logit error."""
    import onnxruntime as ort

    from quantnorm.quantize.pertoken import weight_scales
    from quantnorm.transforms.gptq import gptq_quantize, output_error

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((48, 40)) * 0.1).astype(np.float32)
    x = rng.standard_normal((500, 48)).astype(np.float32) @ (np.eye(48) + 0.3 * rng.standard_normal((48, 48)))
    h = (x.T @ x).astype(np.float32)
    codes, scale = gptq_quantize(w, h, 127)
    nearest = weight_scales(w, 127)
    assert np.array_equal(scale, nearest[1]) and np.abs(codes).max() <= 127
    assert output_error(w, codes, scale, h) < 0.8 * output_error(w, *nearest, h)

    fp32 = zoo_onnx(tmp_path_factory, "pre", "rms", 2, 18)
    calib = RNG.integers(0, 257, size=(16, CONTEXT))
    runs = {}
    for name in ("pertoken-fused", "pertoken-fused-gptq"):
        q = quantize(fp32, get_recipe(name), calib, tmp_path / f"{name}.onnx", vnni=True, probe_inputs=PROBE)
        assert q.status == "ok", q.problems
        runs[name] = q
    g = runs["pertoken-fused-gptq"].settings
    assert g["weight_rounding"] == "gptq" and g["gptq"]["matmuls"] == 2 * 6 + 1
    assert g["gptq"]["output_error_vs_nearest_max"] < 1.0 and g["gptq_calibration_positions"] == 16 * CONTEXT
    assert runs["pertoken-fused"].settings["weight_rounding"] == "nearest" and "gptq" not in runs["pertoken-fused"].settings

    def logits(path):
        s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return s.run(None, {s.get_inputs()[0].name: calib})[0]

    ref = logits(fp32)
    err = {n: float(np.mean((logits(q.path) - ref) ** 2)) for n, q in runs.items()}
    assert err["pertoken-fused-gptq"] < err["pertoken-fused"], err


@pytest.mark.parametrize("external", [False, True])
def test_the_preprocessed_graph_reads_the_optimized_weights_where_they_are(tmp_path_factory, tmp_path, monkeypatch,
                                                                           external):
    """``_preprocess`` writes the graph alone: its weights stay in optimized.onnx (past the external
    data threshold: optimized.onnx.data) beside it, not in a second copy; the graph carries ONNX's
    inferred shapes and runs as the FP32 model does."""
    from quantnorm.onnx_wire import external_data_locations
    from quantnorm.quantize import ort_backend

    fp32 = zoo_onnx(tmp_path_factory, "pre", "rms", 2, 18)
    if external:
        monkeypatch.setenv("QUANTNORM_EXTERNAL_DATA_BYTES", "1000")
    pre = ort_backend._preprocess(fp32, tmp_path / "preprocessed.onnx")
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == (["optimized.onnx", "optimized.onnx.data", "preprocessed.onnx"] if external
                    else ["optimized.onnx", "preprocessed.onnx"])
    graph = onnx.load(str(pre), load_external_data=False).graph
    assert not [i.name for i in graph.initializer if len(i.raw_data) >= 1024]   # no weight copied
    assert sum(i.data_location == TensorProto.EXTERNAL for i in graph.initializer) >= 8
    assert set(external_data_locations(pre)) <= {"optimized.onnx", "optimized.onnx.data"}
    assert len(graph.value_info) > 0
    np.testing.assert_allclose(onnx_logits(pre, PROBE), onnx_logits(fp32, PROBE), rtol=1e-5, atol=1e-5)
