"""Running a gate: each engine configuration the gate needs runs every task its checks read, once, in
this run (the gate's own engine, and for a paired check the configuration it is compared with); then
every check is judged from the per-sample scores of this run and of its references
(certify.gating.judge, with the statistics of certify.gating.stats).

Statuses: a check ``passed`` / ``failed``, or has ``no reference`` (none recorded for its
configuration: that is not a pass; ``--record`` writes one from this run, to be reviewed and
committed), or is ``recorded`` (it had none and this run's measurement became its reference: not a
pass either, the next run checks against it). A gate is ``skipped`` when the target says it cannot
run here (the reason is kept), ``failed`` when a check failed, else ``no reference`` when a check
lacks its reference, else ``recorded`` when this run recorded one, else ``passed``.

A result keeps every run's per-sample scores and verify steps, so a change of statistics re-judges
it (``rejudge``) without running the engine again, and the platform the numbers came from
(``platform``): the CPU capability torch dispatched to and the settings that choose it.

Repeatability. Every gate's engine runs with ``GATE_THREADS`` intra-op threads, however many jobs
share the machine: torch's CPU kernels may split a reduction or a product by thread count (on one
x86 machine 1 and 2 threads gave different greedy tokens), so a fixed count makes a re-run on the
same machine and software bitwise the same run whatever ``--jobs`` is. What the last bits still
depend on is the platform, which a result records (``numeric_platform``): torch's version, the CPU
and the capability its kernels dispatched to (AVX2 against AVX512 turned a greedy answer on another
machine). The checks are exact tests on per-sample scores, so such a change of a sample or two is
judged as what it is; a result says whether it gave its references back bitwise (``bitwise``).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from certify.gating import stats as st
from certify.gating.judge import CheckResult, Family, against_label, judge, own_family, reproduces
from certify.gating.files import GateTarget, ReferenceStore, TaskResult, utc_now
from certify.gating.schema import AcceptanceCheck, AccuracyCheck, GateFile, PairedDeltaCheck, Reference

RunProgress = Callable[[str, int, int], None]   # (run label, done, total)


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
    eval_set_sha256: str = ""
    scores: str | list[float] = ""   # per sample, in sample order (a string of 0 / 1 when binary)
    accepted: list[list[int]] = field(default_factory=list)  # per sample: tokens per verify step

    def task_result(self) -> TaskResult:
        """The measurement back as the target gave it (a stored run re-judged without the engine)."""
        scores = [float(c) for c in self.scores] if isinstance(self.scores, str) else \
            list(self.scores)
        return TaskResult(scores, [list(a) for a in self.accepted], self.seconds)


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
    statistics: int = st.STATISTICS_VERSION
    family: dict[str, Any] = field(default_factory=dict)     # tier, checks, alpha, level
    platform: dict[str, Any] = field(default_factory=dict)   # what decides the numbers' last bits
    rendered: str = ""               # set when the checks were re-judged from the stored scores
    bitwise: bool | None = None      # every reference's numbers given back exactly (None: one lacked)

    def summary(self) -> str:
        if self.status == "skipped":
            return f"{self.gate}: SKIPPED ({self.reason})"
        lines = [f"{self.gate}: {self.status.upper()} in {self.seconds:.1f} s on {self.arch}"]
        for c in self.checks:
            lines.append(f"  {c.status:<12} {c.kind} {c.task}: {c.detail}")
        return "\n".join(lines)


GATE_THREADS = 1    # intra-op threads of every gate's engine runs, whatever --jobs is
PLATFORM_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextmanager
def gate_threads(threads: int | None = None):
    """torch's intra-op thread count at ``threads`` (default ``GATE_THREADS``) for the block,
    restored after (module docstring)."""
    import torch
    threads = GATE_THREADS if threads is None else threads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def numeric_platform() -> dict[str, Any]:
    """What the last bits of a CPU measurement depend on: torch's version, the CPU capability its
    ATen kernels dispatched to (``ATEN_CPU_CAPABILITY`` caps it; oneDNN's own ISA is capped by
    ``ONEDNN_MAX_CPU_ISA``), its intra-op thread count, the CPU model, and those settings as the
    environment gave them (None: unset)."""
    import torch
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "cpu": _cpu_model(),
            "settings": {k: os.environ.get(k) for k in PLATFORM_SETTINGS}}


def _stored_scores(scores: list[float]) -> str | list[float]:
    return "".join(str(int(s)) for s in scores) if st.is_binary(scores) else list(scores)


def _runs_needed(gate: GateFile) -> list[tuple[str, dict[str, Any], str]]:
    """(label, engine mapping, task) in run order: the gate's engine over every task, then each
    compared configuration over the tasks of its paired checks."""
    out = [("gate", dict(gate.engine), t) for t in gate.tasks]
    for c in gate.checks:
        if isinstance(c, PairedDeltaCheck):
            label = against_label(c)
            if (label, c.task) not in {(lb, t) for lb, _, t in out}:
                out.append((label, dict(c.against), c.task))
    return out


def _status(checks: list[CheckResult]) -> str:
    statuses = {c.status for c in checks}
    return next((s for s in ("failed", "no reference", "recorded") if s in statuses), "passed")


def _family_record(family: Family) -> dict[str, Any]:
    return {"tier": family.tier, "checks": family.checks, "alpha": family.alpha,
            "level": family.level}


def run_gate(gate: GateFile, target: GateTarget, store: ReferenceStore, *,
             family: Family | None = None, progress: RunProgress | None = None,
             record: bool = False, overwrite: bool = False) -> GateResult:
    """Run one gate (see the module docstring). ``family``: the statistical checks of the gate's tier
    (judge.tier_families over the gate files), whose share of the tier's family-wise rate each
    check runs at; None judges the gate as its own family (a gate outside any gate directory).
    With ``record`` every configuration run here gets a reference from this run where it has none
    (``overwrite``: replace it); the caller saves the store."""
    reason = target.unavailable()
    if reason:
        return GateResult(gate.gate, gate.tier, "skipped", reason=reason, date=utc_now())
    family = family or own_family(gate)
    with gate_threads():
        env = numeric_platform()
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
                                     res.verify_steps, res.seconds, sets[run.eval_set].sha256,
                                     _stored_scores(res.scores), [list(a) for a in res.accepted]))

    def ref_of(label: str, task: str) -> Reference | None:
        run = gate.tasks[task]
        return store.find(run.eval_set, sets[run.eval_set].sha256, ident, resolved[label],
                          run.samples)

    checks = judge(gate, results, ref_of, family)
    recorded: list[str] = []
    if record:
        now = utc_now()
        for (label, task), res in results.items():
            run = gate.tasks[task]
            ref = Reference(target=ident, engine=resolved[label], samples=run.samples,
                            accuracy=st.mean_points(res.scores), scores=_stored_scores(res.scores),
                            acceptance_length=res.acceptance_length,
                            verify_steps=res.verify_steps or None, seconds=round(res.seconds, 3),
                            arch=arch, recorded=now)
            if store.add(run.eval_set, sets[run.eval_set].sha256, ref, overwrite=overwrite):
                recorded.append(f"{task} ({label})")
        checks = [_now_recorded(r) if r.status == "no reference" and _has_refs(c, ref_of) else r
                  for c, r in zip(gate.checks, checks)]
    return GateResult(gate.gate, gate.tier, _status(checks), checks=checks, runs=records,
                      seconds=time.perf_counter() - t0, arch=arch, target=ident, date=utc_now(),
                      recorded=recorded, family=_family_record(family), platform=env,
                      bitwise=reproduces(checks))


def rejudge(result: GateResult, gate: GateFile, store: ReferenceStore,
            family: Family | None = None) -> GateResult:
    """``result``'s checks judged again from its stored per-sample scores, under this module's
    statistics and ``store``'s references, without running the engine. ``ValueError`` when the
    result holds no scores (written before reports stored them) or lacks a run the gate needs."""
    family = family or own_family(gate)
    results: dict[tuple[str, str], TaskResult] = {}
    for r in result.runs:
        if r.scores == "" or not r.eval_set_sha256:
            raise ValueError(f"{result.gate}: its report holds no per-sample scores; re-run it")
        results[(r.label, r.task)] = r.task_result()
    needed = {(label, task) for label, _, task in _runs_needed(gate)}
    missing = sorted(needed - set(results))
    if missing:
        raise ValueError(f"{result.gate}: the gate file needs runs its report lacks {missing}; "
                         "re-run it")
    runs = {(r.label, r.task): r for r in result.runs}

    def ref_of(label: str, task: str) -> Reference | None:
        r = runs[(label, task)]
        return store.find(r.eval_set, r.eval_set_sha256, result.target, r.engine, r.samples)

    checks = judge(gate, results, ref_of, family)
    return replace(result, status=_status(checks), checks=checks, tier=gate.tier, recorded=[],
                   statistics=st.STATISTICS_VERSION, family=_family_record(family),
                   rendered=utc_now(), bitwise=reproduces(checks))


def _has_refs(check, ref_of) -> bool:
    """Whether every reference ``check`` reads exists (a paired check reads two)."""
    if ref_of("gate", check.task) is None:
        return False
    return isinstance(check, (AccuracyCheck, AcceptanceCheck)) or \
        ref_of(against_label(check), check.task) is not None


def _now_recorded(c: CheckResult) -> CheckResult:
    detail = c.detail.replace("no reference for this configuration",
                              "recorded as its reference by this run")
    detail = detail.replace("no reference pair for these configurations",
                            "recorded as their references by this run")
    return replace(c, status="recorded", detail=detail)


# ------------------------------------------------------------------------------ parallel jobs


Added = list[tuple[str, str, Reference]]   # (eval set, its content hash, reference) a job stored


def _run_in_job(gate: GateFile, family: Family | None, target_spec: str, references: Path,
                record: bool, overwrite: bool, events=None) -> tuple[GateResult, Added]:
    """One gate in a worker process: its own target and a store read from disk at the start. The
    references it records are returned for the parent's store, the one that is saved. ``events``
    (a queue shared with the parent) receives (gate, run label, done, total) as the runs advance."""
    from certify.gating.files import load_target
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
    result = run_gate(gate, load_target(target_spec), store, family=family, progress=progress,
                      record=record, overwrite=overwrite)
    return result, added


@contextmanager
def _threads_per_job(jobs: int):
    """Each of ``jobs`` processes gets an equal share of the cores (OMP_NUM_THREADS, read by the
    numeric libraries at import), unless the caller set it; oversubscribed BLAS threads cost more
    than the parallelism gains. The engine runs themselves are pinned to ``GATE_THREADS`` (run_gate),
    so this share changes no result."""
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
                      families: Mapping[str, Family] | None = None,
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
    called in this process, from a listener thread, as the jobs' engine runs advance. ``families``
    (per tier, from judge.tier_families) is the family each gate's checks are judged in; a tier
    it lacks judges each of its gates as its own family."""
    results: list[GateResult] = []
    ctx = multiprocessing.get_context("spawn")
    with _threads_per_job(jobs), ProcessPoolExecutor(jobs, mp_context=ctx) as pool, \
            _progress_listener(ctx, on_progress) as events:
        futures = {pool.submit(_run_in_job, g, (families or {}).get(g.tier), target_spec, store.dir,
                               record, overwrite, events): g
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


__all__ = ["GATE_THREADS", "RunRecord", "GateResult", "gate_threads", "numeric_platform", "run_gate",
           "rejudge", "run_gates_in_jobs"]
