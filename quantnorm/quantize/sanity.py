"""Checks that a quantized model is not silently broken.

ONNX Runtime's static quantizer can write a model whose scale is ``inf`` (a calibrated tensor
held -inf) and only print a RuntimeWarning (PITFALLS.md 1); the model still runs and returns
finite logits that are noise. So a quantized model is checked before anyone measures it:

- every quantization scale (the scale input of QuantizeLinear / DequantizeLinear, and the
  ``*_scale`` initializers of dynamic models) is finite and > 0; a MatMulNBits block scale is
  finite (ORT's symmetric weight-only scales carry the sign of the block's largest weight);
- every zero point lies in its integer type's range (and is finite);
- the model loads and runs on ORT's CPU provider on the probe inputs with finite logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..fileio import release_memory
from ..measure.accuracy import run_logits
from ..measure.sessions import SessionSpec, make_session

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
MAX_LISTED = 5  # problems of one kind listed by name before the rest are counted


def sanity_check(model_path: Path, probe_inputs: np.ndarray) -> list[str]:
    """Problems of the model at ``model_path``, worst first; an empty list means sane."""
    try:
        model = onnx.load(str(model_path))
    except Exception as exc:  # noqa: BLE001 - a file that does not load is a finding, not a crash
        return [f"cannot read the ONNX file {model_path}: {exc}"]
    problems = check_quant_params(model)
    problems += check_softmax_inputs(model)
    problems += check_runs(model_path, probe_inputs)
    return problems


# A coarser INT8 step (in logits) on attention scores erases their differences.
SOFTMAX_STEP_LIMIT = 1.0


def softmax_input_scales(model: onnx.ModelProto) -> list[dict]:
    """Each Softmax whose input comes out of a DequantizeLinear, with that tensor's largest scale."""
    graph = model.graph
    consts = _constant_tensors(graph)
    producer = {o: n for n in graph.node for o in n.output}
    found = []
    for node in graph.node:
        if node.op_type != "Softmax" or not node.input:
            continue
        dq = producer.get(node.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 2 or dq.input[1] not in consts:
            continue
        found.append({"softmax": node.name, "tensor": dq.input[0], "scale": float(np.max(consts[dq.input[1]]))})
    return found


def softmax_input_report(int8_path: Path) -> dict:
    """How an INT8 model quantizes its Softmax inputs (the attention scores, where HF models add
    their mask): ``{"quantized": n, "max_scale": s or None, "tensors": [...], "problem": text or None}``."""
    model = onnx.load(str(int8_path))
    quantized = softmax_input_scales(model)
    problems = check_softmax_inputs(model)
    return {"quantized": len(quantized), "max_scale": max((q["scale"] for q in quantized), default=None),
            "tensors": quantized[:8], "problem": problems[0] if problems else None}


def check_softmax_inputs(model: onnx.ModelProto) -> list[str]:
    """A finite attention-mask constant (-1e4 .. finfo.min) calibrated into a softmax input.

    The scale stays finite, so ``check_quant_params`` passes, but the INT8 step is huge (1.3e36
    for finfo.min): every real score rounds to one value and attention becomes uniform. Our zoo
    masks by multiplication and never has such a tensor; Hugging Face models add their mask.
    """
    worst = max((q["scale"] for q in softmax_input_scales(model)), default=None)
    if worst is None or worst < SOFTMAX_STEP_LIMIT:
        return []
    return [f"attention scores quantized with an INT8 step of {worst:.3g} (an attention-mask constant was "
            f"calibrated into a softmax input): every real score rounds to one value and attention becomes uniform"]


def check_quant_params(model: onnx.ModelProto) -> list[str]:
    """Non-finite or non-positive scales and out-of-range zero points, by tensor name."""
    consts = _constant_tensors(model.graph)
    scales: dict[str, str] = {}      # scale tensor -> a node that uses it
    zero_points: dict[str, str] = {}
    signed: dict[str, str] = {}      # MatMulNBits' block scales and zero points: finite, any sign
    for node in model.graph.node:
        if node.op_type in QDQ_OPS:
            if len(node.input) > 1:
                scales.setdefault(node.input[1], node.name)
            if len(node.input) > 2 and node.input[2]:
                zero_points.setdefault(node.input[2], node.name)
        elif node.op_type in ("MatMulInteger", "ConvInteger"):
            for name in node.input[2:4]:
                if name:
                    zero_points.setdefault(name, node.name)
        elif node.op_type == "MatMulNBits":
            for name in node.input[2:4]:
                if name:
                    signed.setdefault(name, node.name)
    for name in consts:  # dynamic (QOperator) models multiply by <weight>_scale after MatMulInteger
        if name.endswith("_scale") and consts.is_float(name):
            scales.setdefault(name, "(initializer)")

    bad_scales, bad_zps = [], []
    for name, node in scales.items():
        value = consts.get(name)
        if value is None:
            continue  # computed at run time (DynamicQuantizeLinear): nothing to check offline
        value = value.astype(np.float64)
        if not np.all(np.isfinite(value)):
            bad_scales.append(f"{name} (node {node}) = {_describe(value)}: not finite")
        elif not np.all(value > 0):
            bad_scales.append(f"{name} (node {node}) = {_describe(value)}: not > 0")
    for name, node in signed.items():
        value = consts.get(name)
        if value is not None and not np.all(np.isfinite(value.astype(np.float64))):
            bad_scales.append(f"{name} (node {node}) = {_describe(value)}: not finite")
    for name, node in zero_points.items():
        value = consts.get(name)
        if value is None:
            continue
        if np.issubdtype(value.dtype, np.integer):
            info = np.iinfo(value.dtype)
            if value.size and (value.min() < info.min or value.max() > info.max):
                bad_zps.append(f"{name} (node {node}) outside [{info.min}, {info.max}]")
        elif np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value.astype(np.float64))):
            bad_zps.append(f"{name} (node {node}) = {_describe(value)}: not finite")

    problems = []
    if bad_scales:
        problems.append(f"{len(bad_scales)} quantization scale(s) broken: " + _listing(bad_scales))
    if bad_zps:
        problems.append(f"{len(bad_zps)} zero point(s) broken: " + _listing(bad_zps))
    return problems


def check_runs(model_path: Path, probe_inputs: np.ndarray) -> list[str]:
    """Load and run the model on the CPU provider; the logits must exist and be finite."""
    # the quantizer's freed buffers back to the OS before ORT maps the model: glibc keeps them
    # otherwise, and the session's arena came on top (Gemma 3's run peaked here)
    release_memory(collect_cycles=False)
    try:
        session = make_session(model_path, SessionSpec(threads=1))  # a few probe windows; ORT_ENABLE_ALL as deployed
    except Exception as exc:  # noqa: BLE001 - ORT raises several types; all mean "does not load"
        return [f"ONNX Runtime cannot load the quantized model: {_first_line(exc)}"]
    try:
        logits = np.concatenate(list(run_logits(session, probe_inputs)))
    except Exception as exc:  # noqa: BLE001 - likewise "does not run"
        return [f"ONNX Runtime cannot run the quantized model: {_first_line(exc)}"]
    probe = np.asarray(probe_inputs)
    if logits.ndim != 3 or logits.shape[:2] != probe.shape:
        return [f"logits have shape {logits.shape}, expected [{probe.shape[0]}, {probe.shape[1]}, vocab]"]
    n_bad = int(np.count_nonzero(~np.isfinite(logits)))
    if n_bad:
        kinds = [k for k, f in (("NaN", np.isnan), ("inf", np.isinf)) if f(logits).any()]
        return [f"{n_bad} of {logits.size} logits are {'/'.join(kinds)} on the probe inputs"]
    return []


class _Constants(Mapping):
    """The graph's initializers and Constant outputs by name, each turned into numpy only when read:
    the checks read the scales and zero points, and converting every initializer (Gemma 3's 640 MiB
    embedding table among them) cost seconds per recipe."""

    FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)

    def __init__(self, graph: onnx.GraphProto):
        self._protos = {init.name: init for init in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        self._protos[node.output[0]] = attr.t
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self._protos[name])
        return self._arrays[name]

    def __iter__(self):
        return iter(self._protos)

    def __len__(self) -> int:
        return len(self._protos)

    def is_float(self, name: str) -> bool:
        return self._protos[name].data_type in self.FLOATS


def _constant_tensors(graph: onnx.GraphProto) -> _Constants:
    return _Constants(graph)


def _describe(value: np.ndarray) -> str:
    flat = value.reshape(-1)
    if flat.size == 1:
        return f"{flat[0]:g}"
    bad = flat[~np.isfinite(flat) | (flat <= 0)] if np.issubdtype(flat.dtype, np.floating) else flat
    return f"[{flat.size} values, e.g. {bad[0] if bad.size else flat[0]:g}]"


def _listing(items: list[str]) -> str:
    text = "; ".join(items[:MAX_LISTED])
    return text + (f"; and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
