"""Killer first (``certify.mutants.hints``): a mutant's hint, the test that killed it last time, only
reorders its tests, and the verdicts are those of a run in the usual order (cheapest first), whether
the hint is right, wrong, stale, or a test that fails on the unmutated code."""

from __future__ import annotations

import json
from pathlib import Path

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.lists.records import load_durations, load_items
from certify.mutants.hints import hinted_order, last_killers, set_hints, through_hint
from certify.mutants.report import load_mutants
from certify.mutants.plan import Job, data_jobs
from certify.mutants.runner import run_jobs, warm_pool
from tests.framework.test_mutants import CELLS, certify_mutants, make_project, tree_digest

GUARD = "tests/test_planted.py::test_shift_guard"
CELL = "cells/shift.yaml::torch[rows_4-cpu]"
BROKEN = "tests/test_broken.py::test_shift_broken"
BROKEN_TEST = '''\
import pytest


@pytest.mark.certify_guard("shift")
def test_shift_broken():
    assert False, "a test that fails on the unmutated code too"
'''


def _job(tests: list[str], hint: str | None) -> Job:
    return Job("op", "m", "bug", "v", "mod", "", tests, 1.0, hint=hint)


def test_a_hint_moves_its_test_first_and_keeps_the_others_order():
    assert hinted_order(["a", "b", "c"], "c") == ["c", "a", "b"]
    assert hinted_order(["a", "b", "c"], None) == ["a", "b", "c"]
    assert hinted_order(["a", "b"], "gone") == ["a", "b"]
    assert through_hint(_job(["a", "b", "c"], "b")) == ["a", "b"]
    assert through_hint(_job(["a", "b", "c"], None)) == []


def test_a_hint_is_read_from_the_last_report_and_kept_only_where_it_is_a_test(tmp_path):
    (tmp_path / "mutants").mkdir()
    (tmp_path / "mutants" / "op.json").write_text(json.dumps({"mutants": [
        {"id": "m", "kind": "data", "status": "killed", "killed_by": "b"},
        {"id": "s", "kind": "data", "status": "survived", "killed_by": None}]}))
    killers = last_killers(tmp_path, "op")
    assert killers == {("data", "m"): "b"}
    jobs = [_job(["a", "b"], None), _job(["a"], None)]
    assert set_hints(jobs[:1], killers) == 1 and jobs[0].hint == "b"
    assert set_hints(jobs[1:], killers) == 0 and jobs[1].hint is None
    assert last_killers(tmp_path, "none") == {}


def _verdicts(results) -> dict[str, str]:
    return {r.job.id: r.status for r in results}


def test_the_fast_path_gives_the_full_runs_verdicts_on_rmsnorm():
    paths = project_paths(str(Path(__file__).resolve().parents[2]))
    op = load_catalog(paths.cells).ops["rmsnorm"]
    items = load_items(paths.lists / "items.json")
    durations = load_durations(paths.lists / "durations.json")
    with warm_pool(paths.root, 2) as pool:
        full = run_jobs(data_jobs(paths, op, items, durations), paths.root, 2, pool=pool)
        jobs = data_jobs(paths, op, items, durations)
        killers = {("data", r.job.id): r.killed_by for r in full if r.status == "killed"}
        assert set_hints(jobs, killers) == len(killers) > 0
        fast = run_jobs(jobs, paths.root, 2, pool=pool)
    assert _verdicts(fast) == _verdicts(full)
    assert all(r.by_hint for r in fast if r.status == "killed")
    assert not any(r.by_hint for r in full)
    assert sum(r.ran for r in fast) <= sum(r.ran for r in full)


def _write_hints(project: Path, hints: dict[str, str]) -> None:
    (project / "reports" / "mutants").mkdir(parents=True, exist_ok=True)
    (project / "reports" / "mutants" / "shift.json").write_text(json.dumps({
        "format": "mutants/1", "op": "shift",
        "mutants": [{"id": i, "kind": "data", "status": "killed", "killed_by": t}
                    for i, t in hints.items()]}))


def _statuses(project: Path) -> dict[str, str]:
    return {m["id"]: m["status"] for m in load_mutants(project / "reports")["shift"]["mutants"]}


def test_a_wrong_or_stale_hint_still_gives_the_usual_orders_verdict(tmp_path):
    project = make_project(tmp_path / "p")
    (project / "cells" / "shift.yaml").write_text(CELLS.split("  - id: impl_hangs")[0])
    before = tree_digest(project)
    res = certify_mutants(project, "--op", "shift", "--no-hints")
    full = _statuses(project)
    assert full == {"impl_adds_two": "killed", "spec_shifts_zero": "killed",
                    "impl_shifts_zero": "survived", "impl_commuted": "equivalent"}, res.stdout
    _write_hints(project, {
        "impl_adds_two": GUARD,          # wrong: the guard calls the spec, not the variant
        "spec_shifts_zero": CELL,        # stale: the cell's inputs hold no zero
        "impl_shifts_zero": CELL,        # a survivor with a hint: it must still run every test
        "impl_commuted": "tests/test_planted.py::test_gone"})   # no such test: no hint
    res = certify_mutants(project, "--op", "shift")
    assert _statuses(project) == full, res.stdout + res.stderr
    by = {m["id"]: m for m in load_mutants(project / "reports")["shift"]["mutants"]}
    assert by["impl_adds_two"]["killed_by"] == CELL and not by["impl_adds_two"].get("by_hint")
    assert by["spec_shifts_zero"]["killed_by"] == GUARD
    assert by["impl_shifts_zero"]["tests_ran"] == 2
    assert tree_digest(project) == before


def test_a_hint_after_a_test_that_fails_on_the_unmutated_code_gives_the_usual_orders_verdict(
        tmp_path):
    project = make_project(tmp_path / "p")
    (project / "cells" / "shift.yaml").write_text(CELLS.split("  - id: impl_hangs")[0])
    (project / "tests" / "test_broken.py").write_text(BROKEN_TEST)
    (project / "lists" / "durations.json").write_text(json.dumps(
        {"format": "durations/1", "durations": {BROKEN: 0.001, GUARD: 0.01, CELL: 0.1}}))
    res = certify_mutants(project, "--op", "shift", "--no-hints")
    full = _statuses(project)
    # the broken test runs first and fails every mutant: each kill proves nothing
    assert full == {"impl_adds_two": "error", "spec_shifts_zero": "error",
                    "impl_shifts_zero": "error", "impl_commuted": "equivalent"}, res.stdout
    _write_hints(project, {"impl_adds_two": CELL, "spec_shifts_zero": GUARD,
                           "impl_shifts_zero": BROKEN})
    res = certify_mutants(project, "--op", "shift")
    assert _statuses(project) == full, res.stdout + res.stderr
    by = {m["id"]: m for m in load_mutants(project / "reports")["shift"]["mutants"]}
    assert by["impl_adds_two"]["killed_by"] == BROKEN
