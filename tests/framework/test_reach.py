"""Reach: the claims the catalog makes about what the forward reaches, enforced (certify/reach/claims.py).

The claims read the committed reach file (reports/reach.json, written by `certify trace`); one test
re-runs the tracer and fails when that file is stale. Findings the claims only flag (cells outside the
reach, reached values beyond the cells, ...) are emitted as warnings and shown first in the report.
"""

from __future__ import annotations

import warnings

import pytest

from certify.catalog.load import Catalog, load_catalog
from certify.harness.target import Outcome, certify_cell, certifying_problem
from certify.files.paths import project_paths
from certify.reach import load_reach, reach_text, run_trace
from certify.reach.claims import Finding, _cells_for, catalog_findings, reach_findings

PATHS = project_paths()
RETRACE = "run `certify trace` and commit reports/reach.json"


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    cat = load_catalog(PATHS.cells)
    assert not cat.errors, "\n".join(map(str, cat.errors))
    return cat


@pytest.fixture(scope="module")
def reach():
    r = load_reach(PATHS.reach)
    assert r is not None, f"no reach file at {PATHS.reach}: {RETRACE}"
    return r


def assert_no_failures(findings: list[Finding], kinds: tuple[str, ...]) -> None:
    bad = [f.message for f in findings if f.severity == "fail" and f.kind in kinds]
    assert not bad, f"{len(bad)} claim(s) broken:\n" + "\n".join(bad)


def flag(findings: list[Finding], kinds: tuple[str, ...]) -> list[Finding]:
    """One warning per kind (the report lists them all: reports/coverage.md, first section)."""
    found = [f for f in findings if f.kind in kinds]
    for kind in kinds:
        mine = [f.message for f in found if f.kind == kind]
        if mine:
            more = f"\n  ... and {len(mine) - 3} more" if len(mine) > 3 else ""
            warnings.warn(f"{len(mine)} {kind} finding(s) (reports/coverage.md lists them):\n  "
                          + "\n  ".join(mine[:3]) + more, stacklevel=2)
    return found


# ------------------------------------------------------------------------------ the claims


def test_the_reach_file_is_current():
    """The committed reach file is what the tracer emits now (the catalog's rules, the scenarios, the
    forward). About 15 s on two cores."""
    run = run_trace(PATHS.tracer, PATHS.cells, PATHS.scenarios)
    assert PATHS.reach.read_text() == reach_text(run.reach), f"reports/reach.json is stale: {RETRACE}"


def test_every_reached_variant_has_a_cell_or_a_note_naming_it(catalog, reach):
    findings = reach_findings(catalog, reach)
    assert_no_failures(findings, ("uncovered", "unknown_within"))
    flag(findings, ("declared",))


def test_cells_per_variant_respect_the_at_most_three_rule(catalog):
    assert_no_failures(catalog_findings(catalog), ("cells_over_limit",))


def test_every_cell_why_is_present_and_distinct(catalog):
    assert all(c.why.strip() for op in catalog.ops.values() for c in op.cells)
    assert_no_failures(catalog_findings(catalog), ("why_repeats",))


def test_every_cell_is_driven_by_a_certifying_test(catalog):
    """Every cell becomes at least one (variant, arch) test item of the plugin, and that item fails
    unless the variant, the spec and the oracle all ran."""
    assert_no_failures(catalog_findings(catalog), ("runs_nowhere",))


@pytest.mark.parametrize("missing", ["variant", "spec", "oracle"])
def test_the_certifying_check_fails_when_a_part_did_not_run(missing):
    ran = {"variant": True, "spec": True, "oracle": True, missing: False}
    problem = certifying_problem("op::v::c::cpu", Outcome("passed", ran=ran))
    assert problem and missing in problem
    assert certifying_problem("op::v::c::cpu", Outcome("passed", ran={k: True for k in ran})) is None


def test_a_real_certification_runs_all_three(catalog):
    op = catalog.ops["rmsnorm"]
    outcome = certify_cell(op, op.variants[0].name, op.cells[0], "cpu")
    assert outcome.status == "passed" and certifying_problem("rmsnorm", outcome) is None


def test_cells_outside_the_reach_are_flagged_not_failed(catalog, reach):
    """Cost without coverage, reached values beyond the cells, and declared domains the forward leaves
    are warnings (see certify/reach/claims.py for why); they are listed first in the report."""
    findings = reach_findings(catalog, reach)
    flagged = flag(findings, ("outside_reach", "not_reached", "axis_gap", "outside_domain",
                              "no_variant"))
    assert all(f.severity == "warn" for f in flagged)


# ------------------------------------------------------------------------------ must-show


def _only_covers(catalog: Catalog, reach) -> tuple[str, str, str, str, list[str]]:
    """A reached (op, variant, arch) that exactly one cell certifies, with that cell and the scenarios."""
    for op_name, variants in sorted(reach.reach.items()):
        for variant, vr in sorted(variants.items()):
            for arch in vr.archs():
                cells = _cells_for(catalog.ops[op_name], variant, arch)
                if len(cells) == 1 and not any(variant in n.variants
                                               for n in catalog.ops[op_name].not_certified):
                    return op_name, variant, arch, cells[0].id, vr.scenarios_on(arch)
    pytest.skip("every reached variant has two or more cells")


def test_removing_the_only_cover_of_a_reached_variant_fails_naming_op_variant_and_scenario(catalog,
                                                                                           reach):
    op_name, variant, arch, cell, scenarios = _only_covers(catalog, reach)
    op = catalog.ops[op_name]
    planted = Catalog(ops={**catalog.ops, op_name: op.model_copy(
        update={"cells": tuple(c for c in op.cells if c.id != cell)})}, files=catalog.files)
    with pytest.raises(AssertionError) as err:
        assert_no_failures(reach_findings(planted, reach), ("uncovered",))
    message = str(err.value)
    assert f"{op_name}::{variant}" in message and f"on {arch}" in message
    assert scenarios[0] in message
    # and the same catalog with the cell passes
    assert_no_failures(reach_findings(catalog, reach), ("uncovered",))


def test_a_note_naming_the_variant_turns_the_failure_into_a_declared_gap(catalog, reach):
    op_name, variant, _, cell, _ = _only_covers(catalog, reach)
    op = catalog.ops[op_name]
    from certify.catalog.schema import NotCertified
    note = NotCertified(what="the variant after its cell was removed", why="a test of the claim",
                        variants=(variant,))
    planted = Catalog(ops={**catalog.ops, op_name: op.model_copy(update={
        "cells": tuple(c for c in op.cells if c.id != cell),
        "not_certified": op.not_certified + (note,)})})
    findings = reach_findings(planted, reach)
    assert not [f for f in findings if f.kind == "uncovered"]
    assert [f for f in findings if f.kind == "declared" and f.variant == variant]
