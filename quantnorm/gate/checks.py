"""The gate's checks: a policy applied to one validated results.json -> a RunVerdict.

The checks are two tables, RUN_CHECKS and RECIPE_CHECKS. A number the policy needs that the run
does not have or did not measure (``latency[].status = "not measured: ..."``, a recipe whose
status is ``broken: ...``) is a failing check whose reason says what was missing; it never passes.
The accuracy thresholds are the policy's one table (quantnorm.policy.ACCURACY_LIMITS), the one the
search judges its trials by.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import results as results_file
from ..errors import QuantnormError
from ..measure.sessions import short_provider
from ..policy import ACCURACY_LIMITS, GENERATION_LIMITS, Policy, within
from ..results import FP32_VARIANT, OK_STATUS, is_pretrained, latency_rows, source_kind, status_from_results
from .verdict import Check, ResultsError, RunVerdict


def validate_results(results: Any, source: str = "results") -> None:
    """ResultsError (a GateError: exit code 2) unless ``results`` is a well-formed results.json of a
    supported schema whose every gated number is finite and physically possible
    (quantnorm.results.validate, the contract's own validator). One line naming ``source`` and the field."""
    try:
        results_file.validate(results, source)
    except results_file.ResultsError as exc:
        raise ResultsError(str(exc)) from None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _describe_bad(value: Any) -> str:
    if isinstance(value, float):
        return f"is {value} (not a finite number)"
    return f"is {value!r} (not a number)"


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
    for key, metric, op in ACCURACY_LIMITS:
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
        passed = ok and within(value, op, threshold)
        reason = "" if passed else ("recipe is not usable" if not ok else f"{value:.6g} not {limit}")
        out.append(Check(name, metric, float(value), limit, passed, reason))
    return out


def _provider_checks(results: dict, entry: dict, policy: Policy) -> list[Check]:
    name = entry["name"]
    out: list[Check] = []
    for provider in policy.require_provider:
        short = short_provider(provider)
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
        short = short_provider(str(provider))
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
def _generation_checks(results: dict, entry: dict, policy: Policy) -> list[Check]:
    """Generation speed (tokens/s, absolute and as a ratio to FP32 at the same provider and batch,
    every measured row) and agreement, from ``results["generation"]``; a run without it fails."""
    wanted = [(metric, getattr(policy, key)) for key, metric in GENERATION_LIMITS if getattr(policy, key) is not None]
    if not wanted:
        return []
    name = entry["name"]
    model = results_file.generation_model(results, name)
    fp32 = results_file.generation_model(results, FP32_VARIANT)
    out: list[Check] = []
    for metric, threshold in wanted:
        limit = f">= {threshold:g}"
        if model is None or not model.ok:
            why = "no generation section (run evaluate with --generation)" if model is None else f"recipe {model.status}"
            out.append(Check(name, metric, None, limit, False, f"missing: {why}"))
            continue
        if metric == "identical_before_divergence":
            value = (model.agreement or {}).get(metric)
            out.append(_at_least(name, metric, value, threshold, limit))
            continue
        rows = [r for r in model.decode if r.get("status") == results_file.MEASURED]
        if not rows:
            out.append(Check(name, metric, None, limit, False, "missing: no measured decode row"))
        for row in rows:
            label = f"{metric} {short_provider(row['provider'])} b={row['batch']}"
            value = row.get("gen_tokens_per_s")
            if metric == "gen_speed_ratio":
                base = next((r for r in (fp32.decode if fp32 else []) if r.get("provider") == row["provider"]
                             and r.get("batch") == row["batch"] and r.get("status") == results_file.MEASURED), None)
                value = value / base["gen_tokens_per_s"] if base and _is_number(value) and \
                    _is_number(base.get("gen_tokens_per_s")) and base["gen_tokens_per_s"] > 0 else None
            out.append(_at_least(name, label, value, threshold, limit))
    return out


def _at_least(name: str, label: str, value, threshold: float, limit: str) -> Check:
    if not _is_number(value):
        return Check(name, label, None, limit, False, f"missing: {label} {_describe_bad(value)}")
    passed = value >= threshold
    return Check(name, label, float(value), limit, passed, "" if passed else f"{value:.6g} not {limit}")


RECIPE_CHECKS: tuple[RecipeCheckFn, ...] = (_status_check, _accuracy_checks, _provider_checks, _latency_checks,
                                            _generation_checks)


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
