"""The gate's report and its formats: the Markdown verdict table, JUnit XML, the CI step summary,
and the ERROR versions written when nothing could be judged (exit 2)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fileio import write_text_atomic
from ..policy import Policy
from .verdict import EXIT_FAIL, EXIT_PASS, Check, GateError, RunVerdict, reason


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
        raise GateError(f"cannot append the summary to {path} ({reason(exc)})") from None


def write_junit(path: str | Path, xml_text: str) -> None:
    try:
        write_text_atomic(path, xml_text)
    except OSError as exc:
        raise GateError(f"cannot write the JUnit report {path} ({reason(exc)})") from None


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


def write_outputs(report: GateReport, summary: str | Path | None = None, junit: str | Path | None = None) -> None:
    """The verdict appended to ``summary`` (Markdown) and written to ``junit`` (XML), where given."""
    if summary is not None:
        append_summary(summary, report.markdown())
    if junit is not None:
        write_junit(junit, report.junit_xml())
