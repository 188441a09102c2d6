"""A with-past ONNX graph on ONNX Runtime: steps with the KV cache carried, greedy decoding, and
the cache proof (scoring through the cache equals scoring whole windows).

The graph's interface is the one Optimum and ONNX Runtime GenAI use: inputs ``input_ids``
[batch, seq], ``attention_mask`` [batch, past + seq], ``position_ids`` [batch, seq] (each of the
last two optional: a graph without them is fed without them) and ``past_key_values.{i}.key`` /
``.value`` [batch, kv_heads, past, head_dim]; outputs ``logits`` [batch, seq, vocab] and
``present.{i}.key`` / ``.value`` [batch, kv_heads, past + seq, head_dim]. A prompt is a step
after an empty past (length 0). Graphs quantnorm exports also take ``logits_to_keep`` ([1] int64,
optional, default 0: every position): ``step(..., last_only=True)`` feeds 1 where the graph has it
and slices the logits where it does not.

The cache stays in ONNX Runtime between steps: ``DecodeSession`` binds each step's ``present``
outputs as ORT-allocated values (I/O binding, which the CPU provider supports) and binds those
same values as the next step's ``past`` inputs, so no key or value is copied to numpy and back;
only the logits are read out. A graph of standard operators concatenates past and new keys into
a fresh present each step. A graph whose cache is read and written only by ONNX Runtime's
``GroupQueryAttention`` (quantnorm's fused export) keeps it in one buffer instead, on the CPU: the
same buffer [batch, kv_heads, capacity, head_dim] is bound as each layer's past and its present,
and the operator writes the new keys in place after the ``attention_mask``'s length (what ONNX
Runtime GenAI calls ``past_present_share_buffer``), so a step copies no cache at all. The buffer
grows by doubling (up to the graph's ``max_length``) when a step needs more room.

A split deployment (``prompt_model``) runs the prompt, a step of many rows, through a second
graph of the same model (a per-token INT8 graph: an integer GEMM that is fast at many rows) and
the new tokens through the first (a weight-only graph: fast at one row); both read and write the
same cache, so a step on either continues the other's.

Prompts in a batch have equal length (windows of the evaluation split): the attention mask is
all ones and positions run past, past + 1, ...
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import ConfigError
from ..feeds import LOGITS_TO_KEEP, window_feeder
from ..measure.accuracy import nll_rows
from ..measure.sessions import CUDA, SessionSpec, make_session

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
# LOGITS_TO_KEEP (feeds.py), an optional input (an initializer a feed may override): how many of
# the last positions get logits; its default, 0, keeps every position. A prompt step that only
# needs the next token's logits feeds 1, so the head runs on one row instead of the whole prompt
# (what llama.cpp and transformers' ``logits_to_keep`` do): on a 262k-token vocabulary the head is
# most of a prefill.
MAX_LENGTH_KEY = "quantnorm.max_length"   # model metadata: the longest past + seq the graph is exact for
# model metadata: what the value cache holds where it is not the checkpoint's values (a rotation
# folded into them, quantnorm.transforms.rotation's form d): two graphs share a cache only alike
VALUE_CACHE_KEY = "quantnorm.value_cache"
CHECKPOINT_VALUES = "the checkpoint's values"
ONE_ROW_KEY = "quantnorm.one_row"   # model metadata "1": a token graph exact for steps of one row (one_row.py)
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_ORT_FLOAT = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


# Logits held at once by the loops that read many positions (the cache proof, agreement's teacher
# forcing): a batch is cut so that [rows, positions, vocab] float32 stays near this (Gemma 3's
# 262,144-token vocabulary makes one 128-token window's logits 134 MB).
LOGITS_BUDGET_BYTES = 256 << 20


def rows_within_budget(positions: int, vocab: int, cap: int) -> int:
    """How many sequences of ``positions`` logits over ``vocab`` fit ``LOGITS_BUDGET_BYTES`` (1..cap)."""
    return int(max(1, min(cap, LOGITS_BUDGET_BYTES // max(1, positions * vocab * 4))))


def past_names(n_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def present_names(n_layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


@dataclass(frozen=True)
class PastLayout:
    """The cache a with-past graph takes: ``n_layers`` (keys, values) of [batch, kv_heads, past, head_dim]."""
    n_layers: int
    kv_heads: int
    head_dim: int
    dtype: type = np.float32
    max_length: int | None = None   # from the graph's metadata; None: not stated
    values: str = CHECKPOINT_VALUES   # what its value cache holds (the graph's metadata)

    def empty(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), self.dtype)] * (2 * self.n_layers)

    @classmethod
    def of_session(cls, session: ort.InferenceSession, where: str = "the graph") -> PastLayout:
        """Read from the graph's inputs and outputs; a graph that is not a with-past causal LM, or
        whose ``present`` outputs do not match its ``past`` inputs, is a ``ConfigError``."""
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name: o for o in session.get_outputs()}
        found = sorted({int(m.group(1)) for name in inputs if (m := _PAST.match(name))})
        if INPUT_IDS not in inputs or LOGITS not in outputs or not found:
            raise ConfigError(f"{where} is not a with-past causal LM: it needs inputs input_ids and "
                              f"past_key_values.{{i}}.key/.value and output logits (export it with past)")
        n_layers = len(found)
        if found != list(range(n_layers)):
            raise ConfigError(f"{where}: past_key_values layers are {found}, expected 0..{n_layers - 1}")
        missing = [n for n in past_names(n_layers) if n not in inputs] + \
                  [n for n in present_names(n_layers) if n not in outputs]
        if missing:
            raise ConfigError(f"{where}: the present outputs do not match the past inputs (missing {missing[0]})")
        first = inputs[past_names(1)[0]]
        shape = first.shape
        if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            raise ConfigError(f"{where}: past_key_values.0.key has shape {shape}, expected "
                              f"[batch, kv_heads, past, head_dim] with fixed heads and head_dim")
        for past, present in zip(past_names(n_layers), present_names(n_layers)):
            a, b = inputs[past], outputs[present]
            if a.type != b.type or [a.shape[i] for i in (1, 3)] != [shape[1], shape[3]] or \
                    len(b.shape) != 4 or [b.shape[i] for i in (1, 3)] != [shape[1], shape[3]]:
                raise ConfigError(f"{where}: {present} ({b.type} {b.shape}) does not match {past} ({a.type} {a.shape})")
        if first.type not in _ORT_FLOAT:
            raise ConfigError(f"{where}: the cache is {first.type}; float or float16 expected")
        meta = session.get_modelmeta().custom_metadata_map
        max_length = int(meta[MAX_LENGTH_KEY]) if MAX_LENGTH_KEY in meta else None
        return cls(n_layers, shape[1], shape[3], _ORT_FLOAT[first.type], max_length,
                   meta.get(VALUE_CACHE_KEY, CHECKPOINT_VALUES))


GQA = "GroupQueryAttention"   # com.microsoft: past_key, past_value are inputs 3, 4; present outputs 1, 2
FIRST_CAPACITY = 256            # positions of a shared cache buffer before it first grows


def check_one_cache(tokens: PastLayout, prompt: PastLayout) -> None:
    """A split deployment's two graphs must read and write one cache: a ConfigError where the prompt
    graph's layers, heads, head size, dtype or what its values are (``VALUE_CACHE_KEY``) differ from
    the token graph's."""
    if (prompt.n_layers, prompt.kv_heads, prompt.head_dim, prompt.dtype) != \
            (tokens.n_layers, tokens.kv_heads, tokens.head_dim, tokens.dtype):
        raise ConfigError(f"the prompt graph's cache ({prompt.n_layers} layers x {prompt.kv_heads} heads x "
                          f"{prompt.head_dim}, {np.dtype(prompt.dtype).name}) is not the token graph's "
                          f"({tokens.n_layers} x {tokens.kv_heads} x {tokens.head_dim}, "
                          f"{np.dtype(tokens.dtype).name}): both must be exports of one model")
    if prompt.values != tokens.values:
        raise ConfigError(f"the prompt graph's cache holds {prompt.values}, the token graph's {tokens.values}: one "
                          "cache cannot serve both (pair graphs quantized from the same rotation form)")


def writes_cache_in_place(path: str | Path, n_layers: int) -> bool:
    """Whether the graph at ``path`` can share one buffer for each layer's past and present: every
    ``past_key_values.{i}.*`` is read, as its past, by a ``GroupQueryAttention`` node that writes
    ``present.{i}.*`` (the graph's output, nothing between), and otherwise only by a ``Shape``
    that leaves the length out. Anything else (a Concat, the past's length, a quantizer's node on
    it) needs the past as long as the tokens so far."""
    graph = onnx.load(str(path), load_external_data=False).graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    writer: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
        for name in node.output:
            writer[name] = node
    for layer in range(n_layers):
        past = [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        present = [f"present.{layer}.key", f"present.{layer}.value"]
        node = writer.get(present[0])
        if node is None or node.op_type != GQA or node.domain != "com.microsoft" or \
                list(node.input[3:5]) != past or list(node.output[1:3]) != present:
            return False
        if any(other is not node and not _reads_no_length(other) for name in past for other in readers.get(name, [])):
            return False
    return True


def _reads_no_length(node: onnx.NodeProto) -> bool:
    """A ``Shape`` of a [batch, kv_heads, past, head_dim] past that leaves its length axis out
    (the exporter reads the batch size off a past): the same in a buffer of any length."""
    if node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
        return False
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0) % 4, attrs.get("end", 4)
    end = end % 4 if end < 0 else min(end, 4)
    return end <= 2 or start >= 3


def open_session(model, threads: int | None = 1, spec: SessionSpec | None = None,
                 profile_prefix: Path | None = None) -> ort.InferenceSession:
    """``model``: an ``ort.InferenceSession`` (returned as is) or the path of an ONNX file (a
    session as ``spec`` says; None: the CPU provider with ``threads``; ORT's profiler on where
    ``profile_prefix`` names its files)."""
    if isinstance(model, ort.InferenceSession):
        return model
    return make_session(Path(model), spec or SessionSpec(threads=threads), profile=profile_prefix is not None,
                        profile_prefix=profile_prefix)


class _Graph:
    """One session of a ``DecodeSession`` and what a step needs to know of its inputs."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self.feeds = {i.name for i in session.get_inputs()}
        # an overridable initializer: bind_cpu_input does not see it, so the name is looked up there too
        self.keeps_logits = LOGITS_TO_KEEP in self.feeds | {i.name for i in session.get_overridable_initializers()}
        # One binding for every step: with a shared cache buffer its 2 x layers past inputs and present
        # outputs stay bound to the same values, so a step rebinds only what changes (binding each
        # cache tensor anew took ~0.5 ms of Python per step, 7% of a SmolLM2 token)
        self.binding = session.io_binding()
        self.bound_cache: list | None = None   # the cache values bound as past and present, if any
        # a per-token recipe's token graph (generation/one_row.py): exact for a step of one row only
        self.one_row = session.get_modelmeta().custom_metadata_map.get(ONE_ROW_KEY) == "1"


class DecodeSession:
    """A with-past graph and its cache, kept as ORT values between steps (see the module doc).

    ``shared_cache``: None (default) shares one buffer for past and present where the graph allows
    (``writes_cache_in_place``; a path on the CPU provider), False never, True requires it (a
    ``ConfigError`` where the graph or provider does not allow it). ``prompt_model``: a second
    with-past graph of the same model (same layers, heads and head size) that runs every step of
    more than one row (the split deployment of the module doc); the buffer is shared only where
    both graphs allow it. ``profile_prefix``: the token graph's session runs under ORT's profiler
    (``session.end_profiling()`` returns its file).
    """

    def __init__(self, model, *, threads: int | None = 1, spec: SessionSpec | None = None,
                 shared_cache: bool | None = None, prompt_model=None, profile_prefix: Path | None = None):
        if prompt_model is not None:   # two thread pools taking turns: neither may spin while the other runs
            spec = dataclasses.replace(spec or SessionSpec(threads=threads), stop_spinning=True)
        self.session = open_session(model, threads, spec, profile_prefix)
        self.layout = PastLayout.of_session(self.session)
        self.tokens_graph = _Graph(self.session)
        self.prompt_graph = self.tokens_graph
        if prompt_model is not None:
            prompt_session = open_session(prompt_model, threads, spec)
            check_one_cache(self.layout, PastLayout.of_session(prompt_session, "the prompt graph"))
            self.prompt_graph = _Graph(prompt_session)
        if self.tokens_graph.one_row and (prompt_model is None or self.prompt_graph.one_row):
            raise ConfigError("a one-row token graph (quantnorm.one_row) runs beside the per-token graph it was "
                              "made from, which takes prompts and batches: pass that graph as the prompt graph "
                              "(DecodeSession's prompt_model; quantnorm bench --decode ONE_ROW_GRAPH --prompt-model "
                              "P_GRAPH times the pair)")
        # the cache stays where the provider computes it: host memory for the CPU, the GPU's for CUDA
        self.device = "cuda" if self.session.get_providers()[0] == CUDA else "cpu"
        self.shared = shared_cache is not False and self._can_share(model) and \
            (prompt_model is None or self._can_share(prompt_model))
        if shared_cache and not self.shared:
            raise ConfigError("a shared cache buffer needs a graph path on the CPU provider whose cache only "
                              "GroupQueryAttention reads and writes, with its max_length stated (quantnorm's "
                              "fused with-past export)")
        self._keep_one = ort.OrtValue.ortvalue_from_numpy(np.ones(1, np.int64))
        self._token_logits: tuple[np.ndarray, ort.OrtValue] | None = None   # (buffer, its value) of a one-token step
        self._keep_all = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.int64))   # the input's default: 0, all
        self.outputs = [LOGITS, *present_names(self.layout.n_layers)]
        vocab = next(o.shape[-1] for o in self.session.get_outputs() if o.name == LOGITS)
        self.vocab = vocab if isinstance(vocab, int) and vocab > 0 else 1
        self.reset(1)

    @property
    def one_row(self) -> bool:
        """Whether the token graph takes steps of one row only (the others run on the prompt graph)."""
        return self.tokens_graph.one_row

    @property
    def split(self) -> bool:
        """Whether prompts run through a graph of their own."""
        return self.prompt_graph is not self.tokens_graph

    def _can_share(self, model) -> bool:
        return (not isinstance(model, ort.InferenceSession) and self.device == "cpu"
                and self.layout.max_length is not None and writes_cache_in_place(model, self.layout.n_layers))

    def reset(self, batch: int, tokens: int | None = None) -> None:
        """Start over with an empty cache for ``batch`` sequences; ``tokens``: how many positions
        the caller will feed in all, where known (a shared buffer is made that long at once)."""
        self.batch = batch
        self.length = 0
        self._buffers: list[np.ndarray] = []
        if self.shared:
            self._grow(tokens or FIRST_CAPACITY)
        else:
            self.past = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.layout.empty(batch)]

    def _grow(self, positions: int) -> None:
        """Shared buffers of at least ``positions`` (at most ``max_length``), the cache so far copied in."""
        have = self._buffers[0].shape[2] if self._buffers else 0
        if positions <= have:
            return
        layout = self.layout
        capacity = min(layout.max_length, max(positions, 2 * have))
        grown = [np.zeros((self.batch, layout.kv_heads, capacity, layout.head_dim), layout.dtype)
                 for _ in range(2 * layout.n_layers)]
        for new, old in zip(grown, self._buffers):
            new[:, :, :self.length] = old[:, :, :self.length]
        # ortvalue_from_numpy wraps the array's memory on the CPU: ORT writes the new keys into it
        self._buffers = grown
        self.past = [ort.OrtValue.ortvalue_from_numpy(a) for a in grown]

    def step(self, input_ids: np.ndarray, *, last_only: bool = False, tokens_graph: bool = False) -> np.ndarray:
        """Feed ``input_ids`` [batch, seq] after the cache, keep the present as the new cache;
        return the logits [batch, seq, vocab] as numpy ([batch, 1, vocab] with ``last_only``).
        A step of more than one row runs on the prompt graph unless ``tokens_graph`` says otherwise
        (the token graph scoring whole windows after an empty cache)."""
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[0] != self.batch or ids.shape[1] < 1:
            raise ConfigError(f"a step takes input_ids [{self.batch}, seq >= 1], got {list(ids.shape)}")
        max_length = self.layout.max_length
        if max_length is not None and self.length + ids.shape[1] > max_length:
            raise ConfigError(f"{self.length + ids.shape[1]} tokens exceed the model's {max_length} positions "
                              f"(prompt plus new tokens): use a shorter prompt or fewer new tokens")
        graph = self.tokens_graph if ids.shape[1] == 1 or tokens_graph else self.prompt_graph
        if graph.one_row and ids.size > 1:   # several rows: one scale per tensor would not be per token
            graph = self.prompt_graph
        total = self.length + ids.shape[1]
        if self.shared:
            self._grow(total)
        host = {INPUT_IDS: ids,   # kept referenced until the run: the binding holds their memory
                ATTENTION_MASK: np.ones((self.batch, total), np.int64),
                POSITION_IDS: np.ascontiguousarray(np.broadcast_to(np.arange(self.length, total), ids.shape))}
        binding = graph.binding
        for name, array in host.items():
            if name in graph.feeds:
                binding.bind_cpu_input(name, array)
        if graph.keeps_logits:
            binding.bind_ortvalue_input(LOGITS_TO_KEEP, self._keep_one if last_only else self._keep_all)
        # One token per row on the CPU with the cache in one buffer: the logits go to a buffer kept
        # for that batch, and nothing else is fetched back (get_outputs wraps every present as well:
        # 43 us of a 7 ms SmolLM2 step). Otherwise a fresh output each step: its rows change with it.
        one_token = self.shared and self.device == "cpu" and ids.shape[1] == 1 and self.vocab > 1
        if one_token:
            if self._token_logits is None or self._token_logits[0].shape[0] != self.batch:
                out = np.empty((self.batch, 1, self.vocab), np.float32)
                self._token_logits = (out, ort.OrtValue.ortvalue_from_numpy(out))
            binding.bind_ortvalue_output(LOGITS, self._token_logits[1])
        else:
            binding.bind_output(LOGITS, self.device)
        if not self.shared or graph.bound_cache is not self.past:
            for name, value in zip(past_names(self.layout.n_layers), self.past):
                binding.bind_ortvalue_input(name, value)
            if self.shared:   # each layer's present is its past: the operator appends in place
                for name, value in zip(present_names(self.layout.n_layers), self.past):
                    binding.bind_ortvalue_output(name, value)
                graph.bound_cache = self.past
            else:
                for name in self.outputs[1:]:
                    binding.bind_output(name, self.device)
        graph.session.run_with_iobinding(binding)
        self.length = total
        if one_token:
            return self._token_logits[0].copy()   # the caller may keep it past the next step
        logits, *present = binding.get_outputs()
        if not self.shared:
            self.past = present
        logits = logits.numpy()
        return logits[:, -1:] if last_only and logits.shape[1] != 1 else logits

    def cache(self) -> list[np.ndarray]:
        """The cache as numpy arrays (a copy), in ``past_names`` order, [batch, kv_heads, tokens so far, head_dim]."""
        if self.shared:
            return [a[:, :, :self.length].copy() for a in self._buffers]
        return [value.numpy() for value in self.past]


def greedy_decode(model, prompts: np.ndarray, max_new_tokens: int, *, threads: int | None = 1) -> np.ndarray:
    """Greedy generation through the cache: ``prompts`` [batch, prompt] int -> [batch, max_new_tokens].

    The prompt is one step after an empty past, then each new token is one step; the cache stays
    in ONNX Runtime between steps (``DecodeSession``: I/O binding on any provider, the CPU's
    included); only the logits come back to numpy. Always
    ``max_new_tokens`` tokens (no stop at an end-of-sequence token: generations are compared
    position by position). A prompt plus new tokens past the graph's stated positions is a
    ``ConfigError``.
    """
    prompts = np.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[1] < 1 or not np.issubdtype(prompts.dtype, np.integer):
        raise ConfigError(f"prompts must be integer token ids [batch, prompt >= 1], got {prompts.dtype} {prompts.shape}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    runner = model if isinstance(model, DecodeSession) else DecodeSession(model, threads=threads)
    max_length = runner.layout.max_length
    if max_length is not None and prompts.shape[1] + max_new_tokens - 1 > max_length:
        raise ConfigError(f"a {prompts.shape[1]}-token prompt and {max_new_tokens} new tokens exceed the model's "
                          f"{max_length} positions: use a shorter prompt or fewer new tokens")
    runner.reset(len(prompts), prompts.shape[1] + max_new_tokens - 1)
    logits = runner.step(prompts, last_only=True)
    tokens = []
    while True:
        tokens.append(logits[:, -1].argmax(-1).astype(np.int64))
        if len(tokens) == max_new_tokens:
            return np.stack(tokens, axis=1)
        logits = runner.step(tokens[-1][:, None])


# ---------------------------------------------------------------------------------------------
# The cache proof


@dataclass(frozen=True)
class CacheCheck:
    """Mean next-token NLL (nats) of the same windows scored through the cache and whole."""
    nll_cached: float
    nll_whole: float
    prefill: int
    windows: list[int]          # [n, seq]
    tolerance: float

    @property
    def relative_diff(self) -> float:
        return abs(self.nll_cached - self.nll_whole) / max(abs(self.nll_whole), 1e-30)

    @property
    def ok(self) -> bool:
        return bool(self.relative_diff <= self.tolerance)   # NaN fails

    def to_dict(self) -> dict:
        return {"nll_cached": self.nll_cached, "nll_whole": self.nll_whole, "relative_diff": self.relative_diff,
                "tolerance": self.tolerance, "ok": self.ok, "prefill": self.prefill, "windows": list(self.windows)}


def _whole_nll_sum(session: ort.InferenceSession, windows: np.ndarray, batch_size: int) -> float:
    """Next-token NLL summed over ``windows`` scored whole by a whole-window graph."""
    vocab = next(o.shape[-1] for o in session.get_outputs() if o.name == LOGITS)
    step = rows_within_budget(windows.shape[1], vocab if isinstance(vocab, int) and vocab > 0 else 1, batch_size)
    feed = window_feeder(session)
    total = 0.0
    for lo in range(0, len(windows), step):
        batch = windows[lo:lo + step]
        total += float(nll_rows(session.run([LOGITS], feed(batch))[0][:, :-1], batch[:, 1:]).sum())
    return total


def check_cache(model, windows: np.ndarray, prefill: int, *, whole=None, tolerance: float = 1e-4,
                batch_size: int = 8, threads: int | None = 1, prompt_model=None) -> CacheCheck:
    """Score ``windows`` [n, seq] through the cache (prefill ``prefill`` tokens, then one token at
    a time, teacher-forced, the cache carried between steps) and whole, and return both NLLs.

    ``whole``: the whole-window graph (input ``input_ids`` -> ``logits``) or its path; None scores
    the windows whole with the with-past graph itself (one step after an empty past). Exact in
    FP32 and for per-token recipes; a per-tensor dynamic recipe's scales differ between a prompt
    and one row, so its two NLLs need not agree (PITFALLS.md 20). ``prompt_model``: a split
    deployment's prompt graph (``DecodeSession``) runs the prefill; the windows scored whole are
    then the token graph's (the cache written by one graph, read by the other: what it costs).
    """
    windows = np.ascontiguousarray(windows, dtype=np.int64)
    if windows.ndim != 2 or len(windows) < 1:
        raise ConfigError(f"windows must be token ids [n, seq], got shape {windows.shape}")
    if not 1 <= prefill < windows.shape[1]:
        raise ConfigError(f"prefill must be in [1, {windows.shape[1] - 1}] for {windows.shape[1]}-token windows, "
                          f"got {prefill}")
    # One graph in memory at a time (two FP32 copies of a checkpoint, each with its arena, are most
    # of the generation stage's peak): the whole-window graph scores first and is let go.
    whole_sum = None if whole is None else _whole_nll_sum(open_session(whole, threads), windows, batch_size)
    runner = DecodeSession(model, threads=threads, prompt_model=prompt_model)
    # a one-row token graph takes a step only at batch 1: several windows at once would never reach it
    batch_size = 1 if runner.one_row else rows_within_budget(windows.shape[1], runner.vocab, batch_size)
    cached_sum, own_whole_sum = 0.0, 0.0
    for lo in range(0, len(windows), batch_size):
        batch = windows[lo:lo + batch_size]
        runner.reset(len(batch), batch.shape[1])
        # each step's NLL as it comes: never all positions' logits at once
        cached_sum += float(nll_rows(runner.step(batch[:, :prefill]), batch[:, 1:prefill + 1]).sum())
        for t in range(prefill, batch.shape[1] - 1):
            cached_sum += float(nll_rows(runner.step(batch[:, t:t + 1]), batch[:, t + 1:t + 2]).sum())
        if whole is None:
            runner.reset(len(batch), batch.shape[1])
            own_whole_sum += float(nll_rows(runner.step(batch, tokens_graph=True)[:, :-1], batch[:, 1:]).sum())
    n = windows.shape[0] * (windows.shape[1] - 1)
    whole_sum = own_whole_sum if whole_sum is None else whole_sum
    return CacheCheck(cached_sum / n, whole_sum / n, prefill, list(windows.shape), tolerance)

