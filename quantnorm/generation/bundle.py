"""A run's with-past model as a directory a generation runtime loads (``quantnorm bundle``).

``write_bundle(run_dir, recipe, out_dir)`` writes::

    model.onnx               the recipe's with-past graph (``model.onnx.data`` beside it past 2 GB)
    prompt.onnx              a split deployment's prompt graph (``W+prefill-P``: model.onnx is W's)
    genai_config.json        what ONNX Runtime GenAI reads to load and drive it
    config.json              the checkpoint's
    generation_config.json   the checkpoint's, or one made from config.json's special token ids
    tokenizer files          tokenizer.json, tokenizer_config.json, ... as the checkpoint has them
    report.md, results.json  the run's, unchanged
    quantnorm_bundle.json    which run, recipe and graph this is (and marks the directory a bundle)

``genai_config.json`` follows ONNX Runtime GenAI's schema (its ``src/config.cpp``, and the model
builder's ``make_genai_config``, which writes it for the graphs it builds). What differs from a
builder's config, and why:

- ``model.type`` is ``"decoder"``, the runtime's generic decoder-only model: the graph is
  quantnorm's, not the builder's, so no architecture's special handling (GPT-2's combined past,
  Phi-3's own rules) may apply to it;
- ``search.past_present_share_buffer`` is false: the graph concatenates the past and the new keys
  into a fresh present each step (decode.py), so the runtime feeds each present back as the next
  past instead of binding one buffer of the full length to both;
- ``context_length`` and ``search.max_length`` are the longest past + sequence the graph is
  exact for (its ``quantnorm.max_length`` metadata: the positions, or one less than a sliding
  window), so the runtime never asks for a length the graph was not proved at;
- the inputs are the graph's own: ``attention_mask`` and ``position_ids`` only where it has them;
- a split deployment is the runtime's ``"decoder-pipeline"``: two pipeline models over one KV
  cache the runtime owns, the prompt graph with ``run_on_prompt`` only and the token graph with
  ``run_on_token_gen`` only (its ``decoder_only_pipeline.cpp``: a step of more than one new
  token is the prompt, the rule ``DecodeSession`` follows), each naming its inputs and outputs.

The bundle is built in a temporary directory beside ``out_dir`` and renamed into place, so a
failure leaves nothing; every check (the run, the recipe, its graph, the tokenizer, the output
directory) runs before anything is written.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort

from .. import __version__
from ..errors import ConfigError, RunDirError
from ..fileio import onnx_needs_external_data, save_onnx
from ..onnx_wire import external_data_locations
from ..portable import PKG_PREFIX, resolve_arg
from ..providers import CPU
from ..results import HF_PREFIX, GenerationModel, generation_models, recipes, source_kind
from ..results import load as load_results
from ..runs import REPORT_FILE, RESULTS_FILE
from ..unsigned_weights import has_signed_weight_ops, signed_weight_slots, to_unsigned
from .decode import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    POSITION_IDS,
    PastLayout,
    check_one_cache,
    past_names,
    present_names,
)

AUTO = "auto"
AUTO_PREFIX = "auto:"        # the search's pick: the recipe entry ``auto:<recipe>`` (evaluate.run_search)
FP32 = "fp32"
MODEL_FILE = "model.onnx"
PROMPT_MODEL_FILE = "prompt.onnx"   # a split deployment's prompt graph, beside the token graph's model.onnx
GENAI_CONFIG_FILE = "genai_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "quantnorm_bundle.json"
# Where a GGUF run keeps the checkpoint it dequantized (sources.gguf.CHECKPOINT_DIR; a stage may
# not import a source, so the name is repeated here and a test holds the two equal).
GGUF_CHECKPOINT_DIR = "checkpoint"
# A tokenizer a runtime reads: any one of these (sets of files) is enough ...
TOKENIZER_MODELS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
# ... and these are copied beside it where the checkpoint has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Bundle:
    path: Path
    name: str                 # the generation model bundled: a recipe, "auto:<recipe>" or "fp32"
    files: list[str]
    genai_config: dict
    int8_weights: str | None = None   # the manifest's word on the int8 weight codes (None: the graphs have none)


def write_bundle(run_dir: str | os.PathLike, recipe: str, out_dir: str | os.PathLike, *,
                 force: bool = False, unsigned_int8: bool = False) -> Bundle:
    """Bundle ``recipe``'s with-past model of the run at ``run_dir`` into ``out_dir`` (see the
    module doc). ``recipe``: a recipe the run has a with-past graph of, ``auto`` (the search's
    pick) or ``fp32``. ``force``: replace an earlier bundle at ``out_dir`` (a non-empty directory
    that is not a bundle is never replaced). ``unsigned_int8``: int8 weight codes multiplied with
    uint8 activations stored as uint8 (``unsigned_weights``: exact on CPUs without VNNI too, where
    ONNX Runtime's u8 x s8 kernel saturates; slower on VNNI CPUs). Bad input is a one-line QuantnormError, before
    anything is written."""
    run_dir, out_dir = Path(run_dir), Path(os.path.abspath(out_dir))   # abspath: "." has no name to rename
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory: give a run directory written by `quantnorm evaluate`")
    results = load_results(run_dir)
    model = pick_model(results, recipe, run_dir)
    graph = run_dir / model.path
    layout, inputs = _check_graph(graph, model.name)
    prompt_graph, pipeline = None, None
    if model.entry.get("prompt_path"):
        prompt_graph = run_dir / model.entry["prompt_path"]
        prompt_layout, prompt_inputs = _check_graph(prompt_graph, f"{model.name} (its prompt graph)")
        check_one_cache(layout, prompt_layout)
        pipeline = {PROMPT_MODEL_FILE: prompt_inputs, MODEL_FILE: inputs}
    checkpoint = checkpoint_dir(results, run_dir)
    config = _read_json(checkpoint / CONFIG_FILE, "the checkpoint's config")
    generation = _read_json(checkpoint / GENERATION_CONFIG_FILE, "the checkpoint's generation config") \
        if (checkpoint / GENERATION_CONFIG_FILE).is_file() else None
    tokenizer = tokenizer_files(checkpoint)
    _check_out_dir(out_dir, run_dir, force)
    genai = genai_config(config, layout, inputs, generation, pipeline=pipeline)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}-", suffix=".tmp", dir=out_dir.parent))
    try:
        signed = _copy_model(graph, tmp / MODEL_FILE, unsigned_int8)
        if prompt_graph is not None:
            signed += _copy_model(prompt_graph, tmp / PROMPT_MODEL_FILE, unsigned_int8)
        int8_weights = None if not signed else (
            f"uint8 (code + 128): {signed} products rewritten, exact on every CPU" if unsigned_int8 else
            f"int8: {signed} products exact on CPUs with VNNI only (ONNX Runtime's u8 x s8 kernel saturates "
            "without it); `quantnorm bundle --int8-weights unsigned` stores them for every CPU")
        for name in (CONFIG_FILE, *tokenizer):
            shutil.copyfile(checkpoint / name, tmp / name)
        if generation is not None:
            shutil.copyfile(checkpoint / GENERATION_CONFIG_FILE, tmp / GENERATION_CONFIG_FILE)
        else:
            _write_json(tmp / GENERATION_CONFIG_FILE, generation_config(config))
        for name in (RESULTS_FILE, REPORT_FILE):
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, tmp / name)
        _write_json(tmp / GENAI_CONFIG_FILE, genai)
        _write_json(tmp / MANIFEST_FILE, {"quantnorm_version": __version__, "run": run_dir.resolve().name,
                                          "model": model.name,
                                          "status": model.status, "graph": model.path, "file": MODEL_FILE,
                                          "max_length": genai["model"]["context_length"],
                                          **({"prompt_file": PROMPT_MODEL_FILE, "split": model.entry["split"],
                                              "prompt_graph": model.entry["prompt_path"]} if pipeline else {}),
                                          **({"int8_weights": int8_weights} if int8_weights else {}),
                                          "runtime": "onnxruntime-genai (genai_config.json)"})
        files = sorted(p.name for p in tmp.iterdir())
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Bundle(out_dir, model.name, files, genai, int8_weights)


# ---------------------------------------------------------------------------------------------
# What to bundle


def pick_model(results: dict, recipe: str, run_dir: Path) -> GenerationModel:
    """The generation model ``recipe`` names (``auto``: the search's pick), checked: the run has
    it, its with-past graph was made (status ok) and its file exists."""
    models = generation_models(results)
    if not models:
        raise ConfigError(f"{run_dir} has no generation results (no with-past graphs): run `quantnorm evaluate` "
                          f"with generation on a causal checkpoint first")
    by_name = {m.name: m for m in models if isinstance(m.name, str)}
    have = [name for name, m in by_name.items() if m.ok and m.path]
    name = recipe
    if recipe == AUTO:
        picks = [r.name for r in recipes(results) if isinstance(r.name, str) and r.name.startswith(AUTO_PREFIX)]
        if not picks:
            raise ConfigError(f"--recipe auto: {run_dir} has no search pick (it ran without --recipes auto); "
                              f"with-past graphs: {', '.join(have) or 'none'}")
        # the generation model of the pick carries the recipe entry's name; "auto" alone is accepted too
        name = picks[0] if picks[0] in by_name or AUTO not in by_name else AUTO
    model = by_name.get(name)
    if model is None:
        known = [r.name for r in recipes(results)]
        why = "has no with-past graph" if name in known else "is not a recipe of this run"
        raise ConfigError(f"--recipe {recipe}: {name} {why}; the run's with-past graphs: {', '.join(have) or 'none'}")
    if not model.ok or not model.path:
        raise ConfigError(f"--recipe {recipe}: the with-past graph of {name} is {model.status}; "
                          f"the run's usable ones: {', '.join(have) or 'none'}")
    if isinstance(model.entry.get("one_row"), dict):
        first = model.entry["one_row"].get("recipe")
        raise ConfigError(f"--recipe {recipe}: its token graph is exact for steps of one row only, and ONNX Runtime "
                          f"GenAI's pipeline would run it for a batch of sequences too: bundle --recipe {first}")
    split = isinstance(model.entry.get("split"), dict)
    if split and not model.entry.get("prompt_path"):
        raise ConfigError(f"--recipe {recipe}: {run_dir / RESULTS_FILE} names no prompt graph for this split "
                          f"deployment: run `quantnorm evaluate` again")
    for path, what in [(model.path, "with-past graph"), *([(model.entry["prompt_path"], "prompt graph")] if split
                                                         else [])]:
        if not (run_dir / path).is_file():
            raise ConfigError(f"--recipe {recipe}: {run_dir / path} (the {what} of {name}) is missing: "
                              f"run `quantnorm evaluate` again")
    return model


def _check_graph(path: Path, name: str) -> tuple[PastLayout, set[str]]:
    """The graph's cache layout and input names, read by loading it in ONNX Runtime (what the
    bundle's runtime will do)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3   # errors only (the optional logits_to_keep input draws a warning)
    try:
        session = ort.InferenceSession(str(path), options, providers=[CPU])
    except Exception as exc:  # noqa: BLE001 - ORT raises several types; the user needs its words
        raise ConfigError(f"the with-past graph of {name} ({path}) does not load in ONNX Runtime: "
                          f"{' '.join(str(exc).split())[:240]}") from None
    layout = PastLayout.of_session(session, f"the with-past graph of {name} ({path.name})")
    return layout, {i.name for i in session.get_inputs()}


def checkpoint_dir(results: dict, run_dir: Path) -> Path:
    """The checkpoint directory the run was made from (its config.json and tokenizer): a Hugging
    Face directory, a GGUF run's dequantized checkpoint, or an ONNX export directory."""
    kind = source_kind(results, str(run_dir / RESULTS_FILE))
    source = (results.get("model") or {}).get("source")
    if kind is None:
        raise ConfigError(f"{run_dir / RESULTS_FILE} does not say which checkpoint the run was made from "
                          f"(no model.source)")
    if kind == "trained":
        raise ConfigError(f"{run_dir} is a zoo run: its model reads raw bytes and has no tokenizer a runtime can "
                          f"read, so it cannot be bundled (bundle a --model checkpoint's run)")
    if kind == "gguf":
        path = run_dir / GGUF_CHECKPOINT_DIR
    elif isinstance(source, str):
        path = _recorded_path(source[len(HF_PREFIX):], run_dir)
    elif isinstance(source.get("path"), str):
        path = _recorded_path(source["path"], run_dir)
    else:
        raise ConfigError(f"{run_dir / RESULTS_FILE}: model.source of kind {kind} has no path to its checkpoint")
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(f"the run's checkpoint {path} is gone or has no {CONFIG_FILE}: the bundle copies its "
                          f"config and tokenizer from there")
    return path


def _recorded_path(recorded: str, run_dir: Path) -> Path:
    """A path as results.json records it (portable.portable_path): packaged or run-relative."""
    if recorded.startswith(PKG_PREFIX):
        return Path(resolve_arg(recorded))
    path = Path(recorded)
    return path if path.is_absolute() else run_dir / path


def tokenizer_files(checkpoint: Path) -> list[str]:
    """The tokenizer files to copy; a ConfigError when the checkpoint has no tokenizer model."""
    if not any(all((checkpoint / f).is_file() for f in files) for files in TOKENIZER_MODELS):
        wanted = " or ".join(" + ".join(files) for files in TOKENIZER_MODELS)
        raise ConfigError(f"the checkpoint {checkpoint} has no tokenizer ({wanted}): a bundle needs the tokenizer "
                          f"a runtime reads; add the tokenizer files to the checkpoint directory")
    return [f for f in TOKENIZER_FILES if (checkpoint / f).is_file()]


def _check_out_dir(out_dir: Path, run_dir: Path, force: bool) -> None:
    out, run = out_dir.resolve(), run_dir.resolve()
    if out == run or run.is_relative_to(out):
        raise ConfigError(f"--out {out_dir} is the run directory or holds it: give a directory of its own")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is an existing file: give a directory path")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not (out_dir / MANIFEST_FILE).is_file():
        raise ConfigError(f"--out {out_dir} is a non-empty directory that is not a bundle: give a new or empty "
                          f"directory (--force replaces only an earlier bundle)")
    if not force:
        raise ConfigError(f"--out {out_dir} already holds a bundle: pass --force to replace it")


# ---------------------------------------------------------------------------------------------
# What the runtime reads


def _text_config(config: dict) -> dict:
    nested = config.get("text_config")
    return {**nested, **{k: v for k, v in config.items() if k not in nested}} if isinstance(nested, dict) else config


def special_tokens(config: dict) -> dict:
    """bos/eos/pad ids of a config.json (or a generation_config.json), the ones it states."""
    config = _text_config(config)
    return {key: config[key] for key in SPECIAL_TOKENS if config.get(key) is not None}


def generation_config(config: dict) -> dict:
    """A minimal generation_config.json for a checkpoint that has none: its special token ids."""
    return {**special_tokens(config), "do_sample": False, "_from_model_config": True}


def genai_config(config: dict, layout: PastLayout, inputs: set[str],
                 generation: dict | None = None, *, pipeline: dict[str, set[str]] | None = None) -> dict:
    """ONNX Runtime GenAI's genai_config.json for the graph (see the module doc for the choices);
    ``pipeline``: a split deployment's two files (``PROMPT_MODEL_FILE``, ``MODEL_FILE``) and each
    graph's input names."""
    text = _text_config(config)
    positions = text.get("max_position_embeddings") or text.get("n_positions")
    context = layout.max_length or positions
    if not context:
        raise ConfigError("the with-past graph states no maximum length and config.json no "
                          "max_position_embeddings: the runtime needs a context length")
    tokens = {**special_tokens(config), **special_tokens(generation or {})}
    eos = tokens.get("eos_token_id")
    first_eos = eos[0] if isinstance(eos, list) and eos else eos
    if tokens.get("pad_token_id") is None and first_eos is not None:
        tokens["pad_token_id"] = first_eos   # what the model builder does: padding is masked anyway
    graph_inputs = {INPUT_IDS: INPUT_IDS, **{n: n for n in (ATTENTION_MASK, POSITION_IDS) if n in inputs},
                    "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    # the cache's shape from the graph itself; the model's sizes from config.json where it states them
    sizes = {"hidden_size": text.get("hidden_size") or text.get("n_embd"),
             "num_attention_heads": text.get("num_attention_heads") or text.get("n_head")}
    decoder = {"session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
               "filename": MODEL_FILE, "head_size": layout.head_dim, "inputs": graph_inputs,
               "outputs": {"logits": LOGITS, "present_key_names": "present.%d.key",
                           "present_value_names": "present.%d.value"},
               **{key: int(value) for key, value in sizes.items() if value},
               "num_hidden_layers": layout.n_layers, "num_key_value_heads": layout.kv_heads}
    model = {**tokens, "context_length": int(context), "decoder": decoder, "type": "decoder"}
    if pipeline:
        del decoder["filename"]
        decoder["pipeline"] = [{name: _pipeline_model(file, pipeline[file], layout.n_layers, prompt=name == "prompt")}
                               for name, file in (("prompt", PROMPT_MODEL_FILE), ("tokens", MODEL_FILE))]
        model["type"] = "decoder-pipeline"
    if text.get("vocab_size"):
        model["vocab_size"] = int(text["vocab_size"])
    search = {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
              "max_length": int(context), "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
              "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
              "temperature": 1.0, "top_k": 50, "top_p": 1.0}
    return {"model": model, "search": search}


def _pipeline_model(file: str, inputs: set[str], n_layers: int, *, prompt: bool) -> dict:
    """One model of a ``decoder-pipeline``: its file, the names it reads and writes (the runtime binds
    the shared cache by these), and the phase it runs in."""
    feeds = [INPUT_IDS, *(n for n in (ATTENTION_MASK, POSITION_IDS) if n in inputs)]
    return {"filename": file, "inputs": feeds + past_names(n_layers), "outputs": [LOGITS, *present_names(n_layers)],
            "run_on_prompt": prompt, "run_on_token_gen": not prompt}


# ---------------------------------------------------------------------------------------------
# Files


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} ({what}) cannot be read: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} ({what}) is not a JSON object")
    return data


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _copy_model(src: Path, dst: Path, unsigned_int8: bool) -> int:
    """The graph as ``dst``: a plain copy, or, where its weights pass the external-data threshold
    (or it keeps them outside already) or ``unsigned_int8`` rewrites them, loaded and saved again
    (past the threshold with its weights in ``<dst>.data``). Returns how many integer products
    read int8 weight codes in ``src`` (rewritten with ``unsigned_int8``)."""
    model = None
    signed = 0
    if has_signed_weight_ops(src):
        model = onnx.load(str(src))
        signed = to_unsigned(model) if unsigned_int8 else len(signed_weight_slots(model))
    if not (signed and unsigned_int8) and not external_data_locations(src) and not onnx_needs_external_data(src):
        shutil.copyfile(src, dst)
    else:
        save_onnx(model if model is not None else onnx.load(str(src)), dst)
    return signed


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` onto ``out_dir``; an earlier bundle (or an empty directory)
    there is moved aside first and removed once the new one is in place."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}-old-", suffix=".tmp", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if old is not None:   # put the earlier bundle back
            os.replace(old / out_dir.name, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
