"""quantnorm gate: exit 0 pass, 1 fail, 2 error; fail closed. Synthetic results.json dicts only."""

import copy
import json
import math
import xml.etree.ElementTree as ET

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantnorm.cli import main
from quantnorm.gate import (
    ACCURACY_RANGES,
    LATENCY_RANGES,
    GateError,
    Policy,
    PolicyError,
    ResultsError,
    evaluate_gate,
    load_policy,
    run_gate,
    validate_results,
)

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"


def _acc(ppl_ratio=1.001, kld_mean=0.001, kld_p99=0.01, top1=0.995):
    return {"ppl_fp32": 7.0, "ppl_int8": 7.0 * ppl_ratio, "ppl_ratio": ppl_ratio, "kld_mean": kld_mean,
            "kld_p99": kld_p99, "kld_max": max(0.1, kld_mean, kld_p99), "top1_agreement": top1}


def _row(provider, variant, batch, p50=None, status="measured"):
    row = {"provider": provider, "variant": variant, "batch": batch, "seq": 32, "status": status}
    if status == "measured":
        row.update(p50_ms=p50, p90_ms=p50 * 1.1, p99_ms=p50 * 1.2, tokens_per_s=batch * 32 / p50 * 1e3)
    return row


def results(**acc) -> dict:
    """A passing results.json (schema 1): two recipes, CPU measured, CUDA not measured."""
    return {
        "schema_version": 1, "quantnorm_version": "0.1.0", "command": "quantnorm evaluate ...",
        "recipes": [
            {"name": "static-minmax-matmul", "status": "ok", "accuracy": _acc(**acc)},
            {"name": "dynamic", "status": "ok", "accuracy": _acc(**acc)},
        ],
        "latency": [
            _row(CPU, "fp32", 1, 2.0), _row(CPU, "static-minmax-matmul", 1, 1.5), _row(CPU, "dynamic", 1, 1.8),
            _row(CUDA, "fp32", 1, status="not measured: no CUDA device"),
            _row(CUDA, "static-minmax-matmul", 1, status="not measured: no CUDA device"),
            _row(CUDA, "dynamic", 1, status="not measured: no CUDA device"),
        ],
    }


def write(path, data) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def gate(argv, capsys):
    code = main(["gate", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def assert_one_line_error(err, *needles):
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


# ---- exit 0 / 1 -----------------------------------------------------------------------------


def test_passing_run_exits_0_with_table(tmp_path, capsys):
    run = tmp_path / "run"
    write(run / "results.json", results())
    code, out, _ = gate([run], capsys)  # a run directory
    assert code == 0
    assert "quantnorm gate: PASS" in out and "| recipe | check | value | threshold | result |" in out
    assert "| dynamic | ppl_ratio | 1.001 | <= 1.01 | pass |" in out
    assert gate([run / "results.json"], capsys)[0] == 0  # the file itself


@pytest.mark.parametrize("acc, flag, check", [
    ({"ppl_ratio": 1.05}, [], "ppl_ratio"),
    ({"kld_mean": 0.05}, [], "kld_mean"),
    ({"top1": 0.9}, [], "top1_agreement"),
    ({"kld_p99": 0.3}, ["--max-kld-p99", "0.1"], "kld_p99"),
    ({}, ["--max-latency-ratio", "0.5"], "latency_ratio CPU b=1"),
    ({}, ["--max-ppl-ratio", "1.0005"], "ppl_ratio"),  # a flag tightens the default
])
def test_each_threshold_fails_with_exit_1(tmp_path, capsys, acc, flag, check):
    path = write(tmp_path / "results.json", results(**acc))
    code, out, err = gate([path, *flag], capsys)
    assert code == 1 and err == ""
    assert "quantnorm gate: FAIL" in out and f"| {check} |" in out and "**FAIL**" in out


def test_latency_ratio_value_and_pass(tmp_path, capsys):
    verdict = evaluate_gate(results(), Policy(max_latency_ratio=0.8))
    ratios = {c.recipe: c for c in verdict.checks if c.name.startswith("latency_ratio")}
    assert ratios["static-minmax-matmul"].value == pytest.approx(0.75) and ratios["static-minmax-matmul"].passed
    assert not ratios["dynamic"].passed  # 1.8 / 2.0 = 0.9
    assert verdict.passed and verdict.passing_recipes == ("static-minmax-matmul",)


def test_best_mode_one_passing_recipe_is_enough_but_listed_mode_is_strict(tmp_path, capsys):
    data = results()
    data["recipes"][1]["accuracy"] = _acc(ppl_ratio=1.5)  # dynamic fails
    path = write(tmp_path / "results.json", data)
    code, out, _ = gate([path], capsys)
    assert code == 0 and "fail (not blocking)" in out and "`static-minmax-matmul`" in out
    assert gate([path, "--recipe", "dynamic"], capsys)[0] == 1
    assert gate([path, "--recipe", "static-minmax-matmul"], capsys)[0] == 0
    code, out, _ = gate([path, "--recipe", "static-entropy"], capsys)  # not evaluated: never passes
    assert code == 1 and "was not evaluated" in out


# ---- fail closed: a missing number is a failing check ----------------------------------------


def test_broken_recipe_never_passes(tmp_path, capsys):
    data = results()
    for r in data["recipes"]:
        r["status"] = "broken: NaN scale in head/MatMul"
        del r["accuracy"]
    code, out, _ = gate([write(tmp_path / "results.json", data)], capsys)
    assert code == 1 and "broken: NaN scale" in out and "missing: recipe broken" in out
    # broken even though accuracy numbers exist
    data = results()
    data["recipes"][0]["status"] = "broken: saturates"
    verdict = evaluate_gate(data, Policy(recipes=("static-minmax-matmul",)))
    assert not verdict.passed


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: [r["accuracy"].pop("kld_mean") for r in d["recipes"]], "accuracy.kld_mean absent"),
    (lambda d: d.__setitem__("recipes", []), "lists no recipe"),
])
def test_missing_number_fails_exit_1(tmp_path, capsys, mutate, reason):
    """A well-formed run that lacks a number the policy needs (an encoder has no perplexity) fails."""
    data = results()
    mutate(data)
    code, out, _ = gate([write(tmp_path / "results.json", data)], capsys)
    assert code == 1 and reason in out


def _set(path, value):
    """A mutation of results(): set the key at ``path`` (a tuple of keys and indices) to ``value``."""
    def mutate(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return mutate


def _drop(path):
    def mutate(d):
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]
    return mutate


ACC = ("recipes", 0, "accuracy")
LAT = ("latency", 0)
# every malformed or impossible results.json the gate must refuse to judge: (mutation, field named)
MALFORMED = [
    (_set(("schema_version",), 3), "schema_version 3"),
    (_set(("schema_version",), "1"), "schema_version '1'"),
    (_set(("schema_version",), True), "schema_version True"),
    (_drop(("recipes",)), "recipes is missing"),
    (_set(("recipes",), {"dynamic": {}}), "recipes must be a list"),
    (_set(("recipes", 0), "dynamic"), "recipes[0] must be an object"),
    (_drop(("recipes", 0, "name")), "recipes[0].name must be a non-empty string"),
    (_set(("recipes", 1, "name"), "static-minmax-matmul"), "recipes[1].name 'static-minmax-matmul' duplicates recipes[0]"),
    (_set(("recipes", 1, "name"), "fp32"), "recipes[1].name 'fp32' is the FP32 baseline"),
    (_set(("recipes", 0, "status"), "fine"), "recipes[0].status is 'fine'"),
    (_drop(ACC), "recipes[0].accuracy is missing"),
    (_set(ACC, [1.0]), "recipes[0].accuracy must be an object"),
    (_set(ACC + ("ppl_ratio",), float("nan")), "recipes[0].accuracy.ppl_ratio is nan, not a finite"),
    (_set(ACC + ("kld_mean",), float("inf")), "recipes[0].accuracy.kld_mean is inf, not a finite"),
    (_set(ACC + ("top1_agreement",), "0.99"), "recipes[0].accuracy.top1_agreement is '0.99', not a number"),
    (_set(ACC + ("top1_agreement",), None), "recipes[0].accuracy.top1_agreement is None, not a number"),
    (_set(ACC + ("kld_mean",), -1.0), "recipes[0].accuracy.kld_mean = -1.0 is impossible: a KL divergence is >= 0"),
    (_set(ACC + ("kld_p99",), -0.5), "kld_p99 = -0.5 is impossible"),
    (_set(ACC + ("top1_agreement",), 1.5), "top1_agreement = 1.5 is impossible: a fraction lies in [0, 1]"),
    (_set(ACC + ("top1_agreement",), -0.1), "top1_agreement = -0.1 is impossible"),
    (_set(ACC + ("nn_agreement",), 2), "nn_agreement = 2 is impossible"),
    (_set(ACC + ("cosine_mean",), 1.2), "cosine_mean = 1.2 is impossible: a cosine"),
    (_set(ACC + ("ppl_ratio",), 0.0), "ppl_ratio = 0.0 is impossible: a ratio of perplexities is > 0"),
    (_set(ACC + ("ppl_ratio",), -1.001), "ppl_ratio = -1.001 is impossible"),
    (_set(ACC + ("ppl_fp32",), 0.5), "ppl_fp32 = 0.5 is impossible: a perplexity is >= 1"),
    (_set(ACC + ("ppl_ratio",), 0.9), "ppl_ratio = 0.9 is not ppl_int8 / ppl_fp32"),
    (_set(ACC + ("kld_mean",), 0.5), "kld_mean = 0.5 exceeds kld_max"),
    (_set(ACC + ("n_scored",), 1.5), "n_scored = 1.5 must be an integer"),
    (_set(ACC + ("extra",), float("nan")), "accuracy.extra is nan"),
    (_set(("latency",), {}), "latency must be a list"),
    (_set(LAT, "fast"), "latency[0] must be an object"),
    (_drop(LAT + ("provider",)), "latency[0].provider must be a non-empty string"),
    (_set(LAT + ("provider",), ""), "latency[0].provider must be a non-empty string"),
    (_drop(LAT + ("variant",)), "latency[0].variant must be a non-empty string"),
    (_drop(LAT + ("status",)), "latency[0].status is None"),
    (_set(LAT + ("status",), "skipped"), "latency[0].status is 'skipped'"),
    (_drop(LAT + ("p50_ms",)), "latency[0].p50_ms is missing in a measured row"),
    (_set(LAT + ("p50_ms",), 0.0), "latency[0].p50_ms = 0.0 is impossible: a latency is > 0 ms"),
    (_set(LAT + ("p50_ms",), float("nan")), "latency[0].p50_ms is nan"),
    (_set(LAT + ("p99_ms",), 1.0), "latency[0] percentiles are not ordered"),
    (_set(LAT + ("batch",), 0), "latency[0].batch = 0 is impossible"),
    (_set(("latency", 1), _row(CPU, "fp32", 1, 2.0)), "latency[1] duplicates latency[0]"),
]


@pytest.mark.parametrize("mutate, needle", MALFORMED)
def test_malformed_results_exit_2_naming_file_and_field(tmp_path, capsys, mutate, needle):
    data = results()
    mutate(data)
    path = write(tmp_path / "run" / "results.json", json.dumps(data))  # NaN/Infinity: Python's JSON extension
    code, out, err = gate([path], capsys)
    assert code == 2 and out == "", (out, err)
    assert_one_line_error(err, str(path), needle)
    with pytest.raises(ResultsError, match="^src: ") as info:  # the Python API refuses the same
        evaluate_gate(data, Policy(), source="src")
    assert needle in str(info.value) and isinstance(info.value, GateError)


def test_broken_recipe_without_accuracy_and_fp16_recipe_are_well_formed(tmp_path, capsys):
    """RESULTS.md: a recipe that could not run is {name, status: "broken: ..."} with no accuracy
    block (a failing check, never an error); fp16 is a recipe like the INT8 ones."""
    data = results()
    data["recipes"] = [{"name": "smoothquant", "status": "broken: no norm to fold into"},
                       {"name": "rotate", "status": "not applicable: no rotation for bert"},
                       {"name": "fp16", "status": "ok", "accuracy": _acc(ppl_ratio=1.0)}]
    data["latency"].append(_row(CPU, "fp16", 1, 1.9))
    path = write(tmp_path / "results.json", data)
    code, out, _ = gate([path, "--require-provider", "cpu"], capsys)
    assert code == 0 and "`fp16`" in out and "recipe broken: no norm to fold into" in out
    assert gate([path, "--recipe", "smoothquant"], capsys)[0] == 1  # broken never passes
    code, out, _ = gate([path, "--recipe", "rotate"], capsys)  # nor does a recipe that does not apply
    assert code == 1 and "recipe not applicable: no rotation for bert" in out
    data["recipes"] = data["recipes"][:2]
    assert gate([write(tmp_path / "results.json", data)], capsys)[0] == 1


def test_committed_reports_are_well_formed():
    """Every results.json the repository ships validates: the rules refuse nothing real."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parent.parent / "reports").rglob("results.json"))
    assert len(files) > 10
    for f in files:
        validate_results(json.loads(f.read_text()), str(f))


def test_required_provider_not_measured_fails(tmp_path, capsys):
    path = write(tmp_path / "results.json", results())
    assert gate([path, "--require-provider", "cpu"], capsys)[0] == 0
    code, out, _ = gate([path, "--require-provider", "cpu,cuda"], capsys)
    assert code == 1 and "| provider CUDA |" in out and "not measured: no CUDA device" in out
    # no rows at all for a required provider also fails
    code, out, _ = gate([path, "--require-provider", "tensorrt"], capsys)
    assert code == 1 and "no latency row" in out
    # the latency ratio on a required provider that was not measured is missing, not skipped
    verdict = evaluate_gate(results(), Policy(require_provider=("cuda",), max_latency_ratio=10))
    assert not verdict.passed
    assert any(c.name == "latency_ratio CUDA" and c.reason.startswith("missing") for c in verdict.failures)


# ---- exit 2: one-line errors ------------------------------------------------------------------


def test_missing_path_exits_2(tmp_path, capsys):
    code, out, err = gate([tmp_path / "nope"], capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, "nope", "not found")
    code, _, err = gate([tmp_path / "nope.json"], capsys)
    assert code == 2


def test_run_dir_without_results_exits_2(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    write(tmp_path / "run" / "config.json", {})
    code, _, err = gate([tmp_path / "run"], capsys)
    assert code == 2
    assert_one_line_error(err, "results.json not found", "quantnorm evaluate")


def test_corrupt_json_exits_2(tmp_path, capsys):
    path = write(tmp_path / "results.json", '{"schema_version": 1, "recipes": [')
    code, out, err = gate([path], capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, "not valid JSON")


@pytest.mark.parametrize("data, needle", [
    ({**results(), "schema_version": 0}, "schema_version 0"),
    ({"recipes": []}, "no schema_version"),
    ([1, 2], "no schema_version"),
])
def test_wrong_schema_exits_2(tmp_path, capsys, data, needle):
    code, _, err = gate([write(tmp_path / "results.json", data)], capsys)
    assert code == 2
    assert_one_line_error(err, needle)
    with pytest.raises(GateError, match="schema_version"):
        evaluate_gate(data, Policy())


@pytest.mark.parametrize("text, needles", [
    ("[gate]\nmax_ppl = 1.02\n", ["unknown key 'max_ppl'", "known keys"]),
    ("[gate]\nmax_pll_ratio = 1.02\n", ["unknown key 'max_pll_ratio'", "did you mean 'max_ppl_ratio'?"]),
    ("[gate]\nmax_ppl_ratio = 1\nmin_top1 = [0.9]\n", ["'min_top1'", "must be a number (float)", "list"]),
    ("[gate]\nmax_latency_ratio = -1.0\n", ["'max_latency_ratio'", "must be > 0"]),
    ("[gate]\nmax_kld = nan\n", ["'max_kld'", "finite"]),
    ("[gate]\nrequire_provider = [\"\"]\n", ["'require_provider'", "non-empty strings"]),
    ("gate = 1\n", ["key 'gate' must be a table"]),
    ("max_ppl_ratio = 1.02\nthreshold = 3\n", ["unknown key 'threshold'"]),
    ("[gate]\nmin_top1 = 0.9\n[other]\nx = 1\n", ["unknown top-level key 'other'"]),
    ('[gate]\nmax_kld = "0.01"\n', ["'max_kld'", "must be a number (float)", "string"]),
    ("[gate]\nmax_kld = true\n", ["'max_kld'", "must be a number (float)", "boolean"]),
    ('[gate]\nrequire_provider = "cpu"\n', ["'require_provider'", "must be a list of strings"]),
    ("[gate]\nrecipes = [1, 2]\n", ["'recipes'", "must be a list of strings", "integer"]),
    ("[gate]\nmin_top1 = 98\n", ["'min_top1'", "[0, 1]"]),
    ('[gate]\nrequire_provider = ["tpu"]\n', ["unknown execution provider 'tpu'"]),
    ("[gate\nmax_kld = 1\n", ["not valid TOML"]),
])
def test_bad_policy_exits_2(tmp_path, capsys, text, needles):
    path = write(tmp_path / "results.json", results())
    policy = tmp_path / "policy.toml"
    policy.write_text(text)
    code, out, err = gate([path, "--policy", policy], capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, str(policy), *needles)  # names the file and the field


def test_bad_policy_values_and_missing_policy_file(tmp_path, capsys):
    path = write(tmp_path / "results.json", results())
    code, _, err = gate([path, "--policy", tmp_path / "none.toml"], capsys)
    assert code == 2
    assert_one_line_error(err, "policy file", "not found")
    code, _, err = gate([path, "--max-ppl-ratio", "nan"], capsys)
    assert code == 2
    assert_one_line_error(err, "max_ppl_ratio", "finite")
    for bad in ({"max_kld": -1}, {"max_latency_ratio": 0}, {"recipes": "dynamic"}, {"min_top1": 1.5}):
        with pytest.raises(PolicyError):
            Policy(**bad)


@pytest.mark.parametrize("kwargs", [
    {"max_ppl_ratio": None, "max_kld": None, "min_top1": None},
    {"max_ppl_ratio": None, "max_kld": None, "min_top1": 0.0},  # top-1 >= 0 cannot fail
    {"max_ppl_ratio": None, "max_kld": None, "min_top1": None, "recipes": ("dynamic",)},
])
def test_policy_that_checks_nothing_is_refused(kwargs):
    with pytest.raises(PolicyError, match="checks nothing"):
        Policy(**kwargs)
    # one real check is enough
    assert Policy(**{**kwargs, "require_provider": ("cpu",)}).effective_checks() == ("require_provider",)
    assert Policy(**{**kwargs, "max_kld_p99": 0.1}).effective_checks() == ("max_kld_p99",)


def test_policy_file_and_flag_override(tmp_path, capsys):
    policy = tmp_path / "p.toml"
    policy.write_text("[gate]\nmax_ppl_ratio = 1.0001\nrequire_provider = [\"cpu\"]\n")
    assert load_policy(policy) == Policy(max_ppl_ratio=1.0001, require_provider=(CPU,))
    top_level = tmp_path / "top.toml"
    top_level.write_text("min_top1 = 0.5\nrecipes = [\"dynamic\"]\n")
    assert load_policy(top_level) == Policy(min_top1=0.5, recipes=("dynamic",))
    path = write(tmp_path / "results.json", results())
    assert gate([path, "--policy", policy], capsys)[0] == 1  # 1.001 > 1.0001
    assert gate([path, "--policy", policy, "--max-ppl-ratio", "1.01"], capsys)[0] == 0  # the flag wins


def test_example_policy_is_valid():
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "gate-policy.toml"
    policy = load_policy(example)
    assert policy.max_ppl_ratio == 1.01 and policy.require_provider == (CPU,)
    assert evaluate_gate(results(), policy).passed


# ---- sweeps -----------------------------------------------------------------------------------


def test_sweep_dir_aggregates(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    write(sweep / "pre-rms-seed1" / "results.json", results())
    write(sweep / "peri-rms-seed1" / "results.json", results())
    code, out, _ = gate([sweep], capsys)
    assert code == 0 and out.count("### `") == 2 and "2 of 2 run(s) passed" in out
    write(sweep / "post-layer-seed1" / "results.json", results(ppl_ratio=1.3))
    code, out, _ = gate([sweep], capsys)
    assert code == 1 and "2 of 3 run(s) passed" in out and "post-layer-seed1/results.json`: FAIL" in out
    report = run_gate([sweep], Policy())
    assert [r.passed for r in report.runs] == [True, False, True]  # sorted by path


def test_sweep_dir_errors_and_diverged_cells(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    code, _, err = gate([sweep], capsys)  # empty
    assert code == 2
    assert_one_line_error(err, "no results.json", "empty sweep")
    write(sweep / "a" / "results.json", results())
    write(sweep / "b" / "results.json", "{not json")
    write(sweep / "c" / "results.json", {**results(), "schema_version": 7})
    code, out, err = gate([sweep], capsys)  # any unreadable cell: no verdict at all
    assert code == 2 and out == ""
    assert_one_line_error(err, "b/results.json is not valid JSON", "and 1 more", "schema_version 7")
    (sweep / "b" / "results.json").unlink()
    (sweep / "c" / "results.json").unlink()
    write(sweep / "b" / "config.json", {})  # an unfinished cell
    code, _, err = gate([sweep], capsys)
    assert code == 2
    assert_one_line_error(err, "without results.json")
    write(sweep / "b" / "train.json", {"diverged": True, "diverged_at": 12})  # diverged: a failing run
    code, out, _ = gate([sweep], capsys)
    assert code == 1 and "training diverged at step 12" in out
    # a cell the sweep manifest names but that never wrote a config.json (failed early) is unfinished
    write(sweep / "sweep.json", {"settings": {}, "cells": {"a": {"status": "done"}, "d": {"status": "failed"}}})
    code, _, err = gate([sweep], capsys)
    assert code == 2
    assert_one_line_error(err, "d: run directory without results.json")
    write(sweep / "sweep.json", "{corrupt")
    code, _, err = gate([sweep], capsys)
    assert code == 2
    assert_one_line_error(err, "sweep.json cannot be read")


# ---- outputs ----------------------------------------------------------------------------------


def test_junit_xml_counts_failures(tmp_path, capsys):
    data = results()
    data["recipes"][1]["accuracy"] = _acc(ppl_ratio=1.5, kld_mean=0.5)  # dynamic: 2 failing checks
    path = write(tmp_path / "results.json", data)
    xml_path = tmp_path / "out" / "gate.xml"
    assert gate([path, "--recipe", "static-minmax-matmul,dynamic", "--junit", xml_path], capsys)[0] == 1
    root = ET.parse(xml_path).getroot()
    cases = root.findall(".//testcase")
    assert len(cases) == 2 * 4  # 2 recipes x (status, ppl_ratio, kld_mean, top1_agreement)
    failed = [c for c in cases if c.find("failure") is not None]
    assert {c.get("name") for c in failed} == {"ppl_ratio", "kld_mean"} and len(failed) == 2
    assert root.get("failures") == "2" and root.get("tests") == "8"
    assert "1.5 not <= 1.01" in failed[0].find("failure").get("message")
    # best mode: dynamic's failures do not block, so JUnit reports them as skipped, not failed
    assert gate([path, "--junit", xml_path], capsys)[0] == 0
    root = ET.parse(xml_path).getroot()
    assert root.get("failures") == "0" and root.get("skipped") == "2"
    assert not list(xml_path.parent.glob(".*tmp"))  # written atomically, nothing left behind


def test_summary_appends(tmp_path, capsys):
    path = write(tmp_path / "results.json", results())
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier step\n")
    code, out, _ = gate([path, "--summary", summary], capsys)
    assert code == 0
    assert summary.read_text() == "# earlier step\n" + out
    gate([path, "--summary", summary, "--min-top1", "0.999"], capsys)
    text = summary.read_text()
    assert text.startswith("# earlier step\n") and "gate: PASS" in text and "gate: FAIL" in text


def test_error_still_leaves_failing_artifacts(tmp_path, capsys):
    summary, xml_path = tmp_path / "summary.md", tmp_path / "gate.xml"
    code, _, err = gate([tmp_path / "missing", "--summary", summary, "--junit", xml_path], capsys)
    assert code == 2
    assert_one_line_error(err, "missing not found")
    assert "quantnorm gate: ERROR" in summary.read_text()
    root = ET.parse(xml_path).getroot()
    assert root.get("errors") == "1" and root.find(".//error") is not None


def test_library_api(tmp_path):
    verdict = evaluate_gate(results(), Policy())
    assert verdict.passed and not verdict.failures
    report = run_gate(write(tmp_path / "results.json", results(top1=0.5)), Policy())
    assert not report.passed and report.exit_code == 1
    assert {c.name for c in report.runs[0].failures} == {"top1_agreement"}
    assert "**Overall: FAIL**" in report.markdown()
    ET.fromstring(report.junit_xml())
    with pytest.raises(GateError, match="no input"):
        run_gate([], Policy())
    # the input dict is not modified
    data = results()
    snapshot = copy.deepcopy(data)
    evaluate_gate(data, Policy(max_latency_ratio=1.0, require_provider=("cpu",)))
    assert data == snapshot and not math.isnan(data["recipes"][0]["accuracy"]["ppl_ratio"])


# ---- training status ------------------------------------------------------------------------


def _trained(bits, **train):
    data = results()
    data["model"] = {"source": "trained"}
    data["train"] = {"eval_bits_per_byte": bits, "diverged": False, "unigram_bits_per_byte": 4.688, **train}
    return data


def test_collapsed_model_fails_by_default_and_the_margin_is_a_policy_key(tmp_path, capsys):
    trained = write(tmp_path / "ok.json", _trained(3.1))
    plateau = write(tmp_path / "plateau.json", _trained(4.68))   # INT8 numbers pass: 1.001x, 99.5%
    barely = write(tmp_path / "barely.json", _trained(4.2))
    assert gate([trained], capsys)[0] == 0
    code, out, _ = gate([plateau], capsys)
    assert code == 1 and "train status" in out and "collapsed: 4.680 bits/byte vs unigram 4.688" in out
    assert gate([barely], capsys)[0] == 1
    policy = tmp_path / "p.toml"
    policy.write_text("[gate]\ncollapse_margin = 0.1\n")
    assert gate([barely, "--policy", policy], capsys)[0] == 0      # 0.488 below the baseline: trained at 0.1
    assert gate([plateau, "--policy", policy], capsys)[0] == 1
    policy.write_text("[gate]\ncollapse_margin = -1\n")
    code, _, err = gate([barely, "--policy", policy], capsys)
    assert code == 2 and "collapse_margin" in err


def test_pretrained_checkpoint_has_no_training_status_check(tmp_path, capsys):
    data = results()
    data["model"] = {"source": "hf:some/dir"}
    data["train"] = {"pretrained": True, "diverged": False}
    code, out, _ = gate([write(tmp_path / "hf.json", data)], capsys)
    assert code == 0 and "train status" not in out


@pytest.mark.parametrize("source", [{"kind": "gguf", "file": "m.gguf"}, {"kind": "onnx", "path": "export"}])
def test_gguf_and_onnx_sources_are_pretrained_without_saying_so(tmp_path, capsys, source):
    data = {**results(), "schema_version": 2, "model": {"source": source}, "train": {"diverged": False}}
    code, out, _ = gate([write(tmp_path / "r.json", data)], capsys)
    assert code == 0 and "train status" not in out
    data["model"]["source"] = "trained"                  # the same train section from a zoo run is judged
    code, out, _ = gate([write(tmp_path / "r.json", data)], capsys)
    assert code == 1 and "train status" in out


@pytest.mark.parametrize("source", ["hub:gpt2", {"kind": "safetensors"}, {"path": "x"}, 7])
def test_an_unknown_model_source_is_refused(tmp_path, capsys, source):
    # read as a pretrained checkpoint, it would skip the training-status check: refused instead
    data = {**results(), "model": {"source": source}}
    path = write(tmp_path / "run" / "results.json", data)
    code, out, err = gate([path], capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, str(path), "model.source", "is not a source this quantnorm knows")
    with pytest.raises(ResultsError, match="^src: model.source"):
        evaluate_gate(data, Policy(), source="src")


def test_diverged_or_unknown_status_fails(tmp_path, capsys):
    diverged = _trained(None, diverged=True)
    assert gate([write(tmp_path / "d.json", diverged)], capsys)[0] == 1
    unknown = _trained(3.0)
    del unknown["train"]["unigram_bits_per_byte"]          # no baseline and no data ranges to derive it
    code, out, _ = gate([write(tmp_path / "u.json", unknown)], capsys)
    assert code == 1 and "missing:" in out


def test_committed_plateau_cells_fail_on_their_training_status(capsys):
    # a 400-step zoo cell at lr 3e-3 (Post-LN's collapse) and a 150-step reference cell
    from pathlib import Path

    reports = Path(__file__).resolve().parents[1] / "reports"
    code, out, _ = gate([reports / "zoo" / "cells" / "post-layer-L4-w30-seed0"], capsys)
    assert code == 1 and "collapsed: 4.694 bits/byte vs unigram 4.688" in out
    code, out, _ = gate([reports / "reference" / "cells" / "post-layer-L4-w30-lr0.003-seed0"], capsys)
    assert code == 1 and "collapsed: 4.691 bits/byte vs unigram 4.688" in out


# ---- property-based: no malformed results.json ever passes -----------------------------------

_NOT_A_NUMBER = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=2),
                          st.sampled_from([float("nan"), float("inf"), float("-inf")]))


def _impossible(rule) -> st.SearchStrategy:
    """Values that no measurement can give for a key with this range."""
    options = [_NOT_A_NUMBER]
    if rule.lo is not None:
        below = st.floats(max_value=rule.lo if rule.lo_open else rule.lo - 1e-3, allow_nan=False,
                          allow_infinity=False)
        options.append(below)
    if rule.hi is not None:
        options.append(st.floats(min_value=rule.hi + 1e-3, allow_nan=False, allow_infinity=False))
    if rule.integer:
        options.append(st.floats(min_value=1.1, max_value=1e6).filter(lambda v: v != int(v)))
    return st.one_of(options)


@st.composite
def malformed_results(draw) -> dict:
    data = results()
    data["recipes"][0]["accuracy"].update(nn_agreement=0.9, cosine_mean=0.99, n_scored=100)
    kind = draw(st.sampled_from(["accuracy", "latency", "schema", "duplicate", "drop", "status"]))
    i = draw(st.integers(0, len(data["recipes"]) - 1))
    if kind == "accuracy":
        key = draw(st.sampled_from(sorted(ACCURACY_RANGES)))
        data["recipes"][i].setdefault("accuracy", {})[key] = draw(_impossible(ACCURACY_RANGES[key]))
    elif kind == "latency":
        row = data["latency"][draw(st.sampled_from([0, 1, 2]))]  # the measured CPU rows
        key = draw(st.sampled_from(sorted(LATENCY_RANGES)))
        row[key] = draw(_impossible(LATENCY_RANGES[key]))
    elif kind == "schema":
        data["schema_version"] = draw(st.one_of(st.integers().filter(lambda v: v not in (1, 2)), _NOT_A_NUMBER))
    elif kind == "duplicate":
        data["recipes"].append(copy.deepcopy(data["recipes"][i]))
    elif kind == "drop":
        target, key = draw(st.sampled_from([
            (data, "schema_version"), (data, "recipes"), (data["recipes"][i], "name"),
            (data["recipes"][i], "accuracy"), (data["latency"][0], "provider"), (data["latency"][1], "variant"),
            (data["latency"][2], "status"), (data["latency"][0], "p50_ms")]))
        del target[key]
    else:
        valid = ("broken: ", "not applicable: ")
        data["recipes"][i]["status"] = draw(st.one_of(
            st.text(max_size=20).filter(lambda v: v != "ok" and not v.startswith(valid)), _NOT_A_NUMBER))
    return data


_LAX = Policy(max_ppl_ratio=1e6, max_kld=1e6, min_top1=1e-9)  # the most lenient policy: only validity can fail


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=malformed_results(), policy=st.sampled_from([Policy(), _LAX, Policy(require_provider=("cpu",))]))
def test_property_malformed_results_never_pass_the_api(data, policy):
    with pytest.raises(ResultsError):
        evaluate_gate(data, policy, source="x/results.json")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=malformed_results())
def test_property_malformed_results_exit_2_on_the_cli(data):
    import contextlib
    import io
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.json"
        path.write_text(json.dumps(data))
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(err):
            code = main(["gate", str(path), "--max-ppl-ratio", "1e6", "--max-kld", "1e6", "--min-top1", "1e-9"])
    assert code == 2 and out.getvalue() == ""
    line = err.getvalue().strip()
    assert len(line.splitlines()) == 1 and str(path) in line, line


@settings(max_examples=60, deadline=None)
@given(ppl_ratio=st.floats(0.5, 2.0), kld=st.floats(0, 1), top1=st.floats(0, 1),
       broken=st.booleans())
def test_property_a_pass_means_every_threshold_holds(ppl_ratio, kld, top1, broken):
    data = results(ppl_ratio=ppl_ratio, kld_mean=kld, kld_p99=kld, top1=top1)
    if broken:
        data["recipes"][1]["status"] = "broken: saturates"
    policy = Policy(max_ppl_ratio=1.01, max_kld=0.01, min_top1=0.98)
    verdict = evaluate_gate(data, policy)
    holds = ppl_ratio <= 1.01 and kld <= 0.01 and top1 >= 0.98
    assert verdict.passed == holds
    if verdict.passed:
        assert all(verdict.recipe_passed(r) for r in verdict.passing_recipes)
        assert "static-minmax-matmul" in verdict.passing_recipes
