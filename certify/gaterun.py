"""Running a gate: each engine configuration the gate needs runs every task its checks read, once, in
this run (the gate's own engine, and for a paired check the configuration it is compared with); then
every check compares what was measured with its reference (certify.gatestats).

Statuses: a check ``passed`` / ``failed``, or has ``no reference`` (none recorded for its
configuration: that is not a pass; ``--record`` writes one from this run, to be reviewed and
committed), or is ``recorded`` (it had none and this run's measurement became its reference: not a
pass either, the next run checks against it). A gate is ``skipped`` when the target says it cannot
run here (the reason is kept), ``failed`` when a check failed, else ``no reference`` when a check
lacks its reference, else ``recorded`` when this run recorded one, else ``passed``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from certify import gatestats as st
from certify.gates import (
    GateTarget,
    ReferenceStore,
    TaskResult,
    config_key,
    utc_now,
)
from certify.gateschema import (
    AcceptanceCheck,
    AccuracyCheck,
    GateFile,
    PairedDeltaCheck,
    Reference,
)

RunProgress = Callable[[str, int, int], None]   # (run label, done, total)


@dataclass
class CheckResult:
    kind: str
    task: str
    status: str                      # passed | failed | no reference | recorded
    measured: float | None = None
    reference: float | None = None
    threshold: float | None = None
    mde: float | None = None         # minimum detectable effect (points), statistical checks only
    detail: str = ""


@dataclass
class RunRecord:
    label: str                       # "gate" or "against:<config>"
    task: str
    eval_set: str
    samples: int
    engine: dict[str, Any]
    accuracy: float
    acceptance_length: float | None
    verify_steps: int
    seconds: float


@dataclass
class GateResult:
    gate: str
    tier: str
    status: str
    reason: str = ""
    checks: list[CheckResult] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list)
    seconds: float = 0.0
    arch: str = ""
    target: dict[str, str] = field(default_factory=dict)
    date: str = ""
    recorded: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.status == "skipped":
            return f"{self.gate}: SKIPPED ({self.reason})"
        lines = [f"{self.gate}: {self.status.upper()} in {self.seconds:.1f} s on {self.arch}"]
        for c in self.checks:
            lines.append(f"  {c.status:<12} {c.kind} {c.task}: {c.detail}")
        return "\n".join(lines)


def _runs_needed(gate: GateFile) -> list[tuple[str, dict[str, Any], str]]:
    """(label, engine mapping, task) in run order: the gate's engine over every task, then each
    compared configuration over the tasks of its paired checks."""
    out = [("gate", dict(gate.engine), t) for t in gate.tasks]
    for c in gate.checks:
        if isinstance(c, PairedDeltaCheck):
            label = "against:" + config_key(c.against)
            if (label, c.task) not in {(lb, t) for lb, _, t in out}:
                out.append((label, dict(c.against), c.task))
    return out


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _accuracy(check: AccuracyCheck, res: TaskResult, ref: Reference | None) -> CheckResult:
    n = len(res.scores)
    measured = st.mean_points(res.scores)
    if ref is None:
        return CheckResult("accuracy", check.task, "no reference", measured,
                           detail=f"{measured:.2f} measured; no reference for this configuration")
    sigma = st.score_sigma(ref.score_list())
    thr = st.threshold(ref.accuracy, sigma, n, check.alpha)
    mde = st.minimum_detectable_effect(sigma, n, check.alpha)
    ok = measured >= thr
    return CheckResult("accuracy", check.task, "passed" if ok else "failed", measured, ref.accuracy,
                       thr, mde, f"{measured:.2f} vs threshold {thr:.2f} (ref {ref.accuracy:.2f}, "
                                 f"sigma {sigma:.1f}, n {n}, alpha {check.alpha}; detects a drop of "
                                 f"{mde:.2f})")


def _acceptance(check: AcceptanceCheck, res: TaskResult, ref: Reference | None) -> CheckResult:
    measured = res.acceptance_length
    if measured is None:
        return CheckResult("acceptance_length", check.task, "failed",
                           detail="no verify step ran: the configuration did not speculate")
    if ref is None or ref.acceptance_length is None:
        return CheckResult("acceptance_length", check.task, "no reference", measured,
                           detail=f"{measured:.3f} measured; no reference for this configuration")
    floor = st.acceptance_floor(ref.acceptance_length, check.ratio)
    ok = measured >= floor
    return CheckResult("acceptance_length", check.task, "passed" if ok else "failed", measured,
                       ref.acceptance_length, floor, None,
                       f"{measured:.3f} vs floor {floor:.3f} ({check.ratio} of ref "
                       f"{ref.acceptance_length:.3f}, never below 1.0; {res.verify_steps} verify steps)")


def _paired(check: PairedDeltaCheck, res: TaskResult, other: TaskResult, ref: Reference | None,
            ref_other: Reference | None) -> CheckResult:
    n = len(res.scores)
    measured = st.paired_delta(res.scores, other.scores)
    flips = sum(a != b for a, b in zip(res.scores, other.scores))
    if ref is None or ref_other is None:
        return CheckResult("paired_delta", check.task, "no reference", measured,
                           detail=f"{measured:+.2f} measured ({flips} of {n} samples differ); no "
                                  "reference pair for these configurations")
    rv, ro = ref.score_list(), ref_other.score_list()
    ref_delta = st.paired_delta(rv, ro)
    sigma = st.paired_sigma(rv, ro)
    thr = st.threshold(ref_delta, sigma, n, check.alpha)
    mde = st.minimum_detectable_effect(sigma, n, check.alpha)
    ok = measured >= thr
    return CheckResult("paired_delta", check.task, "passed" if ok else "failed", measured, ref_delta,
                       thr, mde, f"{measured:+.2f} vs threshold {thr:+.2f} (ref {ref_delta:+.2f}, "
                                 f"sigma {sigma:.1f}, {flips} of {n} samples differ; detects a drop "
                                 f"of {mde:.2f})")


def run_gate(gate: GateFile, target: GateTarget, store: ReferenceStore, *,
             progress: RunProgress | None = None, record: bool = False,
             overwrite: bool = False) -> GateResult:
    """Run one gate (see the module docstring). With ``record`` every configuration run here gets a
    reference from this run where it has none (``overwrite``: replace it); the caller saves the store."""
    reason = target.unavailable()
    if reason:
        return GateResult(gate.gate, gate.tier, "skipped", reason=reason, date=utc_now())
    t0 = time.perf_counter()
    ident, arch, sets = target.identity(), target.arch(), target.eval_sets()
    results: dict[tuple[str, str], TaskResult] = {}
    resolved: dict[str, dict[str, Any]] = {}
    records: list[RunRecord] = []
    for label, engine, task in _runs_needed(gate):
        run = gate.tasks[task]
        resolved.setdefault(label, target.resolve_engine(engine))
        name = f"{gate.gate} / {task} ({label})"
        cb = (lambda d, t, name=name: progress(name, d, t)) if progress else None
        res = target.evaluate(engine, run.eval_set, run.samples, cb)
        results[(label, task)] = res
        records.append(RunRecord(label, task, run.eval_set, run.samples, resolved[label],
                                 st.mean_points(res.scores), res.acceptance_length,
                                 res.verify_steps, res.seconds))

    def ref_of(label: str, task: str) -> Reference | None:
        run = gate.tasks[task]
        return store.find(run.eval_set, sets[run.eval_set].sha256, ident, resolved[label],
                          run.samples)

    checks: list[CheckResult] = []
    for c in gate.checks:
        res = results[("gate", c.task)]
        if isinstance(c, AccuracyCheck):
            checks.append(_accuracy(c, res, ref_of("gate", c.task)))
        elif isinstance(c, AcceptanceCheck):
            checks.append(_acceptance(c, res, ref_of("gate", c.task)))
        else:
            label = "against:" + config_key(c.against)
            checks.append(_paired(c, res, results[(label, c.task)], ref_of("gate", c.task),
                                  ref_of(label, c.task)))
    recorded: list[str] = []
    if record:
        now = utc_now()
        for (label, task), res in results.items():
            run = gate.tasks[task]
            scores = res.scores
            stored = "".join(str(int(s)) for s in scores) if st.is_binary(scores) else list(scores)
            ref = Reference(target=ident, engine=resolved[label], samples=run.samples,
                            accuracy=st.mean_points(scores), scores=stored,
                            acceptance_length=res.acceptance_length,
                            verify_steps=res.verify_steps or None, seconds=round(res.seconds, 3),
                            arch=arch, recorded=now)
            if store.add(run.eval_set, sets[run.eval_set].sha256, ref, overwrite=overwrite):
                recorded.append(f"{task} ({label})")
        checks = [_now_recorded(r) if r.status == "no reference" and _has_refs(c, ref_of) else r
                  for c, r in zip(gate.checks, checks)]
    statuses = {c.status for c in checks}
    status = next((s for s in ("failed", "no reference", "recorded") if s in statuses), "passed")
    return GateResult(gate.gate, gate.tier, status, checks=checks, runs=records,
                      seconds=time.perf_counter() - t0, arch=arch, target=ident, date=utc_now(),
                      recorded=recorded)


def _has_refs(check, ref_of) -> bool:
    """Whether every reference ``check`` reads exists (a paired check reads two)."""
    if ref_of("gate", check.task) is None:
        return False
    return isinstance(check, (AccuracyCheck, AcceptanceCheck)) or \
        ref_of("against:" + config_key(check.against), check.task) is not None


def _now_recorded(c: CheckResult) -> CheckResult:
    detail = c.detail.replace("no reference for this configuration",
                              "recorded as its reference by this run")
    detail = detail.replace("no reference pair for these configurations",
                            "recorded as their references by this run")
    return replace(c, status="recorded", detail=detail)


# ------------------------------------------------------------------------------ parallel jobs


Added = list[tuple[str, str, Reference]]   # (eval set, its content hash, reference) a job stored


def _run_in_job(gate: GateFile, target_spec: str, references: Path, record: bool,
                overwrite: bool, events=None) -> tuple[GateResult, Added]:
    """One gate in a worker process: its own target and a store read from disk at the start. The
    references it records are returned for the parent's store, the one that is saved. ``events``
    (a queue shared with the parent) receives (gate, run label, done, total) as the runs advance."""
    from certify.gates import load_target
    store = ReferenceStore(references)
    added: Added = []
    store_add = store.add

    def add(eval_set: str, sha256: str, ref: Reference, overwrite: bool = False) -> bool:
        stored = store_add(eval_set, sha256, ref, overwrite=overwrite)
        if stored:
            added.append((eval_set, sha256, ref))
        return stored

    store.add = add  # type: ignore[method-assign]
    progress = None if events is None else \
        (lambda label, done, total: events.put((gate.gate, label, done, total)))
    result = run_gate(gate, load_target(target_spec), store, progress=progress, record=record,
                      overwrite=overwrite)
    return result, added


@contextmanager
def _threads_per_job(jobs: int):
    """Each of ``jobs`` processes gets an equal share of the cores (OMP_NUM_THREADS, read by the
    numeric libraries at import), unless the caller set it; oversubscribed BLAS threads cost more
    than the parallelism gains."""
    share = str(max(1, (os.cpu_count() or 1) // jobs))
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    for k, v in saved.items():
        if v is None:
            os.environ[k] = share
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


@contextmanager
def _progress_listener(ctx, on_progress: Callable[[str, str, int, int], None] | None):
    """A queue the jobs put their progress events on (None without ``on_progress``), drained by a
    thread of this process that hands each event to ``on_progress``, until the jobs are done."""
    if on_progress is None:
        yield None
        return
    with ctx.Manager() as manager:
        events = manager.Queue()

        def drain() -> None:
            while (event := events.get()) is not None:
                on_progress(*event)

        listener = threading.Thread(target=drain, name="gate-progress", daemon=True)
        listener.start()
        try:
            yield events
        finally:
            events.put(None)  # after every job's events: each job put them before it returned
            listener.join()


def run_gates_in_jobs(gates: list[GateFile], target_spec: str, store: ReferenceStore, jobs: int, *,
                      record: bool = False, overwrite: bool = False,
                      on_result: Callable[[GateResult], None] | None = None,
                      on_error: Callable[[str, BaseException], None] | None = None,
                      on_progress: Callable[[str, str, int, int], None] | None = None
                      ) -> list[GateResult]:
    """Run ``gates`` in ``jobs`` worker processes (started fresh: nothing of this process's state
    is shared), in the given order (put the longest first), reporting each result as it ends. The
    references the jobs record are added to ``store`` here, in the order the jobs end (the caller
    saves it), so parallel recording cannot lose one: a job reads the references on disk when it
    starts and does not see those another job records in the same run; where two jobs record the
    same configuration, the first to end is kept (``overwrite``: the last). A job that raises is
    reported to ``on_error`` and the others go on. ``on_progress(gate, run label, done, total)`` is
    called in this process, from a listener thread, as the jobs' engine runs advance."""
    results: list[GateResult] = []
    ctx = multiprocessing.get_context("spawn")
    with _threads_per_job(jobs), ProcessPoolExecutor(jobs, mp_context=ctx) as pool, \
            _progress_listener(ctx, on_progress) as events:
        futures = {pool.submit(_run_in_job, g, target_spec, store.dir, record, overwrite, events): g
                   for g in gates}
        for fut in as_completed(futures):
            try:
                result, added = fut.result()
            except Exception as e:  # reported per gate; the other jobs go on
                if on_error is None:
                    raise
                on_error(futures[fut].gate, e)
                continue
            for eval_set, sha256, ref in added:
                store.add(eval_set, sha256, ref, overwrite=overwrite)
            results.append(result)
            if on_result:
                on_result(result)
    return results


# ------------------------------------------------------------------------------ reports


def write_report(result: GateResult, reports_dir: Path) -> Path:
    """``<reports>/gates/<gate>.json``: the whole result, and the summary table over every gate's
    latest report (``summary.md``)."""
    reports_dir.mkdir(parents=True, exist_ok=True)
    path = reports_dir / f"{result.gate}.json"
    path.write_text(json.dumps(asdict(result), indent=1, sort_keys=True) + "\n")
    write_summary(reports_dir)
    return path


def write_summary(reports_dir: Path) -> Path:
    rows = []
    for p in sorted(reports_dir.glob("*.json")):
        r = json.loads(p.read_text())
        checks = "; ".join(f"{c['kind']} {c['task']} {c['status']} "
                           f"({_fmt(c['measured'])} vs {_fmt(c['threshold'])})" for c in r["checks"])
        cost = f"{r['seconds']:.1f} s on {r['arch']}" if r["status"] != "skipped" else "-"
        rows.append(f"| `{r['gate']}` | {r['tier']} | {r['status']} | {cost} | {r['date']} | "
                    f"{checks or r.get('reason', '')} |")
    out = reports_dir / "summary.md"
    out.write_text("# Gates: latest results\n\nWritten by `certify gates run`; one row per gate, "
                   "from `reports/gates/<gate>.json`.\n\n| gate | tier | status | cost | date | "
                   "checks (measured vs threshold) |\n|---|---|---|---|---|---|\n"
                   + "\n".join(rows) + "\n")
    return out


__all__ = ["CheckResult", "RunRecord", "GateResult", "run_gate", "run_gates_in_jobs", "write_report",
           "write_summary"]
