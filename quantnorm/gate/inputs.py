"""The gate's inputs: results files, run directories and sweep directories -> the results to judge
(read by quantnorm.results, the one loader, and validated by it), run_gate over them all, and
run_baseline_gate: the same, each candidate run also compared with its baseline run."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .. import results as results_file
from ..manifest import MANIFEST_FILE
from ..policy import Policy
from ..runs import CONFIG_FILE, RESULTS_FILE, TRAIN_SUMMARY_FILE
from .baseline import compare_runs, model_identity, pairing_key, unpaired
from .checks import evaluate_gate, validate_results
from .report import GateReport
from .verdict import BaselineVerdict, Check, GateError, RunVerdict, reason


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
        raise GateError(f"{manifest} cannot be read ({reason(exc)})") from None
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


def _as_list(paths: str | Path | Iterable[str | Path]) -> list[str | Path]:
    return [paths] if isinstance(paths, (str, Path)) else list(paths)


def _files(paths: list[str | Path]) -> list[Path]:
    return [file for path in paths for file in resolve_inputs(path)[0]]


def _pairs(bases: list[tuple[Path, dict]], cands: list[tuple[Path, dict]]) -> list[BaselineVerdict | tuple]:
    """Each candidate run with the baseline run of the same model (pairing_key); one run on each
    side are a pair whatever they are (compare_runs then refuses another model). A run without a
    partner becomes an ``unpaired`` verdict."""
    if len(bases) == 1 and len(cands) == 1:
        return [(bases[0], cands[0])]
    index: dict[str, tuple[Path, dict]] = {}
    for path, results in bases:
        key = pairing_key(results)
        if key in index:
            raise GateError(f"{index[key][0]} and {path} are runs of one model in the baseline: the gate cannot "
                            f"tell which to compare the candidate with; give one of them")
        index[key] = (path, results)
    out: list[BaselineVerdict | tuple] = []
    for path, results in cands:
        base = index.pop(pairing_key(results), None)
        out.append((base, (path, results)) if base is not None else unpaired(str(path), "candidate"))
    if not any(isinstance(p, tuple) for p in out):
        model = ", ".join(f"{k}={v}" for k, v in model_identity(cands[0][1]).items())
        raise GateError(f"no baseline run is of a candidate's model (e.g. {model}): give a baseline of the same "
                        f"model(s)")
    return out + [unpaired(str(path), "baseline") for path, _ in index.values()]


def run_baseline_gate(candidates: str | Path | Iterable[str | Path], baselines: str | Path | Iterable[str | Path],
                      policy: Policy) -> GateReport:
    """Gate the candidate runs by ``policy`` (run_gate) and compare each with the baseline run of the
    same model (quantnorm.gate.baseline). Refused (GateError): a file given as both, a baseline of
    another model or results schema, a baseline without recipes, anything unreadable."""
    candidates, baselines = _as_list(candidates), _as_list(baselines)
    if not baselines:
        raise GateError("no baseline: give main's results.json, run directory or sweep directory")
    cand_files, base_files = _files(candidates), _files(baselines)
    same = {f.resolve() for f in cand_files} & {f.resolve() for f in base_files}
    if same:
        raise GateError(f"{min(same)} is given as both the candidate and the baseline: give the baseline's own "
                        f"results (e.g. main's, kept as an artifact)")
    report = run_gate(candidates, policy)
    cands = [(f, load_results_file(f)) for f in cand_files]
    bases = [(f, load_results_file(f)) for f in base_files]
    verdicts = [p if isinstance(p, BaselineVerdict) else
                compare_runs(p[0][1], p[1][1], policy, base_src=str(p[0][0]), cand_src=str(p[1][0]))
                for p in _pairs(bases, cands)]
    return GateReport(policy=policy, runs=report.runs, baselines=tuple(verdicts))
