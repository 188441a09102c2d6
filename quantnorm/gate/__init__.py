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

The policy and its file format: ``quantnorm.policy``. A results.json is validated by
``quantnorm.results.validate_results`` (the contract's owner).

Library use::

    from quantnorm.gate import Policy, report_markdown, run_gate
    report = run_gate(["runs/pre-rms"], Policy(max_ppl_ratio=1.02))
    print(report_markdown(report)); raise SystemExit(report.exit_code)
"""

from ..policy import Policy, PolicyError, load_policy, policy_from_mapping
from ..results import ACCURACY_RANGES, LATENCY_RANGES, validate_results
from .output import (
    append_summary,
    error_junit,
    error_markdown,
    report_junit,
    report_markdown,
    write_error_outputs,
    write_junit,
)
from .verdict import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_PASS,
    RECIPE_CHECKS,
    RUN_CHECKS,
    Check,
    GateError,
    GateReport,
    ResultsError,
    RunVerdict,
    evaluate_gate,
    load_results_file,
    resolve_inputs,
    run_gate,
)

__all__ = [
    "ACCURACY_RANGES", "EXIT_ERROR", "EXIT_FAIL", "EXIT_PASS", "LATENCY_RANGES", "RECIPE_CHECKS", "RUN_CHECKS",
    "Check", "GateError", "GateReport", "Policy", "PolicyError", "ResultsError", "RunVerdict", "append_summary",
    "error_junit", "error_markdown", "evaluate_gate", "load_policy", "load_results_file", "policy_from_mapping",
    "report_junit", "report_markdown", "resolve_inputs", "run_gate", "validate_results", "write_error_outputs",
    "write_junit",
]
