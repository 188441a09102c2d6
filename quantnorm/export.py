"""PyTorch -> ONNX export at a pinned opset, with a checker pass, a parity check and a norm-op count.

The exported model takes ``input_ids`` (int64, ``[batch, seq]``, both axes dynamic, seq up to the
model's context) and returns ``logits`` (float32, ``[batch, seq, vocab]``); the FP32 and INT8
models share that interface (FORMULAS.md, "The evaluation protocol").

- Exporter: ``torch.onnx.export(dynamo=True, external_data=False)``. The TorchScript exporter
  cannot export ``aten::rms_norm`` (PITFALLS.md 5), and torch 2.13 writes external data by
  default; one self-contained file is what the quantizer and the run directory expect.
- Opset 18 (default) decomposes RMSNorm into Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul and emits
  LayerNorm as ``LayerNormalization``; opset 23 emits ``RMSNormalization``. Opsets below 17 have
  no ``LayerNormalization`` and are refused.
- Parity is not optional: the ONNX model runs on ORT's CPU provider against the PyTorch model
  in eval mode; a max |delta logit| over the tolerance is an ``ExportError`` and no file is left.
- Node names: the dynamo exporter names nodes ``node_MatMul_15``; we rename each node after the
  module it came from (``blocks.0.mlp.down/MatMul``, ``head/MatMul``) so that mixed-precision
  exclusions can be written as patterns a person can read (``head/*``, ``blocks.*.mlp.down/*``).
"""

from __future__ import annotations

import ast
import contextlib
import gc
import io
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from .data import BOS, VOCAB_SIZE
from .errors import ConfigError, ExportError
from .fileio import atomic_path, external_data_file, needs_external_data, save_onnx
from .measure.accuracy import run_logits
from .measure.sessions import SessionSpec, make_session
from .onnx_simplify import simplify

MIN_OPSET = 17  # LayerNormalization first appears in opset 17
DEFAULT_OPSET = 18
INPUT_NAME = "input_ids"
OUTPUT_NAME = "logits"
NORM_OP_KEYS = ("LayerNormalization", "RMSNormalization", "decomposed")


@dataclass(frozen=True)
class ExportResult:
    path: Path
    opset: int
    max_abs_logit_diff: float
    tolerance: float
    norm_ops: dict[str, int] = field(default_factory=dict)

    def to_dict(self, run_dir: Path | None = None) -> dict:
        """The ``export`` section of results.json; ``path`` is relative to ``run_dir`` when given."""
        path = Path(self.path)
        if run_dir is not None:
            path = Path(os.path.relpath(path.resolve(), Path(run_dir).resolve()))
        return {
            "path": path.as_posix(),
            "opset": self.opset,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "tolerance": self.tolerance,
            "norm_ops": dict(self.norm_ops),
        }


def export_onnx(model, out_path: Path, parity_inputs: np.ndarray, *, opset: int = DEFAULT_OPSET,
                tolerance: float = 1e-4) -> ExportResult:
    """Export ``model`` (a ``CausalLM``) to ``out_path`` and prove the file computes the same logits.

    ``parity_inputs``: int64 token ids ``[n, seq]`` with ``seq <= model.cfg.context`` (use
    evaluation or calibration windows). The export uses a different example shape, so the parity
    run also checks that the batch and sequence axes really are dynamic.

    Writes atomically: the file appears only after the checker and the parity check passed; on
    any failure no file is left at ``out_path`` (a file already there is left as it was). The
    model is exported in eval mode and put back in the mode it was in.
    """
    if opset < MIN_OPSET:
        raise ConfigError(f"opset {opset} is too old: LayerNormalization needs opset >= {MIN_OPSET} (use 18 or 23)")
    if not tolerance > 0:
        raise ConfigError(f"parity tolerance must be > 0, got {tolerance}")
    context = model.cfg.context
    if context < 2:
        raise ConfigError(f"context {context} is too short to export with a dynamic sequence axis (need >= 2)")
    parity_inputs = _check_token_inputs(parity_inputs, context, model.cfg.vocab_size)

    was_training = model.training
    model.eval()
    try:
        return _export_checked(model, Path(out_path), parity_inputs, opset, tolerance)
    finally:
        model.train(was_training)


def _export_checked(model, out_path: Path, parity_inputs: np.ndarray, opset: int, tolerance: float) -> ExportResult:
    context = model.cfg.context
    device = next(model.parameters()).device
    # Batch 2 and the full context: torch.export specializes axes of size 0 or 1.
    example = torch.zeros((2, context), dtype=torch.int64, device=device)
    # A tuple, not a dict keyed by name: torch.export matches dict keys to forward()'s argument names.
    dynamic_shapes = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=context)},)

    with atomic_path(out_path, suffix=".onnx") as tmp:
        with quiet_exporter() as chatter:
            try:
                torch.onnx.export(
                    model, (example,), str(tmp), dynamo=True,
                    external_data=needs_external_data(parameter_bytes(model)), opset_version=opset,
                    input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], dynamic_shapes=dynamic_shapes,
                    verbose=False,
                )
            except Exception as exc:  # the exporter raises many types; the user needs the message
                tail = chatter.getvalue().strip().splitlines()[-5:]
                raise ExportError(f"torch.onnx.export failed at opset {opset}: {exc}"
                                  + (f" (exporter said: {' | '.join(tail)})" if tail else "")) from exc

        norm_ops = finish_onnx_file(tmp, rename_nodes_by_module, out_path, inspect=count_norm_ops)

        with torch.no_grad():
            expected = model(torch.from_numpy(parity_inputs).to(device)).float().cpu().numpy()
        try:
            # One thread: a few parity windows gain nothing from more, and idle ORT workers spin.
            got = np.concatenate(list(run_logits(make_session(tmp, SessionSpec(threads=1)), parity_inputs)))
        except Exception as exc:
            raise ExportError(f"ONNX Runtime cannot run the exported model (opset {opset}): {exc}") from exc
        if got.shape != expected.shape:
            raise ExportError(f"ONNX logits have shape {got.shape}, PyTorch {expected.shape}")
        diff = float(np.max(np.abs(got.astype(np.float64) - expected.astype(np.float64))))
        if not diff <= tolerance:  # also catches NaN
            raise ExportError(
                f"ONNX export does not match PyTorch: max |delta logit| = {diff:.3g} > tolerance {tolerance:g} "
                f"(opset {opset}); no file written"
            )
    return ExportResult(path=out_path, opset=opset, max_abs_logit_diff=diff, tolerance=tolerance, norm_ops=norm_ops)


def _check_token_inputs(inputs: np.ndarray, context: int, vocab_size: int) -> np.ndarray:
    inputs = np.asarray(inputs)
    if inputs.ndim != 2 or inputs.shape[0] < 1 or inputs.shape[1] < 1:
        raise ConfigError(f"parity inputs must be token ids of shape [n, seq] with n, seq >= 1, got {inputs.shape}")
    if not np.issubdtype(inputs.dtype, np.integer):
        raise ConfigError(f"parity inputs must be integer token ids, got dtype {inputs.dtype}")
    if inputs.shape[1] > context:
        raise ConfigError(f"parity inputs are {inputs.shape[1]} tokens long but the model's context is {context}")
    if inputs.min() < 0 or inputs.max() >= vocab_size:
        raise ConfigError(f"parity inputs hold token ids outside [0, {vocab_size})")
    return np.ascontiguousarray(inputs, dtype=np.int64)


@contextlib.contextmanager
def quiet_exporter() -> Iterator[io.StringIO]:
    """Swallow the exporter's progress lines (stdout), its warnings and torch's logger chatter.

    What it printed is kept and put into the error message if the export fails.
    """
    buf = io.StringIO()
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
            warnings.simplefilter("ignore")
            yield buf
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        forget_exporter_graphs()


def forget_exporter_graphs() -> None:
    """Let go of the graph the dynamo exporter's last rewrite pass matched. onnxscript's rewrite
    rules are module-level objects whose pattern matchers keep the graph, node and match of their
    last ``match`` call (onnxscript 0.7); that graph's initializers are the exported module's own
    torch parameters, so every module ever exported stayed resident until the next export (on
    Gemma 3, 2.8 GB of parameters through the rest of a run). Each field is set again by the next
    ``match``."""
    try:
        from onnxscript.rewriter import _matcher
    except ImportError:   # another onnxscript layout: nothing known to clear
        return
    matcher_type = getattr(_matcher, "SimplePatternMatcher", None)
    if matcher_type is None:
        return
    for obj in gc.get_objects():
        if type(obj) is matcher_type:
            for field in ("_graph", "_current_node", "_match", "_tracer"):
                if field in obj.__dict__:
                    obj.__dict__[field] = None


def finish_onnx_file(path: Path, name_nodes, final: Path, inspect=None):
    """Load a freshly exported file, name its nodes (``name_nodes(model)``), simplify it
    (``onnx_simplify``: shared initializers, common subexpressions, RMSNorm in the form ONNX Runtime
    fuses; the caller's parity check runs on the result), save it back (``path`` is the temporary
    that becomes ``final``: external data, past 2 GB, is named after ``final``) and check the file
    with ``onnx.checker`` (an ``ExportError`` if it fails). Returns ``inspect(model)`` (None
    without one), read before the save: the graph's Python copy is let go before the checker reads
    the file, so the two are never resident together (Gemma 3's rotated graph: 1.7 GB each, and
    checking the copy in memory serializes a third)."""
    model = onnx.load(str(path))
    name_nodes(model)
    simplify(model)
    seen = inspect(model) if inspect is not None else None
    save_onnx(model, path, data_name=external_data_file(final).name)
    del model
    exporter_data = external_data_file(path)  # torch's own external data file, now copied
    exporter_data.unlink(missing_ok=True)
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"exported ONNX model fails onnx.checker: {exc}") from exc
    return seen


def parameter_bytes(model) -> int:
    """Float32 bytes of a torch module's parameters: whether its export needs external data."""
    return sum(p.numel() * 4 for p in model.parameters())


def rename_nodes_by_module(model: onnx.ModelProto) -> None:
    """Name each node ``<module path>/<OpType>[_k]`` from the exporter's ``name_scopes`` metadata.

    Nodes without that metadata keep their name. Names stay unique within the graph.
    """
    taken: dict[str, int] = {}
    for node in model.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        if scopes is None:
            continue
        try:
            parts = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            continue
        # parts = ['', 'blocks.0', 'blocks.0.attn.q', '<fx node>']: the module is the one before last.
        module = parts[-2] if len(parts) >= 2 else ""
        if not module or module.startswith("_"):  # root module, or an exporter-internal scope
            module = "model"
        base = f"{module}/{node.op_type}"
        k = taken.get(base, 0)
        taken[base] = k + 1
        node.name = base if k == 0 else f"{base}_{k}"
    # A renamed node could collide with an untouched original name; make every name unique.
    seen: set[str] = set()
    for node in model.graph.node:
        name, k = node.name, 0
        while node.name in seen:
            k += 1
            node.name = f"{name}__{k}"
        seen.add(node.name)


# ---------------------------------------------------------------------------------------------
# Counting the norms in a graph


def count_norm_ops(onnx_model_or_path) -> dict[str, int]:
    """Count the normalizations of a graph: native ``LayerNormalization`` / ``RMSNormalization``
    nodes (any domain, so ORT's fused ``SimplifiedLayerNormalization`` is not counted as native
    RMSNormalization) and ``decomposed`` norms recognized from their op pattern.

    A decomposed norm is found from its variance chain: ``ReduceMean(t*t)`` (t squared by
    ``Pow(t, 2)`` or ``Mul(t, t)``) -> ``Add(eps)`` -> ``Sqrt`` -> ``Reciprocal`` then ``Mul``, or
    ``Div``. ``t`` is ``x`` for RMSNorm and ``Sub(x, ReduceMean(x))`` for LayerNorm; both count as
    one decomposed norm. Pure op counts cannot tell a norm from other arithmetic, hence the chain.
    """
    model = onnx_model_or_path if isinstance(onnx_model_or_path, onnx.ModelProto) else onnx.load(str(onnx_model_or_path))
    graph = model.graph
    counts = {key: 0 for key in NORM_OP_KEYS}
    for node in graph.node:
        if node.op_type in ("LayerNormalization", "RMSNormalization") and node.domain in ("", "ai.onnx"):
            counts[node.op_type] += 1
    counts["decomposed"] = len(find_decomposed_norms(graph))
    return counts


def find_decomposed_norms(graph: onnx.GraphProto) -> list[dict]:
    """The decomposed norms of ``graph``: ``{"kind": "rms"|"layer", "nodes": [names of the chain]}``."""
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    constants = _constant_values(graph)

    def only_consumer(tensor: str, op_types: tuple[str, ...]) -> onnx.NodeProto | None:
        users = [n for n in consumers.get(tensor, []) if n.op_type in op_types]
        return users[0] if len(users) == 1 else None

    found = []
    for mean_sq in graph.node:
        if mean_sq.op_type != "ReduceMean" or not mean_sq.input:
            continue
        square = producer.get(mean_sq.input[0])
        base = _squared_tensor(square, constants)
        if base is None:
            continue
        add = only_consumer(mean_sq.output[0], ("Add",))
        if add is None or not any(name in constants for name in add.input):
            continue  # the epsilon must be a constant
        sqrt = only_consumer(add.output[0], ("Sqrt",))
        if sqrt is None:
            continue
        chain = [square, mean_sq, add, sqrt]
        recip = only_consumer(sqrt.output[0], ("Reciprocal",))
        if recip is not None:
            scale = only_consumer(recip.output[0], ("Mul",))
            if scale is None or base not in scale.input:
                continue
            chain += [recip, scale]
        else:
            div = only_consumer(sqrt.output[0], ("Div",))
            if div is None or div.input[0] != base:
                continue
            chain.append(div)
        centered = producer.get(base)
        kind = "rms"
        if centered is not None and centered.op_type == "Sub":
            mean = producer.get(centered.input[1])
            if mean is not None and mean.op_type == "ReduceMean" and mean.input[0] == centered.input[0]:
                kind = "layer"
                chain = [mean, centered] + chain
        found.append({"kind": kind, "nodes": [n.name for n in chain]})
    return found


def _squared_tensor(node: onnx.NodeProto | None, constants: dict[str, np.ndarray]) -> str | None:
    """The tensor ``t`` when ``node`` computes ``t**2`` (``Pow(t, 2)`` or ``Mul(t, t)``)."""
    if node is None:
        return None
    if node.op_type == "Pow" and len(node.input) == 2:
        exponent = constants.get(node.input[1])
        if exponent is not None and exponent.size == 1 and float(exponent.reshape(-1)[0]) == 2.0:
            return node.input[0]
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return node.input[0]
    return None


def _constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers and ``Constant`` node outputs that are small enough to matter (scalars, eps)."""
    values = {}
    for init in graph.initializer:
        if np.prod(init.dims, dtype=np.int64) <= 16:
            values[init.name] = numpy_helper.to_array(init)
        else:
            values[init.name] = np.empty(0)  # a constant all the same; its value is not needed
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
                elif attr.name in ("value_float", "value_int"):
                    values[node.output[0]] = np.asarray(attr.f if attr.name == "value_float" else attr.i)
    return values


def torch_outputs(model, inputs: np.ndarray, batch_size: int = 16) -> list[np.ndarray]:
    """Every output of ``model`` (a module taking int64 windows) on ``inputs``, in batches,
    concatenated: a list even for a single logits tensor."""
    was_training = model.training
    model.eval()
    parts: list[list[np.ndarray]] = []
    try:
        with torch.no_grad():
            for lo in range(0, len(inputs), batch_size):
                out = model(torch.from_numpy(np.ascontiguousarray(inputs[lo:lo + batch_size], dtype=np.int64)))
                out = out if isinstance(out, (tuple, list)) else (out,)
                parts.append([o.float().cpu().numpy() for o in out])
    finally:
        model.train(was_training)
    return [np.concatenate([p[i] for p in parts]) for i in range(len(parts[0]))]


# --------------------------------------------------------------------------------------------
# An ONNX export directory of a zoo model (the layout Optimum's exporter writes), so a zoo run
# can go through the same path as a model exported elsewhere: ``quantnorm export RUN --onnx-dir D``.

ONNX_DIR_MODEL = "model.onnx"
BOS_TOKEN = "<s>"


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what a ByteLevel pre-tokenizer uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json(bos_id: int) -> str:
    """The zoo's vocabulary as a Hugging Face tokenizer: token id = byte value, ``<s>`` = ``bos_id``
    (a byte-level BPE without merges: every byte is its own token, as in ``quantnorm.data``)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ConfigError("--onnx-dir writes a tokenizer.json and needs tokenizers: pip install 'quantnorm[hf]'") \
            from None
    vocab = {char: b for b, char in byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: the text is bytes in order, one token each (a split would change nothing but time).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS_TOKEN])
    if tok.token_to_id(BOS_TOKEN) != bos_id:
        raise ExportError(f"byte tokenizer: {BOS_TOKEN} got id {tok.token_to_id(BOS_TOKEN)}, expected {bos_id}")
    return tok.to_str()


def write_onnx_dir(fp32_onnx: Path, model_config, out_dir: Path, *, placement_note: dict) -> Path:
    """``out_dir`` with ``model.onnx`` (the run's parity-checked FP32 export), ``config.json`` and
    the byte tokenizer. Written into a temporary sibling and renamed into place: a failure leaves
    no half-written directory."""
    import json
    import shutil
    import tempfile

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"--onnx-dir {out_dir} exists and is not empty: give a new directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        shutil.copyfile(fp32_onnx, tmp / ONNX_DIR_MODEL)
        config = {
            "model_type": "quantnorm-zoo", "architectures": ["QuantnormCausalLM"],
            "vocab_size": VOCAB_SIZE, "bos_token_id": BOS, "hidden_size": model_config.d_model,
            "num_hidden_layers": model_config.n_layers, "num_attention_heads": model_config.n_heads,
            "max_position_embeddings": model_config.context, "quantnorm": placement_note,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / "tokenizer.json").write_text(byte_tokenizer_json(BOS), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
            "model_max_length": model_config.context}, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
