"""Count quantnorm's internal imports, and how many sit inside function bodies.

The number to compare before and after an import clean-up: an import inside a function
hides an edge of the module graph (import-linter still sees it, a reader of the module top does
not), so only optional heavy extras should be imported there. Counts import *statements*; with
``--list`` prints each in-function one (internal and third-party) as path:line.

    python tools/count_imports.py [--list] [PACKAGE_DIR]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _internal(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "quantnorm"
    return any(alias.name.split(".")[0] == "quantnorm" for alias in node.names)


def _imports(tree: ast.AST):
    """(import node, inside a function?) for every import statement of a module."""
    def walk(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, in_function
            yield from walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))
    yield from walk(tree, False)


def count(package: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {"internal": [], "internal_in_function": [], "external_in_function": []}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, in_function in _imports(tree):
            where = f"{path}:{node.lineno}"
            if _internal(node):
                found["internal"].append(where)
                if in_function:
                    found["internal_in_function"].append(where)
            elif in_function:
                found["external_in_function"].append(where)
    return found


def main(argv: list[str]) -> int:
    listing = "--list" in argv
    args = [a for a in argv if a != "--list"]
    package = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "quantnorm"
    found = count(package)
    if listing:
        for kind in ("internal_in_function", "external_in_function"):
            for where in found[kind]:
                print(f"{kind}: {where}")
    print(f"internal imports: {len(found['internal'])}, inside function bodies: "
          f"{len(found['internal_in_function'])}; third-party imports inside function bodies: "
          f"{len(found['external_in_function'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
