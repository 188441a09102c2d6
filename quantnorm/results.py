"""The results.json contract (shared RESULTS.md): its schema version, the header every run
writes, the one writer (:class:`ResultsBuilder`, filled by the pipeline's stages), the one loader,
the validator (:func:`validate`, what the gate requires before it judges), and read views.

No other module writes or validates results.json (tests/test_policy.py checks the package for it).
Every reader goes through this module: the run report and the sweep report (quantnorm.report),
the gate, the sweep's resume check. A reader asks :func:`source_kind` what made a run, and
reads recipes and latency rows through :func:`recipes` and :func:`latency_rows` instead of
chains of ``.get(`` calls, so a change to the file's shape is made here once.

Schema versions (:data:`READABLE_SCHEMAS`; :func:`load` refuses any other):

- **1**: the core keys of RESULTS.md (hardware, model, data, train, export, recipes, latency) and
  the later sections (outliers, sqnr, smoothquant, search, diagnostics). ``model.source`` is the
  string ``"trained"`` (a zoo model trained here) or ``"hf:<path>"`` (a Hugging Face directory).
- **2** (:data:`SCHEMA_VERSION`, what a run writes now) adds, with every version-1 key unchanged:
  ``model.source`` may be an object ``{"kind": "gguf" | "onnx" | "hf" | "zoo", ...}`` (a GGUF file
  with its package, hash and quant type; an ONNX export directory); ``model.architecture`` and
  ``model.placement_detected`` (placement and norm read off the ONNX graph, with how and whether
  they agree with the architecture table); ``train.status`` / ``unigram_bits_per_byte`` /
  ``collapse_margin`` (or ``train.pretrained: true`` for a checkpoint not trained here); the
  ``fp16`` section (does the model survive float16) and the ``rotation`` section (rotated
  exports); per recipe ``softmax_inputs`` (whether the attention scores were quantized) and
  ``damage`` (the accuracy block of a recipe marked broken); a recipe status
  ``"not applicable: <reason>"``; ``search.target_max_kld`` (the KL target of the accuracy-aware
  search beside its PPL ratio target); the ``generation`` section (``status``, ``settings``, the
  with-past ``export``, and ``models``: FP32 then each recipe on its with-past graph, with its
  ``cache_check``, ``gptq`` (GPTQ recipes: ``matmuls``, ``codes_reused`` from the whole-window
  solve), ``packed_qkv_layers`` (q, k, v packed into one product), ``packed_shared_groups`` (a weight-only graph's other products that read one input: one product and a Split), ``fused_residual_norms`` (a weight-only or the FP32 graph's residual adds fused with the RMSNorm that reads each: SkipSimplifiedLayerNormalization), ``agreement``, ``decode`` rows
  (batch 1 with a ``step_profile``), a split's ``split`` {tokens, prompt} and ``prompt_path`` (``--prefill-recipe``),
  a ``P+one-row`` entry's ``one_row`` {recipe, counts} and ``prompt_path``; see :func:`generation_models`).
  The ``policy`` section: the accuracy thresholds the run was held to (``max_ppl_ratio``,
  ``max_kld``, ``max_kld_p99``, ``min_top1``; None = off), which the report's verdict applies.
  The ``engines`` section (``--engines``): ``{"status", "engines": [{"engine", "version", "rows":
  [{"format", "status", "path", "size_bytes", "settings", "accuracy", "agreement", "speed"}]}]}``,
  other engines' models scored against the run's FP32 (read through :func:`engine_rows`).
  The ``recipe_choice`` section (no ``--recipes`` named): ``{"by": "probe", "massive_total",
  "probe_windows", "recipes", "default_recipes"}``: the recipes the FP32 probe chose (the ones that
  survive massive activations when it found any); absent when recipes were named. ``hardware.cpu_id``, ``cpu_caches``: the CPU's family, its caches.
  A version-1 file is read as it is: every key added in 2 is optional to a reader.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import __version__
from .errors import RunDirError
from .fileio import write_json_atomic
from .measure.sessions import CPU, hardware_info
from .runs import RESULTS_FILE

# A run's training status as read back from its results.json (train and data sections): the
# reports and the gate read it here, the owner of what results.json holds, not from the trainer.
from .train_status import (  # noqa: F401 - the read view the report package and the gate import
    DEFAULT_COLLAPSE_MARGIN,
    DIVERGED,
    STATUSES,
    check_margin,
    status_from_results,
)
from .train_status import TRAINED as STATUS_TRAINED  # noqa: F401 - beside the source kind TRAINED below

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)

FP32_VARIANT = "fp32"
MEASURED = "measured"
OK = "ok"

# What made a run (model.source): see source_kind.
TRAINED, HF, GGUF, ONNX = "trained", "hf", "gguf", "onnx"
SOURCE_KINDS = (TRAINED, HF, GGUF, ONNX)
PRETRAINED_KINDS = (HF, GGUF, ONNX)
HF_PREFIX = "hf:"
# What a pretrained checkpoint is (model.kind): a causal LM, or an encoder scored by embeddings.
CAUSAL, ENCODER = "causal", "encoder"
# RESULTS.md names a zoo run's source object {"kind": "zoo"}; it is the same thing as "trained"
_KIND_NAMES = {"zoo": TRAINED, TRAINED: TRAINED, HF: HF, GGUF: GGUF, ONNX: ONNX}


class ResultsError(RunDirError):
    """A results.json is missing, unreadable, not a quantnorm results.json, of a schema_version
    this quantnorm does not read, or names a model source it does not know."""


def header(command: str, threads: int | None) -> dict:
    """The keys every results.json starts with (RESULTS.md): schema, version, command, time, hardware."""
    return {
        "schema_version": SCHEMA_VERSION,
        "quantnorm_version": __version__,
        "command": command,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware_info(threads),
    }


def check_schema(results: Any, source: str = "results") -> None:
    """ResultsError unless ``results`` is a results.json object of a readable schema_version."""
    if not isinstance(results, dict) or "schema_version" not in results:
        raise ResultsError(f"{source} is not a quantnorm results.json (no schema_version)")
    version = results["schema_version"]
    if isinstance(version, bool) or version not in READABLE_SCHEMAS:
        known = " and ".join(str(v) for v in READABLE_SCHEMAS)
        raise ResultsError(f"{source}: schema_version {version!r} is not one this quantnorm reads ({known}); "
                           f"use the quantnorm version that wrote it")


def load(path: str | Path) -> dict:
    """A results.json (or the one inside a run directory), checked: readable UTF-8 JSON, an object,
    a readable schema_version, a known model source. Anything else raises ResultsError with one
    line naming the file (and the field)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path} not found: run `quantnorm evaluate` first") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
        raise ResultsError(f"{path} cannot be read ({reason})") from None
    try:
        results = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path} is not valid JSON ({exc}); re-run `quantnorm evaluate`") from None
    check_schema(results, str(path))
    source_kind(results, str(path))
    return results


# ------------------------------------------------------------------------------------ the writer


class ResultsBuilder:
    """results.json as the pipeline's stages fill it; :meth:`write` is the one place the file is
    written. The file's keys come in one order whatever order the stages run in: the header, the
    model source's sections, ``export``, ``recipes``, ``latency``, ``file_sizes_bytes``, the
    optional sections in the order they were added (search, rotation, smoothquant, the probe's,
    a source's extras), and ``stage_seconds`` last."""

    def __init__(self, command: str, threads: int | None) -> None:
        self.command, self.threads = command, threads
        self.recipes: list[dict] = []       # the recipe entries, appended as each recipe (or the search) ends
        self._source: dict = {}
        self._export: dict | None = None
        self._latency: list[dict] = []
        self._file_sizes: dict[str, int] = {}
        self._sections: dict[str, Any] = {}

    def source(self, sections: dict) -> None:
        """The model source's sections (``model``, ``data``, ``train``, ...)."""
        self._source.update(sections)

    def export(self, section: dict) -> None:
        self._export = section

    def add_recipe(self, entry: dict) -> None:
        self.recipes.append(entry)

    def latency(self, rows: list[dict]) -> None:
        self._latency = list(rows)

    def file_sizes(self, paths: dict[str, Path]) -> None:
        """``file_sizes_bytes``: each model file's size, by variant (``fp32``, then each recipe)."""
        self._file_sizes = {name: Path(path).stat().st_size for name, path in paths.items()}

    def section(self, name: str, value: Any) -> None:
        """An optional section (``search``, ``rotation``, ``smoothquant``, ``outliers``, ...)."""
        self._sections[name] = value

    def sections(self, values: dict[str, Any]) -> None:
        self._sections.update(values)

    def build(self, stage_seconds: dict[str, float]) -> dict:
        """The results.json object; the header (time, hardware) is taken now, when the run ends."""
        return {**header(self.command, self.threads), **self._source, "export": self._export,
                "recipes": self.recipes, "latency": self._latency, "file_sizes_bytes": self._file_sizes,
                **self._sections, "stage_seconds": stage_seconds}

    def write(self, run_dir: str | Path, stage_seconds: dict[str, float]) -> dict:
        """Write ``run_dir``/results.json atomically; return what was written."""
        results = self.build(stage_seconds)
        write_json_atomic(Path(run_dir) / RESULTS_FILE, results)
        return results


# ------------------------------------------------------------------------------------ the run


def _model(results: dict) -> dict:
    model = results.get("model")
    return model if isinstance(model, dict) else {}


def source_kind(results: dict, where: str = "results") -> str | None:
    """What made the run: "trained" (a zoo model trained here, ``model.source == "trained"``),
    "hf" (``"hf:<path>"`` or an object of kind hf), "gguf" or "onnx" (an object with that kind).
    None when the file has no ``model.source`` (a hand-written or synthetic results.json); any
    other value raises ResultsError naming ``where`` and the field."""
    model = _model(results)
    if "source" not in model:
        return None
    source = model["source"]
    if isinstance(source, str):
        if source == TRAINED:
            return TRAINED
        if source.startswith(HF_PREFIX):
            return HF
    elif isinstance(source, dict) and isinstance(source.get("kind"), str) and source["kind"] in _KIND_NAMES:
        return _KIND_NAMES[source["kind"]]
    raise ResultsError(f"{where}: model.source {source!r} is not a source this quantnorm knows "
                       f"('trained', 'hf:<path>' or an object with kind {', '.join(('zoo', *PRETRAINED_KINDS))})")


def is_pretrained(results: dict) -> bool:
    """A checkpoint loaded from elsewhere (HF directory, GGUF file, ONNX export), not trained here:
    it has no training status to judge."""
    train = results.get("train")
    return (isinstance(train, dict) and train.get("pretrained") is True) or source_kind(results) in PRETRAINED_KINDS


def model_kind(results: dict) -> str | None:
    """A pretrained checkpoint's kind of model: "causal" (scored by perplexity) or "encoder"
    (embedding agreement); None for a zoo model (always causal, recorded without it)."""
    return _model(results).get("kind")


# ------------------------------------------------------------------------------------ recipes


@dataclass(frozen=True)
class Recipe:
    """One entry of ``recipes``: ``accuracy`` is None for a recipe that could not run, ``damage``
    the numbers of one that ran but is marked broken."""

    name: str
    status: str
    accuracy: dict | None
    settings: dict
    damage: dict | None
    entry: dict   # the whole entry, for the keys a section reads only once

    @property
    def ok(self) -> bool:
        return self.status == OK

    def metric(self, key: str) -> Any:
        """``accuracy[key]``, or None when the recipe has no accuracy block or no such key."""
        return (self.accuracy or {}).get(key)


def _recipe(entry: dict) -> Recipe:
    accuracy = entry.get("accuracy")
    return Recipe(name=entry.get("name"), status=entry.get("status", OK),
                  accuracy=accuracy if isinstance(accuracy, dict) else None,
                  settings=entry.get("settings") or {}, damage=entry.get("damage"), entry=entry)


def recipes(results: dict | None) -> list[Recipe]:
    """The recipe entries, in the order the run evaluated them (the first is the primary recipe)."""
    entries = (results or {}).get("recipes")
    return [_recipe(e) for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def recipe(results: dict | None, name: str) -> Recipe | None:
    return next((r for r in recipes(results) if r.name == name), None)


# ------------------------------------------------------------------------------------ latency


@dataclass(frozen=True)
class LatencyRow:
    """One ``latency`` row: a measured one has its timings, a ``not measured: <reason>`` one none."""

    provider: str | None
    variant: str | None
    batch: int | None
    seq: int | None
    status: str | None
    p50_ms: float | None
    row: dict   # the whole row (percentiles, node placement, notes)

    @property
    def measured(self) -> bool:
        return self.status == MEASURED


def latency_rows(results: dict | None, *, provider: str | None = None, variant: str | None = None,
                 measured: bool = False) -> list[LatencyRow]:
    """The latency rows in file order, optionally of one provider / variant, or measured ones only."""
    rows = (results or {}).get("latency")
    out = []
    for r in rows if isinstance(rows, list) else []:
        if not isinstance(r, dict):
            continue
        view = LatencyRow(r.get("provider"), r.get("variant"), r.get("batch"), r.get("seq"), r.get("status"),
                          r.get("p50_ms"), r)
        if (provider is None or view.provider == provider) and (variant is None or view.variant == variant) \
                and (not measured or view.measured):
            out.append(view)
    return out


def p50_ratio(results: dict | None, variant: str, provider: str = CPU) -> tuple[float | None, int | None]:
    """``variant``'s p50 / FP32's p50 on ``provider`` at the largest batch where both were measured
    (None, None when there is none). A later row of the same batch replaces an earlier one."""
    rows = latency_rows(results, provider=provider, measured=True)
    fp32 = {r.batch: r.p50_ms for r in rows if r.variant == FP32_VARIANT}
    other = {r.batch: r.p50_ms for r in rows if r.variant == variant}
    both = sorted(set(fp32) & set(other))
    if not both or not fp32[both[-1]]:
        return None, None
    return other[both[-1]] / fp32[both[-1]], both[-1]


def fp32_p50(results: dict | None, provider: str = CPU) -> tuple[float | None, int | None]:
    """The FP32 model's p50 on ``provider`` at its largest measured batch, and that batch."""
    rows = latency_rows(results, provider=provider, variant=FP32_VARIANT, measured=True)
    if not rows:
        return None, None
    row = max(rows, key=lambda r: r.batch)
    return row.p50_ms, row.batch


# ------------------------------------------------------------------------------------ generation


@dataclass(frozen=True)
class GenerationModel:
    """One entry of ``generation.models``: the FP32 model ("fp32") or a recipe on its with-past
    graph. ``path``: the with-past ONNX file, relative to the run directory (None when the recipe
    did not apply or broke); ``agreement``: greedy generation against FP32's (None for FP32);
    ``decode``: prompt and generation speed rows (one per provider and batch)."""

    name: str
    status: str
    path: str | None
    cache_check: dict | None
    agreement: dict | None
    decode: list[dict]
    entry: dict

    @property
    def ok(self) -> bool:
        return self.status == OK


def generation_models(results: dict | None) -> list[GenerationModel]:
    """``generation.models`` in the run's order (FP32 first); [] for a run without generation."""
    entries = (section(results, "generation") or {}).get("models")
    if not isinstance(entries, list):
        return []
    return [GenerationModel(name=e.get("name"), status=e.get("status", OK), path=e.get("path"),
                            cache_check=e.get("cache_check"), agreement=e.get("agreement"),
                            decode=[r for r in e.get("decode") or [] if isinstance(r, dict)], entry=e)
            for e in entries if isinstance(e, dict)]


def generation_model(results: dict | None, name: str) -> GenerationModel | None:
    return next((m for m in generation_models(results) if m.name == name), None)


def file_size(results: dict | None, name: str) -> int | None:
    """The model file's size of ``name`` (``fp32`` or a recipe): the recipe entry's ``size_bytes``,
    else ``file_sizes_bytes``; None when the run recorded neither."""
    entry = recipe(results, name)
    size = entry.entry.get("size_bytes") if entry is not None else None
    if not isinstance(size, int):
        size = ((results or {}).get("file_sizes_bytes") or {}).get(name)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def engine_rows(results: dict | None) -> list[dict]:
    """Every row of ``engines.engines[].rows`` with its ``engine`` and ``version``; [] without the section."""
    groups = (section(results, "engines") or {}).get("engines")
    return [{"engine": g.get("engine"), "version": g.get("version"), **row} for g in groups or []
            if isinstance(g, dict) for row in g.get("rows") or [] if isinstance(row, dict)]


# ------------------------------------------------------------------------------------ activations


def section(results: dict | None, name: str) -> dict | None:
    """An optional object section (``hardware``, ``smoothquant``, ``search``, ``fp16``,
    ``sqnr_summary``, ...): None when the run has none (or it is not an object)."""
    found = (results or {}).get(name)
    return found if isinstance(found, dict) else None


def outliers(results: dict | None) -> dict | None:
    """The ``outliers`` section (the probe's, from torch or the ONNX graph), None when not probed."""
    return section(results, "outliers")


def residual(results: dict | None) -> list[dict]:
    """``outliers.residual``: the embedding output's row, then one per block ([] when not probed)."""
    return (outliers(results) or {}).get("residual") or []


def massive_count(results: dict | None) -> int | None:
    """How many massive activations the probe found (None when there was no probe)."""
    section = outliers(results)
    return None if section is None else len(section.get("massive") or [])


def diagnostics(results: dict | None) -> tuple[list[dict] | None, list[float] | None]:
    """The zoo probe's ``diagnostics``: the weight-perturbation rows and the cosine of each block's
    output with its input (each None when absent or empty)."""
    d = section(results, "diagnostics")
    if d is None:
        return None, None
    rows = d.get("perturbation")
    rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else None
    cos = d.get("block_cosine")
    cos = list(cos) if isinstance(cos, list) else None
    return rows or None, cos or None


# ------------------------------------------------------------------------------------ validation
# Well-formed and physically possible: what a results.json must be before any check is judged.
# A value outside these ranges cannot come from a measurement (a tampered, truncated or
# hand-edited file, or a bug upstream), so the gate refuses to judge it (exit 2) rather than
# turning it into a pass or an ordinary failure.

_ROUNDING = 1e-6  # float32 arithmetic can put a cosine at 1 + 1e-7 or a KL of equal distributions at -1e-9


@dataclass(frozen=True)
class _Range:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False   # lo itself is impossible (a ratio of 0)
    integer: bool = False
    why: str = ""

    def problem(self, value: float) -> str | None:
        if self.integer and not isinstance(value, int):
            return f"must be an integer ({self.why})"
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo - _ROUNDING):
            return f"is impossible: {self.why}"
        if self.hi is not None and value > self.hi + _ROUNDING:
            return f"is impossible: {self.why}"
        return None


_FRACTION = _Range(0.0, 1.0, why="a fraction lies in [0, 1]")
_COSINE = _Range(-1.0, 1.0, why="a cosine lies in [-1, 1]")
_KL = _Range(0.0, why="a KL divergence is >= 0")
_COUNT = _Range(0, integer=True, why="a count is a non-negative integer")

# accuracy keys with a physical range; any other numeric accuracy key must still be finite
ACCURACY_RANGES: dict[str, _Range] = {
    "ppl_fp32": _Range(1.0, why="a perplexity is >= 1"),
    "ppl_int8": _Range(1.0, why="a perplexity is >= 1"),
    "ppl_ratio": _Range(0.0, lo_open=True, why="a ratio of perplexities is > 0"),
    "bits_per_byte_fp32": _Range(0.0, why="a cross-entropy is >= 0"),
    "bits_per_byte_int8": _Range(0.0, why="a cross-entropy is >= 0"),
    "kld_mean": _KL, "kld_p99": _KL, "kld_max": _KL,
    "top1_agreement": _FRACTION, "nn_agreement": _FRACTION,
    "cosine_mean": _COSINE, "cosine_p1": _COSINE, "cosine_min": _COSINE,
    "token_cosine_mean": _COSINE, "token_cosine_p1": _COSINE,
    "n_scored": _COUNT, "n_passages": _COUNT,
}
_POSITIVE_MS = _Range(0.0, lo_open=True, why="a latency is > 0 ms")
LATENCY_RANGES: dict[str, _Range] = {
    "p50_ms": _POSITIVE_MS, "p90_ms": _POSITIVE_MS, "p99_ms": _POSITIVE_MS, "mean_ms": _POSITIVE_MS,
    "tokens_per_s": _Range(0.0, lo_open=True, why="a throughput is > 0"),
    "batch": _Range(1, integer=True, why="a batch size is an integer >= 1"),
    "seq": _Range(1, integer=True, why="a sequence length is an integer >= 1"),
}
OK_STATUS, BROKEN_PREFIX, NOT_MEASURED_PREFIX = OK, "broken: ", "not measured: "
# a recipe that does not apply to this model (e.g. a rotation the architecture does not support):
# like a broken one it has no accuracy block and never passes, but it is not a malformed entry
NOT_APPLICABLE_PREFIX = "not applicable: "
_NOT_OK_PREFIXES = (BROKEN_PREFIX, NOT_APPLICABLE_PREFIX)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _malformed(source: str, field: str, problem: str) -> ResultsError:
    return ResultsError(f"{source}: {field} {problem}")


def _number(value: Any, source: str, field: str, rule: _Range | None) -> None:
    """``value`` must be a finite number inside ``rule``; otherwise ResultsError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _malformed(source, field, f"is {value!r}, not a number")
    if not math.isfinite(value):
        raise _malformed(source, field, f"is {value}, not a finite number")
    problem = rule.problem(value) if rule is not None else None
    if problem:
        raise _malformed(source, field, f"= {value!r} {problem}")


def _validate_accuracy(accuracy: Any, source: str, field: str) -> None:
    if not isinstance(accuracy, dict):
        raise _malformed(source, field, f"must be an object, got {type(accuracy).__name__}")
    for key, value in accuracy.items():
        rule = ACCURACY_RANGES.get(key)
        if rule is not None or isinstance(value, float):  # unknown keys may be text, but never NaN
            _number(value, source, f"{field}.{key}", rule)
    if all(_is_number(accuracy.get(k)) for k in ("ppl_fp32", "ppl_int8", "ppl_ratio")):
        expected = accuracy["ppl_int8"] / accuracy["ppl_fp32"]
        if abs(accuracy["ppl_ratio"] - expected) > _ROUNDING * max(1.0, expected):
            raise _malformed(source, f"{field}.ppl_ratio", f"= {accuracy['ppl_ratio']!r} is not ppl_int8 / ppl_fp32 "
                             f"= {expected:.6g}")
    for key in ("kld_mean", "kld_p99"):
        if _is_number(accuracy.get(key)) and _is_number(accuracy.get("kld_max")) and \
                accuracy[key] > accuracy["kld_max"] + _ROUNDING:
            raise _malformed(source, f"{field}.{key}", f"= {accuracy[key]!r} exceeds kld_max = {accuracy['kld_max']!r}")


def _validate_recipes(entries: Any, source: str) -> None:
    if not isinstance(entries, list):
        raise _malformed(source, "recipes", "is missing" if entries is None else
                         f"must be a list, got {type(entries).__name__}")
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        field = f"recipes[{i}]"
        if not isinstance(entry, dict):
            raise _malformed(source, field, f"must be an object, got {type(entry).__name__}")
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            raise _malformed(source, f"{field}.name", f"must be a non-empty string, got {name!r}")
        if name == FP32_VARIANT:
            raise _malformed(source, f"{field}.name", f"{name!r} is the FP32 baseline's name, not a recipe's")
        if name in seen:
            raise _malformed(source, f"{field}.name", f"{name!r} duplicates recipes[{seen[name]}] (which one "
                             f"would be gated?)")
        seen[name] = i
        status = entry.get("status", OK_STATUS)
        if not isinstance(status, str) or not (status == OK_STATUS or status.startswith(_NOT_OK_PREFIXES)):
            raise _malformed(source, f"{field}.status", f"is {status!r}: must be {OK_STATUS!r}, "
                             f"'{BROKEN_PREFIX}<reason>' or '{NOT_APPLICABLE_PREFIX}<reason>'")
        if "accuracy" in entry:  # a broken recipe may carry numbers; they must still be possible ones
            _validate_accuracy(entry["accuracy"], source, f"{field}.accuracy")
        elif status == OK_STATUS:
            raise _malformed(source, f"{field}.accuracy", f"is missing for recipe {name!r} whose status is 'ok'")


def _validate_latency(rows: Any, source: str) -> None:
    if rows is None:  # absent: a policy that needs latency fails its checks (missing), nothing to refuse
        return
    if not isinstance(rows, list):
        raise _malformed(source, "latency", f"must be a list, got {type(rows).__name__}")
    seen: dict[tuple, int] = {}
    for i, row in enumerate(rows):
        field = f"latency[{i}]"
        if not isinstance(row, dict):
            raise _malformed(source, field, f"must be an object, got {type(row).__name__}")
        for key in ("provider", "variant"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise _malformed(source, f"{field}.{key}", f"must be a non-empty string, got {row.get(key)!r}")
        for key in ("batch", "seq"):
            if key in row:
                _number(row[key], source, f"{field}.{key}", LATENCY_RANGES[key])
        status = row.get("status")
        if status == MEASURED:
            if "p50_ms" not in row:
                raise _malformed(source, f"{field}.p50_ms", "is missing in a measured row")
            for key, rule in LATENCY_RANGES.items():
                if key in row and key not in ("batch", "seq"):
                    _number(row[key], source, f"{field}.{key}", rule)
            pcts = [row[k] for k in ("p50_ms", "p90_ms", "p99_ms") if k in row]
            if pcts != sorted(pcts):
                raise _malformed(source, field, f"percentiles are not ordered (p50 <= p90 <= p99): {pcts}")
        elif not (isinstance(status, str) and status.startswith(NOT_MEASURED_PREFIX)):
            raise _malformed(source, f"{field}.status", f"is {status!r}: must be {MEASURED!r} or "
                             f"'{NOT_MEASURED_PREFIX}<reason>'")
        key = (row["provider"], row["variant"], row.get("batch"), row.get("seq"))
        if key in seen:
            raise _malformed(source, field, f"duplicates latency[{seen[key]}] (same provider, variant, batch, seq)")
        seen[key] = i


def validate(results: Any, source: str = "results") -> None:
    """ResultsError unless ``results`` is a well-formed results.json of a readable schema and a known
    model source whose every gated number (recipes' accuracy, latency rows) is finite and physically
    possible. The message is one line naming ``source`` and the field. The gate calls it before it
    judges a run: a value no measurement can produce is refused (exit 2), never passed or failed."""
    check_schema(results, source)
    source_kind(results, source)
    _validate_recipes(results.get("recipes"), source)
    _validate_latency(results.get("latency"), source)
    for i, row in enumerate(engine_rows(results)):
        status, field = row.get("status"), f"engines row {i} ({row['engine']} {row.get('format')})"
        if status == OK_STATUS:
            _validate_accuracy(row.get("accuracy"), source, f"{field}.accuracy")
        elif not (isinstance(status, str) and status.startswith((NOT_MEASURED_PREFIX, BROKEN_PREFIX))):
            raise _malformed(source, f"{field}.status", f"is {status!r}: must be 'ok', 'not measured: ...' or "
                             "'broken: ...'")
