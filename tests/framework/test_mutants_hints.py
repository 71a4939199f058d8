"""Killer first (``certify.mutants.hints``): a mutant's hint, the test that killed it last time, only
reorders its tests, and the verdicts are those of a run in the usual order (cheapest first), whether
the hint is right, wrong, stale, or a test that fails on the unmutated code."""

from __future__ import annotations

import json
from pathlib import Path

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.lists.records import load_durations, load_items
from certify.mutants.hints import (clean_ahead, hint_first, last_killers, last_seconds,
                                   learn_seconds, run_order, set_hints, through_hint)
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


def _job(tests: list[str], hint: str | None, costs: dict[str, float] | None = None) -> Job:
    costs = costs or {t: 1.0 for t in tests}
    return Job("op", "m", "bug", "v", "mod", "", tests, sum(costs.values()), costs=costs, hint=hint)


def test_a_hint_runs_first_unless_the_tests_before_it_cost_less_together():
    assert run_order(_job(["a", "b", "c"], "c")) == ["c", "a", "b"]
    assert run_order(_job(["a", "b", "c"], "c"), hint=False) == ["a", "b", "c"]
    assert run_order(_job(["a", "b", "c"], None)) == ["a", "b", "c"]
    assert run_order(_job(["a", "b"], "gone")) == ["a", "b"]
    dear = _job(["a", "b", "c"], "c", {"a": 0.1, "b": 0.2, "c": 40.0})
    assert not hint_first(dear) and run_order(dear) == ["a", "b", "c"]
    assert clean_ahead(dear) == ["c"]
    cheap = _job(["a", "b", "c"], "b", {"a": 1.0, "b": 0.5, "c": 3.0})
    assert hint_first(cheap) and clean_ahead(cheap) == through_hint(cheap) == ["a", "b"]
    assert through_hint(_job(["a", "b", "c"], None)) == []


def test_the_seconds_seen_reorder_a_jobs_tests_but_never_change_which_run():
    job = _job(["a", "cell", "b"], None, {"a": 0.01, "cell": 0.03, "b": 0.5})
    learn_seconds([job], {"cell": 40.0, "other": 1.0})
    assert job.tests == ["a", "b", "cell"]
    assert job.costs == {"a": 0.01, "cell": 40.0, "b": 0.5}


def test_a_hint_is_read_from_the_last_report_and_kept_only_where_it_is_a_test(tmp_path):
    (tmp_path / "mutants").mkdir()
    (tmp_path / "mutants" / "op.json").write_text(json.dumps({"mutants": [
        {"id": "m", "kind": "data", "status": "killed", "killed_by": "b"},
        {"id": "s", "kind": "data", "status": "survived", "killed_by": None}],
        "test_seconds": {"b": 2.5}}))
    assert last_seconds(tmp_path, "op") == {"b": 2.5}
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
    assert all(r.killed_by == r.job.hint for r in fast if r.status == "killed")
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
        {"format": "durations/1", "durations": {CELL: 0.01, BROKEN: 0.05, GUARD: 0.06}}))
    res = certify_mutants(project, "--op", "shift", "--no-hints")
    full = _statuses(project)
    # the usual order is cell, broken test, guard: a mutant the cell does not kill meets the broken
    # test next, and that kill proves nothing
    assert full == {"impl_adds_two": "killed", "spec_shifts_zero": "error",
                    "impl_shifts_zero": "error", "impl_commuted": "equivalent"}, res.stdout
    # the guard, run first, kills the spec's mutant, yet the broken test comes before it in the
    # usual order: the mutant runs again in that order
    _write_hints(project, {"impl_adds_two": BROKEN, "spec_shifts_zero": GUARD,
                           "impl_shifts_zero": GUARD})
    res = certify_mutants(project, "--op", "shift")
    assert _statuses(project) == full, res.stdout + res.stderr
    by = {m["id"]: m for m in load_mutants(project / "reports")["shift"]["mutants"]}
    assert by["spec_shifts_zero"]["killed_by"] == BROKEN
    assert by["impl_adds_two"]["killed_by"] == CELL
    assert "spec_shifts_zero: killed by " + GUARD + " (its hint)" in res.stdout
