"""Any torch module that maps ``input_ids`` to named outputs -> ONNX, with the parity gate.

The zoo's models export through ``quantnorm.export``; a checkpoint's wrapper (a Hugging Face
model behind ``sources.hf_export.make_wrapper``), and a transform's rotated or smoothed copy of
it, export here. A wrapper may name a ``node_prefix`` (its own attribute holding the model, with
the dot) that is dropped from the front of every node name.

Exporter: ``torch.onnx.export(dynamo=True)`` at the requested opset (18 by default) first; if it
raises, the TorchScript exporter (``dynamo=False``) at opset 17. ``results.json`` records which
one produced the file and why the first failed. What worked here (torch 2.13, transformers 5.24,
tiny random models of each architecture and the real all-MiniLM-L6-v2):

| model_type | dynamo, opset 18 | TorchScript, opset 17 |
|---|---|---|
| gpt2, llama, mistral, qwen2, gemma2, gemma3_text, olmo2 | ok (parity ~1e-7) | fails: ``aten::diff`` (transformers' causal-mask code) has no opset-17 export |
| bert | ok (parity ~1e-6) | ok (parity ~5e-7) |

so the fallback only ever helps encoders; a causal model the dynamo exporter rejects is an
``ExportError`` naming both failures.

Parity (a failure is an ``ExportError`` and no file is left): every output of the ONNX model on
ONNX Runtime's CPU provider against the module in PyTorch, on the parity windows and again on a
shorter prefix of them with another batch size (so both dynamic axes are exercised). The gate is
``max |delta| <= tolerance * max(1, max |reference|)``: relative to the output's scale, because
a real checkpoint's logits or hidden states reach tens where the zoo's stay near one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .errors import ConfigError, ExportError
from .export import (
    count_norm_ops,
    finish_onnx_file,
    parameter_bytes,
    quiet_exporter,
    rename_nodes_by_module,
    torch_outputs,
)
from .fileio import atomic_path, needs_external_data
from .measure.sessions import SessionSpec, make_session

DEFAULT_OPSET = 18
FALLBACK_OPSET = 17
DEFAULT_TOLERANCE = 1e-4
INPUT_NAME = "input_ids"


def onnx_outputs(path: Path, inputs: np.ndarray, batch_size: int = 8, session=None) -> list[np.ndarray]:
    session = session or make_session(path, SessionSpec(threads=1))
    parts = []
    for lo in range(0, len(inputs), batch_size):
        parts.append(session.run(None, {INPUT_NAME: np.ascontiguousarray(inputs[lo:lo + batch_size], dtype=np.int64)}))
    return [np.concatenate([p[i] for p in parts]) for i in range(len(parts[0]))]


@dataclass(frozen=True)
class ModuleExportResult:
    path: Path
    opset: int
    exporter: str                         # "dynamo" | "torchscript"
    max_abs_diff: dict[str, float]        # per output, over both parity shapes
    tolerance: float                      # relative: max|delta| <= tolerance * max(1, max|ref|)
    outputs: tuple[str, ...]
    attempts: list[dict] = field(default_factory=list)
    norm_ops: dict[str, int] = field(default_factory=dict)
    parity_shapes: list[list[int]] = field(default_factory=list)

    def to_dict(self, run_dir: Path | None = None) -> dict:
        path = Path(self.path)
        if run_dir is not None:
            path = Path(os.path.relpath(path.resolve(), Path(run_dir).resolve()))
        first = self.outputs[0]
        return {
            "path": path.as_posix(), "opset": self.opset, "exporter": self.exporter,
            # The contract key: the first output's parity (logits, or the last hidden state).
            "max_abs_logit_diff": self.max_abs_diff[first],
            "max_abs_diff": dict(self.max_abs_diff), "tolerance": self.tolerance,
            "tolerance_rule": "max |delta| <= tolerance * max(1, max |reference|) per output",
            "outputs": list(self.outputs), "input": INPUT_NAME, "attempts": list(self.attempts),
            "parity_shapes": [list(s) for s in self.parity_shapes], "norm_ops": dict(self.norm_ops),
        }


def export_module_onnx(wrapper, out_path: Path, parity_inputs: np.ndarray, *, outputs: tuple[str, ...],
                   max_positions: int | None, opset: int = DEFAULT_OPSET,
                   tolerance: float = DEFAULT_TOLERANCE) -> ModuleExportResult:
    """Export ``wrapper`` to ``out_path`` (dynamo first, TorchScript as the fallback) and prove
    that the file computes the wrapper's outputs. Atomic: on failure no file is left."""
    if opset < FALLBACK_OPSET:
        raise ConfigError(f"opset {opset} is too old: LayerNormalization needs opset >= {FALLBACK_OPSET}")
    parity_inputs = np.ascontiguousarray(parity_inputs, dtype=np.int64)
    if parity_inputs.ndim != 2 or parity_inputs.shape[1] < 3:
        raise ConfigError(f"parity inputs must be windows [n, seq] with seq >= 3, got {parity_inputs.shape}")
    out_path = Path(out_path)
    attempts: list[dict] = []
    with atomic_path(out_path, suffix=".onnx") as tmp:
        exporter, used_opset = None, None
        for dynamo, try_opset in ((True, opset), (False, FALLBACK_OPSET)):
            name = "dynamo" if dynamo else "torchscript"
            try:
                _export_once(wrapper, tmp, parity_inputs, outputs, max_positions, dynamo, try_opset)
            except Exception as exc:  # noqa: BLE001 - the exporters raise many types; keep the message
                attempts.append({"exporter": name, "opset": try_opset, "status": f"failed: {_short(exc)}"})
                continue
            attempts.append({"exporter": name, "opset": try_opset, "status": "ok"})
            exporter, used_opset = name, try_opset
            break
        if exporter is None:
            raise ExportError("torch.onnx.export failed with both exporters: "
                              + "; ".join(f"{a['exporter']} opset {a['opset']}: {a['status']}" for a in attempts))
        norm_ops = finish_onnx_file(tmp, lambda m: name_nodes_by_module(m, getattr(wrapper, "node_prefix", "")),
                                    out_path, inspect=count_norm_ops)

        diffs, shapes = _parity(wrapper, tmp, parity_inputs, outputs, tolerance, used_opset)
    return ModuleExportResult(out_path, used_opset, exporter, diffs, tolerance, tuple(outputs), attempts, norm_ops, shapes)


def _export_once(wrapper, tmp: Path, parity_inputs: np.ndarray, outputs, max_positions, dynamo: bool,
                 opset: int) -> None:
    import torch

    # Batch 2 and the full window: torch.export specializes axes of size 0 or 1.
    example = torch.from_numpy(np.ascontiguousarray(np.resize(parity_inputs, (2, parity_inputs.shape[1]))))
    with quiet_exporter():
        if dynamo:
            seq = torch.export.Dim("seq", max=max_positions) if max_positions else torch.export.Dim("seq")
            torch.onnx.export(wrapper, (example,), str(tmp), dynamo=True,
                              external_data=needs_external_data(parameter_bytes(wrapper)), opset_version=opset,
                              input_names=[INPUT_NAME], output_names=list(outputs),
                              dynamic_shapes=({0: torch.export.Dim("batch"), 1: seq},), verbose=False)
        else:
            axes = {INPUT_NAME: {0: "batch", 1: "seq"}}
            for name in outputs:
                axes[name] = {0: "batch"} if name == "sentence_embedding" else {0: "batch", 1: "seq"}
            torch.onnx.export(wrapper, (example,), str(tmp), dynamo=False, opset_version=opset,
                              input_names=[INPUT_NAME], output_names=list(outputs), dynamic_axes=axes)


def name_nodes_by_module(model: onnx.ModelProto, prefix: str) -> None:
    """Nodes named after the module they came from (``model.layers.0.mlp.down_proj/MatMul``): the
    zoo's renaming, then the wrapper's own attribute (its ``node_prefix``) dropped from the front."""
    rename_nodes_by_module(model)
    if not prefix:
        return
    names = {n.name for n in model.graph.node}
    for node in model.graph.node:
        if node.name.startswith(prefix):
            new = node.name[len(prefix):]
            if new not in names:
                names.discard(node.name)
                names.add(new)
                node.name = new


PARITY_BATCH = 2   # windows per run of both models in the parity gates: a 262k vocabulary's logits are 134 MB a window


def _parity(wrapper, path: Path, inputs: np.ndarray, outputs, tolerance: float,
            opset: int) -> tuple[dict[str, float], list[list[int]]]:
    session = make_session(path, SessionSpec(threads=1))
    got_names = [o.name for o in session.get_outputs()]
    if tuple(got_names) != tuple(outputs):
        raise ExportError(f"ONNX outputs are {got_names}, expected {list(outputs)}")
    seq = inputs.shape[1]
    short = inputs[: max(1, min(3, len(inputs) - 1)), : max(3, seq // 2 + 1)]
    diffs = {name: 0.0 for name in outputs}
    shapes = []
    for windows in (inputs, short):
        shapes.append(list(windows.shape))
        gap = OutputGap()
        for lo in range(0, len(windows), PARITY_BATCH):
            batch = windows[lo:lo + PARITY_BATCH]
            expected = torch_outputs(wrapper, batch)
            try:
                got = onnx_outputs(path, batch, session=session)
            except Exception as exc:  # noqa: BLE001
                raise ExportError(f"ONNX Runtime cannot run the exported model on input {list(batch.shape)} "
                                  f"(opset {opset}): {_short(exc)}") from exc
            for name, e, g in zip(outputs, expected, got):
                if e.shape != g.shape:
                    raise ExportError(f"ONNX output {name} has shape {g.shape}, PyTorch {e.shape}")
            gap.add(expected, got)
            del expected, got
        for name, diff, scale in zip(outputs, gap.gaps, gap.scales):
            limit = tolerance * max(1.0, scale)
            if not diff <= limit:  # also catches NaN
                raise ExportError(f"ONNX export does not match PyTorch: output {name} max |delta| = {diff:.3g} > "
                                  f"{limit:.3g} (tolerance {tolerance:g} x max(1, max|ref|)) on input "
                                  f"{list(windows.shape)}, opset {opset}; no file written")
            diffs[name] = max(diffs[name], diff)
    return diffs, shapes


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(exc).__name__


class OutputGap:
    """max |reference - other| per output, gathered a batch at a time (``add``), with each
    output's max |reference|: a gate over many windows of a 262k vocabulary's logits never holds
    them all. NaN (a broken model) propagates: it fails every gate."""

    def __init__(self):
        self.gaps: list[float] = []
        self.scales: list[float] = []

    def add(self, reference: list[np.ndarray], other: list[np.ndarray]) -> OutputGap:
        if not self.gaps:
            self.gaps, self.scales = [0.0] * len(reference), [0.0] * len(reference)
        for i, (ref, got) in enumerate(zip(reference, other, strict=True)):
            # float64 one leading slice at a time (a window's logits, not the batch); np.max over
            # the list keeps a NaN
            d = float(np.max([np.max(np.abs(r.astype(np.float64) - g.astype(np.float64)))
                              for r, g in zip(np.atleast_1d(ref), np.atleast_1d(got), strict=True)]))
            self.gaps[i] = d if not d <= self.gaps[i] else self.gaps[i]
            self.scales[i] = max(self.scales[i], float(np.max(np.abs(ref))))
        return self

    def value(self, *, relative: bool = False) -> float:
        """The largest gap over outputs; with ``relative`` each divided by ``max(1, max |reference|)``."""
        worst = 0.0
        for gap, scale in zip(self.gaps, self.scales, strict=True):
            d = gap / max(1.0, scale) if relative else gap
            if not d <= worst:
                worst = d
            if np.isnan(worst):
                break
        return worst


def max_output_diff(reference: list[np.ndarray], other: list[np.ndarray], *, relative: bool = False) -> float:
    """max |reference - other| over matching outputs; with ``relative`` each output's is divided by
    ``max(1, max |reference|)``. NaN (a broken model) propagates: it fails every gate."""
    return OutputGap().add(reference, other).value(relative=relative)


def export_matching_original(transformed, original, out_path: Path, parity_inputs: np.ndarray, *, what: str,
                             outputs: tuple[str, ...], max_positions: int | None, opset: int, tolerance: float):
    """Export ``transformed`` (a smoothed or rotated copy of ``original``) with the export's own parity
    gate, then prove the ONNX file computes the *original* outputs (relative to each output's
    scale). Returns (export result, that relative difference); a mismatch leaves no file."""
    exported = export_module_onnx(transformed, out_path, parity_inputs, outputs=outputs, max_positions=max_positions,
                                  opset=opset)
    return exported, check_matches_original(original, out_path, parity_inputs, what=what, tolerance=tolerance)


def check_matches_original(original, out_path: Path, parity_inputs: np.ndarray, *, what: str, tolerance: float,
                           relative: bool = True, batch_size: int = PARITY_BATCH) -> float:
    """The second gate of every transformed export (smoothed, rotated; zoo model or checkpoint):
    the ONNX file's outputs against the *original* module's on ``parity_inputs`` (the INT8 model
    is judged against the original FP32 one). Returns the difference; a mismatch removes the file
    and raises ``ExportError``."""
    out_path = Path(out_path)
    parity_inputs = np.asarray(parity_inputs)
    session = make_session(out_path, SessionSpec(threads=1))
    gap = OutputGap()
    for lo in range(0, len(parity_inputs), batch_size):   # both models' outputs a batch at a time
        batch = parity_inputs[lo:lo + batch_size]
        gap.add(torch_outputs(original, batch), onnx_outputs(out_path, batch, session=session))
    del session
    diff = gap.value(relative=relative)
    if not diff <= tolerance:
        out_path.unlink(missing_ok=True)
        rel = "relative " if relative else ""
        raise ExportError(f"{what} ONNX model does not match the original model: max {rel}|delta| = "
                          f"{diff:.3g} > {tolerance:g}; no file kept")
    return diff
