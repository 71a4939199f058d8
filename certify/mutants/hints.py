"""What the op's last report teaches the next run: each mutant's killer, and each test's seconds.

A mutant needs one kill, and the test that killed it last time (its hint) most likely kills it again,
so it runs ahead of the cheaper tests that passed last time, unless those cost less together than
the hint does; the run still stops at the first failure. The hint only reorders: when it passes (the
code or the tests changed since), the mutant's other tests run in their usual order, and a survivor
has run every test. The runner (``certify.mutants.runner``) makes the verdict of a kill by the hint
the one a run in the usual order gives: the hint and the tests before it in that order run on the
unmutated code, and where one of them fails there (a kill by it would prove nothing) the mutant runs
again without its hint.

The usual order is cheapest first, by the measured durations (``test_lists/durations.json``) or the
seconds a test took in the last run, whichever is longer: a duration measured where a cell did not
run its kernels would put a minute of Triton's interpreter ahead of cheap tests that kill as well.
Which tests a mutant runs (the cap) is decided by the measured durations alone, so the seconds seen
change only the order.
"""

from __future__ import annotations

import json
from pathlib import Path

from certify.mutants.plan import Job

REPORT_DIR = "mutants"   # certify.mutants.report.DIR (not imported: the report imports the runner)


def _last_report(reports: Path, op: str) -> dict:
    try:
        return json.loads((Path(reports) / REPORT_DIR / f"{op}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def last_seconds(reports: Path, op: str) -> dict[str, float]:
    """Each test's seconds in the op's last runs (the report's ``test_seconds``)."""
    return {t: float(s) for t, s in _last_report(reports, op).get("test_seconds", {}).items()}


def learn_seconds(jobs: list[Job], seen: dict[str, float]) -> None:
    """Give each job's tests the longer of their measured and seen seconds, and put them in that
    order again, cheapest first (ties keep their order); the set of tests stays."""
    for j in jobs:
        j.costs = {t: max(c, seen.get(t, 0.0)) for t, c in j.costs.items()}
        place = {t: n for n, t in enumerate(j.tests)}
        j.tests = sorted(j.tests, key=lambda t: (j.costs.get(t, 0.0), place[t]))
        j.cost = sum(j.costs.values())


def last_killers(reports: Path, op: str) -> dict[tuple[str, str], str]:
    """(kind, mutant id) -> the test that killed it, from the op's last report (none if unreadable)."""
    data = _last_report(reports, op)
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


def hint_first(job: Job) -> bool:
    """Whether the job's hint runs first: it has one, and the tests before it in the usual order
    cost at least as much together."""
    if job.hint is None or job.hint not in job.tests:
        return False
    before = job.tests[:job.tests.index(job.hint)]
    return sum(job.costs.get(t, 0.0) for t in before) >= job.costs.get(job.hint, 0.0)


def run_order(job: Job, hint: bool = True) -> list[str]:
    """The job's tests in the order they run: the hint first where ``hint_first``, else the usual
    order."""
    if not hint or not hint_first(job):
        return list(job.tests)
    return [job.hint, *(t for t in job.tests if t != job.hint)]


def through_hint(job: Job) -> list[str]:
    """The job's tests in their usual order up to and with its hint (none without a hint): the
    tests a run in that order would meet before the hint's kill."""
    if job.hint is None or job.hint not in job.tests or not job.tests:
        return []
    return job.tests[:job.tests.index(job.hint) + 1]


def clean_ahead(job: Job) -> list[str]:
    """The tests to run on the unmutated code beside the mutants: the hint, and where it runs first
    the tests before it in the usual order too."""
    if job.hint is None or job.hint not in job.tests:
        return []
    return through_hint(job) if hint_first(job) else [job.hint]


def expected_cost(job: Job) -> float:
    """The seconds a job is expected to run: up to its hint's kill when it has one (the hint most
    likely kills), else all its tests'."""
    order = run_order(job)
    if job.hint is None or job.hint not in order:
        return job.cost
    return sum(job.costs.get(t, 0.0) for t in order[:order.index(job.hint) + 1])
