"""Run mutants in worker processes, a few at once, and confirm each kill on the unmutated code.

Each mutated module is written to a temporary folder outside the working tree and served to its
worker by an import finder (``certify.mutants.worker``): the working tree is only read, whatever
happens to the run (an interrupt kills the workers and removes the folder; a kill leaves at most the
folder, under the system's temporary directory). The workers are forked from warm servers
(``certify.mutants.warm``) that imported torch, Triton and pytest once; compiled bytecode goes to the
run's temporary folder, so a project module is compiled once a run, not once a mutant. A worker that
outlives its time limit is killed, and its mutant counts as killed (``timeout``: a mutant that hangs
the op is caught).

A mutant is killed when one of its tests fails; its run stops there. A mutant with a hint (the test
that killed it last time, ``certify.mutants.hints``) may run that test first. The tests that killed
mutants run once more on the unmutated code, beside the mutants still running: the hints (and the
tests before them in their mutants' usual order) from the start, every other killer once it kills.
A test that fails there too proves nothing about the mutants it killed, which are reported as
``error`` with that reason, not as killed; a mutant killed by its hint where the hint or a test
before it fails there runs again in the usual order, so that its verdict is the one that order
gives.
"""

from __future__ import annotations

import heapq
import json
import os
import tempfile
import time
from contextlib import ExitStack, contextmanager
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import certify
from certify.mutants.hints import clean_ahead, expected_cost, run_order, through_hint
from certify.mutants.plan import Job, module_file
from certify.mutants.pool import WarmPool, WorkerDied

STARTUP_S = 30.0     # a worker's allowance beside its tests: interpreter, torch and pytest start-up
TIME_FACTOR = 3.0    # a worker may take this many times its tests' measured cost before it is killed
#                      (times the machine's load over its cores, when that is above 1)

KILLED, SURVIVED, TIMEOUT, ERROR, EQUIVALENT = "killed", "survived", "timeout", "error", "equivalent"
CRASHED = "crashed"   # the worker died of a signal inside the op's tests (a mutant's wild write)
CAUGHT = (KILLED, TIMEOUT, CRASHED)   # the statuses that count as killed
NOT_RUN = "not run"   # no cell or test of the op that reads the module runs on this machine


@dataclass
class Result:
    job: Job
    status: str              # killed | survived | timeout | crashed | error | equivalent | not run
    killed_by: str | None = None
    seconds: float = 0.0
    ran: int = 0             # tests that ran
    message: str = ""
    outcomes: dict[str, str] = field(default_factory=dict)
    by_hint: bool = False    # killed by its hint, run first
    durations: dict[str, float] = field(default_factory=dict)   # each test's seconds in this run


def _env(root: Path, threads: int, pycache: Path) -> dict[str, str]:
    framework = str(Path(certify.__file__).resolve().parents[1])
    path = [str(root), framework, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
           "PYTHONPYCACHEPREFIX": str(pycache), "HYPOTHESIS_PROFILE": "ci",
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


@contextmanager
def warm_pool(root: Path, workers: int = 2):
    """``workers`` warm workers, each with its share of the cores, and their temporary folder (with
    the compiled bytecode), for one or more ops' runs."""
    threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    with tempfile.TemporaryDirectory(prefix="certify-mutants-warm-") as tmp:
        pool = WarmPool(workers, root, _env(root, threads, Path(tmp) / "pycache"), Path(tmp))
        try:
            yield pool
        except BaseException:
            pool.kill_all()
            raise
        pool.close()


def _run_worker(pool: WarmPool, job: dict, work: Path, name: str,
                timeout: float) -> tuple[dict | None, float, bool]:
    """(the worker's result or None, seconds, whether it timed out)."""
    job_file, result_file = work / f"{name}.job.json", work / f"{name}.result.json"
    log_file = work / f"{name}.log"
    job_file.write_text(json.dumps(job))
    t0 = time.perf_counter()
    try:
        with pool.take() as w:
            code, seconds = w.run(job_file, result_file, log_file, timeout)
    except WorkerDied as e:
        return {"crash": str(e), "exit": None}, time.perf_counter() - t0, False
    if code is None:
        return None, seconds, True
    if not result_file.is_file():
        out = log_file.read_text(errors="replace") if log_file.is_file() else ""
        return {"crash": out[-2000:], "exit": code}, seconds, False
    return json.loads(result_file.read_text()), seconds, False


def _load_slack() -> float:
    """How many times slower than measured the tests run now: the load average over the cores (at
    least 1), so a loaded machine does not turn a survivor's slow run into a timeout, a kill."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _one(pool: WarmPool, job: Job, n: int, work: Path, root: Path, limit: float | None,
         hint: bool = True) -> Result:
    if not job.tests:
        return Result(job, NOT_RUN, message="no cell or test of the op that reads the edited module "
                                            "runs on this machine's archs")
    name = f"m{n}" + ("" if hint else "-again")
    path = work / name / "mutant.py"
    path.parent.mkdir()
    path.write_text(job.source)
    original = module_file(job.module)
    package_dir = str(original.parent) if original.name == "__init__.py" else None
    tests = run_order(job, hint)
    spec = {"module": job.module, "path": str(path), "package_dir": package_dir,
            "tests": tests, "root": str(root), "stop": True}
    timeout = limit or (STARTUP_S + TIME_FACTOR * job.cost) * _load_slack()
    res, seconds, timed_out = _run_worker(pool, spec, work, name, timeout)
    if timed_out:
        return Result(job, TIMEOUT, seconds=seconds,
                      message=f"the tests did not finish in {timeout:.0f} s (the mutant hangs or "
                              "slows the op)")
    if "crash" in res and res["exit"] is not None and res["exit"] < 0:
        return Result(job, CRASHED, seconds=seconds,
                      message=f"the worker died of signal {-res['exit']} in the op's tests (the mutant "
                              f"crashes the process): {res['crash'][-600:]}")
    if "crash" in res:
        return Result(job, ERROR, seconds=seconds,
                      message=f"the worker ended without a result (exit {res['exit']}): {res['crash']}")
    ran = sum(1 for v in res["outcomes"].values() if v != "skipped")
    durations = res.get("durations", {})
    if res["first_failed"]:
        by_hint = tests[0] != job.tests[0] and res["first_failed"] == job.hint
        return Result(job, KILLED, res["first_failed"], seconds, ran, res["message"], res["outcomes"],
                      by_hint, durations)
    if res["not_run"] or res["exit"] not in (0, 5):
        return Result(job, ERROR, seconds=seconds, ran=ran, outcomes=res["outcomes"],
                      message=f"pytest exit {res['exit']}; not run: {res['not_run'][:5]}",
                      durations=durations)
    return Result(job, SURVIVED, seconds=seconds, ran=ran, outcomes=res["outcomes"],
                  durations=durations)


def _clean(pool: WarmPool, tests: list[str], work: Path, root: Path,
           name: str) -> tuple[dict[str, str], dict[str, float]]:
    """Each test's outcome on the unmutated code (``failed`` for all when the run gave no result),
    and each test's seconds."""
    spec = {"module": None, "tests": tests, "root": str(root), "stop": False}
    res, _, timed_out = _run_worker(pool, spec, work, name, STARTUP_S + 600.0)
    if timed_out or "crash" in res:
        return {t: "failed" for t in tests}, {}
    return {t: res["outcomes"].get(t, "not run") for t in tests}, res.get("durations", {})


def run_jobs(jobs: list[Job], root: Path, workers: int = 2, run_equivalent: bool = False,
             progress=None, limit: float | None = None, pool: WarmPool | None = None,
             seen: dict[str, float] | None = None) -> list[Result]:
    """Run the jobs, ``workers`` at once in warm workers (``pool``'s, or a pool of their own), the
    costliest first, and confirm the kills. A job marked equivalent is run only with
    ``run_equivalent``. A worker is killed after ``limit`` seconds (default: ``STARTUP_S`` plus
    ``TIME_FACTOR`` times its tests' measured cost).

    The hinted killers (``Job.hint``), with the tests before them in their mutants' usual order where
    the hint runs first, run on the unmutated code beside the mutants, as one more job; so does each
    killer no hint foresaw, as soon as it kills. ``seen`` gets each test's longest seconds in the run (its tests' and the clean runs').
    """
    seen = {} if seen is None else seen
    results: dict[int, Result] = {}
    todo = []
    for n, job in enumerate(jobs):
        if job.equivalent and not run_equivalent:
            results[n] = Result(job, EQUIVALENT, message=job.equivalent)
        else:
            todo.append(n)
    todo.sort(key=lambda n: -expected_cost(jobs[n]))
    hinted = sorted({t for n in todo if jobs[n].tests for t in clean_ahead(jobs[n])})
    costs = {t: c for n in todo for t, c in jobs[n].costs.items()}
    hinted_cost = sum(costs.get(t, 0.0) for t in hinted)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="certify-mutants-")))
        if pool is None:
            pool = stack.enter_context(warm_pool(root, workers))
        with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
            queue = [(-expected_cost(jobs[n]), n, ("mutant", n)) for n in todo]
            if hinted:
                queue.append((-hinted_cost, -1, ("clean", hinted)))
            heapq.heapify(queue)
            running: dict = {}
            clean: dict[str, str] = {}
            asked = set(hinted)   # the tests run, or to run, on the unmutated code
            try:
                while queue or running:
                    while queue and len(running) < max(1, workers):   # the costliest waiting first
                        _, key, (kind, what) = heapq.heappop(queue)
                        running[ex.submit(_one, pool, jobs[what], what, work, root, limit)
                                if kind == "mutant" else
                                ex.submit(_clean, pool, what, work, root, f"clean{key}")] = kind, what
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for f in done:
                        kind, what = running.pop(f)
                        if kind == "clean":
                            outcomes, seconds = f.result()
                            clean.update(outcomes)
                            _longest(seen, seconds)
                            continue
                        r = results[what] = f.result()
                        if progress:
                            progress(r)
                        if r.status == KILLED and r.killed_by not in asked | {"(collection)"}:
                            asked.add(r.killed_by)   # confirmed beside the mutants still running
                            heapq.heappush(queue, (-r.job.costs.get(r.killed_by, 0.0),
                                                   len(jobs) + len(asked), ("clean", [r.killed_by])))
                again = _rerun_hinted(results, clean, pool, work, root, limit, progress)
                if again:
                    _longest(seen, _confirm(results, clean, pool, work, root))
                _mark_errors(results, clean)
                for r in results.values():
                    _longest(seen, r.durations)
            except BaseException:  # an interrupt: no new worker starts, the running ones end now
                for f in running:
                    f.cancel()
                pool.kill_all()
                raise
    return [results[n] for n in range(len(jobs))]


def _longest(seen: dict[str, float], durations: dict[str, float]) -> None:
    for t, s in durations.items():
        seen[t] = max(s, seen.get(t, 0.0))


def _confirm(results: dict[int, Result], clean: dict[str, str], pool: WarmPool, work: Path,
             root: Path) -> dict[str, float]:
    """Run on the unmutated code the killing tests not run there yet, adding to ``clean``; their
    seconds."""
    killers = sorted({r.killed_by for r in results.values() if r.status == KILLED} - set(clean)
                     - {"(collection)"})
    if not killers:
        return {}
    outcomes, seconds = _clean(pool, killers, work, root, f"confirm{len(clean)}")
    clean.update(outcomes)
    return seconds


def _rerun_hinted(results: dict[int, Result], clean: dict[str, str], pool: WarmPool, work: Path,
                  root: Path, limit: float | None, progress) -> list[int]:
    """Run once more in the usual order (cheapest first) each mutant killed by its hint where its
    hint or a test before it fails on the unmutated code, so that its verdict is the one that order
    gives; the mutants run again."""
    again = [n for n, r in results.items() if r.status == KILLED and r.by_hint
             and any(clean.get(t) == "failed" for t in through_hint(r.job))]
    for n in again:
        results[n] = _one(pool, results[n].job, n, work, root, limit, hint=False)
        if progress:
            progress(results[n])
    return again


def _mark_errors(results: dict[int, Result], clean: dict[str, str]) -> None:
    """A kill by a test that fails (or could not run) on the unmutated code too is no kill."""
    for r in results.values():
        if r.status == KILLED and (clean.get(r.killed_by) == "failed"
                                   or r.killed_by == "(collection)"):
            r.status = ERROR
            r.message = (f"{r.killed_by} fails on the unmutated code too (or could not be run "
                         "there): the kill proves nothing")
