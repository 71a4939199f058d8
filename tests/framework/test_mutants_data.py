"""The cell files' plausible bugs: every op has at least five, and every edit applies exactly once to
its module and leaves Python that parses (``certify mutants`` refuses one that does not)."""

from __future__ import annotations

from certify.catalog.load import load_catalog
from certify.catalog.mutants import mutants_of
from certify.files.paths import project_paths
from certify.mutants.plan import EditError, apply_edit, module_file

CATALOG = load_catalog(project_paths().cells)
MINIMUM = 5


def test_every_op_has_at_least_five_mutants_of_its_own():
    few = {name: len(mutants_of(op)) for name, op in CATALOG.ops.items()
           if len(mutants_of(op)) < MINIMUM}
    assert CATALOG.ops and not few, f"ops with fewer than {MINIMUM} mutants: {few}"


def test_every_edit_applies_once_and_parses():
    """One test over every op (one pre-merge pin): a stale mutant anywhere fails it, each named."""
    stale = []
    for name, op in sorted(CATALOG.ops.items()):
        for m in mutants_of(op):
            source = module_file(op.mutant_module(m)).read_text()
            try:
                assert apply_edit(source, m.find, m.replace, f"{name}/{m.id}") != source
            except EditError as e:
                stale.append(str(e))
    assert not stale, "stale mutants (their module changed under them):\n" + "\n".join(stale)


def test_every_gdn_and_qsa_variant_that_runs_here_has_five_counted_mutants():
    """A score over one or two mutants says little: every variant of the GDN and QSA ops that a CPU
    machine runs (and the spec) has five that are not declared equivalent."""
    few = {}
    for name, op in CATALOG.ops.items():
        if not name.startswith(("gdn_", "qsa_")):
            continue
        labels = {"spec"} | {v.name for v in op.variants if v.impl != "spec"
                             and {"cpu", "cpu-interpret"} & set(v.archs)}
        counted = [m.label for m in mutants_of(op) if not m.equivalent]
        few.update({f"{name}/{lab}": counted.count(lab) for lab in labels
                    if counted.count(lab) < MINIMUM})
    assert not few, f"variants with fewer than {MINIMUM} counted mutants: {few}"
