"""ONNX files written one initializer at a time (onnx_wire.write_model_streaming): the model
onnx.save writes, as protobuf, onnx.checker and ONNX Runtime read it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from quantnorm.fileio import save_onnx, serialized_size_estimate
from quantnorm.measure.sessions import SessionSpec, make_session
from quantnorm.onnx_wire import write_model_streaming


def _model() -> onnx.ModelProto:
    """x @ w + b, with initializers stored every way a TensorProto holds data: raw bytes, a typed
    list (float_data), int64 raw bytes, strings, an empty tensor; plus metadata and a function."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "w")
    b = helper.make_tensor("b", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])
    idx = numpy_helper.from_array(np.arange(5, dtype=np.int64), "idx")
    words = helper.make_tensor("words", TensorProto.STRING, [2], [b"a", b"bc"])
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["t"], name="mm"), helper.make_node("Add", ["t", "b"], ["y"], name="add")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w, b, idx, words, empty], doc_string="doc")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10,
                              producer_name="quantnorm-test")
    model.metadata_props.add(key="k", value="v")
    model.functions.add().CopyFrom(helper.make_function("local", "f", ["a"], ["c"],
                                                        [helper.make_node("Relu", ["a"], ["c"])],
                                                        [helper.make_opsetid("", 17)]))
    return model


def test_a_streamed_file_parses_to_the_model_onnx_save_writes(tmp_path):
    model = _model()
    streamed, saved = tmp_path / "streamed.onnx", tmp_path / "saved.onnx"
    write_model_streaming(model, streamed)
    onnx.save(model, str(saved))
    expected = model.SerializeToString(deterministic=True)
    assert onnx.load(str(streamed)).SerializeToString(deterministic=True) == expected
    assert onnx.load(str(saved)).SerializeToString(deterministic=True) == expected
    assert [i.name for i in onnx.load(str(streamed)).graph.initializer] == ["w", "b", "idx", "words", "empty"]
    onnx.checker.check_model(str(streamed))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = ort.InferenceSession(str(streamed), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(out, x @ numpy_helper.to_array(model.graph.initializer[0]) + [1, 2, 3, 4], rtol=1e-6)


def test_the_size_estimate_tracks_the_serialized_size_within_the_per_tensor_slack():
    model = _model()
    big = numpy_helper.from_array(np.ones((256, 256), np.float32), "big")
    model.graph.initializer.append(big)
    actual = model.ByteSize()
    estimate = serialized_size_estimate(model)
    assert actual <= estimate <= actual + 64 * len(model.graph.initializer)


def test_save_onnx_inline_is_the_streamed_file(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANTNORM_EXTERNAL_DATA_BYTES", raising=False)
    model = _model()
    save_onnx(model, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx.data").exists()
    assert onnx.load(str(tmp_path / "m.onnx")).SerializeToString(deterministic=True) == \
        model.SerializeToString(deterministic=True)


def test_raw_initializers_are_the_weights_bytes_where_they_lie_in_the_file(tmp_path):
    from quantnorm.onnx_wire import raw_initializers

    model = _model()
    path = tmp_path / "m.onnx"
    write_model_streaming(model, path)
    with raw_initializers(path) as raw:
        # typed-field tensors (b, words) carry no raw_data: not listed
        assert sorted(raw) == ["empty", "idx", "w"]
        for init in model.graph.initializer:
            if init.name in raw:
                dims, data_type, data = raw[init.name]
                assert (dims, data_type) == (tuple(init.dims), init.data_type)
                assert bytes(data) == numpy_helper.to_array(init).tobytes()


def test_gptq_codes_known_from_the_file_match_the_weights_keys(tmp_path):
    from quantnorm.transforms.gptq import GPTQCodes

    model = _model()
    path = tmp_path / "m.onnx"
    write_model_streaming(model, path)
    codes = GPTQCodes()
    weight = numpy_helper.to_array(model.graph.initializer[0])
    assert not codes.knows(path, ["mm"], 127, "windows")
    codes.put(GPTQCodes.key(weight, 127, "windows"), np.zeros((3, 4), np.int8), np.ones(4, np.float32), 0.0)
    assert codes.knows(path, ["mm"], 127, "windows")
    assert not codes.knows(path, ["mm"], 63, "windows")          # another code range
    model.graph.initializer[0].raw_data = (weight + 1e-3).astype(np.float32).tobytes()
    write_model_streaming(model, path)
    assert not codes.knows(path, ["mm"], 127, "windows")         # other weights: solved anew


def test_raw_initializers_read_external_data_where_it_lies(tmp_path):
    from quantnorm.onnx_wire import raw_initializers

    model = _model()
    expected = {i.name: numpy_helper.to_array(i).tobytes() for i in model.graph.initializer if i.HasField("raw_data")}
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.onnx.data", size_threshold=0)
    with raw_initializers(path) as raw:
        got = {name: bytes(data) for name, (_, _, data) in raw.items()}
    assert {k: v for k, v in got.items() if k in expected} == expected
    assert (tmp_path / "m.onnx.data").stat().st_size > 0 and "w" in got


def test_gptq_codes_are_known_through_a_preprocessed_graph(tmp_path, monkeypatch):
    """The quantizer hands ``knows`` the pre-processed graph, whose weights are referenced in ORT's
    optimized copy beside it: they are hashed there."""
    from quantnorm.quantize.ort_backend import _preprocess
    from quantnorm.transforms.gptq import GPTQCodes

    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    src = tmp_path / "m.onnx"
    write_model_streaming(model, src)
    (tmp_path / "pre").mkdir()
    pre = _preprocess(src, tmp_path / "pre" / "preprocessed.onnx")
    referenced = [i for i in onnx.load(str(pre), load_external_data=False).graph.initializer if i.name == "w"]
    assert referenced and referenced[0].data_location == TensorProto.EXTERNAL   # the case under test
    codes = GPTQCodes()
    weight = numpy_helper.to_array(w)
    codes.put(GPTQCodes.key(weight, 127, "windows"), np.zeros((64, 64), np.int8), np.ones(64, np.float32), 0.0)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded whole to read its weights")

    monkeypatch.setattr("quantnorm.transforms.gptq.onnx.load", no_load)
    assert codes.knows(pre, ["mm"], 127, "windows")
    assert not codes.knows(pre, ["mm"], 63, "windows")


def test_a_graph_read_by_reference_is_written_self_contained_with_extra_initializers(tmp_path):
    """``external_from``: references resolved and their bytes copied inline; ``extra_initializers``
    written after the graph's own, as if they were in it."""
    from quantnorm.onnx_wire import model_with_weights_by_reference

    model = _model()
    big = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "big")
    model.graph.initializer.append(big)
    src = tmp_path / "src" / "m.onnx"
    src.parent.mkdir()
    write_model_streaming(model, src)
    by_reference = onnx.ModelProto.FromString(model_with_weights_by_reference(src))
    assert any(i.data_location == TensorProto.EXTERNAL for i in by_reference.graph.initializer)
    extra = numpy_helper.from_array(np.full(3, 7, np.int8), "extra")
    out = tmp_path / "elsewhere.onnx"
    write_model_streaming(by_reference, out, extra_initializers=[extra], external_from=src.parent)
    src.unlink()   # the written file needs nothing of the source
    written = onnx.load(str(out))
    expected = onnx.ModelProto()
    expected.CopyFrom(model)
    expected.graph.initializer.append(extra)
    assert written.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


def _matmul_model(weight: np.ndarray) -> onnx.ModelProto:
    w = numpy_helper.from_array(weight, "w")
    emb = numpy_helper.from_array(np.random.default_rng(5).standard_normal((10, weight.shape[0])).astype(np.float32),
                                  "emb")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["x"], name="gather"),
         helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, weight.shape[1]])], [emb, w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_the_per_token_rewrite_reads_weights_from_the_file_not_a_loaded_model(tmp_path, monkeypatch):
    """Inline or external-data source, the same INT8 file; onnx.load is never called (it would
    hold every FP32 weight for the whole rewrite), and the kept FP32 weights are copied in."""
    from quantnorm.quantize import pertoken

    weight = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32)
    model = _matmul_model(weight)
    inline, external = tmp_path / "inline" / "m.onnx", tmp_path / "external" / "m.onnx"
    inline.parent.mkdir()
    external.parent.mkdir()
    write_model_streaming(model, inline)
    onnx.save_model(onnx.ModelProto.FromString(model.SerializeToString()), str(external), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.onnx.data", size_threshold=0)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded whole")

    monkeypatch.setattr(onnx, "load", no_load)
    monkeypatch.setattr(onnx, "load_model", no_load)
    written = []
    for src in (inline, external):
        dst = tmp_path / f"{src.parent.name}-int8.onnx"
        settings = pertoken.quantize_per_token(src, dst, ["mm"], reduce_range=False, fused=True)
        assert settings["pertoken_matmuls"] == ["mm"]
        written.append(dst.read_bytes())
    monkeypatch.undo()
    assert written[0] == written[1]
    int8 = onnx.load_from_string(written[0])
    inits = {i.name: i for i in int8.graph.initializer}
    assert "w" not in inits and not any(i.data_location == TensorProto.EXTERNAL for i in int8.graph.initializer)
    np.testing.assert_array_equal(numpy_helper.to_array(inits["emb"]), numpy_helper.to_array(model.graph.initializer[0]))
    codes, scales = pertoken.weight_scales(weight, 127)
    np.testing.assert_array_equal(numpy_helper.to_array(inits["mm/pertoken/W_quantized"]), codes)
    ids = np.array([[1, 2, 3], [4, 5, 9]], dtype=np.int64)
    # 8-bit signed codes: through make_session, which runs them unsigned where the CPU has no VNNI
    # (ORT's u8 x s8 kernel saturates there: 6.5 off a largest output of 21 on an emulated Haswell)
    (tmp_path / "int8.onnx").write_bytes(written[0])
    y = make_session(tmp_path / "int8.onnx", SessionSpec()).run(None, {"ids": ids})[0]
    reference = numpy_helper.to_array(model.graph.initializer[0])[ids] @ weight
    assert np.abs(y - reference).max() < 0.05 * np.abs(reference).max()


def test_release_memory_collects_cycles_only_when_asked():
    import gc
    import weakref

    from quantnorm.fileio import release_memory

    class Node:
        pass

    gc.disable()   # no automatic collection between the steps
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        release_memory(collect_cycles=False)
        assert alive() is not None          # a cycle is not freed by reference counts
        release_memory()
        assert alive() is None
    finally:
        gc.enable()


def test_collections_skip_the_objects_alive_on_entry_and_get_them_back_on_exit():
    """Garbage is collected before the objects are set aside (a frozen cycle would never be freed);
    an object alive on entry that becomes garbage inside is freed after; nested uses set aside once."""
    import gc
    import weakref

    from quantnorm.fileio import collections_skip_existing_objects

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    gc.disable()
    try:
        dead = weakref.ref(cycle())
        alive = cycle()
        kept = weakref.ref(alive)
        with collections_skip_existing_objects():
            assert dead() is None, "garbage set aside"
            frozen = gc.get_freeze_count()
            assert frozen > 1000
            made_inside = cycle()
            made_inside_ref = weakref.ref(made_inside)
            with collections_skip_existing_objects():
                # set aside once: nothing more is frozen (the count may only fall, as frozen
                # objects freed by reference counting leave it), and an object made after the
                # outer entry is still collected inside the nested use
                assert gc.get_freeze_count() <= frozen
                del made_inside
                gc.collect()
                assert made_inside_ref() is None
            del alive
            gc.collect()
            assert kept() is not None            # set aside: not examined inside
            inside = weakref.ref(cycle())
            gc.collect()
            assert inside() is None              # what the run makes is collected as usual
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert kept() is None                    # handed back, then freed
    finally:
        gc.enable()
