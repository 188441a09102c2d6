"""docs/ci/quantnorm-gate.yml: what .ci/run checks (schema, zizmor), the pins, and its gate steps
(alone, and against main's results restored from the cache) run for real with examples/gate-policy.toml."""

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_gate import results

from quantnorm.cli import main

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "docs" / "ci" / "quantnorm-gate.yml"
POLICY = ROOT / "examples" / "gate-policy.toml"
PINNED = re.compile(r"^[\w.-]+/[\w.-]+(/[\w.-]+)*@[0-9a-f]{40}$")  # owner/repo[/sub-action]@commit


def _steps() -> list[dict]:
    doc = yaml.safe_load(WORKFLOW.read_text())
    (job,) = doc["jobs"].values()
    return job["steps"]


def test_every_action_is_pinned_to_a_commit_with_its_version():
    lines = [line for line in WORKFLOW.read_text().splitlines() if re.match(r"\s*(- )?uses:", line)]
    assert len(lines) == 5
    for line in lines:
        ref, _, comment = line.split("uses:", 1)[1].partition("#")
        assert PINNED.match(ref.strip()), line
        assert re.fullmatch(r"\s*v\d+\.\d+\.\d+\s*", comment), line  # the release the hash is


def test_checkout_persists_no_credentials_and_the_artifact_has_no_hidden_files():
    steps = _steps()
    checkout = next(s for s in steps if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["persist-credentials"] is False
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["with"].get("include-hidden-files", False) is False
    assert ".git" not in upload["with"]["path"]


@pytest.mark.parametrize("argv", [
    ["check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
    ["zizmor", "--offline", "--persona", "pedantic", str(WORKFLOW)],
])
def test_workflow_passes_schema_and_security_audit(argv):
    assert shutil.which(argv[0]), f"{argv[0]} is in the dev extra: pip install -e '.[dev]'"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _argv(step_name: str) -> list[str]:
    (step,) = [s for s in _steps() if s.get("name") == step_name]
    return shlex.split(step["run"].replace("\\\n", " "))


def _workspace(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    shutil.copy(POLICY, tmp_path / "examples" / "gate-policy.toml")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "summary.md"))
    run = tmp_path / "runs" / "ci"
    run.mkdir(parents=True)
    return run


def test_the_workflow_gate_step_runs_with_the_example_policy(tmp_path, monkeypatch, capsys):
    """The Gate step's own command line, run on a passing and on a failing run directory."""
    argv = _argv("Gate")
    assert argv[:3] == ["quantnorm", "gate", "runs/ci"] and "examples/gate-policy.toml" in argv
    assert "--github-summary" in argv and "--baseline" not in argv
    run = _workspace(tmp_path, monkeypatch)
    (run / "results.json").write_text(json.dumps(results()))
    assert main(argv[1:]) == 0
    assert "quantnorm gate: PASS" in (tmp_path / "summary.md").read_text() and (tmp_path / "gate.xml").is_file()
    assert json.loads((tmp_path / "gate.json").read_text())["verdict"] == "PASS"
    (run / "results.json").write_text(json.dumps(results(top1=0.9)))  # below the policy's min_top1 0.95
    assert main(argv[1:]) == 1
    assert "top1_agreement" in capsys.readouterr().out


def test_the_workflow_gates_a_pull_request_against_mains_cached_results(tmp_path, monkeypatch, capsys):
    """Main saves runs/ci/results.json under quantnorm-baseline/ in the cache; a pull request restores
    that directory and its Gate-against-main step fails a regression the thresholds alone pass."""
    steps = {s.get("name"): s for s in _steps()}
    restore, save = steps["Restore main's results (the baseline)"], steps["Save the baseline"]
    assert restore["with"]["path"] == save["with"]["path"] == "quantnorm-baseline"
    assert restore["with"]["restore-keys"] in save["with"]["key"]
    assert "cp runs/ci/results.json quantnorm-baseline/results.json" in steps["Keep main's results as the next baseline"]["run"]
    argv = _argv("Gate against main")
    assert argv[:5] == ["quantnorm", "gate", "runs/ci", "--baseline", "quantnorm-baseline"]
    run = _workspace(tmp_path, monkeypatch)
    (tmp_path / "quantnorm-baseline").mkdir()
    (tmp_path / "quantnorm-baseline" / "results.json").write_text(json.dumps(results(kld_mean=0.001)))
    (run / "results.json").write_text(json.dumps(results(kld_mean=0.0011)))
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out.startswith("## quantnorm gate: PASS")
    (run / "results.json").write_text(json.dumps(results(kld_mean=0.004)))  # under max_kld 0.01, 4x main's
    assert main(argv[1:]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("**Overall: FAIL**") and "kld_mean" in out.splitlines()[0]
    assert "Against the baseline" in (tmp_path / "summary.md").read_text()
