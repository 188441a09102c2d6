"""The gate's verdicts: one Check per number and threshold, a RunVerdict per results.json, a
Change per number compared with a baseline run's (a BaselineVerdict per pair of runs), and the
gate's errors and exit codes."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QuantnormError

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


class GateError(QuantnormError):
    """The gate cannot judge: a result is missing, unreadable, corrupt or of another schema."""


class ResultsError(GateError):
    """A results.json is malformed or holds a number no measurement can produce."""


def reason(exc: BaseException) -> str:
    """An OS or parse error's one-line reason."""
    return getattr(exc, "strerror", None) or str(exc).splitlines()[0]


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


# A Change's verdict. NOT_COMPARABLE (latency measured on other hardware) and SKIPPED (a number one
# side does not have, a recipe broken in both) neither pass nor fail; NEW lists a recipe the baseline lacks.
PASS, FAIL, NOT_COMPARABLE, SKIPPED, NEW = "pass", "FAIL", "not comparable", "skipped", "new"


@dataclass(frozen=True)
class Change:
    """One number of the candidate run compared with the baseline run's."""

    recipe: str | None       # None: the run as a whole
    name: str                # e.g. "kld_mean", "latency CPU fp32 b=8", "recipe"
    baseline: float | None
    candidate: float | None
    change: str              # e.g. "+0.003 (+300%)"
    tolerance: str           # what the change may be, e.g. "+0.0002 and +25%"
    verdict: str             # PASS, FAIL, NOT_COMPARABLE, SKIPPED or NEW
    reason: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict == FAIL


@dataclass(frozen=True)
class BaselineVerdict:
    """A candidate run compared with its baseline run: fails when any Change fails."""

    candidate: str    # the candidate's results.json path
    baseline: str     # the baseline's results.json path
    changes: tuple[Change, ...]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.failed)
