"""The deployment gate: a policy (thresholds) applied to results.json files -> pass / fail.

Exit codes (``quantnorm gate``): 0 every run passes, 1 a run fails a check, 2 the gate could not
judge (missing, unreadable or corrupt input, a ``schema_version`` quantnorm.results does not read
(1 and 2), a ``model.source`` it does not know, a malformed or physically impossible results.json,
a bad policy or one that checks nothing).

It fails closed. A results.json is read by quantnorm.results.load (the one loader) and validated
first by quantnorm.results.validate (the contract's validator; here validate_results: NaN, a
negative KL, a fraction above 1, duplicate recipe names, a latency row without a provider, ... ->
ResultsError, exit 2, one line naming the file and the field). On a valid one, a number the policy needs that
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

The policy is quantnorm.policy's (the one the search ``--recipes auto`` judges its trials by, with
the same defaults). Policy file (TOML), either in a ``[gate]`` table or as top-level keys::

    [gate]
    max_ppl_ratio = 1.01        # accuracy.ppl_ratio      <= this
    max_kld = 0.01              # accuracy.kld_mean       <= this
    max_kld_p99 = 0.05          # accuracy.kld_p99        <= this   (optional)
    min_top1 = 0.98             # accuracy.top1_agreement >= this
    max_latency_ratio = 1.0     # INT8 p50 / FP32 p50     <= this   (optional)
    require_provider = ["cpu"]  # providers that must have measured latency rows
    recipes = []                # [] = the best recipe must pass; a list = each listed must pass
    collapse_margin = 0.8       # a trained model's eval bits/byte must be this far below the unigram baseline

Against a baseline (``quantnorm gate CANDIDATE --baseline BASELINE``, run_baseline_gate): the
candidate is gated as above and each of its runs is compared with the baseline run of the same
model, recipe by recipe (``baseline``: PPL ratio, KL mean, top-1 and generation agreement, model
size, each with an absolute and a relative tolerance from ``[gate.baseline]``; ``noise``: latency
judged against the spread the two runs measured, "not comparable" on other hardware). A dropped or
newly broken recipe fails; another model, another results schema, one file given as both or a
baseline without recipes is an error (exit 2).

Modules: ``checks`` (the check tables, evaluate_gate), ``inputs`` (files, run and sweep
directories, run_gate, run_baseline_gate), ``baseline`` (compare_runs), ``noise`` (latency against
its noise, hardware), ``report`` (GateReport; Markdown, JUnit, JSON, the step summary), ``verdict``
(Check, RunVerdict, Change, BaselineVerdict, errors, exit codes).

Library use::

    from quantnorm.gate import Policy, run_gate
    report = run_gate(["runs/pre-rms"], Policy(max_ppl_ratio=1.02))
    print(report.markdown()); raise SystemExit(report.exit_code)
"""

from __future__ import annotations

from ..policy import Policy, PolicyError, load_policy, normalize_provider_name, policy_from_mapping
from ..results import ACCURACY_RANGES, LATENCY_RANGES
from .baseline import compare_runs, model_identity
from .checks import RECIPE_CHECKS, RUN_CHECKS, RecipeCheckFn, RunCheckFn, evaluate_gate, validate_results
from .inputs import load_results_file, resolve_inputs, run_baseline_gate, run_gate
from .noise import hardware_differences, noise_change
from .report import (
    GITHUB_SUMMARY_LIMIT,
    GateReport,
    append_summary,
    error_dict,
    error_junit,
    error_markdown,
    report_dict,
    report_junit,
    report_markdown,
    truncate_summary,
    write_error_outputs,
    write_junit,
    write_outputs,
)
from .verdict import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_PASS,
    FAIL,
    NEW,
    NOT_COMPARABLE,
    PASS,
    SKIPPED,
    BaselineVerdict,
    Change,
    Check,
    GateError,
    ResultsError,
    RunVerdict,
)

__all__ = [
    "ACCURACY_RANGES", "EXIT_ERROR", "EXIT_FAIL", "EXIT_PASS", "FAIL", "GITHUB_SUMMARY_LIMIT", "LATENCY_RANGES",
    "NEW", "NOT_COMPARABLE", "PASS", "RECIPE_CHECKS", "RUN_CHECKS", "SKIPPED",
    "BaselineVerdict", "Change", "Check", "GateError", "GateReport", "Policy", "PolicyError", "RecipeCheckFn",
    "ResultsError", "RunCheckFn", "RunVerdict", "append_summary", "compare_runs", "error_dict", "error_junit", "error_markdown",
    "evaluate_gate", "hardware_differences", "load_policy", "load_results_file", "model_identity", "noise_change",
    "normalize_provider_name", "policy_from_mapping", "report_dict", "report_junit", "report_markdown",
    "resolve_inputs", "run_baseline_gate", "run_gate", "truncate_summary", "validate_results",
    "write_error_outputs", "write_junit", "write_outputs",
]
