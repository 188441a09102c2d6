"""The deployment gate: a policy (thresholds) applied to results.json files -> pass / fail.

Exit codes (``quantnorm gate``): 0 every run passes, 1 a run fails a check, 2 the gate could not
judge (missing, unreadable or corrupt input, a ``schema_version`` quantnorm.results does not read
(1 and 2), a ``model.source`` it does not know, a malformed or physically impossible results.json,
a bad policy or one that checks nothing).

It fails closed. A results.json is read by quantnorm.results.load (the one loader) and validated
first (validate_results: NaN, a negative KL, a
fraction above 1, duplicate recipe names, a latency row without a provider, ... -> ResultsError,
exit 2, one line naming the file and the field). On a valid one, a number the policy needs that
the run does not have or did not measure (``latency[].status = "not measured: ..."``, a recipe
whose status is ``broken: ...``) is a failing check whose reason says what was missing; it never
passes. The checks themselves are two tables, RUN_CHECKS and RECIPE_CHECKS.

Which recipes must pass:

- ``recipes = []`` (the default): a run passes when *at least one* recipe passes every check
  (the deployable one; you ship the best recipe). The other recipes' failures are shown but do not
  block (JUnit reports them as skipped).
- ``recipes = ["a", "b"]``: each listed recipe must be present and pass every check; recipes not
  listed are not gated.

Latency ratio = INT8 p50 / FP32 p50 on the same provider, batch and sequence length, one check per
(provider, batch). It is checked on the ``require_provider`` providers when any are given, else on
every provider where the FP32 model and the recipe were both measured (and fails if there is none).

Policy file (TOML), either in a ``[gate]`` table or as top-level keys::

    [gate]
    max_ppl_ratio = 1.01        # accuracy.ppl_ratio      <= this
    max_kld = 0.01              # accuracy.kld_mean       <= this
    max_kld_p99 = 0.05          # accuracy.kld_p99        <= this   (optional)
    min_top1 = 0.98             # accuracy.top1_agreement >= this
    max_latency_ratio = 1.0     # INT8 p50 / FP32 p50     <= this   (optional)
    require_provider = ["cpu"]  # providers that must have measured latency rows
    recipes = []                # [] = the best recipe must pass; a list = each listed must pass
    collapse_margin = 0.8       # a trained model's eval bits/byte must be this far below the unigram baseline

Library use::

    from quantnorm.gate import Policy, run_gate
    report = run_gate(["runs/pre-rms"], Policy(max_ppl_ratio=1.02))
    print(report.markdown()); raise SystemExit(report.exit_code)
"""

from __future__ import annotations

import difflib
import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from . import results as results_file
from .errors import ConfigError, QuantnormError
from .fileio import write_text_atomic
from .manifest import MANIFEST_FILE
from .measure.sessions import normalize_provider
from .results import FP32_VARIANT, MEASURED, is_pretrained, latency_rows, source_kind
from .runs import CONFIG_FILE, RESULTS_FILE, TRAIN_SUMMARY_FILE
from .train_status import DEFAULT_COLLAPSE_MARGIN, status_from_results

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


class GateError(QuantnormError):
    """The gate cannot judge: a result is missing, unreadable, corrupt or of another schema."""


class PolicyError(ConfigError):
    """The gate policy (file or flags) has an unknown key, a wrong type or an invalid value."""


# ---------------------------------------------------------------------------------------------
# Policy

_FLOAT_KEYS = ("max_ppl_ratio", "max_kld", "max_kld_p99", "min_top1", "max_latency_ratio", "collapse_margin")
_LIST_KEYS = ("require_provider", "recipes")


def _short_provider(provider: str) -> str:
    return provider.replace("ExecutionProvider", "")


def normalize_provider_name(name: str) -> str:
    """``cpu``/``cuda``/``tensorrt`` or an ORT provider name -> the ORT name (PolicyError if unknown)."""
    try:
        return normalize_provider(name)
    except ConfigError as exc:
        raise PolicyError(f"require_provider: {exc}") from None


@dataclass(frozen=True)
class Policy:
    """Thresholds of the gate. ``None`` disables an optional check (kld p99, latency ratio)."""

    max_ppl_ratio: float | None = 1.01
    max_kld: float | None = 0.01
    max_kld_p99: float | None = None
    min_top1: float | None = 0.98
    max_latency_ratio: float | None = None
    require_provider: tuple[str, ...] = ()
    recipes: tuple[str, ...] = ()
    collapse_margin: float | None = DEFAULT_COLLAPSE_MARGIN   # None: no training-status check

    def __post_init__(self) -> None:
        for key in _FLOAT_KEYS:
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PolicyError(f"policy key {key!r} must be a number (float), got {type(value).__name__}")
            if not math.isfinite(value):
                raise PolicyError(f"policy key {key!r} must be a finite number, got {value}")
            object.__setattr__(self, key, float(value))
        for key in ("max_ppl_ratio", "max_latency_ratio"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise PolicyError(f"policy key {key!r} must be > 0, got {value}")
        for key in ("max_kld", "max_kld_p99", "collapse_margin"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise PolicyError(f"policy key {key!r} must be >= 0, got {value}")
        if self.min_top1 is not None and not 0.0 <= self.min_top1 <= 1.0:
            raise PolicyError(f"policy key 'min_top1' must be in [0, 1] (a fraction, not %), got {self.min_top1}")
        for key in _LIST_KEYS:
            value = getattr(self, key)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or \
                    not all(isinstance(v, str) and v.strip() for v in value):
                raise PolicyError(f"policy key {key!r} must be a list of non-empty strings, got {value!r}")
            object.__setattr__(self, key, tuple(dict.fromkeys(v.strip() for v in value)))
        if self.require_provider:
            object.__setattr__(self, "require_provider",
                               tuple(dict.fromkeys(normalize_provider_name(p) for p in self.require_provider)))
        if not self.effective_checks():
            # every gated run would pass on its recipes' status alone: a gate that cannot fail a
            # quantized model for what quantization did to it is a misconfiguration, not a policy
            raise PolicyError("the policy checks nothing (every threshold is off or cannot fail, e.g. min_top1 = 0, "
                              "and no provider is required): set at least one of "
                              + ", ".join(_FLOAT_KEYS) + " or require_provider")

    def effective_checks(self) -> tuple[str, ...]:
        """The policy keys that can fail a run for what quantization did (``min_top1 = 0`` cannot:
        every fraction is >= 0; ``collapse_margin`` judges the training, not the INT8 model)."""
        keys = [k for k in _FLOAT_KEYS if getattr(self, k) is not None and k != "collapse_margin"
                and not (k == "min_top1" and self.min_top1 <= 0)]
        return tuple(keys + (["require_provider"] if self.require_provider else []))

    @property
    def mode(self) -> str:
        return "listed" if self.recipes else "best"

    def override(self, **changes: Any) -> Policy:
        """A copy with the given keys replaced; ``None`` values (flags not given) are ignored."""
        changes = {k: v for k, v in changes.items() if v is not None}
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise PolicyError(f"unknown policy key(s): {', '.join(sorted(unknown))}")
        return replace(self, **changes)

    def describe(self) -> str:
        parts = []
        if self.max_ppl_ratio is not None:
            parts.append(f"PPL ratio <= {self.max_ppl_ratio:g}")
        if self.max_kld is not None:
            parts.append(f"KL mean <= {self.max_kld:g} nats")
        if self.max_kld_p99 is not None:
            parts.append(f"KL p99 <= {self.max_kld_p99:g} nats")
        if self.min_top1 is not None:
            parts.append(f"top-1 agreement >= {self.min_top1:g}")
        if self.max_latency_ratio is not None:
            parts.append(f"INT8/FP32 p50 latency <= {self.max_latency_ratio:g}")
        if self.collapse_margin is not None:
            parts.append(f"trained (eval bits/byte >= {self.collapse_margin:g} below the unigram baseline)")
        if self.require_provider:
            parts.append("measured on " + ", ".join(_short_provider(p) for p in self.require_provider))
        parts.append("recipes that must pass: " + (", ".join(self.recipes) if self.recipes else
                                                   "at least one (the best)"))
        return "; ".join(parts)


_TOML_TYPES = {**{k: ("number (float)", (int, float)) for k in _FLOAT_KEYS},
               **{k: ("list of strings", (list,)) for k in _LIST_KEYS}}


def policy_from_mapping(data: dict, source: str = "policy") -> Policy:
    """Build a Policy from a parsed TOML document (a ``[gate]`` table or top-level keys)."""
    if "gate" in data:
        extra = sorted(k for k in data if k != "gate")
        if extra:
            raise PolicyError(f"{source}: unknown top-level key {extra[0]!r} (with a [gate] table, every key "
                              f"goes inside it)")
        table, where = data["gate"], "[gate]"
        if not isinstance(table, dict):
            raise PolicyError(f"{source}: key 'gate' must be a table ([gate]), got {type(table).__name__}")
    else:
        table, where = data, "the top level"
    known = {f.name for f in fields(Policy)}
    for key, value in table.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PolicyError(f"{source}: unknown key {key!r} in {where}; {hint}known keys: {', '.join(sorted(known))}")
        expected, types = _TOML_TYPES[key]
        if isinstance(value, bool) or not isinstance(value, types) or \
                (key in _LIST_KEYS and not all(isinstance(v, str) for v in value)):
            raise PolicyError(f"{source}: key {key!r} must be a {expected}, got {_toml_type(value)}")
    try:
        return Policy(**table)
    except PolicyError as exc:
        raise PolicyError(f"{source}: {exc}") from None


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean ({str(value).lower()})"
    if isinstance(value, list):
        bad = [v for v in value if not isinstance(v, str)]
        if bad:
            return f"a list holding {_toml_type(bad[0])}"
        return "list"
    if isinstance(value, dict):
        return "table"
    return {str: "string", int: "integer", float: "float"}.get(type(value), type(value).__name__) + f" ({value!r})"


def _read_text(path: Path, error: type[Exception], what: str, missing_hint: str) -> str:
    """A UTF-8 file's text; missing or unreadable -> ``error`` with one line naming ``what``."""
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{what} not found{missing_hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} cannot be read ({_reason(exc)})") from None


def load_policy(path: str | Path) -> Policy:
    """Read a TOML policy file; a missing file, invalid TOML, unknown keys or wrong types -> PolicyError."""
    path = Path(path)
    text = _read_text(path, PolicyError, f"policy file {path}", "")
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise PolicyError("reading a TOML policy needs Python 3.11+ (tomllib) or `pip install tomli`; "
                              "or give the thresholds as flags") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"policy file {path} is not valid TOML ({exc})") from None
    return policy_from_mapping(data, source=str(path))


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


# ---------------------------------------------------------------------------------------------
# Verdicts


@dataclass(frozen=True)
class Check:
    """One comparison of one number against one threshold (or one required fact)."""

    recipe: str | None     # None: a run-level check, not tied to a recipe
    name: str              # e.g. "ppl_ratio", "latency_ratio CPU b=8", "provider CUDA"
    value: float | None    # the measured number (None when missing / not a number)
    threshold: str         # e.g. "<= 1.01"
    passed: bool
    reason: str = ""       # why it failed (what was missing), or a note


@dataclass(frozen=True)
class RunVerdict:
    """The checks of one results.json (one run) under one policy."""

    source: str                    # the results.json path (or a label)
    mode: str                      # "best" or "listed" (see Policy.recipes)
    recipes: tuple[str, ...]       # the gated recipes, in order
    checks: tuple[Check, ...]

    def recipe_passed(self, recipe: str) -> bool:
        own = [c for c in self.checks if c.recipe == recipe]
        return bool(own) and all(c.passed for c in own)

    @property
    def run_level_ok(self) -> bool:
        return all(c.passed for c in self.checks if c.recipe is None)

    @property
    def passing_recipes(self) -> tuple[str, ...]:
        return tuple(r for r in self.recipes if self.recipe_passed(r))

    @property
    def passed(self) -> bool:
        if not self.run_level_ok or not self.recipes:
            return False
        if self.mode == "best":
            return bool(self.passing_recipes)
        return all(self.recipe_passed(r) for r in self.recipes)

    def blocking(self, check: Check) -> bool:
        """Whether this check's failure makes the run fail (in "best" mode a failing recipe does not
        block while another recipe passes every check)."""
        if check.passed:
            return False
        if check.recipe is None or self.mode == "listed":
            return True
        return not self.passed

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if self.blocking(c))


@dataclass(frozen=True)
class GateReport:
    policy: Policy
    runs: tuple[RunVerdict, ...]

    @property
    def passed(self) -> bool:
        return bool(self.runs) and all(r.passed for r in self.runs)

    @property
    def exit_code(self) -> int:
        return EXIT_PASS if self.passed else EXIT_FAIL

    def markdown(self) -> str:
        return report_markdown(self)

    def junit_xml(self) -> str:
        return report_junit(self)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _describe_bad(value: Any) -> str:
    if isinstance(value, float):
        return f"is {value} (not a finite number)"
    return f"is {value!r} (not a number)"


# ---------------------------------------------------------------------------------------------
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
OK_STATUS, BROKEN_PREFIX, NOT_MEASURED_PREFIX = "ok", "broken: ", "not measured: "
# a recipe that does not apply to this model (e.g. a rotation the architecture does not support):
# like a broken one it has no accuracy block and never passes, but it is not a malformed entry
NOT_APPLICABLE_PREFIX = "not applicable: "
_NOT_OK_PREFIXES = (BROKEN_PREFIX, NOT_APPLICABLE_PREFIX)


class ResultsError(GateError):
    """A results.json is malformed or holds a number no measurement can produce."""


def _check_contract(results: Any, source: str) -> None:
    """ResultsError unless ``results`` is a results.json object of a schema_version and a model
    source quantnorm.results reads (its own error, re-raised as the gate's: exit 2)."""
    try:
        results_file.check_schema(results, source)
        source_kind(results, source)
    except results_file.ResultsError as exc:
        raise ResultsError(str(exc)) from None


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


def validate_results(results: Any, source: str = "results") -> None:
    """ResultsError (a GateError: exit code 2) unless ``results`` is a well-formed results.json of a
    supported schema whose every gated number is finite and physically possible. The message is one
    line naming ``source`` and the field."""
    _check_contract(results, source)
    _validate_recipes(results.get("recipes"), source)
    _validate_latency(results.get("latency"), source)


_ACCURACY_CHECKS = (  # (policy key, accuracy key, "<=" or ">=")
    ("max_ppl_ratio", "ppl_ratio", "<="),
    ("max_kld", "kld_mean", "<="),
    ("max_kld_p99", "kld_p99", "<="),
    ("min_top1", "top1_agreement", ">="),
)


def _compare(value: float, op: str, threshold: float) -> bool:
    return value <= threshold if op == "<=" else value >= threshold


def _status_check(results: dict, entry: dict, policy: Policy) -> list[Check]:
    """A recipe that is not ``ok`` (``broken: <reason>``) never passes, whatever numbers it has."""
    status = entry.get("status", OK_STATUS)
    ok = status == OK_STATUS
    return [Check(entry["name"], "status", None, OK_STATUS, ok, "" if ok else f"recipe {status}")]


def _accuracy_checks(results: dict, entry: dict, policy: Policy) -> list[Check]:
    out: list[Check] = []
    name = entry["name"]
    status = entry.get("status", OK_STATUS)
    ok = status == OK_STATUS
    accuracy = entry.get("accuracy")
    for key, metric, op in _ACCURACY_CHECKS:
        threshold = getattr(policy, key)
        if threshold is None:
            continue
        limit = f"{op} {threshold:g}"
        if not isinstance(accuracy, dict):
            why = f"recipe {status}, " if not ok else ""
            out.append(Check(name, metric, None, limit, False, f"missing: {why}no accuracy section"))
            continue
        if metric not in accuracy:
            out.append(Check(name, metric, None, limit, False, f"missing: accuracy.{metric} absent"))
            continue
        value = accuracy[metric]
        if not _is_number(value):
            out.append(Check(name, metric, None, limit, False, f"missing: accuracy.{metric} {_describe_bad(value)}"))
            continue
        passed = ok and _compare(value, op, threshold)
        reason = "" if passed else ("recipe is not usable" if not ok else f"{value:.6g} not {limit}")
        out.append(Check(name, metric, float(value), limit, passed, reason))
    return out


def _provider_checks(results: dict, entry: dict, policy: Policy) -> list[Check]:
    name = entry["name"]
    out: list[Check] = []
    for provider in policy.require_provider:
        short = _short_provider(provider)
        problems: dict[str, list[str]] = {}  # reason -> rows; rows usually share one ("no CUDA device")
        for variant in (FP32_VARIANT, name):
            rows = latency_rows(results, provider=provider, variant=variant)
            if not rows:
                problems.setdefault("no latency row", []).append(variant)
            for r in rows:
                if not r.measured:
                    why = r.status if isinstance(r.status, str) and r.status else "no status"
                elif not _is_number(r.p50_ms):
                    why = f"p50_ms {_describe_bad(r.p50_ms)}"
                else:
                    continue
                problems.setdefault(why, []).append(f"{variant} b={r.batch}")
        reason = "; ".join(f"{why} ({', '.join(rows)})" for why, rows in problems.items())
        out.append(Check(name, f"provider {short}", None, "measured", not problems, reason))
    return out


def _latency_checks(results: dict, entry: dict, policy: Policy) -> list[Check]:
    name = entry["name"]
    threshold = policy.max_latency_ratio
    if threshold is None:
        return []
    limit = f"<= {threshold:g}"
    out: list[Check] = []
    if policy.require_provider:
        providers = list(policy.require_provider)
    else:
        providers = list(dict.fromkeys(r.provider for r in latency_rows(results, variant=name, measured=True)))
    for provider in providers:
        short = _short_provider(str(provider))
        int8_rows = latency_rows(results, provider=provider, variant=name, measured=True)
        if not int8_rows:
            out.append(Check(name, f"latency_ratio {short}", None, limit, False,
                             f"missing: no measured INT8 latency on {short}"))
            continue
        for row in int8_rows:
            label = f"latency_ratio {short} b={row.batch}"
            fp32 = [r for r in latency_rows(results, provider=provider, variant=FP32_VARIANT)
                    if r.batch == row.batch and r.seq == row.seq]
            if not fp32 or not fp32[0].measured:
                why = fp32[0].status if fp32 else "no row"
                out.append(Check(name, label, None, limit, False, f"missing: FP32 latency {why}"))
                continue
            p_int8, p_fp32 = row.p50_ms, fp32[0].p50_ms
            if not _is_number(p_int8) or not _is_number(p_fp32) or p_fp32 <= 0:
                out.append(Check(name, label, None, limit, False,
                                 f"missing: p50_ms INT8 {p_int8!r}, FP32 {p_fp32!r} (need positive numbers)"))
                continue
            ratio = p_int8 / p_fp32
            passed = ratio <= threshold
            note = "" if passed else f"{ratio:.4g} not {limit} ({p_int8:.4g} ms / {p_fp32:.4g} ms)"
            if row.row.get("simulated_int8"):
                note = (note + "; " if note else "") + "simulated INT8 (QDQ with float math)"
            out.append(Check(name, label, ratio, limit, passed, note))
    if not out:
        out.append(Check(name, "latency_ratio", None, limit, False,
                         "missing: no provider has measured FP32 and INT8 latency"))
    return out


def _train_status_check(results: dict, policy: Policy) -> list[Check]:
    """A model that never trained (on the unigram plateau, or barely off it) or diverged fails: its
    INT8 numbers (PPL ratio 1.000x, 100% top-1) say nothing. A pretrained checkpoint
    (``train.pretrained``, or a ``model.source`` other than a zoo run) was not trained here and has
    no such check; nor has a hand-written results.json with neither a source nor a train section."""
    train = results.get("train")
    if policy.collapse_margin is None or is_pretrained(results) or (train is None and source_kind(results) is None):
        return []
    limit = f"trained (margin {policy.collapse_margin:g} bits/byte)"
    if not isinstance(train, dict):
        return [Check(None, "train status", None, limit, False, "missing: results.json has no train section")]
    try:  # the recorded baseline, or (older runs) the one derived from the recorded corpus and byte ranges
        st = status_from_results(train, results.get("data"), policy.collapse_margin)
    except QuantnormError as exc:
        return [Check(None, "train status", None, limit, False, f"missing: {exc}")]
    return [Check(None, "train status", st.eval_bits_per_byte, limit, st.trained,
                  "" if st.trained else st.describe())]


# The check tables. A run-level check sees the whole results.json and returns checks with
# ``recipe=None`` (a failing one fails the run whatever its recipes do); a recipe check sees one
# recipe entry of the gated set. Each is ``fn(results, [entry,] policy) -> list[Check]`` and runs
# only on validated input (validate_results), so it may index the keys validation guarantees. To add
# a check, write one such function and append it here: evaluate_gate, the Markdown table and the
# JUnit report need no change.
RunCheckFn = Callable[[dict, Policy], list[Check]]
RecipeCheckFn = Callable[[dict, dict, Policy], list[Check]]
RUN_CHECKS: tuple[RunCheckFn, ...] = (_train_status_check,)
RECIPE_CHECKS: tuple[RecipeCheckFn, ...] = (_status_check, _accuracy_checks, _provider_checks, _latency_checks)


def evaluate_gate(results: dict, policy: Policy, source: str = "results.json") -> RunVerdict:
    """Apply ``policy`` to one parsed results.json. A malformed or impossible results dict (another
    schema_version, a NaN, a negative KL, duplicate recipe names, ...) raises ResultsError, a
    GateError; a number the policy needs that the run did not measure is a failing check, never a pass."""
    validate_results(results, source)
    checks: list[Check] = []
    for run_check in RUN_CHECKS:
        checks += run_check(results, policy)
    by_name = {entry["name"]: entry for entry in results["recipes"]}  # unique: validated
    if (policy.require_provider or policy.max_latency_ratio is not None) and "latency" not in results:
        checks.append(Check(None, "latency", None, "a list", False, "missing: results.json has no latency list"))

    gated = list(policy.recipes) if policy.recipes else list(by_name)
    if not gated:
        checks.append(Check(None, "recipes", None, ">= 1 recipe", False, "missing: results.json lists no recipe"))
    for name in gated:
        entry = by_name.get(name)
        if entry is None:
            present = ", ".join(by_name) or "none"
            checks.append(Check(name, "present", None, "in results", False,
                                f"missing: recipe {name!r} was not evaluated (present: {present})"))
            continue
        for recipe_check in RECIPE_CHECKS:
            checks += recipe_check(results, entry, policy)
    return RunVerdict(source=source, mode=policy.mode, recipes=tuple(gated), checks=tuple(checks))


# ---------------------------------------------------------------------------------------------
# Inputs


def load_results_file(path: str | Path) -> dict:
    """One results.json read by quantnorm.results.load and validated; anything unreadable or
    malformed -> GateError (one line naming the file and the field)."""
    try:
        results = results_file.load(path)
    except results_file.ResultsError as exc:
        raise GateError(str(exc)) from None
    validate_results(results, str(path))
    return results


def _diverged_cell(cell: Path) -> RunVerdict | None:
    """A sweep cell whose training diverged has no results.json by design: a failing run, not an error."""
    try:
        summary = json.loads((cell / TRAIN_SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or not summary.get("diverged"):
        return None
    check = Check(None, "train", None, "not diverged", False,
                  f"training diverged at step {summary.get('diverged_at')}; no model to deploy")
    return RunVerdict(source=str(cell / RESULTS_FILE), mode="best", recipes=(), checks=(check,))


def _manifest_cells(sweep_dir: Path) -> set[Path]:
    """The cell directories a sweep manifest (``quantnorm sweep``'s sweep.json) names; a manifest
    that cannot be read is an error (fail closed: it may be the only record of a failed cell)."""
    manifest = sweep_dir / MANIFEST_FILE
    if not manifest.exists():
        return set()
    try:
        data = json.loads(manifest.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GateError(f"{manifest} cannot be read ({_reason(exc)})") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, dict):
        raise GateError(f"{manifest} is not a quantnorm sweep manifest (no cells)")
    return {sweep_dir / name for name in cells if isinstance(name, str) and name and "/" not in name}


def resolve_inputs(path: str | Path) -> tuple[list[Path], list[RunVerdict]]:
    """A results.json, a run directory or a sweep directory -> (results files to gate, runs that
    already failed without one). Missing input, an empty sweep or an unfinished cell -> GateError."""
    path = Path(path)
    if path.is_file():
        return [path], []
    if not path.is_dir():
        raise GateError(f"{path} not found: give a results.json, a run directory or a sweep directory")
    if (path / RESULTS_FILE).is_file():
        return [path / RESULTS_FILE], []
    if (path / RESULTS_FILE).exists():
        raise GateError(f"{path / RESULTS_FILE} is not a file")
    files = sorted(p for p in path.rglob(RESULTS_FILE) if p.is_file())
    have = {p.parent for p in files}
    failed: list[RunVerdict] = []
    unfinished: list[str] = []
    # cells: every run directory below (it has a config.json), and every cell the sweep's manifest
    # names (a cell that failed before writing its config.json is still a cell without a result)
    cells = {config.parent for config in path.rglob(CONFIG_FILE)} | _manifest_cells(path)
    for cell in sorted(cells):
        if cell in have or cell == path:
            continue
        verdict = _diverged_cell(cell)
        if verdict is not None:
            failed.append(verdict)
        else:
            unfinished.append(str(cell))
    if unfinished:
        more = f" (and {len(unfinished) - 1} more)" if len(unfinished) > 1 else ""
        raise GateError(f"{unfinished[0]}{more}: run directory without {RESULTS_FILE} (unfinished or failed); "
                        f"finish the sweep or run `quantnorm evaluate --checkpoint` on it")
    if not files and not failed:
        if (path / CONFIG_FILE).is_file():
            raise GateError(f"{path / RESULTS_FILE} not found: run `quantnorm evaluate` first")
        raise GateError(f"{path}: no {RESULTS_FILE} in it or below it (an empty sweep directory)")
    return files, failed


def run_gate(paths: str | Path | Iterable[str | Path], policy: Policy) -> GateReport:
    """Gate results files, run directories and sweep directories. Every input must be readable:
    otherwise GateError (naming every unreadable file, on one line) and no verdict."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise GateError("no input: give a results.json, a run directory or a sweep directory")
    runs: list[RunVerdict] = []
    errors: list[str] = []
    for path in paths:
        files, failed = resolve_inputs(path)
        runs += failed
        for file in files:
            try:
                runs.append(evaluate_gate(load_results_file(file), policy, source=str(file)))
            except GateError as exc:
                errors.append(str(exc))
    if errors:
        more = f" (and {len(errors) - 1} more unreadable: {'; '.join(errors[1:])})" if len(errors) > 1 else ""
        raise GateError(errors[0] + more)
    runs.sort(key=lambda r: r.source)
    return GateReport(policy=policy, runs=tuple(runs))


# ---------------------------------------------------------------------------------------------
# Output


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value(check: Check) -> str:
    return "missing" if check.value is None and check.reason.startswith("missing") else \
        ("–" if check.value is None else f"{check.value:.6g}")


def _result(run: RunVerdict, check: Check) -> str:
    if check.passed:
        return "pass"
    return "**FAIL**" if run.blocking(check) else "fail (not blocking)"


def report_markdown(report: GateReport) -> str:
    verdict = "PASS" if report.passed else "FAIL"
    n_pass = sum(r.passed for r in report.runs)
    lines = [f"## quantnorm gate: {verdict}", "",
             f"Policy: {_md(report.policy.describe())}.", ""]
    for run in report.runs:
        lines.append(f"### `{_md(run.source)}`: {'PASS' if run.passed else 'FAIL'}")
        if run.mode == "best":
            passing = run.passing_recipes
            lines.append("")
            lines.append("Recipes passing every check: " + (", ".join(f"`{r}`" for r in passing) if passing else
                                                          "none") + " (at least one must).")
        lines += ["", "| recipe | check | value | threshold | result | reason |", "|---|---|---|---|---|---|"]
        for c in run.checks:
            lines.append(f"| {_md(c.recipe or '(run)')} | {_md(c.name)} | {_value(c)} | {_md(c.threshold)} | "
                         f"{_result(run, c)} | {_md(c.reason)} |")
        lines.append("")
    lines.append(f"**Overall: {verdict}** ({n_pass} of {len(report.runs)} run(s) passed)")
    return "\n".join(lines) + "\n"


def error_markdown(message: str) -> str:
    return f"## quantnorm gate: ERROR\n\n{_md(message)}\n\n**Overall: ERROR** (nothing was judged; exit code 2)\n"


def report_junit(report: GateReport) -> str:
    """JUnit XML: one testsuite per run, one testcase per run x recipe x check. Failing checks that
    block are <failure>; failures of recipes that do not block ("best" mode) are <skipped>."""
    root = ET.Element("testsuites", name="quantnorm gate")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for run in report.runs:
        suite = ET.SubElement(root, "testsuite", name=run.source)
        counts = {"tests": 0, "failures": 0, "skipped": 0}
        for c in run.checks:
            case = ET.SubElement(suite, "testcase", classname=f"{run.source}:{c.recipe or '(run)'}",
                                 name=c.name, time="0")
            counts["tests"] += 1
            detail = f"{c.recipe or '(run)'} {c.name}: value {_value(c)}, threshold {c.threshold}; {c.reason}"
            if run.blocking(c):
                counts["failures"] += 1
                failure = ET.SubElement(case, "failure", message=c.reason or "failed", type="GateFailure")
                failure.text = detail
            elif not c.passed:
                counts["skipped"] += 1
                ET.SubElement(case, "skipped", message=f"not blocking (another recipe passes): {c.reason}")
        for k, v in counts.items():
            suite.set(k, str(v))
            totals[k] += v
        suite.set("errors", "0")
    for k, v in totals.items():
        root.set(k, str(v))
    root.set("errors", "0")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def error_junit(message: str) -> str:
    root = ET.Element("testsuites", name="quantnorm gate", tests="1", failures="0", errors="1", skipped="0")
    suite = ET.SubElement(root, "testsuite", name="quantnorm gate", tests="1", failures="0", errors="1", skipped="0")
    case = ET.SubElement(suite, "testcase", classname="quantnorm gate", name="read inputs", time="0")
    ET.SubElement(case, "error", message=message, type="GateError").text = message
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def append_summary(path: str | Path, markdown: str) -> None:
    """Append Markdown to a file (e.g. $GITHUB_STEP_SUMMARY); an unwritable file -> GateError."""
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(markdown if markdown.endswith("\n") else markdown + "\n")
    except OSError as exc:
        raise GateError(f"cannot append the summary to {path} ({_reason(exc)})") from None


def write_junit(path: str | Path, xml_text: str) -> None:
    try:
        write_text_atomic(path, xml_text)
    except OSError as exc:
        raise GateError(f"cannot write the JUnit report {path} ({_reason(exc)})") from None


def write_error_outputs(message: str, summary: str | Path | None = None, junit: str | Path | None = None) -> None:
    """On an exit-2 error, still leave an ERROR summary and an <error> JUnit report (best effort), so
    that CI artifacts never look like a pass."""
    if summary is not None:
        try:
            append_summary(summary, error_markdown(message))
        except GateError:
            pass
    if junit is not None:
        try:
            write_junit(junit, error_junit(message))
        except GateError:
            pass
