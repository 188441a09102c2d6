"""The Hugging Face source: a local checkpoint directory, or a GGUF file dequantized into one.

load (local files only, ``quantnorm.sources.hf_loader``) -> tokenize the corpus splits with the model's own
tokenizer -> export the wrapper with the parity gate. Accuracy is token-level for causal LMs (PPL
ratio, KL, top-1 over next tokens) and embedding agreement for encoders (plus the masked positions
for an encoder with an MLM head). SmoothQuant recipes smooth the checkpoint with the zoo's fold
rule (``quantnorm.sources.hf_fold`` says how, ``quantnorm.transforms.smoothquant`` does it);
rotation recipes rotate it (``quantnorm.transforms.rotation``).
``--recipes auto`` scores trials over tokens: next tokens for causal LMs, the masked positions
for MLM encoders; an encoder without an MLM head has no perplexity to target and is refused.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import BUILTIN_PYDOC
from ..errors import ConfigError
from ..generation.decode import CHECKPOINT_VALUES, VALUE_CACHE_KEY
from ..generation.with_past import HFWithPast, WithPastSource, export_with_past, parity_prompts
from ..measure.scoring import Scoring
from ..portable import portable_path
from ..runs import PAST_SUFFIX, check_out_dir, past_file
from ..transforms.rotation import rotate_and_export, rotated_copy, rotated_onnx_file
from ..transforms.smoothquant import smooth_and_export, smooth_by_rules
from ..transforms.variants import FP32Variants
from .base import SearchScoring, SourceData, TorchChecks
from .gguf import gguf_checkpoint, resolve_gguf
from .hf_export import export_hf_onnx, make_wrapper, output_names
from .hf_fold import fold_rules, missing_fold_rule
from .hf_loader import DETECTED, GRAPH_DETECTED_FROM, NORM_FORMULAS, TABLE_DETECTED_FROM, load_checkpoint
from .tokenized import AUTO_EVAL_WINDOWS, mlm_windows, prepare_hf_data


@dataclass(frozen=True)
class HFOptions:
    """What to load and which text to use; the CLI builds it from --model and friends."""

    path: Path
    allow_pickle: bool = False
    corpus: str = BUILTIN_PYDOC
    window: int = 128                 # tokens per window (--context)
    max_eval_windows: int | str | None = AUTO_EVAL_WINDOWS  # "auto": hf.data.default_eval_windows
    out_dir: Path | None = None
    # Where the checkpoint came from when it is not a plain directory (a GGUF file): the
    # ``model.source`` object of results.json (RESULTS.md additions). None: ``hf:<path>``.
    provenance: dict | None = None
    gguf: Path | None = None          # the GGUF file the checkpoint was dequantized from (engines run it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.window < 3:
            raise ConfigError(f"--context (the window in tokens) must be >= 3 for --model, got {self.window}")
        if self.max_eval_windows not in (None, AUTO_EVAL_WINDOWS) and self.max_eval_windows < 2:
            raise ConfigError(f"evaluation windows must be >= 2, got {self.max_eval_windows}")


def token_namer(tokenizer, windows: np.ndarray):
    """``name(sample, position)``: the token at a probe entry, so "position 0" reads as ``<s>``."""
    def name(sample: int, position: int) -> str | None:
        try:
            return str(tokenizer.convert_ids_to_tokens(int(windows[sample, position])))
        except Exception:  # noqa: BLE001 - a label only; never fail the probe for it
            return None
    return name


def default_out_dir(model_path: Path, prefix: str = "hf") -> Path:
    path = Path(model_path).resolve()
    name = path.parent.name if path.name in ("model", "checkpoint", "") and path.parent.name else path.name
    return Path("runs") / f"{prefix}-{name}"


def max_positions_of(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_search_supported(searches: bool, kind: str, mlm_head: bool, path) -> None:
    """``auto`` needs a perplexity to target: causal LMs, or encoders with an MLM head."""
    if searches and kind == "encoder" and not mlm_head:
        raise ConfigError(f"--recipes auto needs a perplexity to target, and {path} is an encoder without an MLM "
                          f"head: run the static-*/dynamic/smoothquant recipes and read the embedding metrics")


def token_scoring(kind: str, data: SourceData, mlm, batch_size: int) -> Scoring:
    """What a checkpoint's or an ONNX export's models are scored on: next tokens, or an encoder's
    embeddings (with the masked positions when it has an MLM head)."""
    if kind == "causal":
        return Scoring("token", data.eval_inputs, data.eval_targets, batch_size)
    return Scoring("embedding", data.eval_inputs, None, batch_size, mlm=mlm)


def token_search_scoring(kind: str, data: SourceData, mlm) -> SearchScoring:
    if kind == "causal":
        return SearchScoring(data.eval_inputs, data.eval_targets, "token",
                             "1/ppl_ratio over next tokens (higher is better; FP32 baseline 1)")
    masked, scored = mlm  # encoders with an MLM head (checked in prepare): score the masked positions
    return SearchScoring(masked, np.where(scored, data.eval_inputs, -1), "token",
                         "1/ppl_ratio over the masked positions of the MLM windows (higher is better; FP32 baseline 1)")


def hf_data(data, mlm) -> SourceData:
    """``SourceData`` of ``quantnorm.sources.tokenized.HFData`` (with the MLM protocol when scored)."""
    describe = data.describe()
    if mlm is not None:
        describe["mlm"] = {"mask_fraction": 0.15, "seed": 0, "n_scored": int(mlm[1].sum()),
                           "rule": "fixed seeded 15% of inner positions replaced by [MASK]"}
    return SourceData(data.window, data.eval_inputs, data.eval_targets, data.calib_inputs, describe)


class HFSource:
    def __init__(self, opts: HFOptions):
        self.opts = opts
        self.run_dir = check_out_dir(opts.out_dir or default_out_dir(opts.path))

    def prepare(self, cfg) -> None:
        self.loaded = load_checkpoint(self.opts.path, allow_pickle=self.opts.allow_pickle)
        spec, config = self.loaded.spec, self.loaded.model.config
        self.kind, self.table_placement = spec.kind, spec.placement
        check_search_supported(cfg.searches, spec.kind, self.loaded.files.mlm_head, self.opts.path)
        self.max_positions = max_positions_of(config)
        self.hf_data = prepare_hf_data(self.loaded.tokenizer, config, spec.kind, corpus=self.opts.corpus,
                                       window=self.opts.window, calib_samples=cfg.calib_samples,
                                       max_eval_windows=self.opts.max_eval_windows, model_path=self.opts.path,
                                       max_positions=self.max_positions)
        special = self.hf_data.special
        self.mlm = (mlm_windows(self.hf_data.eval_inputs, special.mask)
                    if self.loaded.files.mlm_head and special.mask is not None else None)
        self.data = hf_data(self.hf_data, self.mlm)
        self.wrapper = make_wrapper(self.loaded)
        self.n_params = int(self.loaded.n_params())
        self.outputs = output_names(spec.kind, self.loaded.files.mlm_head)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def export(self, fp32_path: Path, cfg) -> dict:
        exported = export_hf_onnx(self.wrapper, fp32_path, self.data.eval_inputs[: cfg.parity_windows],
                                  outputs=self.outputs, max_positions=self.max_positions, opset=cfg.opset)
        # The recipes, the probe and the measurements read the ONNX graph: the torch weights (1 GB
        # for Gemma 3 270M) are let go until a transform or the FP16 check needs them again (each
        # lets them go again).
        self.release_weights()
        return exported.to_dict(self.run_dir)

    def release_weights(self) -> None:
        """Move the torch weights to the meta device (their memory is freed); ``weights()`` reloads."""
        if self.wrapper is not None:
            self.loaded.model.to("meta")
            self.wrapper = None

    @contextmanager
    def weights_for_one_export(self):
        """``weights()`` for one transformed export, let go after it: the quantizer and the scoring
        that follow read the file, and reloading for the next transform costs seconds."""
        try:
            yield self.weights()
        finally:
            self.release_weights()

    def reloaded_wrapper(self):
        """The export wrapper with the checkpoint's own weights, reloaded (the ones held are let go:
        a transform may have changed them in place)."""
        self.release_weights()
        return self.weights()[1]

    def weights(self):
        """(LoadedCheckpoint, export wrapper) with real weights: reloaded from the checkpoint
        directory when ``release_weights`` let them go."""
        if self.wrapper is None:
            self.loaded = load_checkpoint(self.opts.path, allow_pickle=self.opts.allow_pickle)
            self.wrapper = make_wrapper(self.loaded)
        return self.loaded, self.wrapper

    def transforms(self, cfg) -> FP32Variants:
        """One smoothed export per alpha (this checkpoint's fold rules) and one rotated export per
        form, each made on first use from the weights (reloaded if the export let them go)."""
        parity = self.data.eval_inputs[: cfg.parity_windows]
        shape = {"outputs": self.outputs, "max_positions": self.max_positions, "opset": cfg.opset}

        def smooth(alpha: float, path: Path):
            with self.weights_for_one_export() as (loaded, wrapper):
                return smooth_and_export(wrapper, fold_rules(loaded.spec), self.data.calib_inputs, parity, path,
                                         alpha=alpha, **shape)

        def rotate(recipe):   # in place: the original weights are reloaded for the second gate
            with self.weights_for_one_export() as (loaded, wrapper):
                return rotate_and_export(loaded, wrapper, parity, self.run_dir / rotated_onnx_file(recipe.rotation),
                                         form=recipe.rotation, reload_original=self.reloaded_wrapper, **shape)
        spec = self.loaded.spec   # the table row: a recipe without a fold rule is refused before any reload
        return FP32Variants(self.run_dir, smooth=smooth, rotate=rotate,
                            refuse=lambda recipe: missing_fold_rule(spec, recipe))

    def with_past(self, cfg) -> WithPastSource:
        """The with-past graphs of a causal checkpoint: the model through transformers' own cache,
        its smoothed copies (this checkpoint's fold rules) and its rotated ones, each made from the
        weights (reloaded if the export let them go) on first use."""
        if self.kind != "causal":
            raise ConfigError(f"{self.loaded.spec.model_type} is an encoder: it embeds a whole text at once and "
                              f"generates nothing, so it has no KV cache to decode with")
        prompts = parity_prompts(self.data.eval_inputs, self.max_positions, cfg.parity_windows)

        def export(wrapper, path: Path, values: str = CHECKPOINT_VALUES):
            return export_with_past(HFWithPast(wrapper.model), path, prompts, opset=cfg.opset,
                                    metadata={} if values == CHECKPOINT_VALUES else {VALUE_CACHE_KEY: values})

        def smooth(alpha: float, path: Path):
            loaded, wrapper = self.weights()
            return export(smooth_by_rules(wrapper, fold_rules(loaded.spec), self.data.calib_inputs, alpha)[0], path)

        def rotate(recipe):   # in place: the weights are let go after, so the next use reloads the original
            with self.weights_for_one_export() as (loaded, wrapper):
                rotated, _ = rotated_copy(loaded, wrapper, recipe.rotation, in_place=True)
                return export(rotated, self.run_dir / past_file(rotated_onnx_file(recipe.rotation)), recipe.value_cache)
        spec = self.loaded.spec
        return WithPastSource(export=lambda path: export(self.weights()[1], path),
                              variants=FP32Variants(self.run_dir, smooth=smooth, rotate=rotate, suffix=PAST_SUFFIX,
                                                    refuse=lambda recipe: missing_fold_rule(spec, recipe)),
                              release=self.release_weights)

    def scoring(self, cfg) -> Scoring:
        return token_scoring(self.kind, self.data, self.mlm, cfg.eval_batch_size)

    def search_scoring(self, cfg) -> SearchScoring:
        return token_search_scoring(self.kind, self.data, self.mlm)

    def probe_options(self) -> dict:
        return {"n_blocks": len(self.loaded.layers), "causal": self.kind == "causal",
                "token": token_namer(self.loaded.tokenizer, self.data.eval_inputs)}

    def torch_checks(self, cfg) -> TorchChecks:
        """A causal checkpoint's module for the FP16 check (its weights reloaded if the export let
        them go); an encoder has none."""
        return TorchChecks(fp16=(lambda: self.weights()[0]) if self.kind == "causal" else None)

    def sections(self, detected: dict) -> dict:
        model = {**self.model_section(), "placement_detected": detected}
        if self.table_placement == DETECTED:  # outside the loader table: the graph's answer is the placement
            if detected.get("placement") is None:
                raise ConfigError(f"--model {self.opts.path}: {self.loaded.spec.model_type} is not in the loader "
                                  f"table and its placement cannot be read from the exported graph "
                                  f"({detected.get('how')})")
            model.update(placement=detected["placement"], norm=detected["norm"],
                         norm_formula=NORM_FORMULAS.get(detected["norm"] or "unknown", NORM_FORMULAS["unknown"]))
        return {"model": model, "data": self.data.describe,
                "train": {"pretrained": True, "diverged": False,
                          "note": "pretrained checkpoint: not trained by quantnorm"}}

    def model_section(self) -> dict:
        """``results["model"]``: the zoo's keys where they have a meaning, plus what was detected."""
        config, spec, files = self.loaded.model.config, self.loaded.spec, self.loaded.files
        opts = self.opts
        d_model = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        return {
            "source": (opts.provenance if opts.provenance is not None
                       else f"hf:{portable_path(opts.path.resolve(), self.run_dir)}"),
            "architecture": spec.model_type,
            "architectures": list(files.config.get("architectures") or []),
            "model_class": type(self.loaded.model).__name__,
            **spec.describe(),
            "detected_from": GRAPH_DETECTED_FROM if spec.placement == DETECTED else TABLE_DETECTED_FROM,
            "placement_check": self.loaded.placement_check,
            "n_layers": len(self.loaded.layers),
            "d_model": d_model,
            "n_heads": getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None),
            "context": self.max_positions,
            "vocab_size": getattr(config, "vocab_size", None),
            "n_params": self.n_params,
            "weights": files.weights,
            "mlm_head": files.mlm_head,
            "pooling": files.pooling if spec.kind == "encoder" else None,
            "dtype": "float32",
            "attn_implementation": "eager",
        }



def gguf_source(model_path: Path, *, out: Path | None, progress: bool, **options) -> HFSource:
    """A GGUF file: dequantized once into ``<run dir>/checkpoint``, then read as a checkpoint."""
    gguf = resolve_gguf(model_path, progress=progress)
    out = check_out_dir(out or Path("runs") / f"gguf-{gguf_run_name(gguf.provenance.file)}")
    checkpoint = gguf_checkpoint(gguf, out, progress=progress)
    return HFSource(HFOptions(path=checkpoint, out_dir=out, provenance=gguf.provenance.to_dict(), gguf=gguf.path,
                              **options))


def gguf_run_name(file_name: str) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct.q4_1`` (a run directory name)."""
    stem = file_name[: -len(".gguf")] if file_name.endswith(".gguf") else file_name
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in stem).lower()
