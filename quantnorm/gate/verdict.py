"""The gate's verdicts: the check tables applied to validated results.json files."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .. import results as results_file
from ..errors import QuantnormError
from ..manifest import MANIFEST_FILE
from ..measure.sessions import short_provider
from ..policy import ACCURACY_CHECKS, Policy, meets
from ..results import (
    FP32_VARIANT,
    OK_STATUS,
    describe_bad,
    is_number,
    is_pretrained,
    latency_rows,
    source_kind,
    status_from_results,
    validate_results,
)
from ..runs import CONFIG_FILE, RESULTS_FILE, TRAIN_SUMMARY_FILE

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


class GateError(QuantnormError):
    """The gate cannot judge: a result is missing, unreadable, corrupt or of another schema."""


class ResultsError(GateError, results_file.ResultsError):
    """A results.json the gate was given is malformed (quantnorm.results.validate_results said why)."""


def _validated(results: dict, source: str) -> None:
    try:
        validate_results(results, source)
    except results_file.ResultsError as exc:
        raise ResultsError(str(exc)) from None


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
    for key, metric, op in ACCURACY_CHECKS:
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
        if not is_number(value):
            out.append(Check(name, metric, None, limit, False, f"missing: accuracy.{metric} {describe_bad(value)}"))
            continue
        passed = ok and meets(value, op, threshold)
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
                elif not is_number(r.p50_ms):
                    why = f"p50_ms {describe_bad(r.p50_ms)}"
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
            if not is_number(p_int8) or not is_number(p_fp32) or p_fp32 <= 0:
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
    _validated(results, source)
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
    _validated(results, str(path))
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
