"""One acceptance policy: the search (--recipes auto) and the gate judge a model by the same
thresholds with the same defaults, so the search's pick passes `quantnorm gate` under that policy;
and results.json is written and validated by quantnorm.results alone."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import click
import numpy as np
import pytest
import torch

from quantnorm import cli as cli_module
from quantnorm.cli import evaluate_config, evaluate_options, main
from quantnorm.config import EvaluateConfig
from quantnorm.evaluate import run_search
from quantnorm.export import export_onnx
from quantnorm.measure.accuracy import compare
from quantnorm.measure.sessions import SessionSpec, make_session
from quantnorm.models import CausalLM, ModelConfig
from quantnorm.policy import DEFAULT_POLICY, Policy, PolicyError, load_policy, resolve_policy
from quantnorm.results import ResultsBuilder
from quantnorm.search import SearchConfig
from quantnorm.sources import SearchScoring

CONTEXT = 16
RNG = np.random.default_rng(1)
CALIB = RNG.integers(0, 256, size=(8, CONTEXT))
EVAL = RNG.integers(0, 256, size=(6, CONTEXT))
CALIB[:, 0] = EVAL[:, 0] = 256  # BOS
TARGETS = RNG.integers(0, 256, size=(6, CONTEXT))
SPEC = SessionSpec(threads=1)
PACKAGE = Path(__file__).resolve().parents[1] / "quantnorm"


def cli_config(**flags) -> EvaluateConfig:
    """The EvaluateConfig `quantnorm evaluate` builds from these flags (the rest at their defaults)."""
    command = click.command()(evaluate_options(lambda **_: None))
    given = {p.name: () if getattr(p, "multiple", False) else p.default for p in command.params}
    given.update(recipes="auto", threads=1, iters=2, **flags)
    return evaluate_config(dict(given), progress=False)


def test_the_policy_has_one_set_of_defaults():
    """evaluate's flags, EvaluateConfig, the search and the gate all start from DEFAULT_POLICY."""
    assert cli_config().policy() == EvaluateConfig().policy() == DEFAULT_POLICY
    assert SearchConfig().policy == EvaluateConfig().search_config().policy == DEFAULT_POLICY
    assert (DEFAULT_POLICY.max_ppl_ratio, DEFAULT_POLICY.max_kld, DEFAULT_POLICY.min_top1) == (1.01, 0.01, 0.95)
    # the example policy file states the defaults it does not change
    example = load_policy(PACKAGE.parent / "examples" / "gate-policy.toml")
    assert (example.max_ppl_ratio, example.max_kld, example.min_top1) == (1.01, 0.01, 0.95)


def test_accuracy_failures_name_each_threshold_and_fail_closed():
    policy = Policy(max_ppl_ratio=1.01, max_kld=0.01, min_top1=0.98, max_kld_p99=0.05)
    good = {"ppl_ratio": 1.005, "kld_mean": 0.002, "kld_p99": 0.01, "top1_agreement": 0.99}
    assert policy.accepts_accuracy(good) and policy.accuracy_failures(good) == []
    assert policy.accuracy_failures({**good, "top1_agreement": 0.97}) == ["top1_agreement 0.97 not >= 0.98"]
    assert policy.accuracy_failures({**good, "ppl_ratio": 1.02}) == ["ppl_ratio 1.02 not <= 1.01"]
    assert policy.accuracy_failures({**good, "kld_p99": None}) == ["kld_p99 missing"]      # absent: never a pass
    assert policy.accuracy_failures({**good, "kld_mean": float("nan")}) == ["kld_mean missing"]
    assert Policy(max_kld=None, min_top1=None).accepts_accuracy({"ppl_ratio": 1.0})


def test_evaluate_policy_file_and_flags(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text("[gate]\nmin_top1 = 0.995\nmax_kld = 0.02\nrequire_provider = ['cpu']\n")
    cfg = cli_config(policy_file=path, max_kld=0.005)
    assert (cfg.max_ppl_ratio, cfg.min_top1, cfg.max_kld) == (1.01, 0.995, 0.005)  # the flag over the file
    assert resolve_policy(path).require_provider == ("CPUExecutionProvider",)
    with pytest.raises(PolicyError):
        cli_config(min_top1=1.5)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(placement="pre", norm="rms", n_layers=1, d_model=32, n_heads=2, context=CONTEXT))
    path = root / "model.fp32.onnx"
    export_onnx(model, path, EVAL[:2])
    return path


class _NoTransforms:
    exports: dict = {}

    @staticmethod
    def fp32_for(recipe, fp32_path):
        return fp32_path


def search_then_gate(fp32: Path, run_dir: Path, cfg: EvaluateConfig, gate_args: list[str]) -> tuple[dict, int]:
    """--recipes auto's search on the tiny model, its pick written to results.json as evaluate writes
    it, then `quantnorm gate` on that run: (the search section, the gate's exit code)."""
    out = ResultsBuilder("test", 1)
    fp32_session = make_session(fp32, SPEC)
    measure = lambda path: compare(fp32_session, make_session(path, SPEC), EVAL, TARGETS).to_dict()  # noqa: E731
    search = run_search(run_dir, cfg, fp32, _NoTransforms(), CALIB, SearchScoring(EVAL, TARGETS, "byte"), SPEC,
                        False, out.recipes, {}, {}, measure=measure)
    out.section("search", search)
    out.write(run_dir, {})
    return search, main(["gate", str(run_dir), *gate_args])


def test_the_search_pick_passes_the_gate_with_its_defaults(fp32, tmp_path, capsys):
    search, code = search_then_gate(fp32, tmp_path, cli_config(search_pick="first"), [])
    assert search["status"] == "passed" and search["target_min_top1"] == 0.95 and search["target_max_kld"] == 0.01
    assert code == 0, capsys.readouterr().out


def test_a_stricter_policy_file_binds_the_search_and_the_gate_alike(fp32, tmp_path, capsys):
    """The first recipe meets the PPL target but not this file's top-1 floor: the search must not
    keep it (a search judging PPL alone would, and the gate would fail it); the gate's verdict on
    what it keeps is the search's own."""
    loose = tmp_path / "loose"
    search, _ = search_then_gate(fp32, loose, cli_config(search_pick="first"), [])
    first = search["trials"][0]
    assert first["passed"] and first["ppl_ratio"] <= 1.01
    floor = (first["top1_agreement"] + 1.0) / 2   # above the first trial's top-1, still reachable in FP32
    policy = tmp_path / "policy.toml"
    policy.write_text(f"[gate]\nmin_top1 = {floor!r}\n")
    strict = tmp_path / "strict"
    search, code = search_then_gate(fp32, strict, cli_config(search_pick="first", policy_file=policy),
                                    ["--policy", str(policy)])
    assert not search["trials"][0]["passed"] and search["target_min_top1"] == floor
    assert code == (0 if search["status"] == "passed" else 1), capsys.readouterr().out


# ------------------------------------------------------------------------------------ results.json's owner


def _results_names(tree: ast.Module) -> set[str]:
    """Names bound to "results.json" in a module (RESULTS_FILE imported, or a constant of its own)."""
    names = {"RESULTS_FILE"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and \
                isinstance(node.value, ast.Tuple) else [(target, node.value)]
            names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and isinstance(v, ast.Constant)
                      and v.value == "results.json"}
    return names


def _mentions_results(node: ast.AST, names: set[str]) -> bool:
    return any((isinstance(n, ast.Name) and n.id in names) or (isinstance(n, ast.Constant) and n.value == "results.json")
               for n in ast.walk(node))


WRITERS = {"write_json_atomic", "write_text_atomic", "atomic_path", "write_text", "write_bytes", "dump", "open"}


def test_only_results_py_writes_or_validates_results_json():
    """No module but quantnorm.results writes results.json (a writer's call naming the file), or
    defines how one is validated (its range tables, its schema_version); the gate calls
    quantnorm.results.validate."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "results.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = _results_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                target = node.func.value if isinstance(node.func, ast.Attribute) and fn in ("write_text", "write_bytes") \
                    else ast.Tuple(elts=node.args[:1], ctx=ast.Load())
                if fn in WRITERS and _mentions_results(target, names) and \
                        not (fn == "open" and not any(isinstance(a, ast.Constant) and "w" in str(a.value) for a in node.args[1:])):
                    offenders.append(f"{rel}:{node.lineno} writes results.json ({fn})")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("ACCURACY_RANGES", "LATENCY_RANGES")
                                                    for t in node.targets):
                offenders.append(f"{rel}:{node.lineno} defines results.json's ranges")
            if isinstance(node, ast.Compare) and any(isinstance(n, ast.Constant) and n.value == "schema_version"
                                                     for n in ast.walk(node)):
                offenders.append(f"{rel}:{node.lineno} checks results.json's schema_version itself")
    assert offenders == []
    gate_checks = (PACKAGE / "gate" / "checks.py").read_text(encoding="utf-8")
    assert "results_file.validate(results, source)" in gate_checks


def test_the_ownership_check_can_fail(tmp_path, monkeypatch):
    """A module planting its own write of results.json is caught."""
    planted = tmp_path / "quantnorm"
    planted.mkdir()
    (planted / "gate").mkdir()
    (planted / "gate" / "checks.py").write_text("results_file.validate(results, source)\n")
    (planted / "rogue.py").write_text("from .fileio import write_json_atomic\nfrom .runs import RESULTS_FILE\n"
                                      "def save(d, r):\n    write_json_atomic(d / RESULTS_FILE, r)\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", planted)
    with pytest.raises(AssertionError, match="rogue.py:4 writes results.json"):
        test_only_results_py_writes_or_validates_results_json()


def test_cli_module_reads_no_policy_default_of_its_own():
    """The gate's and evaluate's threshold flags default to None: the policy (file or defaults) decides."""
    for command in (cli_module.cli.commands["gate"], cli_module.cli.commands["evaluate"]):
        for param in command.params:
            if param.name in ("max_ppl_ratio", "max_kld", "max_kld_p99", "min_top1", "max_latency_ratio"):
                assert param.default is None, (command.name, param.name)
