"""Run mutants in worker processes, a few at once, and confirm each kill on the unmutated code.

Each mutated module is written to a temporary folder outside the working tree and served to its
worker by an import finder (``certify.mutants.worker``): the working tree is only read, whatever
happens to the run (an interrupt kills the workers and removes the folder; a kill leaves at most the
folder, under the system's temporary directory). A worker that outlives its time limit is killed,
and its mutant counts as killed (``timeout``: a mutant that hangs the op is caught).

A mutant is killed when one of its tests fails. The tests that killed mutants then run once more,
together, on the unmutated code: a test that fails there too proves nothing about the mutants it
killed, which are reported as ``error`` with that reason, not as killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import certify
from certify.mutants.plan import Job, module_file

STARTUP_S = 30.0     # a worker's allowance beside its tests: interpreter, torch and pytest start-up
TIME_FACTOR = 3.0    # a worker may take this many times its tests' measured cost before it is killed
#                      (times the machine's load over its cores, when that is above 1)

KILLED, SURVIVED, TIMEOUT, ERROR, EQUIVALENT = "killed", "survived", "timeout", "error", "equivalent"
CRASHED = "crashed"   # the worker died of a signal inside the op's tests (a mutant's wild write)
CAUGHT = (KILLED, TIMEOUT, CRASHED)   # the statuses that count as killed
NOT_RUN = "not run"   # no cell or test of the op that reads the module runs on this machine

_LIVE: set[subprocess.Popen] = set()   # the workers running now, ended all at once on an interrupt
_LIVE_GUARD = threading.Lock()


@dataclass
class Result:
    job: Job
    status: str              # killed | survived | timeout | crashed | error | equivalent | not run
    killed_by: str | None = None
    seconds: float = 0.0
    ran: int = 0             # tests that ran
    message: str = ""
    outcomes: dict[str, str] = field(default_factory=dict)


def _env(root: Path, threads: int) -> dict[str, str]:
    framework = str(Path(certify.__file__).resolve().parents[1])
    path = [str(root), framework, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
            "PYTHONDONTWRITEBYTECODE": "1", "HYPOTHESIS_PROFILE": "ci",
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _run_worker(job: dict, work: Path, name: str, root: Path, timeout: float,
                threads: int) -> tuple[dict | None, float, bool]:
    """(the worker's result or None, seconds, whether it timed out)."""
    job_file, result_file = work / f"{name}.job.json", work / f"{name}.result.json"
    job_file.write_text(json.dumps(job))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "certify.mutants.worker", str(job_file),
                             str(result_file)], cwd=root, env=_env(root, threads),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    with _LIVE_GUARD:
        _LIVE.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return None, time.perf_counter() - t0, True
    except BaseException:
        _kill(proc)
        raise
    finally:
        with _LIVE_GUARD:
            _LIVE.discard(proc)
    seconds = time.perf_counter() - t0
    if not result_file.is_file():
        return {"crash": (out or "")[-2000:], "exit": proc.returncode}, seconds, False
    return json.loads(result_file.read_text()), seconds, False


def _kill(proc: subprocess.Popen) -> None:
    """End a worker and what it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _load_slack() -> float:
    """How many times slower than measured the tests run now: the load average over the cores (at
    least 1), so a loaded machine does not turn a survivor's slow run into a timeout, a kill."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _one(job: Job, n: int, work: Path, root: Path, threads: int, limit: float | None) -> Result:
    if not job.tests:
        return Result(job, NOT_RUN, message="no cell or test of the op that reads the edited module "
                                            "runs on this machine's archs")
    path = work / f"m{n}" / "mutant.py"
    path.parent.mkdir()
    path.write_text(job.source)
    original = module_file(job.module)
    package_dir = str(original.parent) if original.name == "__init__.py" else None
    spec = {"module": job.module, "path": str(path), "package_dir": package_dir,
            "tests": job.tests, "root": str(root), "stop": True}
    timeout = limit or (STARTUP_S + TIME_FACTOR * job.cost) * _load_slack()
    res, seconds, timed_out = _run_worker(spec, work, f"m{n}", root, timeout, threads)
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
    if res["first_failed"]:
        return Result(job, KILLED, res["first_failed"], seconds, ran, res["message"], res["outcomes"])
    if res["not_run"] or res["exit"] not in (0, 5):
        return Result(job, ERROR, seconds=seconds, ran=ran, outcomes=res["outcomes"],
                      message=f"pytest exit {res['exit']}; not run: {res['not_run'][:5]}")
    return Result(job, SURVIVED, seconds=seconds, ran=ran, outcomes=res["outcomes"])


def run_jobs(jobs: list[Job], root: Path, workers: int = 2, run_equivalent: bool = False,
             progress=None, limit: float | None = None) -> list[Result]:
    """Run the jobs, ``workers`` at once (each with its share of the cores), the costliest first, and
    confirm the kills. A job marked equivalent is run only with ``run_equivalent``. A worker is
    killed after ``limit`` seconds (default: ``STARTUP_S`` plus ``TIME_FACTOR`` times its tests'
    measured cost)."""
    results: dict[int, Result] = {}
    todo = []
    for n, job in enumerate(jobs):
        if job.equivalent and not run_equivalent:
            results[n] = Result(job, EQUIVALENT, message=job.equivalent)
        else:
            todo.append(n)
    threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    todo.sort(key=lambda n: -jobs[n].cost)
    with tempfile.TemporaryDirectory(prefix="certify-mutants-") as tmp:
        work = Path(tmp)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = {n: pool.submit(_one, jobs[n], n, work, root, threads, limit) for n in todo}
            try:
                for n in todo:
                    results[n] = futures[n].result()
                    if progress:
                        progress(results[n])
            except BaseException:  # an interrupt: no new worker starts, the running ones end now
                for f in futures.values():
                    f.cancel()
                with _LIVE_GUARD:
                    live = list(_LIVE)
                for proc in live:
                    _kill(proc)
                raise
        _confirm(results, work, root, threads * max(1, workers))
    return [results[n] for n in range(len(jobs))]


def _confirm(results: dict[int, Result], work: Path, root: Path, threads: int) -> None:
    """Run every killing test on the unmutated code; a kill by a test that fails there too is no
    kill."""
    killers = sorted({r.killed_by for r in results.values() if r.status == KILLED})
    if not killers:
        return
    spec = {"module": None, "tests": killers, "root": str(root), "stop": False}
    res, _, timed_out = _run_worker(spec, work, "clean", root, STARTUP_S + 600.0, threads)
    failing = set(killers) if timed_out or "crash" in res else \
        {t for t, v in res["outcomes"].items() if v == "failed"}
    for r in results.values():
        if r.status == KILLED and (r.killed_by in failing or r.killed_by == "(collection)"):
            r.status = ERROR
            r.message = (f"{r.killed_by} fails on the unmutated code too (or could not be run "
                         "there): the kill proves nothing")
