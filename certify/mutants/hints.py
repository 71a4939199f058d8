"""Killer first: a mutant runs first the test that killed it in the op's last report.

A mutant needs one kill, and the test that killed it last time most likely kills it again, so it runs
ahead of the cheaper tests that passed last time; the run still stops at the first failure. The hint
only reorders: when it passes (the code or the tests changed since), the mutant's other tests run in
their usual order, cheapest first, and a survivor has run every test. The runner
(``certify.mutants.runner``) makes the verdict of a kill by the hint the one a run in the usual order
gives: the hint and the tests before it in that order run on the unmutated code, and where one of
them fails there (a kill by it would prove nothing) the mutant runs again without its hint.
"""

from __future__ import annotations

import json
from pathlib import Path

from certify.mutants.plan import Job

REPORT_DIR = "mutants"   # certify.mutants.report.DIR (not imported: the report imports the runner)


def last_killers(reports: Path, op: str) -> dict[tuple[str, str], str]:
    """(kind, mutant id) -> the test that killed it, from the op's last report (none if unreadable)."""
    path = Path(reports) / REPORT_DIR / f"{op}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    records = data.get("mutants", []) + data.get("generic", {}).get("mutants", [])
    return {(r.get("kind", "data"), r["id"]): r["killed_by"] for r in records
            if r.get("status") == "killed" and r.get("killed_by") and r.get("id")}


def set_hints(jobs: list[Job], killers: dict[tuple[str, str], str]) -> int:
    """Give each job its last killer as a hint where that is one of its tests; how many got one."""
    n = 0
    for j in jobs:
        hint = killers.get((j.kind, j.id))
        j.hint = hint if hint in j.tests else None
        n += j.hint is not None
    return n


def hinted_order(tests: list[str], hint: str | None) -> list[str]:
    """The tests with the hint first, the others in their order."""
    if hint is None or hint not in tests:
        return list(tests)
    return [hint, *(t for t in tests if t != hint)]


def through_hint(job: Job) -> list[str]:
    """The job's tests in their usual order up to and with its hint (none without a hint): the
    tests a run in that order would meet before the hint's kill."""
    if job.hint is None or job.hint not in job.tests or not job.tests:
        return []
    return job.tests[:job.tests.index(job.hint) + 1]


def expected_cost(job: Job) -> float:
    """The measured seconds a job is expected to run: its hint's when it has one (it most likely
    kills), else all its tests'."""
    if job.hint is not None and job.hint in job.costs:
        return job.costs[job.hint]
    return job.cost
