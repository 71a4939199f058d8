"""Claims a catalog makes about its tests, checked statically (no test is imported or run).

Each op has one hypothesis property test and one hand-checkable guard, found by their markers
``@pytest.mark.certify_property("<op>")`` and ``@pytest.mark.certify_guard("<op>")`` anywhere under the
test roots.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

KINDS = ("certify_guard", "certify_property")


def marked_tests(roots: list[Path]) -> dict[str, dict[str, list[str]]]:
    """op -> {marker kind -> ["path::test_name", ...]}."""
    found: dict[str, dict[str, list[str]]] = defaultdict(lambda: {k: [] for k in KINDS})
    for root in roots:
        for path in sorted(Path(root).rglob("test_*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for dec in node.decorator_list:
                    kind, op = _marker(dec)
                    if kind:
                        found[op][kind].append(f"{path}::{node.name}")
    return dict(found)


def _marker(dec: ast.expr) -> tuple[str | None, str | None]:
    """('certify_guard', 'op') for ``pytest.mark.certify_guard("op")``, else (None, None)."""
    if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
            and dec.func.attr in KINDS and dec.args and isinstance(dec.args[0], ast.Constant)):
        return dec.func.attr, str(dec.args[0].value)
    return None, None
