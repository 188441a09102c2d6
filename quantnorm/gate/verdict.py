"""The gate's verdicts: one Check per number and threshold, a RunVerdict per results.json, and
the gate's errors and exit codes."""

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
