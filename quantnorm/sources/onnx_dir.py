"""The ONNX source: a directory holding a model the user already exported.

The layout Hugging Face Optimum's exporter writes: ``model.onnx`` (with its external data file
when it has one), ``config.json`` and the tokenizer files beside it. Accepted graphs:

- a causal LM: inputs ``input_ids`` (and optionally ``attention_mask``, ``position_ids``),
  output ``logits``; scored by PPL ratio, KL and top-1 over next tokens;
- an encoder: inputs ``input_ids`` (and optionally ``attention_mask``, ``token_type_ids``),
  output ``last_hidden_state``; scored by embedding cosine and nearest-neighbour agreement.

A causal graph may also take a KV cache (``past_key_values.{i}.key`` / ``.value`` in,
``present.{i}.key`` / ``.value`` out: Optimum's ``text-generation-with-past``, or a quantnorm
bundle): whole windows are then scored as one step after an empty cache (``quantnorm.feeds``),
and the generation stage takes the graph itself, unbound, as its with-past FP32 model. Cache
inputs under any other names, or ``present`` outputs that do not match them, are refused.

"Export" for this source is *binding*: every window the pipeline runs is full length, so the
optional inputs are fixed inside the graph (``attention_mask`` = 1, ``token_type_ids`` = 0,
``position_ids`` = 0..T-1, computed from ``input_ids``'s shape) and the graph becomes the
one-input model every later stage (calibration, quantization, accuracy, latency, SQNR, the probe)
takes. Encoders also get the sentence embedding as a graph output (the pooling of
``1_Pooling/config.json``, mean when absent), as the checkpoint path exports it. The bound graph
is checked against the original one fed the same values explicitly.

No torch module exists here: SmoothQuant and rotation recipes are reported as not applicable,
the probe reads the graph (``quantnorm.measure.graph_probe``), and placement and norm come from
the graph alone (``quantnorm.measure.placement``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..data import BUILTIN_PYDOC
from ..errors import ConfigError, ExportError
from ..export import count_norm_ops
from ..feeds import PAST_INPUT, window_feeder
from ..fileio import atomic_path, external_data_file, save_onnx
from ..generation.bundle import MANIFEST_FILE as BUNDLE_MANIFEST_FILE
from ..generation.with_past import WithPastSource
from ..measure.sessions import CPU
from ..portable import portable_path
from ..runs import check_out_dir
from ..transforms.variants import FP32Variants
from .base import Scoring, SearchScoring, TorchChecks, no_transforms
from .hf import default_out_dir, hf_data, token_namer, token_scoring, token_search_scoring
from .hf_loader import (
    DETECTED,
    GRAPH_DETECTED_FROM,
    NORM_FORMULAS,
    TOKENIZER_FILES,
    load_tokenizer,
    pooling_mode,
    read_config_json,
)
from .tokenized import AUTO_EVAL_WINDOWS, prepare_hf_data

ONNX_FILE = "model.onnx"
INPUT_IDS = "input_ids"
# The optional inputs a full-length window fixes, and the value each gets.
BOUND_INPUTS = {
    "attention_mask": "1 everywhere (every window is full length)",
    "token_type_ids": "0 everywhere (one segment)",
    "position_ids": "0..T-1 in every row",
}
OUTPUTS = {"causal": ("logits",), "encoder": ("last_hidden_state", "sentence_embedding")}
PARITY_TOLERANCE = 1e-4   # relative: binding only moves constants into the graph
ORT_FP32 = TensorProto.FLOAT


@dataclass(frozen=True)
class OnnxOptions:
    path: Path
    corpus: str = BUILTIN_PYDOC
    window: int = 128
    max_eval_windows: int | str | None = AUTO_EVAL_WINDOWS  # "auto": hf.data.default_eval_windows
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.window < 3:
            raise ConfigError(f"--context (the window in tokens) must be >= 3 for --model, got {self.window}")


@dataclass(frozen=True)
class GraphInterface:
    """What the graph's inputs and outputs say about it, read without its weights."""

    kind: str                      # "causal" | "encoder"
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    opset: int
    past: tuple[str, ...] = ()     # the KV-cache inputs of a with-past graph

    @property
    def with_past(self) -> bool:
        return bool(self.past)


def read_interface(path: Path) -> GraphInterface:
    """Check that ``path`` is a graph this source can evaluate; one-line ``ConfigError`` otherwise."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends: corrupt or truncated
        raise ConfigError(f"--model {path.parent}: {path.name} is not a readable ONNX model (truncated or corrupt?): "
                          f"{' '.join(str(exc).split())[:160]}") from None
    graph = model.graph
    if not graph.node:
        raise ConfigError(f"--model {path.parent}: {path.name} has no nodes (truncated or not an exported model?)")
    initializers = {i.name for i in graph.initializer}
    inputs = tuple(i.name for i in graph.input if i.name not in initializers)
    outputs = tuple(o.name for o in graph.output)
    past = tuple(name for name in inputs if name.startswith("past_key_values") or name.startswith("past."))
    _check_cache_names(path, past, outputs)
    if INPUT_IDS not in inputs:
        raise ConfigError(f"--model {path.parent}: {path.name} has no input_ids input (inputs: {', '.join(inputs)}); "
                          f"quantnorm feeds token ids")
    unknown = [name for name in inputs if name != INPUT_IDS and name not in BOUND_INPUTS and name not in past]
    if unknown:
        raise ConfigError(f"--model {path.parent}: {path.name} has inputs quantnorm cannot fill ({', '.join(unknown)}); "
                          f"accepted: input_ids, {', '.join(BOUND_INPUTS)}")
    ids = next(i for i in graph.input if i.name == INPUT_IDS)
    if ids.type.tensor_type.elem_type != TensorProto.INT64:
        raise ConfigError(f"--model {path.parent}: input_ids is not int64 in {path.name}; export with int64 token ids")
    if "logits" in outputs:
        kind = "causal"
    elif "last_hidden_state" in outputs:
        kind = "encoder"
    else:
        raise ConfigError(f"--model {path.parent}: {path.name} has neither a logits nor a last_hidden_state output "
                          f"(outputs: {', '.join(outputs)}); export a causal LM or a base encoder")
    float16 = [i.name for i in graph.initializer if i.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16)]
    if float16:
        raise ConfigError(f"--model {path.parent}: {path.name} stores weights in 16-bit floats ({float16[0]}, ...): "
                          f"export in float32 (the FP32 graph is the baseline every INT8 recipe is measured against)")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if past and kind != "causal":
        raise ConfigError(f"--model {path.parent}: {path.name} takes a KV cache but has no logits output")
    return GraphInterface(kind, inputs, outputs, opset, past)


def _check_cache_names(path: Path, past: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    """A cache under Optimum's names with a ``present`` output for every ``past`` input."""
    if not past:
        return
    layers = sorted({int(m.group(1)) for name in past if (m := PAST_INPUT.match(name))})
    expected = [f"past_key_values.{i}.{kv}" for i in range(len(layers)) for kv in ("key", "value")]
    if sorted(past) != sorted(expected):
        raise ConfigError(f"--model {path.parent}: {path.name} takes cache inputs ({past[0]}, ...) not named "
                          f"past_key_values.{{i}}.key/.value for layers 0..n-1: export it with Optimum's "
                          f"text-generation-with-past, or with use_cache=False")
    missing = [n.replace("past_key_values.", "present.") for n in expected
               if n.replace("past_key_values.", "present.") not in outputs]
    if missing:
        raise ConfigError(f"--model {path.parent}: {path.name}'s present outputs do not match its past inputs "
                          f"(no {missing[0]}): the graph cannot carry its cache from one step to the next")


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value, name))


def bind_inputs(model: onnx.ModelProto, interface: GraphInterface, pooling: str) -> tuple[onnx.ModelProto, list[str]]:
    """The one-input model (see the module docstring); returns it and the outputs it dropped."""
    graph = model.graph
    declared = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    front: list[onnx.NodeProto] = []
    bound = [name for name in interface.inputs if name in BOUND_INPUTS]
    if bound:
        front.append(helper.make_node("Shape", [INPUT_IDS], ["qn_bind/shape"], name="qn_bind/shape"))
    for name in bound:
        dtype = declared[name]
        np_type = helper.tensor_dtype_to_np_dtype(dtype)
        if name == "position_ids":
            front += [
                _const("qn_bind/one_index", np.array(1, dtype=np.int64)),
                helper.make_node("Gather", ["qn_bind/shape", "qn_bind/one_index"], ["qn_bind/seq"], name="qn_bind/seq",
                                 axis=0),
                _const("qn_bind/zero", np.array(0, dtype=np.int64)),
                _const("qn_bind/step", np.array(1, dtype=np.int64)),
                helper.make_node("Range", ["qn_bind/zero", "qn_bind/seq", "qn_bind/step"], ["qn_bind/range"],
                                 name="qn_bind/range"),
                _const("qn_bind/axes0", np.array([0], dtype=np.int64)),
                helper.make_node("Unsqueeze", ["qn_bind/range", "qn_bind/axes0"], ["qn_bind/row"], name="qn_bind/row"),
            ]
            expanded = name if dtype == TensorProto.INT64 else "qn_bind/positions"
            front.append(helper.make_node("Expand", ["qn_bind/row", "qn_bind/shape"], [expanded],
                                          name="qn_bind/positions_expand"))
            if expanded != name:
                front.append(helper.make_node("Cast", [expanded], [name], name="qn_bind/positions_cast", to=dtype))
        else:
            value = 1 if name == "attention_mask" else 0
            front.append(helper.make_node("ConstantOfShape", ["qn_bind/shape"], [name], name=f"qn_bind/{name}",
                                          value=numpy_helper.from_array(np.array([value], dtype=np_type))))
    kept_inputs = [i for i in graph.input if i.name not in bound]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    nodes = front + list(graph.node)
    for i, node in enumerate(nodes):
        if not node.name:  # the quantizer's exclusions and the reports name nodes
            node.name = f"{node.op_type}_{i}"
    del graph.node[:]
    graph.node.extend(nodes)

    wanted = OUTPUTS[interface.kind]
    dropped = [o.name for o in graph.output if o.name not in wanted]
    kept = [o for o in graph.output if o.name in wanted]
    del graph.output[:]
    graph.output.extend(kept)
    if interface.kind == "encoder":
        graph.node.extend(_pooling_nodes(pooling, interface.opset))
        graph.output.append(helper.make_tensor_value_info("sentence_embedding", ORT_FP32, None))
    return model, dropped


def _explicit_feeds(session, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The original graph's feed for whole windows, every optional input given its bound value
    in its declared integer type (int32 masks exist), a cache empty."""
    feeds = dict(window_feeder(session)(ids))
    for i in session.get_inputs():
        if i.name == "attention_mask":
            feeds[i.name] = np.ones_like(ids)
        elif i.name == "token_type_ids":
            feeds[i.name] = np.zeros_like(ids)
        elif i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
        if "int32" in i.type:
            feeds[i.name] = feeds[i.name].astype(np.int32)
    return feeds


def _pooling_nodes(pooling: str, opset: int) -> list[onnx.NodeProto]:
    """``sentence_embedding`` from ``last_hidden_state`` [B, T, d]: mean, max or the first token."""
    out, src = "sentence_embedding", "last_hidden_state"
    if pooling == "cls":
        return [_const("qn_pool/index0", np.array(0, dtype=np.int64)),
                helper.make_node("Gather", [src, "qn_pool/index0"], [out], name="qn_pool/cls", axis=1)]
    op = "ReduceMax" if pooling == "max" else "ReduceMean"
    # ReduceMean takes its axes as an input from opset 18 (ReduceMax too); an attribute before.
    if opset >= 18:
        return [_const("qn_pool/axes", np.array([1], dtype=np.int64)),
                helper.make_node(op, [src, "qn_pool/axes"], [out], name=f"qn_pool/{pooling}", keepdims=0)]
    return [helper.make_node(op, [src], [out], name=f"qn_pool/{pooling}", axes=[1], keepdims=0)]


def _pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "cls":
        return hidden[:, 0]
    return hidden.max(axis=1) if pooling == "max" else hidden.mean(axis=1)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class GivenWithPast:
    """The with-past graph of an ONNX export directory, copied as given (its check: the cache proof)."""
    path: Path
    opset: int
    n_layers: int

    def to_dict(self, run_dir: Path | None = None) -> dict:
        return {"path": Path(self.path).name, "opset": self.opset, "n_layers": self.n_layers,
                "exporter": "the user's (ONNX export directory, used as given)", "max_abs_diff": {}}


class OnnxDirSource:
    def __init__(self, opts: OnnxOptions):
        self.opts = opts
        self.dir = opts.path
        self.run_dir = check_out_dir(opts.out_dir or default_out_dir(opts.path, prefix="onnx"))
        self.table_placement = DETECTED  # no architecture table for a graph: what it shows is the answer

    def prepare(self, cfg) -> None:
        self.interface = read_interface(self.dir / ONNX_FILE)
        self.kind = self.interface.kind
        self.config = read_config_json(self.dir, "the layout Optimum's exporter writes: model.onnx, config.json and "
                                                 "the tokenizer files")
        if not any((self.dir / n).is_file() for n in TOKENIZER_FILES):
            raise ConfigError(f"--model {self.dir}: no tokenizer files beside {ONNX_FILE} (expected one of "
                              f"{', '.join(TOKENIZER_FILES)}); data is tokenized with the model's own tokenizer")
        if cfg.searches and self.kind == "encoder":
            raise ConfigError(f"--recipes auto needs a perplexity to target, and {self.dir} is an encoder export "
                              f"(last_hidden_state): run the static-*/dynamic recipes and read the embedding metrics")
        self.pooling = pooling_mode(self.dir) if self.kind == "encoder" else None
        manifest = self.dir / BUNDLE_MANIFEST_FILE
        self.bundle = json.loads(manifest.read_text()) if manifest.is_file() else None
        self.tokenizer = load_tokenizer(self.dir)
        config = SimpleNamespace(**self.config)  # getattr access as on a transformers config; no model code
        self.max_positions = next((v for k in ("max_position_embeddings", "n_positions")
                                   if isinstance(v := self.config.get(k), int) and v > 0), None)
        self.hf_data = prepare_hf_data(self.tokenizer, config, self.kind, corpus=self.opts.corpus,
                                       window=self.opts.window, calib_samples=cfg.calib_samples,
                                       max_eval_windows=self.opts.max_eval_windows, model_path=self.dir,
                                       max_positions=self.max_positions)
        self.data = hf_data(self.hf_data, None)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def export(self, fp32_path: Path, cfg) -> dict:
        import onnxruntime as ort

        source_file = self.dir / ONNX_FILE
        try:
            original = onnx.load(str(source_file))
        except Exception as exc:  # noqa: BLE001 - a missing or truncated external data file
            raise ConfigError(f"--model {self.dir}: cannot load {ONNX_FILE} with its weights: "
                              f"{' '.join(str(exc).split())[:200]}") from None
        bound, dropped = bind_inputs(original, self.interface, self.pooling or "mean")
        self.n_params = int(sum(int(np.prod(i.dims)) for i in bound.graph.initializer if i.data_type == ORT_FP32))
        with atomic_path(fp32_path, suffix=".onnx") as tmp:
            save_onnx(bound, tmp, data_name=external_data_file(fp32_path).name)
        del original, bound
        parity_inputs = self.data.eval_inputs[: max(1, cfg.parity_windows)]
        try:
            reference = ort.InferenceSession(str(source_file), providers=[CPU])
            candidate = ort.InferenceSession(str(fp32_path), providers=[CPU])
        except Exception as exc:  # noqa: BLE001 - ORT's untyped errors
            fp32_path.unlink(missing_ok=True)
            raise ConfigError(f"--model {self.dir}: onnxruntime cannot load {ONNX_FILE}: "
                              f"{' '.join(str(exc).split())[:200]}") from None
        diffs = self._parity(reference, candidate, parity_inputs)
        first = OUTPUTS[self.kind][0]
        if not all(d <= PARITY_TOLERANCE for d in diffs.values()):
            fp32_path.unlink(missing_ok=True)
            raise ExportError(f"binding the inputs of {self.dir / ONNX_FILE} changed its outputs (relative max |delta| "
                              f"{diffs}); please report this graph")
        return {
            "path": fp32_path.name, "opset": self.interface.opset,
            "exporter": "the user's (ONNX export directory; inputs bound by quantnorm)",
            "max_abs_logit_diff": diffs[first], "max_abs_diff": diffs, "tolerance": PARITY_TOLERANCE,
            "tolerance_rule": "max |delta| <= tolerance * max(1, max |reference|) per output",
            "parity_reference": f"the original {ONNX_FILE} fed the bound values explicitly",
            "outputs": list(OUTPUTS[self.kind]), "input": INPUT_IDS,
            "bound_inputs": {name: BOUND_INPUTS[name] for name in self.interface.inputs if name in BOUND_INPUTS},
            "dropped_outputs": dropped, "pooling": self.pooling,
            "parity_shapes": [list(parity_inputs.shape)], "norm_ops": count_norm_ops(fp32_path),
            "attempts": [],
        }

    def _parity(self, reference, candidate, inputs: np.ndarray) -> dict[str, float]:
        ids = np.ascontiguousarray(inputs, dtype=np.int64)
        feeds = _explicit_feeds(reference, ids)
        first = OUTPUTS[self.kind][0]
        ref = dict(zip([first], reference.run([first], feeds)))
        if self.kind == "encoder":
            ref["sentence_embedding"] = _pool(ref[first], self.pooling or "mean")
        got = dict(zip(OUTPUTS[self.kind], candidate.run(list(OUTPUTS[self.kind]), window_feeder(candidate)(ids))))
        return {name: float(np.abs(ref[name] - got[name]).max() / max(1.0, float(np.abs(ref[name]).max())))
                for name in OUTPUTS[self.kind]}

    def with_past(self, cfg) -> WithPastSource:
        """A with-past graph is its own with-past FP32 model (copied unbound); any other has none."""
        if self.kind != "causal":
            raise ConfigError(f"{self.dir / ONNX_FILE} is an encoder: it generates nothing, so it has no KV cache")
        if not self.interface.with_past:
            raise ConfigError(f"{self.dir / ONNX_FILE} takes no KV cache and an ONNX export has no torch module to "
                              f"export one from: export it with past (optimum-cli export onnx --task "
                              f"text-generation-with-past) or evaluate the checkpoint directory")

        def export(path: Path) -> GivenWithPast:
            with atomic_path(path, suffix=".onnx") as tmp:
                save_onnx(onnx.load(str(self.dir / ONNX_FILE)), tmp, data_name=external_data_file(path).name)
            return GivenWithPast(path, self.interface.opset, len(self.interface.past) // 2)
        variants = self._bundle_variants() if self.bundle is not None else no_transforms("an ONNX source", self.run_dir)
        return WithPastSource(export=export, variants=variants)

    def transforms(self, cfg) -> FP32Variants:
        if self.bundle is not None:
            return self._bundle_variants()
        return no_transforms("an ONNX source", self.run_dir)

    def _bundle_variants(self) -> FP32Variants:
        """A bundle's model is a quantnorm INT8 model already: no recipe applies to it again; its
        accuracy is the baseline's own and its speed and cache are measured as given."""
        why = (f"the bundle's model is already quantized by quantnorm ({self.bundle.get('model')}, from run "
               f"{self.bundle.get('run')}): it is measured as given, the baseline of this run")
        return FP32Variants(self.run_dir, refuse=lambda recipe: why)

    def _bundle_placement(self, detected: dict) -> dict:
        """A quantized graph hides the residual adds the detector walks: a bundle's placement is the
        one its own run recorded (the bundle's results.json), said so."""
        if self.bundle is None or detected.get("placement") is not None:
            return detected
        try:
            made_by = json.loads((self.dir / "results.json").read_text())["model"]
        except (OSError, ValueError, KeyError, TypeError):
            return detected
        return {**detected, "placement": made_by.get("placement"), "norm": made_by.get("norm"),
                "how": f"the bundle's results.json (the run that made it): {detected.get('how')}"}

    def scoring(self, cfg) -> Scoring:
        return token_scoring(self.kind, self.data, None, cfg.eval_batch_size)

    def search_scoring(self, cfg) -> SearchScoring:
        return token_search_scoring(self.kind, self.data, None)

    def probe_options(self) -> dict:
        return {"n_blocks": self.config.get("num_hidden_layers"), "causal": self.kind == "causal",
                "token": token_namer(self.tokenizer, self.data.eval_inputs)}

    def torch_checks(self, cfg) -> TorchChecks:
        return TorchChecks()  # no torch module here: the FP16 check and the diagnostics need one

    def sections(self, detected: dict) -> dict:
        detected = self._bundle_placement(detected)
        if detected.get("placement") is None:
            raise ConfigError(f"--model {self.dir}: the placement cannot be read from {ONNX_FILE} "
                              f"({detected.get('how')}); quantnorm compares placements, so it needs a graph whose "
                              f"residual adds it can walk from the token embedding")
        c = self.config
        source_file = self.dir / ONNX_FILE
        model = {
            "source": {"kind": "onnx", "path": portable_path(self.dir.resolve(), self.run_dir), "file": ONNX_FILE,
                       "sha256": _file_sha256(source_file), "bytes": source_file.stat().st_size,
                       "baseline": "the exported FP32 graph, inputs bound" if self.bundle is None else
                       f"the bundle's {self.bundle.get('model')} model as given (already quantized by quantnorm)"
                       + (f"; a split deployment: only its token graph ({ONNX_FILE}) is read back, not its prompt "
                          f"graph ({self.bundle['prompt_file']})" if self.bundle.get("prompt_file") else ""),
                       **({"bundle": self.bundle} if self.bundle is not None else {})},
            "architecture": str(c.get("model_type") or "unknown"),
            "architectures": list(c.get("architectures") or []),
            "model_class": "ONNX graph",
            "kind": self.kind,
            "placement": detected["placement"], "norm": detected["norm"],
            "rule": "read from the ONNX graph",
            "norm_formula": NORM_FORMULAS.get(detected["norm"] or "unknown", NORM_FORMULAS["unknown"]),
            "final_norm": "yes (in the graph)" if detected.get("final_norm") else None,
            "placement_check": {"verified": True, "label": "read from the graph",
                                "detail": "no torch module: placement and norm are the graph's own"},
            "placement_detected": detected,
            "detected_from": GRAPH_DETECTED_FROM,
            "n_layers": c.get("num_hidden_layers"), "d_model": c.get("hidden_size"),
            "n_heads": c.get("num_attention_heads"), "context": self.max_positions,
            "vocab_size": c.get("vocab_size") or len(self.tokenizer),
            "n_params": self.n_params, "weights": "onnx", "mlm_head": False, "pooling": self.pooling,
            "dtype": "float32",
        }
        return {"model": model, "data": self.data.describe,
                "train": {"pretrained": True, "diverged": False,
                          "note": "exported model: not trained by quantnorm"}}

