"""The import contracts (.importlinter) hold on this tree and catch a planted bad import.

Each case copies the package to a temporary directory, plants one import that breaks a contract,
and runs lint-imports on the copy: it must fail and name that import. A contract file that stops
matching the code (a typo in a module name, a contract that is never broken) fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the dev extra")

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = ROOT / ".importlinter"


def lint_imports(package_parent: Path) -> tuple[int, str]:
    """lint-imports with this repository's contracts on the ``quantnorm`` under ``package_parent``."""
    code = ("import sys; from importlinter.cli import lint_imports_command; "
            "lint_imports_command.main(args=sys.argv[1:], prog_name='lint-imports')")
    # PYTHONPATH first: the copy is analysed, not the installed package. COLUMNS: rich wraps
    # the report at the terminal width, which would split the lines asserted on.
    env = {**os.environ, "PYTHONPATH": str(package_parent), "COLUMNS": "300"}
    proc = subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo", str(CONTRACTS)],
                          cwd=package_parent, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())


def test_the_real_tree_keeps_every_contract():
    rc, out = lint_imports(ROOT)
    assert rc == 0, out
    assert " 0 broken" in out and "BROKEN" not in out


@pytest.mark.parametrize("module, planted, broken", [
    # The gate must never need the pipeline (it runs in CI on results files alone).
    ("gate/checks.py", "import quantnorm.evaluate", ["quantnorm.gate is not allowed to import quantnorm.evaluate",
                                             "report, gate, results and policy read results"]),
    # A report <-> sweep cycle: the sweep report (report.comparison) reads sweep.json through
    # quantnorm.manifest, never through the sweep.
    ("report/comparison.py", "from quantnorm import sweep",
     ["No import cycles between sibling modules", "quantnorm.report is not allowed to import quantnorm.sweep: - quantnorm.report.comparison -> quantnorm.sweep"]),
    # The results.json contract reaching into the pipeline.
    ("results.py", "import quantnorm.evaluate", ["quantnorm.results is not allowed to import quantnorm.evaluate"]),
    # Inside the report package: the statistics never need the reports built on them.
    ("report/stats.py", "from quantnorm.report import findings",
     ["The report package: the reports > their parts > the helpers BROKEN"]),
    # Inside the report package: what a claim is measured with never needs the claims.
    ("report/evidence.py", "from quantnorm.report import claims_training",
     ["The report package: the reports > their parts > the helpers BROKEN"]),
    # Inside the sweep package: the grid never needs the executors that run its cells.
    ("sweep/grid.py", "from quantnorm.sweep import executors",
     ["The sweep package: run_sweep (its __init__) > the executors and a cell's process > sweep.json > the grid "
      "BROKEN"]),
    # Inside the generation package: running a with-past graph never needs its exporter.
    ("generation/decode.py", "from quantnorm.generation import with_past",
     ["The generation package: the with-past export > decoding on ONNX Runtime BROKEN"]),
    # A model source reaching up into the pipeline.
    ("sources/hf_loader.py", "from quantnorm.sweep import run_sweep", ["A model source never imports the pipeline BROKEN"]),
    # A model source measuring for itself (the pipeline measures every source the same way).
    ("sources/zoo.py", "from quantnorm.measure.diagnostics import diagnostics",
     ["A model source says what is scored and measures nothing", "quantnorm.sources.zoo -> quantnorm.measure.diagnostics"]),
    # A transform reaching into a model source (transforms serve every source).
    ("transforms/rotation.py", "from quantnorm.sources import hf_loader",
     ["A transform never imports a model source or the pipeline BROKEN"]),
    # A basic reaching up into a stage (the hardware <-> measure.sessions cycle).
    ("hardware.py", "from quantnorm.measure.sessions import provider_status",
     ["quantnorm.hardware is not allowed to import quantnorm.measure"]),
])
def test_a_planted_import_breaks_its_contract(tmp_path, module, planted, broken):
    shutil.copytree(ROOT / "quantnorm", tmp_path / "quantnorm", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "quantnorm" / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n{planted}  # planted by the test\n", encoding="utf-8")
    rc, out = lint_imports(tmp_path)
    assert rc == 1, out
    for message in broken:
        assert message in out, out
