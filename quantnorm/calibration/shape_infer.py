"""ONNX Runtime's quantizer and calibrators, loading models without two copies on disk.

ORT's ``load_model_with_shape_infer`` (called by ``quantize_static``, ``quantize_dynamic`` and
every calibrator's constructor) runs ``onnx.shape_inference.infer_shapes_path``, which writes a
shape-inferred copy of the whole model (weights included) to disk and reads it back. Each
calibrator then saves its augmented model, weights included, and opens a session on that file.
On a 1.7 GB graph (Gemma 3's, pre-processed) that costs each calibrator more time than its
calibration runs (shape inference, the write, the serialization), and a percentile calibration
builds three of them.

``ort_loads_fast`` swaps in ``load_with_shape_infer``: shape inference runs on the graph alone,
its weights referenced in the model's own file (``onnx_wire.model_with_weights_by_reference``;
shape inference reads dims and types, never weight values), and the values are read into the
model only where the caller needs them (the quantizers quantize them; a calibrator never reads
them). ORT's dynamic quantizer infers shapes once more on the model it holds in memory
(``save_and_reload_model_with_shape_infer``: a deep copy saved to disk with its weights and read
back, as costly again); ``infer_shapes_in_memory`` infers them on a copy whose large weights are
stubs (dims and type only) and hands the result's value_info to the model itself.
``calibrator_beside`` then saves a calibrator's augmented model beside the original, so
that its references resolve, and removes it once the session holds it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_model
from onnxruntime.quantization import calibrate as ort_calibrate
from onnxruntime.quantization.quant_utils import add_infer_metadata

from ..onnx_wire import model_with_weights_by_reference


def load_with_shape_infer(model_path: str | os.PathLike, *, weights: bool = True) -> onnx.ModelProto:
    """``model_path`` shape-inferred and marked as ORT's loader marks it (``add_infer_metadata``).
    ``weights``: read the weight values into the model (False: they stay references into
    ``model_path``'s file, for a copy saved in the same directory)."""
    model_path = Path(model_path)
    model = onnx.ModelProto.FromString(model_with_weights_by_reference(model_path))
    model = onnx.shape_inference.infer_shapes(model)
    add_infer_metadata(model)
    if weights:
        load_external_data_for_model(model, str(model_path.parent))
    return model


# Initializers at least this large are stubbed for shape inference (small ones may be shape
# constants that inference reads: the Reshape targets, the axes of a Squeeze).
STUB_BYTES = 1024


def infer_shapes_in_memory(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the value_info of shape inference and ORT's inference mark, in place (what
    ORT's ``save_and_reload_model_with_shape_infer`` returns, without writing the model out)."""
    skeleton = onnx.ModelProto()
    _copy_fields(model, skeleton, skip=("graph",))
    _copy_fields(model.graph, skeleton.graph, skip=("initializer",))   # value_info too: inference keeps it
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL or len(init.raw_data) < STUB_BYTES:
            skeleton.graph.initializer.append(init)
            continue
        # dims and type are all shape inference reads of a weight; a reference to nowhere keeps
        # the stub a valid tensor without its bytes
        stub = skeleton.graph.initializer.add(name=init.name, data_type=init.data_type, dims=init.dims,
                                              data_location=onnx.TensorProto.EXTERNAL)
        stub.external_data.add(key="location", value="__shape_inference_stub__")
    inferred = onnx.shape_inference.infer_shapes(skeleton)
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    add_infer_metadata(model)
    return model


def _copy_fields(src, dst, *, skip: tuple[str, ...]) -> None:
    """Every set field of the message ``src`` but those named in ``skip``, into ``dst``."""
    for field, value in src.ListFields():
        if field.name in skip:
            continue
        # is_repeated from protobuf 5.28 on; label before it (deprecated since)
        if (field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED):
            getattr(dst, field.name).extend(value)
        elif field.message_type is not None:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


@contextlib.contextmanager
def ort_loads_fast(*, weights: bool = True) -> Iterator[None]:
    """While active, ORT's quantizers and calibrators load models with ``load_with_shape_infer``, and
    its dynamic quantizer re-infers shapes with ``infer_shapes_in_memory``."""
    # The module, not the function the package exports under the same name.
    modules = (ort_calibrate, importlib.import_module("onnxruntime.quantization.quantize"))
    originals = [m.load_model_with_shape_infer for m in modules]

    def load(model_path):
        return load_with_shape_infer(model_path, weights=weights)

    dynamic = importlib.import_module("onnxruntime.quantization.onnx_quantizer")
    reload_original = dynamic.save_and_reload_model_with_shape_infer
    for m in modules:
        m.load_model_with_shape_infer = load
    dynamic.save_and_reload_model_with_shape_infer = infer_shapes_in_memory
    try:
        yield
    finally:
        for m, original in zip(modules, originals):
            m.load_model_with_shape_infer = original
        dynamic.save_and_reload_model_with_shape_infer = reload_original


@contextlib.contextmanager
def calibrator_beside(model_path: str | os.PathLike) -> Iterator[str | None]:
    """A path for a calibrator's augmented model beside ``model_path`` (a hidden temporary name),
    removed on exit; None where that directory cannot be written (the caller then lets ORT copy
    the weights as it always did)."""
    model_path = Path(model_path)
    try:
        fd, path = tempfile.mkstemp(prefix=f".{model_path.stem}.calib-", suffix=".onnx", dir=model_path.parent)
    except OSError:
        yield None
        return
    os.close(fd)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
