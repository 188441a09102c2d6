"""SQNR of QDQ models: hand computation, a planted outlier channel, rank correlation, summary."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, qdq_loss_debug, quantize_static

from quantnorm.data import BOS
from quantnorm.export import rename_nodes_by_module
from quantnorm.measure.graph_probe import weight_matmul_inputs
from quantnorm.measure.outliers import TensorAccumulator
from quantnorm.measure.sqnr import (
    activation_sqnr,
    expose_tensors,
    onnx_tensor_stats,
    open_beside,
    qdq_tapped_model,
    spearman,
    sqnr_db,
    sqnr_summary,
    sqnr_with_stats,
)
from quantnorm.models import CausalLM, ModelConfig
from quantnorm.onnx_wire import REFERENCE_MIN_BYTES, model_with_weights_by_reference, onnx_nodes

SEQ, D = 16, 32
OUTLIER_CHANNEL, OUTLIER_GAIN = 3, 100.0


def windows(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).integers(0, 256, size=(n, SEQ))
    x[:, 0] = BOS
    return x


class _Reader(CalibrationDataReader):
    def __init__(self, x: np.ndarray):
        self._batches = iter([{"input_ids": x[i:i + 4]} for i in range(0, len(x), 4)])

    def get_next(self):
        return next(self._batches, None)


def _export_and_quantize(model: CausalLM, directory: Path) -> tuple[Path, Path]:
    fp32, int8 = directory / "model.fp32.onnx", directory / "model.int8.onnx"
    torch.onnx.export(
        model, (torch.from_numpy(windows(2, 9)),), str(fp32), dynamo=True, external_data=False,
        opset_version=18, input_names=["input_ids"], output_names=["logits"],
        dynamic_shapes={"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=SEQ)}},
        verbose=False)
    quantize_static(str(fp32), str(int8), _Reader(windows(8, 1)), quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["MatMul"], per_channel=True)
    return fp32, int8


def _tiny(outlier: bool) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement="pre", norm="layer", n_layers=1, d_model=D, n_heads=2, context=SEQ)).eval()
    if outlier:  # the MLP's input norm gain makes one channel of mlp.up's input ~100x the others
        with torch.no_grad():
            model.blocks[0].mlp_norms["norm"].weight[OUTLIER_CHANNEL] = OUTLIER_GAIN
    return model


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    model = _tiny(outlier=False)
    return (model, *_export_and_quantize(model, tmp_path_factory.mktemp("clean")))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    model = _tiny(outlier=True)
    return (model, *_export_and_quantize(model, tmp_path_factory.mktemp("planted")))


def _modules(fp32: Path) -> dict[str, list[str]]:
    """tensor -> the modules of the MatMuls reading it (after the export's renaming, node names are
    ``<module>/MatMul``)."""
    model = onnx.load(str(fp32))
    rename_nodes_by_module(model)
    return {t: [n.split("/")[0] for n in nodes] for t, nodes in weight_matmul_inputs(model).items()}


def _input_of(model: CausalLM, fp32: Path, module: str) -> str:
    return next(t for t, mods in _modules(fp32).items() if module in mods)


def test_sqnr_of_first_tensor_matches_hand_quantization(clean):
    model, fp32, int8 = clean
    x = windows(6, 2)
    rows = {r["tensor"]: r for r in activation_sqnr(fp32, int8, x, batch_size=4)}
    name = _input_of(model, fp32, "blocks.0.attn.q")
    assert set(_modules(fp32)[name]) == {"blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v"}

    with torch.no_grad():  # the FP32 tensor by hand: pre-LN's first norm of the embedding
        ref = model.blocks[0].attn_norms["norm"](model.embed(torch.from_numpy(x))).numpy().astype(np.float64)
    graph = onnx.load(str(int8)).graph
    q_node = next(n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == name)
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    scale, zp = float(inits[q_node.input[1]]), inits[q_node.input[2]]
    info = np.iinfo(zp.dtype)
    zp = float(zp)
    q = np.clip(np.rint(ref / scale) + zp, info.min, info.max)  # ONNX QuantizeLinear: round half to even
    hand = 10 * math.log10(np.sum(ref**2) / np.sum((ref - (q - zp) * scale) ** 2))

    row = rows[name]
    assert row["n_values"] == x.size * D
    assert row["sqnr_db"] == pytest.approx(hand, abs=0.05)
    # Nothing upstream is quantized, so the local and end-to-end errors are the same tensor's.
    assert row["sqnr_local_db"] == pytest.approx(row["sqnr_db"], abs=1e-6)
    # Every quantized activation has a row.
    quantized = {n.input[0].removesuffix("_QuantizeLinear_Input") for n in graph.node if n.op_type == "QuantizeLinear"}
    assert set(rows) == quantized
    measured = [r["sqnr_db"] for r in rows.values() if r["sqnr_db"] is not None]
    assert measured and all(10 < v < 80 for v in measured)  # None only for an exactly representable tensor


def test_onnx_tensor_stats_match_torch_side(clean):
    model, fp32, _ = clean
    x = windows(6, 2)
    name = _input_of(model, fp32, "blocks.0.attn.q")
    stats = onnx_tensor_stats(fp32, [name], x, batch_size=4)[name]
    with torch.no_grad():
        ref = model.blocks[0].attn_norms["norm"](model.embed(torch.from_numpy(x))).numpy()
    acc = TensorAccumulator(name)
    acc.add(ref)
    expected = acc.finish()
    assert stats["ratio"] == pytest.approx(expected.ratio, rel=1e-4)
    assert stats["kurtosis"] == pytest.approx(expected.kurtosis, rel=1e-4)
    assert stats["inf_norm"] == pytest.approx(expected.inf_norm, rel=1e-4)
    assert stats["median_abs"] == pytest.approx(expected.median_abs, rel=1e-4)


def test_planted_outlier_channel_lowers_sqnr(clean, planted):
    x = windows(6, 3)
    results = {}
    for label, (model, fp32, int8) in {"clean": clean, "planted": planted}.items():
        name = _input_of(model, fp32, "blocks.0.mlp.up")
        row = next(r for r in activation_sqnr(fp32, int8, x) if r["tensor"] == name)
        stats = onnx_tensor_stats(fp32, [name], x)[name]
        results[label] = (row["sqnr_local_db"], stats["ratio"], stats["top"][0]["channel"])
    (clean_db, clean_ratio, _), (planted_db, planted_ratio, planted_channel) = results["clean"], results["planted"]
    assert planted_channel == OUTLIER_CHANNEL
    assert planted_ratio > 10 * clean_ratio
    assert planted_db < clean_db - 10.0, results


def test_sqnr_db_known_values():
    assert sqnr_db(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(10 * math.log10(2.0))
    assert sqnr_db(np.array([3.0, 4.0]), np.array([3.0, 4.1])) == pytest.approx(10 * math.log10(25 / 0.01))
    assert sqnr_db(np.array([1.0, 2.0]), np.array([1.0, 2.0])) is None  # exact: no noise
    assert sqnr_db(np.zeros(3), np.ones(3)) is None                      # no signal


def test_spearman_known_ranks():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties get average ranks: x ranks (1, 2.5, 2.5, 4), y ranks (1, 2, 3, 4) -> Pearson of ranks.
    rx, ry = np.array([1, 2.5, 2.5, 4]), np.array([1, 2, 3, 4])
    assert spearman([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None
    assert spearman([1, 2, None, 3, float("nan")], [3, 2, 1, 1, 0]) == pytest.approx(-1.0)


def test_sqnr_summary_joins_and_ranks():
    rows = [{"tensor": f"t{i}", "sqnr_db": 40.0 - 5 * i, "sqnr_local_db": 41.0 - 5 * i} for i in range(6)]
    rows.append({"tensor": "exact", "sqnr_db": None, "sqnr_local_db": None})
    stats = {f"t{i}": {"ratio": 2.0**i, "kurtosis": 3.0 + i, "inf_norm": float(i)} for i in range(6)}
    summary = sqnr_summary(rows, stats, worst=2)
    assert summary["spearman_ratio_sqnr"] == pytest.approx(-1.0)
    assert summary["spearman_kurtosis_sqnr"] == pytest.approx(-1.0)
    assert [w["tensor"] for w in summary["worst"]] == ["t5", "t4"]
    assert summary["worst"][0] == {"tensor": "t5", "sqnr_db": 15.0, "sqnr_local_db": 16.0,
                                   "ratio": 32.0, "kurtosis": 8.0, "inf_norm": 5.0}
    assert summary["n_tensors"] == 6
    only = sqnr_summary(rows, stats, tensors={"t0", "t1", "t2"})
    assert [w["tensor"] for w in only["worst"]] == ["t2", "t1", "t0"] and only["n_tensors"] == 3


def test_one_pass_gives_the_same_sqnr_and_stats_as_two(clean):
    """sqnr_with_stats (one FP32 pass, one window per run, pruned graphs) agrees with the SQNR
    rows at batch 4 and with onnx_tensor_stats on each paired tensor."""
    _, fp32, int8 = clean
    x = windows(6, 4)
    rows, stats = sqnr_with_stats(fp32, int8, x)
    at_batch_4 = activation_sqnr(fp32, int8, x, batch_size=4)
    assert [r["tensor"] for r in rows] == [r["tensor"] for r in at_batch_4]
    for one, four in zip(rows, at_batch_4):
        assert one["n_values"] == four["n_values"]
        for key in ("sqnr_db", "sqnr_local_db"):
            assert (one[key] is None) == (four[key] is None)
            if one[key] is not None:
                assert one[key] == pytest.approx(four[key], abs=1e-6)
    paired = [r["tensor"] for r in rows if r["sqnr_db"] is not None]
    assert paired and set(paired) <= set(stats)
    separate = onnx_tensor_stats(fp32, paired, x, batch_size=4)
    for name in paired:
        for key in ("ratio", "kurtosis", "inf_norm", "median_abs", "rms"):
            assert stats[name][key] == pytest.approx(separate[name][key], rel=1e-6), (name, key)


def test_exposing_only_inner_tensors_drops_the_head(clean):
    """With only=True the logits are no output and the head's MatMul (and its weight) are gone;
    the tapped graph runs on the original's weights to the same values."""
    model, fp32, _ = clean
    name = _input_of(model, fp32, "blocks.0.attn.q")
    pruned, full = expose_tensors(fp32, [name], only=True), onnx.load(str(fp32))
    assert [o.name for o in pruned.graph.output] == [name]
    assert len(pruned.graph.node) < len(full.graph.node)
    assert len(pruned.graph.initializer) < len(full.graph.initializer)
    x = windows(2, 5)
    tapped = open_beside(fp32, pruned).run([name], {"input_ids": x})[0]
    reference = open_beside(fp32, expose_tensors(fp32, [name])).run([name], {"input_ids": x})[0]
    np.testing.assert_array_equal(tapped, reference)


def test_tapped_graphs_reference_the_weights_and_leave_no_file(clean):
    """The tapped copy holds no weight bytes (each initializer of 1 KB or more points into the
    original file by offset), runs to the original's logits, and is removed once the session is
    open; where nothing can be written beside the model, the weights are copied instead."""
    _, fp32, _ = clean
    before = sorted(fp32.parent.iterdir())
    light = onnx.ModelProto.FromString(model_with_weights_by_reference(fp32))
    full = onnx.load(str(fp32))
    big = [i.name for i in full.graph.initializer if len(i.raw_data) >= REFERENCE_MIN_BYTES]
    assert big
    referenced = {i.name: {e.key: e.value for e in i.external_data} for i in light.graph.initializer
                  if i.data_location == onnx.TensorProto.EXTERNAL}
    assert sorted(referenced) == sorted(big)
    assert all(r["location"] == fp32.name for r in referenced.values())
    assert sum(len(i.raw_data) for i in light.graph.initializer) == sum(
        len(i.raw_data) for i in full.graph.initializer if i.name not in referenced)
    raw = fp32.read_bytes()
    for init in full.graph.initializer:
        if init.name in referenced:
            start, length = int(referenced[init.name]["offset"]), int(referenced[init.name]["length"])
            assert raw[start:start + length] == init.raw_data
    x = windows(3, 6)
    expected = onnxruntime.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).run(None, {"input_ids": x})[0]
    np.testing.assert_allclose(open_beside(fp32, light).run(None, {"input_ids": x})[0], expected, rtol=1e-5, atol=1e-6)
    assert sorted(fp32.parent.iterdir()) == before


def test_tapped_graph_falls_back_to_a_copy_where_it_cannot_write(clean, monkeypatch):
    _, fp32, _ = clean
    import quantnorm.measure.sqnr as sqnr_module

    def refuse(*args, **kwargs):
        raise PermissionError("read-only directory")

    monkeypatch.setattr(sqnr_module.tempfile, "mkstemp", refuse)
    x = windows(2, 7)
    expected = onnxruntime.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).run(None, {"input_ids": x})[0]
    light = onnx.ModelProto.FromString(model_with_weights_by_reference(fp32))
    np.testing.assert_allclose(open_beside(fp32, light).run(None, {"input_ids": x})[0], expected, rtol=1e-5, atol=1e-6)


def test_qdq_taps_are_the_debug_augmentations_activation_tensors(clean, tmp_path):
    """qdq_tapped_model taps what qdq_loss_debug's augmentation saves, minus the dequantized weights,
    under the tensors' own names (a quantized graph output, the logits here, is one of them)."""
    _, _, int8 = clean
    augmented = tmp_path / "augmented.onnx"
    qdq_loss_debug.modify_model_output_intermediate_tensors(str(int8), str(augmented),
                                                            op_types_for_saving=["QuantizeLinear", "DequantizeLinear"])
    model = onnx.load(str(augmented))
    suffix = qdq_loss_debug._TENSOR_SAVE_POSTFIX
    initializers = {i.name for i in model.graph.initializer}
    weights = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in initializers}
    saved = {o.name[:-len(suffix)] for o in model.graph.output if o.name.endswith(suffix)} - weights
    tapped = qdq_tapped_model(int8)
    assert {o.name for o in tapped.graph.output} == saved
    assert len(saved) > 4


def test_wire_walk_reads_the_nodes_onnx_load_reads(clean):
    """onnx_wire.onnx_nodes steps over the weights and returns the graph's and the local
    functions' nodes exactly as onnx.load parses them (the dynamo export writes functions)."""
    _, fp32, int8 = clean
    for path in (fp32, int8):
        model = onnx.load(str(path))
        expected = [(n.op_type, list(n.input), list(n.output))
                    for n in [*model.graph.node, *(node for fn in model.functions for node in fn.node)]]
        assert onnx_nodes(path) == expected


def test_wire_walk_refuses_a_file_that_is_not_onnx(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x3a\xff\xff\xff\x0f not a model")  # field 7, length far past the end
    with pytest.raises(ValueError, match="runs past"):
        onnx_nodes(bad)


def test_wire_walk_reads_the_external_data_locations(tmp_path, monkeypatch):
    """onnx_wire.external_data_locations finds the weight files onnx.load lists, without reading
    the weights; fileio.onnx_needs_external_data counts them in."""
    from onnx import TensorProto, helper, numpy_helper

    from quantnorm.fileio import onnx_needs_external_data
    from quantnorm.onnx_wire import external_data_locations

    weight = numpy_helper.from_array(np.ones((64, 64), dtype=np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight])
    model = helper.make_model(graph)
    inline, external = tmp_path / "inline.onnx", tmp_path / "external.onnx"
    onnx.save(model, str(inline))
    onnx.save(model, str(external), save_as_external_data=True, all_tensors_to_one_file=True,
              location="external.onnx.data", size_threshold=0)
    assert external_data_locations(inline) == set()
    assert external_data_locations(external) == {"external.onnx.data"}
    listed = {e.value for i in onnx.load(str(external), load_external_data=False).graph.initializer
              for e in i.external_data if e.key == "location"}
    assert external_data_locations(external) == listed
    # 16 KiB of weights: past a 10,000-byte threshold inline or beside the file, under a 40,000 one
    monkeypatch.setenv("QUANTNORM_EXTERNAL_DATA_BYTES", "10000")
    assert onnx_needs_external_data(inline) and onnx_needs_external_data(external)
    monkeypatch.setenv("QUANTNORM_EXTERNAL_DATA_BYTES", "40000")
    assert not onnx_needs_external_data(inline) and not onnx_needs_external_data(external)
