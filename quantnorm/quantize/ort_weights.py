"""ONNX Runtime's per-channel weight quantization, one numpy pass per weight instead of one per channel.

ORT's quantizers compute a per-channel weight's scales and codes channel by channel in Python
(``compute_data_quant_params`` and ``quantize_nparray`` once per output channel): Gemma 3's tied
262,144-row head alone is 262,144 calls of each. On a graph that size (386,560 channels) that
loop is over a third of a ``quantize_dynamic`` or static MinMax recipe, for arithmetic numpy does
on the whole array in a small fraction of the time.

``ort_quantizes_weights_fast`` swaps in the same arithmetic vectorized over the channel axis, for
the case every recipe here uses (8-bit integer weights, no per-tensor overrides, no minimum real
range, no blocks); anything else, and any range that is not finite, goes to ORT's own code. The
results are ORT's to the byte (tests compare both paths, so a change in ORT's arithmetic fails a
test rather than passing silently). The formulas are ``quant_utils.compute_scale_zp`` and
``quantize_nparray``:

    rmin, rmax = min(min(w), 0), max(max(w), 0)     (float32; symmetric: -+max(|rmin|, |rmax|))
    scale      = (rmax - rmin) / (qmax - qmin)     in float64, then float32 (1.0 where < tiny)
    zero point = round((qmin + qmax) / 2)          symmetric; else round(qmin - rmin / scale)
    codes      = clip(round(w / scale) + zero point, type's min, type's max)   (float32 division)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import TensorProto

_EIGHT_BIT = (TensorProto.INT8, TensorProto.UINT8)


def channel_params(weight: np.ndarray, axis: int, quant_type: int, symmetric: bool,
                   reduce_range: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(zero points, scales), one per index of ``axis``, as ORT's per-channel loop computes them;
    None where ORT's own code must decide (an empty channel, a range that is not finite)."""
    from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType

    if weight.size == 0:
        return None
    qmin, qmax = get_qmin_qmax_for_qType(quant_type, reduce_range, symmetric=symmetric)
    others = tuple(i for i in range(weight.ndim) if i != axis)   # reduced in place: no transposed copy
    zero = np.zeros((), dtype=weight.dtype)
    rmin = np.minimum(weight.min(axis=others), zero)
    rmax = np.maximum(weight.max(axis=others), zero)
    if symmetric:
        absmax = np.maximum(np.abs(rmin), np.abs(rmax))
        rmin, rmax = -absmax, absmax
    scale = (rmax.astype(np.float64) - rmin.astype(np.float64)) / (np.float64(qmax) - np.float64(qmin))
    if not np.all(np.isfinite(scale)):
        return None
    degenerate = scale < np.finfo(weight.dtype).tiny
    if symmetric:
        zero_point = np.full(scale.shape, np.round((qmin + qmax) / np.float64(2.0)), dtype=np.float64)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            zero_point = np.round(qmin - rmin / scale)
    zero_point = np.where(degenerate, 0, zero_point).astype(qmin.dtype)
    scale = np.where(degenerate, 1.0, scale).astype(weight.dtype)
    return zero_point, scale


def channel_codes(weight: np.ndarray, axis: int, quant_type: int, zero_point: np.ndarray,
                  scale: np.ndarray) -> np.ndarray:
    """The codes of ``weight`` per channel of ``axis`` (ORT's ``quantize_nparray`` per channel)."""
    from onnxruntime.quantization.quant_utils import ONNX_TYPE_TO_NP_TYPE, get_qmin_qmax_for_qType

    qmin, qmax = get_qmin_qmax_for_qType(quant_type, reduce_range=False, symmetric=False)
    along = [1] * weight.ndim
    along[axis] = -1
    # one float32 buffer worked in place, in the weight's own layout (a 168M-value head makes
    # every temporary 670 MB); each step is ORT's elementwise operation on the same operands
    codes = np.divide(weight, scale.reshape(along), dtype=np.float32)
    np.round(codes, out=codes)
    codes += zero_point.reshape(along)
    np.clip(codes, qmin, qmax, out=codes)
    return codes.astype(ONNX_TYPE_TO_NP_TYPE[quant_type])


@contextlib.contextmanager
def ort_quantizes_weights_fast() -> Iterator[None]:
    """While active, ORT's static (QDQ) and dynamic quantizers quantize 8-bit per-channel weights
    with ``channel_params`` and ``channel_codes``."""
    from onnxruntime.quantization import base_quantizer, onnx_quantizer, qdq_quantizer

    patches = [
        (qdq_quantizer.QDQQuantizer, "_calc_initializer_quant_params", _fast_calc_initializer_quant_params),
        (base_quantizer.BaseQuantizer, "quantize_weight_per_channel_impl", _fast_quantize_weight_per_channel_impl),
        (qdq_quantizer, "quantize_onnx_initializer", _fast_quantize_onnx_initializer),
        (onnx_quantizer, "quantize_onnx_initializer", _fast_quantize_onnx_initializer),
    ]
    # An ORT without one of these (a later refactor) keeps its own code there: slower, never wrong.
    patches = [p for p in patches if hasattr(p[0], p[1])]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, fast in patches:
        setattr(owner, name, _with_original(fast, getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _with_original(fast, original):
    def call(*args, **kwargs):
        return fast(original, *args, **kwargs)
    call.__wrapped__ = original
    return call


def _fast_quantize_onnx_initializer(original, weight, quant_type, zero_point, scale, axis=None,
                                    quant_weight_name=None, block_size=0):
    if axis is None or block_size or quant_type not in _EIGHT_BIT:
        return original(weight, quant_type, zero_point, scale, axis, quant_weight_name, block_size)
    from onnxruntime.quantization.quant_utils import TENSOR_NAME_QUANT_SUFFIX, tensor_proto_to_array

    data = tensor_proto_to_array(weight)
    codes = channel_codes(data, axis, quant_type, np.asarray(zero_point).reshape(-1), np.asarray(scale).reshape(-1))
    name = quant_weight_name if quant_weight_name else f"{weight.name}{TENSOR_NAME_QUANT_SUFFIX}"
    return onnx.numpy_helper.from_array(codes.reshape(tuple(weight.dims)), name)


def _fast_calc_initializer_quant_params(original, quantizer) -> dict:
    """The per-channel 8-bit weights without overrides vectorized; every other tensor by ORT."""
    from onnxruntime.quantization.qdq_quantizer import QDQQuantTensorType, QuantizationParams
    from onnxruntime.quantization.quant_utils import find_by_name, normalize_axis, tensor_proto_to_array

    fast: dict = {}
    if not getattr(quantizer, "block_size", 0) and quantizer.min_real_range is None \
            and quantizer.weight_qType in _EIGHT_BIT:
        for name, info in quantizer.tensors_to_quantize.items():
            if info.tensor_type is not QDQQuantTensorType.WEIGHT or info.axis is None \
                    or name in quantizer.tensor_quant_overrides:
                continue
            initializer = find_by_name(name, quantizer.model.initializer())
            if initializer is None:
                continue
            data = tensor_proto_to_array(initializer)
            valid, axis = normalize_axis(info.axis, data.ndim)
            if not valid:
                continue   # ORT raises its own error for it
            # per-channel initializers are always symmetric in ORT's QDQ quantizer
            params = channel_params(data, axis, quantizer.weight_qType, True, quantizer.reduce_range)
            if params is not None:
                fast[name] = QuantizationParams(zero_point=params[0], scale=params[1],
                                                quant_type=quantizer.weight_qType, axis=axis)
    everything = quantizer.tensors_to_quantize
    quantizer.tensors_to_quantize = {k: v for k, v in everything.items() if k not in fast}
    try:
        computed = original(quantizer)
    finally:
        quantizer.tensors_to_quantize = everything
    computed.update(fast)
    return {name: computed[name] for name in everything if name in computed}


def _fast_quantize_weight_per_channel_impl(original, quantizer, weight_name, weight_qType, channel_axis,
                                           reduce_range=True, keep_float_weight=False):
    from onnxruntime.quantization.quant_utils import (
        TENSOR_NAME_QUANT_SUFFIX,
        find_by_name,
        normalize_axis,
        tensor_proto_to_array,
    )

    def by_ort():
        return original(quantizer, weight_name, weight_qType, channel_axis, reduce_range, keep_float_weight)

    initializer = find_by_name(weight_name, quantizer.model.initializer())
    if initializer is None or weight_qType not in _EIGHT_BIT or quantizer.min_real_range is not None \
            or weight_name in quantizer.tensor_quant_overrides:
        return by_ort()
    weights = tensor_proto_to_array(initializer)
    valid, axis = normalize_axis(channel_axis, weights.ndim)
    if not valid:
        return by_ort()
    params = channel_params(weights, axis, weight_qType, quantizer.is_weight_symmetric(weight_qType),
                            quantizer.reduce_range and reduce_range)
    if params is None:
        return by_ort()
    zero_point, scale = params
    q_weight_name = weight_name + TENSOR_NAME_QUANT_SUFFIX
    zp_name, scale_name = weight_name + "_zero_point", weight_name + "_scale"
    # the initializers ORT's loop writes, in its order and encodings
    shape = [initializer.dims[axis]]
    quantizer.model.initializer_extend([
        onnx.helper.make_tensor(scale_name, initializer.data_type, shape, scale.tolist()),
        onnx.helper.make_tensor(zp_name, weight_qType, shape, zero_point.tolist()),
    ])
    if not keep_float_weight:
        codes = channel_codes(weights, axis, weight_qType, zero_point, scale)
        quantizer.model.initializer_extend([onnx.numpy_helper.from_array(codes.reshape(tuple(initializer.dims)),
                                                                         q_weight_name)])
    return q_weight_name, zp_name, scale_name
