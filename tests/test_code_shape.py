"""The package's shape rule (DESIGN.md): no module over 600 lines, no function over 80.

Every module of ``quantnorm`` is parsed with ``ast``; a function is measured from its ``def`` line
to its last line (a method or a nested function on its own). The test names every offender, so a
long function is split into named steps where it is written, not found later by a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "quantnorm"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# Known offenders, each to be split (none now); an entry that no longer offends fails the test below.
ALLOWED: set[str] = set()


def offenders(package: Path = PACKAGE) -> dict[str, int]:
    """``path`` (a module over the limit) or ``path::qualified.name`` (a function) -> its lines."""
    found: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        n_lines = len(source.splitlines())
        if n_lines > MAX_MODULE_LINES:
            found[rel] = n_lines
        for name, length in _function_lengths(ast.parse(source, filename=rel)):
            if length > MAX_FUNCTION_LINES:
                found[f"{rel}::{name}"] = length
    return found


def _function_lengths(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines from ``def`` to the end) of every function and method under ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _function_lengths(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _function_lengths(node, prefix + node.name + ".")
        else:
            yield from _function_lengths(node, prefix)


def test_no_module_over_600_lines_and_no_function_over_80():
    found = offenders()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, "split into named steps or modules with one job each: " + "; ".join(
        f"{k} ({v} lines; limit {MAX_FUNCTION_LINES if '::' in k else MAX_MODULE_LINES})" for k, v in sorted(new.items()))


def test_the_allow_list_holds_only_current_offenders():
    stale = sorted(ALLOWED - set(offenders()))
    assert not stale, f"no longer over the limit, remove from ALLOWED: {', '.join(stale)}"


@pytest.mark.parametrize("body, expected", [
    ("def f():\n" + "    x = 1\n" * 80, "pkg/m.py::f"),                                     # 81 lines
    ("class C:\n    def run(self):\n" + "        pass\n" * 80, "pkg/m.py::C.run"),           # a method
    ("def outer():\n    def inner():\n" + "        pass\n" * 80, "pkg/m.py::outer.inner"),    # nested
    ("x = 1\n" * 601, "pkg/m.py"),                                                          # the module
])
def test_the_check_names_each_offender(tmp_path, body, expected):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(body, encoding="utf-8")
    (package / "ok.py").write_text("def g():\n" + "    pass\n" * 79, encoding="utf-8")   # 80 lines: allowed
    assert expected in offenders(package) and not any(k.startswith("pkg/ok.py") for k in offenders(package))
