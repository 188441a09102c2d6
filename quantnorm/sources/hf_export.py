"""Hugging Face model -> the module the one export stage takes (``quantnorm.module_export``).

Wrappers (input ``input_ids`` int64 ``[batch, seq]``, both axes dynamic, no attention mask: every
window is full length, so the mask would be all ones):

- causal LMs: ``logits`` ``[batch, seq, vocab]`` (float32), like the zoo's models;
- encoders: ``last_hidden_state`` ``[batch, seq, hidden]`` and ``sentence_embedding``
  ``[batch, hidden]`` (the checkpoint's sentence-transformers pooling, mean by default), plus
  ``logits`` ``[batch, seq, vocab]`` when the checkpoint has an MLM head. The first output is
  3-D with batch and sequence leading, so the quantizer's sanity check runs on it unchanged.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..export import torch_outputs  # noqa: F401  (the wrappers' outputs in torch, for callers and tests)
from ..module_export import (  # noqa: F401  (re-exported: the export of a wrapper)
    DEFAULT_OPSET,
    DEFAULT_TOLERANCE,
    INPUT_NAME,
    ModuleExportResult,
    export_matching_original,
    export_module_onnx,
    onnx_outputs,
)

WRAPPER_ATTR = "model"  # the wrapper's attribute holding the HF model (stripped from node names)


def output_names(kind: str, mlm_head: bool = False) -> tuple[str, ...]:
    if kind == "causal":
        return ("logits",)
    return ("last_hidden_state", "sentence_embedding") + (("logits",) if mlm_head else ())


def make_wrapper(loaded):
    """The export/measurement module for a ``LoadedCheckpoint`` (see the module doc)."""
    import torch
    from torch import nn

    spec, files = loaded.spec, loaded.files

    class CausalLMWrapper(nn.Module):
        node_prefix = WRAPPER_ATTR + "."  # dropped from ONNX node names (module_export)

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    class EncoderWrapper(nn.Module):
        node_prefix = WRAPPER_ATTR + "."

        def __init__(self, model, pooling: str, mlm_head: bool):
            super().__init__()
            self.model = model
            self.pooling = pooling
            self.mlm_head = mlm_head

        def forward(self, input_ids):
            hidden = self.model.base_model(input_ids=input_ids).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            elif self.pooling == "max":
                pooled = hidden.amax(dim=1)
            else:  # mean over all tokens: every window is full length (attention mask all ones)
                pooled = hidden.mean(dim=1)
            if self.mlm_head:
                return hidden, pooled, self.model.cls(hidden)
            return hidden, pooled

    if spec.kind == "causal":
        wrapper = CausalLMWrapper(loaded.model)
    else:
        wrapper = EncoderWrapper(loaded.model, files.pooling, files.mlm_head)
    assert hasattr(wrapper, WRAPPER_ATTR)
    return wrapper.eval().to(torch.float32)


def export_hf_onnx(wrapper, out_path: Path, parity_inputs: np.ndarray, *, outputs: tuple[str, ...],
                   max_positions: int | None, opset: int = DEFAULT_OPSET,
                   tolerance: float = DEFAULT_TOLERANCE) -> ModuleExportResult:
    """``module_export.export_module_onnx`` for a checkpoint's wrapper."""
    return export_module_onnx(wrapper, out_path, parity_inputs, outputs=outputs, max_positions=max_positions,
                              opset=opset, tolerance=tolerance)
