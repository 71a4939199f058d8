"""The cell files' plausible bugs: every op has at least five, and every edit applies exactly once to
its module and leaves Python that parses (``certify mutants`` refuses one that does not)."""

from __future__ import annotations

import pytest

from certify.catalog.load import load_catalog
from certify.catalog.mutants import mutants_of
from certify.files.paths import project_paths
from certify.mutants.plan import apply_edit, module_file

CATALOG = load_catalog(project_paths().cells)
MINIMUM = 5


def test_every_op_has_at_least_five_mutants_of_its_own():
    few = {name: len(mutants_of(op)) for name, op in CATALOG.ops.items()
           if len(mutants_of(op)) < MINIMUM}
    assert CATALOG.ops and not few, f"ops with fewer than {MINIMUM} mutants: {few}"


@pytest.mark.parametrize("name", sorted(CATALOG.ops))
def test_every_edit_applies_once_and_parses(name):
    op = CATALOG.ops[name]
    for m in mutants_of(op):
        source = module_file(op.mutant_module(m)).read_text()
        assert apply_edit(source, m.find, m.replace, f"{name}/{m.id}") != source
