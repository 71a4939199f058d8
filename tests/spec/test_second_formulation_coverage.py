"""Every spec function is checked against a second formulation, so a new one cannot skip it.

A test that compares a spec function with an independently written formulation carries
``@pytest.mark.second_formulation("module:function", ...)``. Read statically (no test is imported):
every op of the catalog (its ``spec:`` and the ``spec:`` of each of its numerics tiers) and every
public function of ``spec/ops/*.py`` must be named by such a marker on a test whose body calls it by
name, and every name in a marker must be a function that exists.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths

pytestmark = pytest.mark.premerge

ROOT = Path(__file__).resolve().parents[2]
MARKER = "second_formulation"

# Public spec/ops functions that compute nothing a second formulation could restate: each is
# exempt with the reason.
EXEMPT = {
    "spec.ops.qsa:empty_planes": "allocates NaN-filled planes of given shapes; QSA tests read them",
}


@functools.cache
def _marked() -> dict[str, list[str]]:
    """'module:function' -> ['file::test', ...] for markers whose test body names the function."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            names = ({n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                     | {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)})
            for dec in node.decorator_list:
                if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and dec.func.attr == MARKER):
                    continue
                for arg in dec.args:
                    target = arg.value
                    where = f"{path.relative_to(ROOT)}::{node.name}"
                    if target.split(":")[-1] not in names:
                        where += " (does not call it)"
                    found.setdefault(target, []).append(where)
    return found


HOW = ("\nwrite each one a second time from docs/spec.md in another form (a loop, the recurrent "
       "or chunked form, a public implementation), compare the two in a test under tests/spec/ "
       "and mark it @pytest.mark.second_formulation(\"module:function\")")


def _checked(found: dict[str, list[str]], target: str) -> bool:
    return any("(does not call it)" not in w for w in found.get(target, []))


def _public_spec_functions() -> list[str]:
    out = []
    for path in sorted((ROOT / "spec" / "ops").glob("*.py")):
        module = f"spec.ops.{path.stem}"
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                out.append(f"{module}:{node.name}")
    return out


def test_every_catalog_op_and_tier_has_its_spec_checked_by_a_second_formulation():
    catalog = load_catalog(project_paths().cells)
    assert not catalog.errors and len(catalog.ops) >= 30
    found = _marked()
    missing = []
    for name, op in sorted(catalog.ops.items()):
        paths = [("exact", op.spec)] + [(tier, t.spec) for tier, t in sorted(op.numerics.items())]
        missing += [f"{name} [{tier}]: {path}" for tier, path in paths if not _checked(found, path)]
    assert not missing, ("spec functions with no second formulation checked:\n"
                         + "\n".join(missing) + HOW)


def test_every_public_spec_function_has_a_second_formulation_or_an_exemption():
    found = _marked()
    missing = [p for p in _public_spec_functions() if p not in EXEMPT and not _checked(found, p)]
    assert not missing, ("spec functions with no second formulation checked:\n"
                         + "\n".join(missing) + HOW)


def test_every_marker_names_an_existing_function_that_its_test_calls():
    problems = []
    for target, where in sorted(_marked().items()):
        module, _, name = target.partition(":")
        try:
            ok = callable(getattr(importlib.import_module(module), name, None))
        except ImportError:
            ok = False
        if not ok:
            problems.append(f"{target}: no such function ({where})")
        problems += [f"{target}: {w}" for w in where if w.endswith("(does not call it)")]
    assert not problems, "\n".join(problems)
    assert not set(EXEMPT) & set(_marked()), "an exempt function is checked: drop its exemption"
