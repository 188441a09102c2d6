"""A causal model -> one ONNX graph with a KV cache (the with-past export), and its parity gate.

The graph's interface is ``decode``'s (the names Optimum and ONNX Runtime GenAI use). Two wrappers
give it the same torch forward ``(input_ids, attention_mask, position_ids, past) -> (logits,
*present)``, ``past`` and ``present`` flat lists [key 0, value 0, key 1, ...]:

- ``ZooWithPast``: the zoo's ``CausalLM.forward_with_past``;
- ``HFWithPast``: a Hugging Face causal LM through transformers' own cache, a ``DynamicCache``
  built from the flat past tensors inside the forward (so the exporter traces plain tensors in
  and out; no cache object crosses the graph's boundary).

Exporter: ``torch.onnx.export(dynamo=True)``; batch, sequence and past length are dynamic (the
example has past 2 and sequence 3: torch.export specializes axes of size 0 or 1, yet the graph
runs a prompt after a past of length 0 and one token after a past).

Parity (an ``ExportError``, and no file left, when it fails): the graph on ONNX Runtime's CPU
provider against the wrapper in PyTorch, each carrying its own cache: the prompt after an empty
past, then ``decode_steps`` single tokens (the greedy tokens of PyTorch's logits, fed to both).
Every step's logits and present keys/values must agree within ``tolerance * max(1, max |ref|)``,
and so must the prompt's last position run alone (``logits_to_keep`` = 1: ``add_logits_to_keep``).

The graph records in its metadata the longest past + sequence it is exact for
(``quantnorm.max_length``): the model's positions, and for a model with sliding-window layers
one less than the window (transformers' sliding cache keeps window - 1 keys, so past that length
a sliding layer's present would be shorter than the attention mask).
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from ..errors import ConfigError, ExportError
from ..export import finish_onnx_file, parameter_bytes, quiet_exporter
from ..fileio import atomic_path, needs_external_data
from ..module_export import name_nodes_by_module
from .decode import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    LOGITS_TO_KEEP,
    MAX_LENGTH_KEY,
    POSITION_IDS,
    DecodeSession,
    past_names,
    present_names,
)
from .graph_passes import add_logits_to_keep, attend_without_repeating_kv, fuse_group_query_attention

DEFAULT_OPSET = 18
DEFAULT_TOLERANCE = 1e-4
DEFAULT_DECODE_STEPS = 2
_EXAMPLE_PAST, _EXAMPLE_SEQ = 2, 3


def _pairs(flat):
    return list(zip(flat[0::2], flat[1::2]))


class ZooWithPast(nn.Module):
    """A zoo ``CausalLM`` with the with-past forward (see the module doc)."""
    node_prefix = "model."   # dropped from ONNX node names: ``blocks.0.attn.q/MatMul`` as in the whole-window graph

    def __init__(self, model):
        super().__init__()
        cfg = model.cfg
        self.model = model
        self.n_layers, self.kv_heads, self.head_dim = cfg.n_layers, cfg.n_heads, cfg.d_model // cfg.n_heads
        self.heads = cfg.n_heads
        self.max_length = cfg.context
        self.vocab_size = cfg.vocab_size

    def forward(self, input_ids, attention_mask, position_ids, past):
        logits, present = self.model.forward_with_past(input_ids, _pairs(past), position_ids=position_ids,
                                                       attention_mask=attention_mask)
        return (logits, *[t for kv in present for t in kv])


class HFWithPast(nn.Module):
    """A Hugging Face causal LM with the with-past forward, through a ``DynamicCache``.

    The cache layout (layers, key/value heads, head size, sliding windows) is read from the cache
    transformers itself builds on a two-token probe, so it holds for any architecture whose cache
    is made of plain or sliding-window layers; any other cache (linear attention, shared KV) is a
    ``ConfigError``.
    """
    node_prefix = "model."

    def __init__(self, model):
        super().__init__()
        from transformers import DynamicCache

        self.model = model
        self._cache_class = DynamicCache
        # the forward's cache argument is ``cache`` in recent transformers (``past_key_values``, the
        # older name, still works there but warns)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        config = model.config.get_text_config(decoder=True)
        probe = DynamicCache(config=model.config)
        if not hasattr(probe, "layers"):
            raise ConfigError("the with-past export needs transformers >= 4.56 (a DynamicCache made of layers): "
                              "pip install -U transformers")
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 2), dtype=torch.int64, device=model.device), use_cache=True,
                  **{self._cache_kw: probe})
        kinds = {type(layer).__name__ for layer in probe.layers}
        if not kinds <= {"DynamicLayer", "DynamicSlidingWindowLayer"}:
            raise ConfigError(f"{config.model_type}: its cache has layers {sorted(kinds)}; the with-past export "
                              f"takes plain and sliding-window attention caches only")
        keys = probe.layers[0].keys
        self.n_layers, self.kv_heads, self.head_dim = len(probe.layers), keys.shape[1], keys.shape[3]
        self.heads = getattr(config, "num_attention_heads", None) or self.kv_heads   # query heads
        windows = [layer.sliding_window for layer in probe.layers if getattr(layer, "is_sliding", False)]
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        limits = [n for n in [positions, *(w - 1 for w in windows)] if n]
        self.max_length = min(limits) if limits else None
        self.vocab_size = config.vocab_size

    def forward(self, input_ids, attention_mask, position_ids, past):
        cache = self._cache_class(ddp_cache_data=_pairs(past), config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_kw: cache})
        # the model appended this step's keys and values to the cache it was given: the present
        return (out.logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])


@dataclass(frozen=True)
class WithPastSource:
    """What a causal model source gives the generation stage: ``export(path)`` makes its FP32
    with-past graph; ``variants`` (a ``transforms.variants.FP32Variants``) makes the rotated and
    smoothed with-past graphs a recipe quantizes, on first use, by the same dispatch as the
    whole-window ones; ``release()`` lets the torch weights go once every graph is made."""
    export: Callable[[Path], WithPastExportResult]
    variants: object
    release: Callable[[], None] = lambda: None


def parity_prompts(windows: np.ndarray, max_length: int | None, n: int) -> np.ndarray:
    """The with-past parity prompts: ``n`` evaluation windows, cut to leave room for the decode steps."""
    windows = np.asarray(windows)
    room = windows.shape[1] if max_length is None else min(windows.shape[1], max_length - DEFAULT_DECODE_STEPS)
    return np.ascontiguousarray(windows[:max(1, n), :max(_EXAMPLE_PAST + _EXAMPLE_SEQ, room // 2)])


@dataclass(frozen=True)
class WithPastExportResult:
    path: Path
    opset: int
    n_layers: int
    kv_heads: int
    head_dim: int
    max_length: int | None
    tolerance: float                     # relative: max|delta| <= tolerance * max(1, max|ref|)
    max_abs_diff: dict[str, float]       # per step ("prompt", "decode 1", ...): the worst output
    prompt_shape: list[int] = field(default_factory=list)
    keeps_logits: bool = False           # the graph takes ``logits_to_keep`` (add_logits_to_keep)
    fused_attention: int = 0             # layers whose attention is one GroupQueryAttention node

    def to_dict(self, run_dir: Path | None = None) -> dict:
        path = Path(self.path)
        if run_dir is not None:
            path = Path(os.path.relpath(path.resolve(), Path(run_dir).resolve()))
        return {"path": path.as_posix(), "opset": self.opset, "exporter": "dynamo", "n_layers": self.n_layers,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "max_length": self.max_length,
                "tolerance": self.tolerance,
                "tolerance_rule": "max |delta| <= tolerance * max(1, max |reference|) per output and step",
                "max_abs_diff": dict(self.max_abs_diff), "prompt_shape": list(self.prompt_shape),
                "inputs": [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past_names(self.n_layers)],
                "optional_inputs": [LOGITS_TO_KEEP] if self.keeps_logits else [],
                "outputs": [LOGITS, *present_names(self.n_layers)],
                "attention": (f"com.microsoft.GroupQueryAttention in {self.fused_attention} of {self.n_layers} layers"
                              if self.fused_attention else "as exported (standard ONNX operators)")}


def export_with_past(wrapper, out_path: Path, prompts: np.ndarray, *, opset: int = DEFAULT_OPSET,
                     tolerance: float = DEFAULT_TOLERANCE, decode_steps: int = DEFAULT_DECODE_STEPS,
                     fuse_attention: bool = True, metadata: dict[str, str] | None = None) -> WithPastExportResult:
    """Export ``wrapper`` (``ZooWithPast`` or ``HFWithPast``) to ``out_path`` and prove, on
    ``prompts`` [n, prompt] (int token ids) and ``decode_steps`` greedy tokens after them, that the
    graph computes the wrapper's logits and cache. ``fuse_attention``: each layer's attention as
    one ONNX Runtime ``GroupQueryAttention`` node where the pass finds it (graph_passes.py; False
    keeps standard ONNX operators only, for another runtime or to measure what the fusion buys).
    ``metadata``: more of the graph's metadata (``decode.VALUE_CACHE_KEY`` where a transform rotated
    the values the cache holds). Atomic: on failure no file is left."""
    if opset < 17:
        raise ConfigError(f"opset {opset} is too old: LayerNormalization needs opset >= 17 (use 18 or 23)")
    if not tolerance > 0 or decode_steps < 1:
        raise ConfigError(f"tolerance must be > 0 and decode_steps >= 1, got {tolerance}, {decode_steps}")
    prompts = _check_prompts(prompts, wrapper, decode_steps)
    out_path = Path(out_path)
    was_training = wrapper.training
    wrapper.eval()
    try:
        with atomic_path(out_path, suffix=".onnx") as tmp:
            _export_once(wrapper, tmp, prompts, opset)
            passes = []
            finish_onnx_file(tmp, lambda m: passes.append(_finish_graph(m, wrapper, fuse_attention, metadata)), out_path)
            diffs = _parity(wrapper, tmp, prompts, decode_steps, tolerance, opset)
    finally:
        wrapper.train(was_training)
    return WithPastExportResult(out_path, opset, wrapper.n_layers, wrapper.kv_heads, wrapper.head_dim,
                                wrapper.max_length, tolerance, diffs, list(prompts.shape), *passes[0])


def _check_prompts(prompts: np.ndarray, wrapper, decode_steps: int) -> np.ndarray:
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[0] < 1 or prompts.shape[1] < 1 or \
            not np.issubdtype(prompts.dtype, np.integer):
        raise ConfigError(f"parity prompts must be integer token ids [n, prompt >= 1], got {prompts.dtype} "
                          f"{prompts.shape}")
    if prompts.min() < 0 or prompts.max() >= wrapper.vocab_size:
        raise ConfigError(f"parity prompts hold token ids outside [0, {wrapper.vocab_size})")
    need = max(prompts.shape[1] + decode_steps, _EXAMPLE_PAST + _EXAMPLE_SEQ)
    if wrapper.max_length is not None and need > wrapper.max_length:
        raise ConfigError(f"a {prompts.shape[1]}-token parity prompt and {decode_steps} decode steps need {need} "
                          f"positions; the model has {wrapper.max_length}")
    return np.ascontiguousarray(prompts, dtype=np.int64)


def _example(wrapper, prompts: np.ndarray, past: int, seq: int, batch: int = 2):
    """Inputs of the wrapper's forward for the exporter: ``batch`` rows of ``seq`` prompt tokens
    after ``past`` random cached ones."""
    weight = next(wrapper.parameters())
    generator = torch.Generator().manual_seed(0)
    cache = [torch.randn((batch, wrapper.kv_heads, past, wrapper.head_dim), generator=generator).to(weight)
             for _ in range(2 * wrapper.n_layers)]
    return _step_inputs(torch.from_numpy(np.resize(prompts[:, :seq], (batch, seq))).to(weight.device), cache)


def _step_inputs(ids: torch.Tensor, past: list[torch.Tensor]) -> tuple:
    """(input_ids, attention_mask all ones, positions continuing from the past, past)."""
    batch, seq = ids.shape
    length = past[0].shape[2]
    mask = torch.ones((batch, length + seq), dtype=torch.int64, device=ids.device)
    positions = torch.arange(length, length + seq, device=ids.device)[None].expand(batch, seq).contiguous()
    return ids, mask, positions, past


def _export_once(wrapper, tmp: Path, prompts: np.ndarray, opset: int) -> None:
    Dim = torch.export.Dim
    limit = wrapper.max_length
    batch = Dim("batch")
    seq = Dim("seq", max=limit) if limit else Dim("seq")
    past = Dim("past", max=limit) if limit else Dim("past")
    # The mask's length is past + seq; AUTO lets torch.export find that relation itself.
    shapes = ({0: batch, 1: seq}, {0: batch, 1: Dim.AUTO}, {0: batch, 1: seq},
              [{0: batch, 2: past}] * (2 * wrapper.n_layers))
    example = _example(wrapper, prompts, _EXAMPLE_PAST, _EXAMPLE_SEQ)
    with quiet_exporter() as chatter:
        try:
            torch.onnx.export(
                wrapper, example, str(tmp), dynamo=True, external_data=needs_external_data(parameter_bytes(wrapper)),
                opset_version=opset, input_names=[INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past_names(wrapper.n_layers)],
                output_names=[LOGITS, *present_names(wrapper.n_layers)], dynamic_shapes=shapes, verbose=False)
        except Exception as exc:  # noqa: BLE001 - the exporter raises many types; the user needs the message
            tail = chatter.getvalue().strip().splitlines()[-5:]
            raise ExportError(f"torch.onnx.export of the with-past model failed at opset {opset}: "
                              f"{' '.join(str(exc).split())[:300]}"
                              + (f" (exporter said: {' | '.join(tail)})" if tail else "")) from exc


def _finish_graph(model: onnx.ModelProto, wrapper, fuse_attention: bool = True,
                  metadata: dict[str, str] | None = None) -> tuple[bool, int]:
    """Nodes named after their modules, the cache's length axes named ``past + seq`` (the exporter
    writes its own expressions), the graph passes (graph_passes.py: the ``logits_to_keep`` input,
    attention that reads the cache without repeating it, then as one GroupQueryAttention node), and
    the stated maximum length and ``metadata`` in the graph's metadata. Returns (the graph takes
    ``logits_to_keep``, layers fused)."""
    name_nodes_by_module(model, wrapper.node_prefix)
    keeps_logits = add_logits_to_keep(model)
    attend_without_repeating_kv(model, wrapper.heads, wrapper.kv_heads, wrapper.head_dim)
    fused = fuse_group_query_attention(model, wrapper.heads, wrapper.kv_heads, wrapper.head_dim,
                                       wrapper.max_length) if fuse_attention else 0
    for value in model.graph.input:
        if value.name == ATTENTION_MASK:
            value.type.tensor_type.shape.dim[1].dim_param = "past + seq"
    for value in model.graph.output:
        if value.name.startswith("present."):
            value.type.tensor_type.shape.dim[2].dim_param = "past + seq"
    props = {**({MAX_LENGTH_KEY: str(wrapper.max_length)} if wrapper.max_length is not None else {}),
             **(metadata or {})}
    if props:
        onnx.helper.set_model_props(model, props)
    return keeps_logits, fused


def torch_step(wrapper, ids: np.ndarray, past: list | None) -> tuple[np.ndarray, list]:
    """One step of the wrapper in PyTorch with its own cache (``past``: flat torch tensors, or
    None for an empty one): (logits as numpy, the present as torch tensors)."""
    weight = next(wrapper.parameters())
    if past is None:
        empty = torch.zeros((len(ids), wrapper.kv_heads, 0, wrapper.head_dim)).to(weight)
        past = [empty] * (2 * wrapper.n_layers)
    with torch.no_grad():
        logits, *present = wrapper(*_step_inputs(torch.from_numpy(ids).to(weight.device), past))
    return logits.float().cpu().numpy(), list(present)


def _parity(wrapper, path: Path, prompts: np.ndarray, decode_steps: int, tolerance: float,
            opset: int) -> dict[str, float]:
    try:
        runner = DecodeSession(path)
        runner.reset(len(prompts))
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"ONNX Runtime cannot load the with-past export (opset {opset}): "
                          f"{' '.join(str(exc).split())[:300]}") from exc
    diffs: dict[str, float] = {}
    ids, past = prompts, None
    for step in range(decode_steps + 1):
        name = "prompt" if step == 0 else f"decode {step}"
        expected, past = torch_step(wrapper, ids, past)
        try:
            got = [runner.step(ids), *runner.cache()]
            if step == 0:   # the prompt again as generation runs it: the last position's logits only
                runner.reset(len(prompts))
                last = runner.step(ids, last_only=True)
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"ONNX Runtime cannot run the with-past export at the {name} step (opset {opset}): "
                              f"{' '.join(str(exc).split())[:300]}") from exc
        reference = [expected, *[t.float().cpu().numpy() for t in past]]
        diffs[name] = _worst_diff(reference, got, name, tolerance, opset, wrapper.n_layers)
        if step == 0:
            diffs["prompt, last position"] = _worst_diff([expected[:, -1:]], [last], "prompt (last position only)",
                                                         tolerance, opset, 0)
        ids = np.ascontiguousarray(expected[:, -1].argmax(-1)[:, None], dtype=np.int64)
    return diffs


def _worst_diff(reference: list[np.ndarray], got: list[np.ndarray], step: str, tolerance: float, opset: int,
                n_layers: int) -> float:
    worst = 0.0
    for name, ref, out in zip([LOGITS, *present_names(n_layers)], reference, got, strict=True):
        if ref.shape != out.shape:
            raise ExportError(f"with-past export: {name} has shape {list(out.shape)} at the {step} step, "
                              f"PyTorch {list(ref.shape)}")
        diff = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
        limit = tolerance * max(1.0, float(np.max(np.abs(ref), initial=0.0)))
        if not diff <= limit:  # also catches NaN
            raise ExportError(f"with-past ONNX export does not match PyTorch with its cache: {name} max |delta| = "
                              f"{diff:.3g} > {limit:.3g} (tolerance {tolerance:g} x max(1, max|ref|)) at the "
                              f"{step} step, opset {opset}; no file written")
        worst = max(worst, diff)
    return worst
