"""Local Hugging Face checkpoints: detect the architecture, its placement and norm, and load it.

The detection table (``ARCHITECTURES``) is keyed by ``config.json``'s ``model_type``: adding an
architecture is one entry, not a new ``if`` (DESIGN.md). Each entry says where the norms sit
(``shared/FORMULAS.md``, "Real models, for the loaders") and which HF module plays which role,
because HF's names mislead: ``post_attention_layernorm`` is the *pre-MLP* norm in LLaMA but an
*attention-output* norm in Gemma 2 / OLMo 2.

An architecture outside the table still loads (``generic_spec``): any model transformers builds
without remote code, AutoModelForCausalLM for a ``*ForCausalLM`` and AutoModel for an encoder. The
exported graph then says its placement and norm (``quantnorm.measure.placement``); what a graph
cannot tell, the fold rules of SmoothQuant and the stream rotation (which norm feeds which Linears,
Gemma's ``(1 + w)``), is what the table adds, and without it those recipes are not applicable.

Safety rules (a checkpoint directory is untrusted input, and nothing may be fetched):
- local files only: ``local_files_only=True`` and ``HF_HUB_OFFLINE=1`` for everything we call;
- never ``trust_remote_code`` (a checkpoint that needs custom code is not one we support);
- never unpickle ``.bin`` weights unless the caller says ``allow_pickle=True`` (``--allow-pickle``);
- detection reads ``config.json`` as JSON, so an unsupported or broken directory gets a one-line
  ``ConfigError`` before transformers is imported.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")

NORM_FORMULAS = {
    "layer": "gamma * (x - mean) / sqrt(var + eps) + beta",
    "rms": "w * x / sqrt(mean(x^2) + eps)",
    "rms_1p": "(1 + w) * x / sqrt(mean(x^2) + eps)",
    "unknown": "read from the exported graph",
}
DETECTED = "detected"  # placement/norm of an architecture outside the table: read from the ONNX graph


@dataclass(frozen=True)
class ArchSpec:
    """One row of the detection table.

    ``layers``: attribute path of the block list inside the *base* model (``BertModel``,
    ``LlamaModel``..., i.e. ``model.base_model``); ``norm_roles``: per-block norm module (path
    inside a block) -> what it does; ``final_norm``: path of the norm before the head inside the
    base model (None: none).
    ``rule``: the per-sublayer rule, as FORMULAS.md writes it. ``check``: how the placement is
    verified on the loaded model (see ``verify_placement``).
    """

    model_type: str
    family: str
    kind: str                      # "causal" (next-token logits) | "encoder" (hidden states)
    placement: str                 # post | pre | peri | output-norm (OLMo 2: output norm only)
    norm: str                      # layer | rms
    norm_formula: str              # key of NORM_FORMULAS
    layers: str
    norm_roles: dict[str, str]
    final_norm: str | None
    rule: str
    check: str                     # pre | post | sum_of_norm_outputs
    sublayer_outputs: tuple[str, str] = ("", "")  # (attention output, MLP output) modules of a block
    extras: tuple[str, ...] = ()   # e.g. QK-norm
    notes: str = ""
    qk_norm: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> dict:
        """The detection facts for results.json ``model``."""
        return {
            "family": self.family, "kind": self.kind, "placement": self.placement, "norm": self.norm,
            "norm_formula": NORM_FORMULAS[self.norm_formula], "rule": self.rule,
            "norm_roles": dict(self.norm_roles), "final_norm": self.final_norm,
            "qk_norm": list(self.qk_norm), "notes": self.notes,
        }


_LLAMA_ROLES = {"input_layernorm": "attention input (pre-norm)",
                "post_attention_layernorm": "MLP input (pre-norm; HF's name notwithstanding)"}
_PRE_RMS_RULE = "x = x + F(N(x)), final norm before the head"
# Gemma 2 and 3: placement, norm, formula, layers, roles, final norm, rule, check, sublayer outputs
_GEMMA = ("peri", "rms", "rms_1p", "layers",
          {"input_layernorm": "attention input", "post_attention_layernorm": "attention output, before the add",
           "pre_feedforward_layernorm": "MLP input", "post_feedforward_layernorm": "MLP output, before the add"},
          "norm", "x = x + N_out(F(N_in(x))), norm(x) * (1 + w), final norm before the head",
          "sum_of_norm_outputs", ("post_attention_layernorm", "post_feedforward_layernorm"))

_ARCH_LIST = [
    ArchSpec("gpt2", "GPT-2", "causal", "pre", "layer", "layer", "h",
             {"ln_1": "attention input (pre-norm)", "ln_2": "MLP input (pre-norm)"}, "ln_f",
             "x = x + F(LN(x)), final ln_f before the head", "pre", ("attn.c_proj", "mlp.c_proj")),
    ArchSpec("llama", "LLaMA", "causal", "pre", "rms", "rms", "layers", _LLAMA_ROLES, "norm",
             _PRE_RMS_RULE, "pre", ("self_attn.o_proj", "mlp.down_proj")),
    ArchSpec("mistral", "Mistral", "causal", "pre", "rms", "rms", "layers", _LLAMA_ROLES, "norm",
             _PRE_RMS_RULE, "pre", ("self_attn.o_proj", "mlp.down_proj")),
    ArchSpec("qwen2", "Qwen2", "causal", "pre", "rms", "rms", "layers", _LLAMA_ROLES, "norm",
             _PRE_RMS_RULE, "pre", ("self_attn.o_proj", "mlp.down_proj")),
    ArchSpec("gemma2", "Gemma 2", "causal", *_GEMMA,
             notes="embeddings scaled by sqrt(hidden); attention and final logit soft-capping"),
    ArchSpec("gemma3_text", "Gemma 3 (text-only Gemma3ForCausalLM)", "causal", *_GEMMA,
             notes="embeddings scaled by sqrt(hidden); QK-norm", qk_norm=("self_attn.q_norm", "self_attn.k_norm")),
    ArchSpec("olmo2", "OLMo 2", "causal", "output-norm", "rms", "rms", "layers",
             {"post_attention_layernorm": "attention output, before the add (no input norm)",
              "post_feedforward_layernorm": "MLP output, before the add (no input norm)"},
             "norm", "x = x + N(F(x)) (output norm only), final norm before the head",
             "sum_of_norm_outputs", ("post_attention_layernorm", "post_feedforward_layernorm"),
             notes="QK-norm over the whole q/k projections", qk_norm=("self_attn.q_norm", "self_attn.k_norm")),
    ArchSpec("bert", "BERT", "encoder", "post", "layer", "layer", "encoder.layer",
             {"attention.output.LayerNorm": "after attention + residual (post-norm)",
              "output.LayerNorm": "after MLP + residual (post-norm)"},
             None, "x = LN(x + F(x)), no final norm (the embeddings have their own LayerNorm)", "post",
             ("attention.output.dense", "output.dense"), notes="bidirectional; [CLS] ... [SEP] windows"),
]
ARCHITECTURES: dict[str, ArchSpec] = {a.model_type: a for a in _ARCH_LIST}


GRAPH_DETECTED_FROM = "the ONNX graph (quantnorm.measure.placement)"
TABLE_DETECTED_FROM = "config.json model_type (quantnorm.sources.hf_loader.ARCHITECTURES)"


def generic_spec(config: dict) -> ArchSpec:
    """Any architecture outside the table that transformers loads without remote code: a causal LM
    when ``architectures`` names a ``*ForCausalLM`` (loaded with AutoModelForCausalLM), else an
    encoder (AutoModel, hidden states and a pooled embedding). Its placement and norm are read from
    the exported ONNX graph (quantnorm.measure.placement) and its block list is found at load time;
    the table's fold rules (SmoothQuant, the stream rotation) are unknown for it, so the recipes
    that need one are not applicable. A one-line ConfigError for what the wrappers cannot run:
    no ``model_type``, or an encoder-decoder (its forward needs decoder inputs)."""
    names = [str(a) for a in config.get("architectures") or []]
    model_type = config.get("model_type")
    if not model_type or model_type == "gemma3":
        get_arch(model_type)  # raises the one-line error listing what is supported
    if config.get("is_encoder_decoder"):
        get_arch(model_type, " (an encoder-decoder: its forward needs decoder inputs; --model takes causal LMs "
                             "and encoders)")
    kind = "causal" if any(n.endswith("ForCausalLM") for n in names) else "encoder"
    return ArchSpec(str(model_type), f"{model_type} (not in the loader table)", kind, DETECTED, DETECTED,
                    "unknown", "", {}, None, "read from the exported ONNX graph", "none",
                    notes="architecture outside the loader table: placement and norm detected on the graph; "
                          "no fold rule known (SmoothQuant and the stream rotation are not applicable)")


def supported_architectures() -> str:
    return ", ".join(f"{a.model_type} ({a.placement}/{a.norm})" for a in _ARCH_LIST)


def get_arch(model_type: str | None, hint: str = "") -> ArchSpec:
    """The table entry for ``model_type``; anything else is a one-line ConfigError (``hint``: why)."""
    spec = ARCHITECTURES.get(str(model_type))
    if spec is not None:
        return spec
    if model_type == "gemma3":
        hint = " (multimodal Gemma 3 is not supported; text-only Gemma3ForCausalLM checkpoints are 'gemma3_text')"
    raise ConfigError(f"unsupported architecture {model_type!r}{hint}: --model takes any causal LM or encoder that "
                      f"transformers loads without remote code (its placement read from the exported graph); the "
                      f"loader table adds the fold rules of {supported_architectures()}")


@dataclass(frozen=True)
class CheckpointFiles:
    """What a checkpoint directory holds, found without running any of its code."""

    path: Path
    config: dict
    spec: ArchSpec
    weights: str                   # "safetensors" | "pickle"
    weight_files: tuple[str, ...]
    mlm_head: bool                 # encoders: the checkpoint carries masked-LM head weights
    pooling: str                   # encoders: sentence-transformers pooling mode (mean / cls / max)


def read_config_json(path: Path, layout: str) -> dict:
    """``path/config.json`` as a dict; a one-line ``ConfigError`` when it is missing (``layout``
    says what the directory should hold), unreadable or not a JSON object."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"--model {path}: no config.json ({layout})")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model {path}: config.json is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--model {path}: config.json is not a JSON object")
    return config


def inspect_checkpoint(path: str | Path, *, allow_pickle: bool = False) -> CheckpointFiles:
    """Check a local checkpoint directory and detect its architecture (no transformers import).

    One-line ``ConfigError`` for: not a directory, no or unreadable config.json, an unsupported
    ``model_type``, no weights, only pickled ``.bin`` weights without ``allow_pickle``, no
    tokenizer files.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"--model {path}: not a directory (give a local Hugging Face checkpoint directory)")
    config = read_config_json(path, "a Hugging Face checkpoint directory needs config.json, safetensors weights "
                                    "and tokenizer files")
    if config.get("auto_map"):
        # Custom code would be needed; we never run it (trust_remote_code stays False).
        raise ConfigError(f"--model {path}: config.json has auto_map (custom modeling code); quantnorm never sets "
                          f"trust_remote_code (any causal LM or encoder that transformers itself implements runs)")
    spec = ARCHITECTURES.get(str(config.get("model_type"))) or generic_spec(config)

    safetensors = tuple(n for n in SAFETENSORS_FILES if (path / n).is_file())
    pickled = tuple(n for n in PICKLE_FILES if (path / n).is_file())
    if safetensors:
        weights, weight_files = "safetensors", safetensors
    elif pickled:
        if not allow_pickle:
            raise ConfigError(f"--model {path}: only pickled weights ({', '.join(pickled)}); unpickling can run "
                              f"arbitrary code, so pass --allow-pickle if you trust this checkpoint (or convert it "
                              f"to model.safetensors)")
        weights, weight_files = "pickle", pickled
    else:
        raise ConfigError(f"--model {path}: no weights (expected model.safetensors or model.safetensors.index.json)")
    if not any((path / n).is_file() for n in TOKENIZER_FILES):
        raise ConfigError(f"--model {path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); "
                          f"data is tokenized with the model's own tokenizer")

    # the MLM head's module is BERT's (``cls``): an encoder outside the table is scored on its embeddings
    mlm_head = spec.kind == "encoder" and spec.placement != DETECTED and _has_mlm_head(path, weights, weight_files)
    return CheckpointFiles(path, config, spec, weights, weight_files, mlm_head, pooling_mode(path))


def _safetensors_keys(path: Path, weight_files: tuple[str, ...]) -> list[str]:
    if "model.safetensors.index.json" in weight_files:
        index = json.loads((path / "model.safetensors.index.json").read_text(encoding="utf-8"))
        return list(index.get("weight_map", {}))
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _has_mlm_head(path: Path, weights: str, weight_files: tuple[str, ...]) -> bool:
    """Whether the masked-LM head is stored (``cls.predictions.*``); read from the safetensors
    header only. Pickled checkpoints are not opened here: their head is found at load time."""
    if weights != "safetensors":
        return False
    try:
        keys = _safetensors_keys(path, weight_files)
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the user's to fix; say which
        raise ConfigError(f"--model {path}: cannot read the safetensors header ({exc})") from None
    return any(k.startswith("cls.predictions.") for k in keys)


def pooling_mode(path: Path) -> str:
    """sentence-transformers' pooling (``1_Pooling/config.json``); mean pooling when absent."""
    cfg = path / "1_Pooling" / "config.json"
    if cfg.is_file():
        try:
            pooling = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return "mean"
        for key, mode in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                          ("pooling_mode_max_tokens", "max")):
            if pooling.get(key):
                return mode
    return "mean"


# ---------------------------------------------------------------------------------------------
# Loading (needs the hf extra)


def require_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError("--model needs transformers and tokenizers: pip install 'quantnorm[hf]'") from None
    return transformers


@dataclass
class LoadedCheckpoint:
    files: CheckpointFiles
    model: object                  # the transformers model (eval mode, float32, eager attention)
    tokenizer: object
    base: object                   # the base model inside (LlamaModel, BertModel ...)
    layers: list                   # its blocks
    placement_check: dict

    @property
    def spec(self) -> ArchSpec:
        return self.files.spec

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load_checkpoint(path: str | Path, *, allow_pickle: bool = False) -> LoadedCheckpoint:
    """Load model and tokenizer from local files only, in float32 with eager attention (the
    reference implementation, which also returns attention probabilities for the probe)."""
    files = inspect_checkpoint(path, allow_pickle=allow_pickle)
    transformers = require_transformers()
    import torch

    spec = files.spec
    common = {"local_files_only": True, "trust_remote_code": False}
    if spec.kind == "causal":
        cls = transformers.AutoModelForCausalLM
    elif files.mlm_head:
        cls = transformers.AutoModelForMaskedLM
    else:
        cls = transformers.AutoModel
    quiet = quiet_transformers(transformers)
    try:
        with quiet:
            model = cls.from_pretrained(str(files.path), attn_implementation="eager",
                                        use_safetensors=files.weights == "safetensors",
                                        **dtype_kwarg(transformers, torch.float32), **common)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; one line for the user
        raise ConfigError(f"--model {files.path}: transformers cannot load the weights: {one_line(exc)}") from None
    tokenizer = load_tokenizer(files.path)
    model.eval()
    _conv1d_to_linear(model)
    base = model.base_model
    if not spec.layers:  # outside the table: the block list is the ModuleList of num_hidden_layers
        spec = _with_block_list(spec, base, model.config)
        files = replace(files, spec=spec)
    try:
        layers = list(base.get_submodule(spec.layers))
    except AttributeError:
        raise ConfigError(f"--model {files.path}: no block list at {spec.layers!r}; is this really a "
                          f"{spec.family} checkpoint?") from None
    loaded = LoadedCheckpoint(files, model, tokenizer, base, layers, {})
    loaded.placement_check = verify_placement(loaded)
    return loaded


def load_tokenizer(path: Path):
    """The directory's tokenizer, from local files, never running remote code."""
    transformers = require_transformers()
    try:
        with quiet_transformers(transformers):
            return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                              trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; one line for the user
        raise ConfigError(f"--model {path}: cannot load the tokenizer: {one_line(exc)}") from None


def _with_block_list(spec: ArchSpec, base, config) -> ArchSpec:
    from torch import nn

    n = getattr(config, "num_hidden_layers", None)
    for name, module in base.named_modules():
        if isinstance(module, nn.ModuleList) and name and (n is None or len(module) == n):
            return replace(spec, layers=name)
    raise ConfigError(f"{spec.model_type}: no block list (an nn.ModuleList of {n} blocks) in the base model")


def dtype_kwarg(transformers, dtype) -> dict:
    """transformers 5 calls it ``dtype``; 4.x ``torch_dtype`` (a real checkpoint is often bf16 on disk)."""
    major = int(str(transformers.__version__).split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


class quiet_transformers:
    """Silence transformers' info/warning chatter (load reports, generation config notes)."""

    def __init__(self, transformers):
        self.logging = transformers.utils.logging

    def __enter__(self):
        self.level = self.logging.get_verbosity()
        self.logging.set_verbosity_error()
        self.progress = self.logging.is_progress_bar_enabled()
        self.logging.disable_progress_bar()

    def __exit__(self, *exc):
        self.logging.set_verbosity(self.level)
        if self.progress:
            self.logging.enable_progress_bar()


def one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(exc).__name__


def _conv1d_to_linear(model) -> None:
    """GPT-2's ``Conv1D`` (``x @ W + b`` with W as [in, out]) -> an equal ``nn.Linear``.

    ``Conv1D`` exports as ``Gemm`` on a flattened input, which the weight-MatMul recipes do not
    quantize; ``nn.Linear`` exports as ``MatMul`` + ``Add`` like every other architecture, and
    the probe and SQNR see the same module kinds everywhere. Exact: the weight is transposed.
    """
    import torch
    from torch import nn

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - very old or very new transformers
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, Conv1D):
            linear = nn.Linear(module.weight.shape[0], module.weight.shape[1], bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(module.weight.T)
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)


# ---------------------------------------------------------------------------------------------
# Verifying the detected placement on the loaded model


def verify_placement(loaded: LoadedCheckpoint, seq: int = 8) -> dict:
    """Check the table's placement on block 0 of the loaded model with forward hooks.

    - ``pre``: the attention-input norm reads the block input (the residual stream), and the
      block output is ``x + attn_out + mlp_out`` (no norm on the stream);
    - ``post``: the block output *is* the output of the block's last norm;
    - ``sum_of_norm_outputs`` (peri, OLMo 2's output norm): the block output is
      ``x + N_attn_out + N_mlp_out``, the two output norms' outputs added to the stream.
    Returns ``{"verified": bool, "check": ..., "max_abs_error": ...}``; a mismatch is reported
    (results and report), not raised: the numbers are still measured on the real model.
    """
    import torch

    spec = loaded.spec
    if spec.check == "none":
        return {"verified": False, "check": "none", "label": "read from the graph",
                "reason": "architecture outside the loader table: no module-level check; placement read from the graph"}
    block = loaded.layers[0]
    norm_names = list(spec.norm_roles)
    captured: dict[str, tuple] = {}
    handles = []

    def grab(name):
        def hook(mod, args, out):
            captured[name] = (args[0] if args else None, out[0] if isinstance(out, tuple) else out)
        return hook

    wanted = {"block": block}
    for name in norm_names + [n for n in spec.sublayer_outputs if n]:
        try:
            wanted[name] = block.get_submodule(name)
        except AttributeError:
            return {"verified": False, "check": spec.check, "reason": f"block 0 has no module {name!r}"}
    for name, module in wanted.items():
        handles.append(module.register_forward_hook(grab(name)))
    vocab = int(getattr(loaded.model.config, "vocab_size", 2) or 2)
    ids = torch.arange(seq, dtype=torch.int64)[None] % max(vocab, 1)
    try:
        with torch.no_grad():
            loaded.model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    x_in, x_out = captured["block"]
    if x_in is None:  # called with keyword arguments only: the input is the embedding output
        return {"verified": False, "check": spec.check, "reason": "block input not visible to hooks"}

    def err(a, b) -> float:
        return float((a.double() - b.double()).abs().max())

    scale = float(x_out.abs().max()) or 1.0
    if spec.check == "pre":
        attn_out = captured[spec.sublayer_outputs[0]][1]
        mlp_out = captured[spec.sublayer_outputs[1]][1]
        reads_stream = err(captured[norm_names[0]][0], x_in)
        sum_err = err(x_in + attn_out + mlp_out, x_out)
        error = max(reads_stream, sum_err)
        detail = "input norm reads the stream; block output = x + attn_out + mlp_out"
    elif spec.check == "post":
        error = err(captured[norm_names[-1]][1], x_out)
        detail = f"block output = output of {norm_names[-1]}"
    else:
        a, m = (captured[n][1] for n in spec.sublayer_outputs)
        error = err(x_in + a + m, x_out)
        detail = f"block output = x + {spec.sublayer_outputs[0]} + {spec.sublayer_outputs[1]} (norm outputs)"
        if "input_layernorm" in captured:  # peri: the input norm reads the stream as well
            error = max(error, err(captured["input_layernorm"][0], x_in))
            detail = "input norm reads the stream; " + detail
    ok = error <= 1e-4 * max(1.0, scale)
    return {"verified": bool(ok), "check": spec.check, "detail": detail, "max_abs_error": error}
