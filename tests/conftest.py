"""Suite-wide rules.

Strict skips (``QUANTNORM_STRICT_SKIPS=1``, set by ``.ci/run``): a test may skip only because a
GPU is present or absent (its reason names ``GPU`` or ``CUDA``); any other skip (a missing
package, a missing model pack, an xfail) fails the session. Otherwise CI could go green without
running the Hugging Face or Ray tests at all.
"""

import os
import re

import pytest

pytest_plugins = ["pytester"]  # tests/test_conftest.py runs small inner sessions

STRICT_SKIPS_ENV = "QUANTNORM_STRICT_SKIPS"
ALLOWED_SKIP = re.compile(r"\b(GPU|CUDA)\b")

_refused: list[tuple[str, str]] = []


def _reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)
    return reason.removeprefix("Skipped: ")


def _check(report) -> None:
    if report.skipped and os.environ.get(STRICT_SKIPS_ENV) == "1":
        reason = _reason(report)
        if hasattr(report, "wasxfail") or not ALLOWED_SKIP.search(reason):
            _refused.append((report.nodeid, reason))


def pytest_runtest_logreport(report):
    _check(report)


def pytest_collectreport(report):  # a module-level importorskip skips the whole file at collection
    _check(report)


def pytest_terminal_summary(terminalreporter):
    if _refused:
        terminalreporter.section("skips refused (only GPU presence/absence may skip a test)", red=True)
        for nodeid, reason in _refused:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _refused and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
