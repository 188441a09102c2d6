"""The acceptance policy: when an INT8 model is good enough to deploy. One set of thresholds (PPL
ratio, KL, top-1 agreement, latency ratio, the training status's collapse margin) with one set of
defaults, read by the accuracy-aware search (``--recipes auto`` keeps only a model the policy
accepts) and by the gate (``quantnorm gate`` judges a run by it), so that the search never picks a
recipe the gate then fails under the same policy.

A :class:`Policy` is frozen and validated when built (a bad value is a PolicyError, a ConfigError:
exit 2). :func:`load_policy` reads the TOML file the gate and ``evaluate --policy`` take (a
``[gate]`` table or top-level keys; see examples/gate-policy.toml)::

    [gate]
    max_ppl_ratio = 1.01        # accuracy.ppl_ratio      <= this
    max_kld = 0.01              # accuracy.kld_mean       <= this
    max_kld_p99 = 0.05          # accuracy.kld_p99        <= this   (optional)
    min_top1 = 0.95             # accuracy.top1_agreement >= this
    max_latency_ratio = 1.0     # INT8 p50 / FP32 p50     <= this   (optional)
    min_gen_speed_ratio = 1.0   # generation tokens/s, INT8 / FP32, same provider and batch >= this (optional)
    min_gen_tokens_per_s = 50   # generation tokens/s of the recipe >= this (optional)
    min_gen_agreement = 0.9     # generation.identical_before_divergence >= this (optional)
    require_provider = ["cpu"]  # providers that must have measured latency rows
    recipes = []                # [] = the best recipe must pass; a list = each listed must pass
    collapse_margin = 0.8       # a trained model's eval bits/byte must be this far below the unigram baseline

    [gate.baseline]             # `quantnorm gate CANDIDATE --baseline BASELINE` (see BaselinePolicy)
    require_same_hardware = false
    kld_mean = { abs = 0.0002, rel = 0.25 }
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .measure.sessions import normalize_provider, short_provider
from .train_status import DEFAULT_COLLAPSE_MARGIN


class PolicyError(ConfigError):
    """The acceptance policy (file or flags) has an unknown key, a wrong type or an invalid value."""


_FLOAT_KEYS = ("max_ppl_ratio", "max_kld", "max_kld_p99", "min_top1", "max_latency_ratio", "min_gen_speed_ratio",
               "min_gen_tokens_per_s", "min_gen_agreement", "collapse_margin")
# The generation thresholds (policy key, what the gate compares): read off results["generation"].
GENERATION_LIMITS = (
    ("min_gen_speed_ratio", "gen_speed_ratio"),
    ("min_gen_tokens_per_s", "gen_tokens_per_s"),
    ("min_gen_agreement", "identical_before_divergence"),
)
_LIST_KEYS = ("require_provider", "recipes")


def normalize_provider_name(name: str) -> str:
    """``cpu``/``cuda``/``tensorrt`` or an ORT provider name -> the ORT name (PolicyError if unknown)."""
    try:
        return normalize_provider(name)
    except ConfigError as exc:
        raise PolicyError(f"require_provider: {exc}") from None


# The accuracy thresholds: (policy key, accuracy key, "<=" or ">="). The search and the gate both
# judge a model's accuracy by this one table.
ACCURACY_LIMITS = (
    ("max_ppl_ratio", "ppl_ratio", "<="),
    ("max_kld", "kld_mean", "<="),
    ("max_kld_p99", "kld_p99", "<="),
    ("min_top1", "top1_agreement", ">="),
)


def within(value: float, op: str, threshold: float) -> bool:
    return value <= threshold if op == "<=" else value >= threshold


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Tolerance:
    """How far one number may move the wrong way from the baseline's before the gate calls it a
    regression. A change fails only when it is beyond both: ``abs`` (in the number's unit) is the
    floor below which a change is noise, ``rel`` the share of the baseline's value (for an agreement,
    of its disagreement 1 - agreement: 0.995 -> 0.990 doubles what disagrees). 0 leaves the other alone."""

    abs: float
    rel: float

    def __post_init__(self) -> None:
        for key in ("abs", "rel"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PolicyError(f"tolerance {key!r} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, key, float(value))

    def describe(self, unit: str = "") -> str:
        return f"+{self.abs:g}{unit} and +{self.rel * 100:g}%"


# The baseline checks: name -> (what it compares, which way is worse, its default tolerance).
BASELINE_CHECKS: dict[str, tuple[str, str, Tolerance]] = {
    "ppl_ratio": ("accuracy.ppl_ratio", "higher", Tolerance(0.002, 0.001)),
    "kld_mean": ("accuracy.kld_mean, nats", "higher", Tolerance(0.0002, 0.25)),
    "top1_agreement": ("accuracy.top1_agreement (rel: of the disagreement)", "lower", Tolerance(0.002, 0.25)),
    "generation_agreement": ("generation agreement with FP32 (rel: of the disagreement)", "lower",
                             Tolerance(0.02, 0.25)),
    "size_bytes": ("the recipe's model file, bytes", "higher", Tolerance(1024, 0.01)),
    "latency": ("p50 ms, beyond the p90 - p50 spreads of both runs added", "higher", Tolerance(0.0, 0.05)),
}


@dataclass(frozen=True)
class BaselinePolicy:
    """The ``[gate.baseline]`` table: what ``quantnorm gate CANDIDATE --baseline BASELINE`` allows.
    ``tolerances``: check name -> Tolerance (BASELINE_CHECKS' defaults for the ones not given).
    ``require_same_hardware``: latency measured on another CPU (model, ISA flags), with other
    threads or another provider fails instead of being "not comparable"."""

    tolerances: tuple[tuple[str, Tolerance], ...] = ()
    require_same_hardware: bool = False

    def __post_init__(self) -> None:
        given = dict(self.tolerances.items() if isinstance(self.tolerances, dict) else self.tolerances)
        unknown = sorted(set(given) - set(BASELINE_CHECKS))
        if unknown:
            raise PolicyError(f"baseline: unknown check {unknown[0]!r}; known: {', '.join(BASELINE_CHECKS)}")
        for name, tol in given.items():
            if not isinstance(tol, Tolerance):
                raise PolicyError(f"baseline: {name} must be a Tolerance, got {type(tol).__name__}")
        merged = {name: given.get(name, default) for name, (_, _, default) in BASELINE_CHECKS.items()}
        object.__setattr__(self, "tolerances", tuple(merged.items()))
        if not isinstance(self.require_same_hardware, bool):
            raise PolicyError(f"baseline: require_same_hardware must be true or false, "
                              f"got {self.require_same_hardware!r}")

    def tolerance(self, check: str) -> Tolerance:
        return dict(self.tolerances)[check]

    def with_tolerances(self, abs_: dict[str, float] | None = None, rel: dict[str, float] | None = None) -> BaselinePolicy:
        """A copy with these absolute and relative tolerances replaced (``--abs-tol``/``--rel-tol``)."""
        abs_, rel = abs_ or {}, rel or {}
        unknown = sorted((set(abs_) | set(rel)) - set(BASELINE_CHECKS))
        if unknown:
            raise PolicyError(f"unknown baseline check {unknown[0]!r}; known: {', '.join(BASELINE_CHECKS)}")
        tols = {name: Tolerance(abs_.get(name, tol.abs), rel.get(name, tol.rel)) for name, tol in self.tolerances}
        return replace(self, tolerances=tuple(tols.items()))

    def describe(self) -> str:
        parts = [f"{name} {tol.describe()}" for name, tol in self.tolerances]
        hardware = "latency on other hardware fails" if self.require_same_hardware else \
            "latency on other hardware is not comparable"
        return "a regression fails when beyond both tolerances: " + ", ".join(parts) + "; " + hardware


def parse_tolerances(items: tuple[str, ...] | list[str], flag: str) -> dict[str, float]:
    """``--abs-tol kld_mean=0.001`` (repeatable, or comma-separated) -> {check: value}; PolicyError
    naming the flag on anything else."""
    out: dict[str, float] = {}
    for item in (part.strip() for text in items for part in text.split(",") if part.strip()):
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in BASELINE_CHECKS:
            raise PolicyError(f"{flag} {item!r}: expected CHECK=VALUE with CHECK one of {', '.join(BASELINE_CHECKS)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise PolicyError(f"{flag} {item!r}: {value.strip()!r} is not a number") from None
    return out


def with_baseline_flags(policy: Policy, abs_tol: tuple[str, ...] = (), rel_tol: tuple[str, ...] = (),
                        same_hardware: bool = False) -> Policy:
    """``policy`` with ``gate``'s baseline flags on top: --abs-tol, --rel-tol, --same-hardware."""
    base = policy.baseline.with_tolerances(parse_tolerances(abs_tol, "--abs-tol"), parse_tolerances(rel_tol, "--rel-tol"))
    if same_hardware:
        base = replace(base, require_same_hardware=True)
    return replace(policy, baseline=base)


def _unknown_key(source: str, key: str, where: str, known: list[str]) -> PolicyError:
    """An unknown policy key, with the closest known one as a hint."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return PolicyError(f"{source}: unknown key {key!r} in {where}; {hint}known keys: {', '.join(known)}")


def baseline_from_mapping(table: Any, source: str) -> BaselinePolicy:
    """``[gate.baseline]``: ``require_same_hardware`` and one ``{abs = ..., rel = ...}`` per check
    (either key may be left out: its default stands)."""
    if not isinstance(table, dict):
        raise PolicyError(f"{source}: key 'baseline' must be a table ([gate.baseline]), got {_toml_type(table)}")
    same = table.get("require_same_hardware", False)
    if not isinstance(same, bool):
        raise PolicyError(f"{source}: baseline.require_same_hardware must be a boolean, got {_toml_type(same)}")
    base = BaselinePolicy(require_same_hardware=same)
    tols: dict[str, dict[str, float]] = {"abs": {}, "rel": {}}
    for name, value in table.items():
        if name == "require_same_hardware":
            continue
        if name not in BASELINE_CHECKS:
            raise _unknown_key(source, name, "[gate.baseline]", ["require_same_hardware", *BASELINE_CHECKS])
        if not isinstance(value, dict) or not value or set(value) - {"abs", "rel"}:
            raise PolicyError(f"{source}: baseline.{name} must be a table {{ abs = ..., rel = ... }}, got {value!r}")
        for key, number in value.items():
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise PolicyError(f"{source}: baseline.{name}.{key} must be a number, got {_toml_type(number)}")
            tols[key][name] = number
    try:
        return base.with_tolerances(tols["abs"], tols["rel"])
    except PolicyError as exc:
        raise PolicyError(f"{source}: baseline: {exc}") from None


@dataclass(frozen=True)
class Policy:
    """The acceptance thresholds (the search's targets and the gate's checks). ``None`` disables a
    check (kld p99 and latency ratio are off by default)."""

    max_ppl_ratio: float | None = 1.01
    max_kld: float | None = 0.01
    max_kld_p99: float | None = None
    # 0.95, not 0.98: on a pretrained vocabulary of 49k-262k tokens many next tokens are near ties,
    # and what users deploy there flips more of them than a byte-level model's INT8 does: llama.cpp
    # Q8_0 agrees on 95.6% (SmolLM2-135M) and 97.0% (Gemma 3 270M) of top-1 tokens at KL 0.0052 and
    # 0.0032 (reports/real-models). A bar Q8_0 fails would reject every INT8 deployment of those
    # checkpoints; the KL and PPL ratio bounds still hold each model to Q8_0's neighbourhood.
    min_top1: float | None = 0.95
    max_latency_ratio: float | None = None
    min_gen_speed_ratio: float | None = None
    min_gen_tokens_per_s: float | None = None
    min_gen_agreement: float | None = None
    require_provider: tuple[str, ...] = ()
    recipes: tuple[str, ...] = ()
    collapse_margin: float | None = DEFAULT_COLLAPSE_MARGIN   # None: no training-status check
    baseline: BaselinePolicy = BaselinePolicy()   # what `gate --baseline` allows ([gate.baseline])

    def __post_init__(self) -> None:
        if not isinstance(self.baseline, BaselinePolicy):
            raise PolicyError(f"policy key 'baseline' must be a BaselinePolicy, got {type(self.baseline).__name__}")
        for key in _FLOAT_KEYS:
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PolicyError(f"policy key {key!r} must be a number (float), got {type(value).__name__}")
            if not math.isfinite(value):
                raise PolicyError(f"policy key {key!r} must be a finite number, got {value}")
            object.__setattr__(self, key, float(value))
        for key in ("max_ppl_ratio", "max_latency_ratio", "min_gen_speed_ratio", "min_gen_tokens_per_s"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise PolicyError(f"policy key {key!r} must be > 0, got {value}")
        for key in ("max_kld", "max_kld_p99", "collapse_margin"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise PolicyError(f"policy key {key!r} must be >= 0, got {value}")
        for key in ("min_top1", "min_gen_agreement"):
            value = getattr(self, key)
            if value is not None and not 0.0 <= value <= 1.0:
                raise PolicyError(f"policy key {key!r} must be in [0, 1] (a fraction, not %), got {value}")
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
        if self.min_gen_speed_ratio is not None:
            parts.append(f"generation tokens/s INT8/FP32 >= {self.min_gen_speed_ratio:g}")
        if self.min_gen_tokens_per_s is not None:
            parts.append(f"generation >= {self.min_gen_tokens_per_s:g} tokens/s")
        if self.min_gen_agreement is not None:
            parts.append(f"greedy tokens identical to FP32's before divergence >= {self.min_gen_agreement:g}")
        if self.collapse_margin is not None:
            parts.append(f"trained (eval bits/byte >= {self.collapse_margin:g} below the unigram baseline)")
        if self.require_provider:
            parts.append("measured on " + ", ".join(short_provider(p) for p in self.require_provider))
        parts.append("recipes that must pass: " + (", ".join(self.recipes) if self.recipes else
                                                   "at least one (the best)"))
        return "; ".join(parts)

    def accuracy_failures(self, accuracy: dict[str, Any]) -> list[str]:
        """The accuracy thresholds ``accuracy`` (a recipe's accuracy block, or a search trial's
        numbers) does not meet, as ``"<metric> <value> not <op> <threshold>"``; a metric the policy
        needs that is absent or not a finite number fails ("missing"). [] when it is accepted."""
        failures = []
        for key, metric, op in ACCURACY_LIMITS:
            threshold = getattr(self, key)
            if threshold is None:
                continue
            value = accuracy.get(metric)
            if not _finite(value):
                failures.append(f"{metric} missing")
            elif not within(value, op, threshold):
                failures.append(f"{metric} {value:.6g} not {op} {threshold:g}")
        return failures

    def accepts_accuracy(self, accuracy: dict[str, Any]) -> bool:
        """Whether ``accuracy`` meets every accuracy threshold of the policy."""
        return not self.accuracy_failures(accuracy)


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
    table = dict(table)
    if "baseline" in table:
        table["baseline"] = baseline_from_mapping(table["baseline"], source)
    for key, value in table.items():
        if key == "baseline":
            continue
        if key not in known:
            raise _unknown_key(source, key, where, sorted(known))
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
DEFAULT_POLICY = Policy()  # the one set of defaults: the search, `evaluate` and `quantnorm gate` start from it
# The defaults before min_top1 went from 0.98 to 0.95: what a run that recorded no ``policy`` section
# (written before runs recorded it) was held to, so its report reads as it did.
UNRECORDED_POLICY = replace(DEFAULT_POLICY, min_top1=0.98)


def resolve_policy(path: str | Path | None = None, **overrides: Any) -> Policy:
    """The policy file's (``path``; None: the defaults), with ``overrides`` on top (a None value:
    not given, the file's or the default stands): what ``--policy FILE`` and the flags make."""
    return (load_policy(path) if path is not None else DEFAULT_POLICY).override(**overrides)
