"""The gate's report and its formats: the Markdown verdict table (its first line says PASS or FAIL
and why), JUnit XML, JSON for scripts, the CI step summary (GitHub's is capped at 1 MiB: a longer
one is cut with a note), and the ERROR versions written when nothing could be judged (exit 2)."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..fileio import write_text_atomic
from ..policy import Policy
from .verdict import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_PASS,
    FAIL,
    NEW,
    NOT_COMPARABLE,
    PASS,
    BaselineVerdict,
    Check,
    GateError,
    RunVerdict,
    reason,
)

# GitHub Actions refuses a step summary over 1 MiB ("$GITHUB_STEP_SUMMARY upload aborted").
GITHUB_SUMMARY_LIMIT = 1024 * 1024
GITHUB_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


@dataclass(frozen=True)
class GateReport:
    policy: Policy
    runs: tuple[RunVerdict, ...]
    baselines: tuple[BaselineVerdict, ...] = ()   # with --baseline: each candidate run against its baseline

    @property
    def passed(self) -> bool:
        return bool(self.runs) and all(r.passed for r in self.runs) and all(b.passed for b in self.baselines)

    def why(self) -> str:
        """The verdict's reason in one line: the first failures, or what passed."""
        failures = [f"{_where(c.recipe)}{c.name}: {c.reason or 'failed'}" for r in self.runs if not r.passed
                    for c in (r.failures or r.checks) if not c.passed]
        failures += [f"{_where(c.recipe)}{c.name}: {c.reason} (against the baseline)"
                     for b in self.baselines for c in b.failures]
        if failures:
            more = f" (and {len(failures) - 2} more)" if len(failures) > 2 else ""
            return "; ".join(failures[:2]) + more
        if not self.runs:
            return "no run was judged"
        why = f"{len(self.runs)} run(s) meet the policy"
        if self.baselines:
            changes = [c for b in self.baselines for c in b.changes]
            other = sum(c.verdict == NOT_COMPARABLE for c in changes)
            why += f"; no regression against the baseline ({sum(c.verdict == PASS for c in changes)} checks pass" + \
                (f", {other} not comparable" if other else "") + ")"
        return why

    def to_dict(self) -> dict:
        return report_dict(self)

    @property
    def exit_code(self) -> int:
        return EXIT_PASS if self.passed else EXIT_FAIL

    def markdown(self) -> str:
        return report_markdown(self)

    def junit_xml(self) -> str:
        return report_junit(self)


def _where(recipe: str | None) -> str:
    return f"{recipe} " if recipe else ""


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value(check: Check) -> str:
    return "missing" if check.value is None and check.reason.startswith("missing") else \
        ("–" if check.value is None else f"{check.value:.6g}")


def _result(run: RunVerdict, check: Check) -> str:
    if check.passed:
        return "pass"
    return "**FAIL**" if run.blocking(check) else "fail (not blocking)"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.6g}"


def _baseline_markdown(report: GateReport) -> list[str]:
    lines = []
    for b in report.baselines:
        lines += [f"### Against the baseline: `{_md(b.candidate)}` vs `{_md(b.baseline)}`: "
                  f"{'PASS' if b.passed else 'FAIL'}", "",
                  "| recipe | check | baseline | candidate | change | tolerance | verdict | reason |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in b.changes:
            verdict = "**FAIL**" if c.verdict == FAIL else c.verdict
            lines.append(f"| {_md(c.recipe or '(run)')} | {_md(c.name)} | {_num(c.baseline)} | {_num(c.candidate)} | "
                         f"{_md(c.change)} | {_md(c.tolerance)} | {verdict} | {_md(c.reason)} |")
        lines.append("")
    return lines


def report_markdown(report: GateReport) -> str:
    verdict = "PASS" if report.passed else "FAIL"
    n_pass = sum(r.passed for r in report.runs)
    lines = [f"## quantnorm gate: {verdict}: {_md(report.why())}", "",
             f"Policy: {_md(report.policy.describe())}.", ""]
    if report.baselines:
        lines += [f"Against the baseline: {_md(report.policy.baseline.describe())}.", ""]
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
    lines += _baseline_markdown(report)
    failed = sum(not b.passed for b in report.baselines)
    against = f"; {failed} of {len(report.baselines)} regressed against the baseline" if report.baselines else ""
    lines.append(f"**Overall: {verdict}** ({n_pass} of {len(report.runs)} run(s) passed{against})")
    return "\n".join(lines) + "\n"


def error_markdown(message: str) -> str:
    return f"## quantnorm gate: ERROR: {_md(message)}\n\n**Overall: ERROR** (nothing was judged; exit code 2)\n"


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
    for b in report.baselines:
        _baseline_junit(root, b, totals)
    for k, v in totals.items():
        root.set(k, str(v))
    root.set("errors", "0")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _baseline_junit(root: ET.Element, b: BaselineVerdict, totals: dict[str, int]) -> None:
    """One testsuite per candidate run against its baseline: a FAIL is a <failure>, "not comparable"
    and "skipped" are <skipped>, a pass or a new recipe passes."""
    suite = ET.SubElement(root, "testsuite", name=f"{b.candidate} vs baseline {b.baseline}")
    counts = {"tests": 0, "failures": 0, "skipped": 0}
    for c in b.changes:
        case = ET.SubElement(suite, "testcase", classname=f"{b.candidate}:{c.recipe or '(run)'}:baseline",
                             name=c.name, time="0")
        counts["tests"] += 1
        detail = f"baseline {_num(c.baseline)}, candidate {_num(c.candidate)}, change {c.change}, " \
                 f"tolerance {c.tolerance}; {c.reason}"
        if c.verdict == FAIL:
            counts["failures"] += 1
            ET.SubElement(case, "failure", message=c.reason or "regressed", type="BaselineRegression").text = detail
        elif c.verdict not in (PASS, NEW):
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", message=f"{c.verdict}: {c.reason}")
    for k, v in counts.items():
        suite.set(k, str(v))
        totals[k] += v
    suite.set("errors", "0")


def report_dict(report: GateReport) -> dict:
    """The verdict for scripts (``--json``): verdict, why, exit code, every check and change."""
    return {
        "verdict": "PASS" if report.passed else "FAIL", "why": report.why(), "exit_code": report.exit_code,
        "policy": report.policy.describe(),
        "runs": [{"source": r.source, "passed": r.passed, "mode": r.mode, "recipes": list(r.recipes),
                  "passing_recipes": list(r.passing_recipes),
                  "checks": [{**asdict(c), "blocking": r.blocking(c)} for c in r.checks]} for r in report.runs],
        "baselines": [{"candidate": b.candidate, "baseline": b.baseline, "passed": b.passed,
                       "changes": [asdict(c) for c in b.changes]} for b in report.baselines],
    }


def error_dict(message: str) -> dict:
    return {"verdict": "ERROR", "why": message, "exit_code": EXIT_ERROR, "runs": [], "baselines": []}


def error_junit(message: str) -> str:
    root = ET.Element("testsuites", name="quantnorm gate", tests="1", failures="0", errors="1", skipped="0")
    suite = ET.SubElement(root, "testsuite", name="quantnorm gate", tests="1", failures="0", errors="1", skipped="0")
    case = ET.SubElement(suite, "testcase", classname="quantnorm gate", name="read inputs", time="0")
    ET.SubElement(case, "error", message=message, type="GateError").text = message
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def truncate_summary(markdown: str, limit: int) -> str:
    """``markdown`` cut at a line so that it takes at most ``limit`` bytes of UTF-8, with a note
    saying so (the first line, the verdict, always stays)."""
    data = markdown.encode("utf-8")
    if len(data) <= limit:
        return markdown
    note = (f"\n\n**Truncated**: the verdict is {len(data):,} bytes and the step summary takes at most "
            f"{limit:,}; the whole table is in the gate's output (and --junit, --json).\n")
    room = max(0, limit - len(note.encode("utf-8")))
    head = data[:room].decode("utf-8", errors="ignore")
    head = head[:head.rfind("\n")] if "\n" in head else head
    return head + note


def github_summary_path() -> Path:
    """$GITHUB_STEP_SUMMARY, the file GitHub Actions shows on the job's page; GateError when unset."""
    path = os.environ.get(GITHUB_SUMMARY_ENV)
    if not path:
        raise GateError(f"--github-summary: ${GITHUB_SUMMARY_ENV} is not set (not on GitHub Actions); "
                        f"give --summary FILE instead")
    return Path(path)


def append_summary(path: str | Path, markdown: str, limit: int | None = None) -> None:
    """Append Markdown to a file (e.g. $GITHUB_STEP_SUMMARY), cut to what keeps the file within
    ``limit`` bytes when given (the summary the step already wrote counts); unwritable -> GateError."""
    markdown = markdown if markdown.endswith("\n") else markdown + "\n"
    try:
        if limit is not None:
            used = Path(path).stat().st_size if Path(path).exists() else 0
            markdown = truncate_summary(markdown, max(0, limit - used))
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(markdown)
    except OSError as exc:
        raise GateError(f"cannot append the summary to {path} ({reason(exc)})") from None


def write_junit(path: str | Path, xml_text: str) -> None:
    try:
        write_text_atomic(path, xml_text)
    except OSError as exc:
        raise GateError(f"cannot write the JUnit report {path} ({reason(exc)})") from None


def write_json(path: str | Path, data: dict) -> None:
    try:
        write_text_atomic(path, json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise GateError(f"cannot write the JSON verdict {path} ({reason(exc)})") from None


def _summaries(summary: str | Path | None, github: bool) -> list[tuple[Path, int | None]]:
    out: list[tuple[Path, int | None]] = [(Path(summary), None)] if summary is not None else []
    if github:
        out.append((github_summary_path(), GITHUB_SUMMARY_LIMIT))
    return out


def write_error_outputs(message: str, summary: str | Path | None = None, junit: str | Path | None = None,
                        github_summary: bool = False, json_out: str | Path | None = None) -> None:
    """On an exit-2 error, still leave an ERROR summary, an <error> JUnit report and an ERROR JSON
    (best effort), so that CI artifacts never look like a pass."""
    try:
        summaries = _summaries(summary, github_summary)
    except GateError:
        summaries = _summaries(summary, False)
    for path, limit in summaries:
        try:
            append_summary(path, error_markdown(message), limit)
        except GateError:
            pass
    for path, write, text in ((junit, write_junit, error_junit(message)),
                              (json_out, write_json, error_dict(message))):
        if path is not None and str(path) != "-":
            try:
                write(path, text)
            except GateError:
                pass


def write_outputs(report: GateReport, summary: str | Path | None = None, junit: str | Path | None = None,
                  github_summary: bool = False, json_out: str | Path | None = None) -> None:
    """The verdict appended to ``summary`` and to $GITHUB_STEP_SUMMARY (``github_summary``; cut at
    GitHub's 1 MiB), written to ``junit`` (XML) and ``json_out`` (JSON; "-" is the caller's stdout)."""
    for path, limit in _summaries(summary, github_summary):
        append_summary(path, report.markdown(), limit)
    if junit is not None:
        write_junit(junit, report.junit_xml())
    if json_out is not None and str(json_out) != "-":
        write_json(json_out, report.to_dict())
