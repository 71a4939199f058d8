"""``certify mutants [--op OP] [--mutant ID] [--jobs N] [--cap S] [--generic N] [--equivalent]
[--no-hints] [--list]``."""

from __future__ import annotations

import argparse
import resource
import sys
import time
from contextlib import ExitStack

from certify.catalog.load import load_catalog
from certify.catalog.mutants import mutants_of
from certify.files.paths import project_paths
from certify.harness.archs import present_archs
from certify.mutants.collect import current_items
from certify.mutants.hints import last_killers, last_seconds, learn_seconds, set_hints
from certify.mutants.plan import CAP_S, EditError, data_jobs
from certify.mutants.report import op_report, score_text, survivor_line, write_op_report
from certify.mutants.runner import CAUGHT, run_jobs, warm_pool


def add_parser(sub) -> None:
    m = sub.add_parser("mutants", help="run each op's plausible bugs (its cell file's mutants) "
                                       "against its own cells, guard and property tests; write the "
                                       "score and the survivors under reports/mutants/")
    m.add_argument("--op", action="append", help="only this op (repeatable; default: every op "
                                                  "with mutants)")
    m.add_argument("--mutant", action="append", metavar="ID", help="only this mutant (repeatable; "
                   "writes no report: a partial run is no score)")
    m.add_argument("--jobs", type=int, default=2, metavar="N",
                   help="worker processes at once, each with its share of the cores (default 2)")
    m.add_argument("--cap", type=float, default=CAP_S, metavar="S",
                   help=f"run a mutant's tests, cheapest first, up to S measured seconds in all "
                        f"(default {CAP_S:g}; 0: every test); the tests left out are named")
    m.add_argument("--generic", type=int, default=0, metavar="N",
                   help="also run N operator mutations of each variant's code made by cosmic-ray "
                        "(pip install -e '.[mutants]'), spread over the variants; scored apart")
    m.add_argument("--equivalent", action="store_true",
                   help="also run the mutants declared equivalent (each must survive)")
    m.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="kill a mutant's worker after S seconds, a timeout that counts as killed "
                        "(default: 30 s plus three times its tests' measured seconds, times the "
                        "load average over the cores where that is above 1)")
    m.add_argument("--no-hints", action="store_true",
                   help="ignore the op's last report: run each mutant's tests cheapest first by their "
                        "measured durations only, not the test that killed it last time first nor by "
                        "the seconds seen last time (the verdicts are the same)")
    m.add_argument("--list", action="store_true", help="list the mutants and their tests, run none")
    m.set_defaults(fn=cmd_mutants)


def cmd_mutants(args: argparse.Namespace) -> int:
    from certify.lists.records import load_durations, load_items  # noqa: PLC0415

    paths = project_paths()
    catalog = load_catalog(paths.cells)
    for e in catalog.errors:
        print(f"error: {e}", file=sys.stderr)
    items_file = paths.lists / "items.json"
    items = load_items(items_file) if items_file.is_file() else []
    durations = load_durations(paths.lists / "durations.json")
    names = args.op or sorted(n for n, op in catalog.ops.items() if mutants_of(op))
    unknown = [n for n in names if n not in catalog.ops]
    if unknown:
        print(f"certify mutants: unknown op(s) {unknown}", file=sys.stderr)
        return 2
    archs = [a for a in present_archs() if not a.startswith("sm_")] + \
        [a for a in present_archs() if a.startswith("sm_")]
    rc = 1 if catalog.errors else 0
    with ExitStack() as stack:
        pool = None if args.list else stack.enter_context(warm_pool(paths.root, args.jobs))
        for name in names:
            rc = max(rc, _run_op(args, paths, catalog, name, items, durations, archs, pool))
    return rc


def _run_op(args, paths, catalog, name, items, durations, archs, pool) -> int:
    """Plan, run and report one op's mutants; the exit code (0: every counted mutant killed)."""
    rc = 0
    op = catalog.ops[name]
    t0, cpu0 = time.perf_counter(), _children_cpu() + (pool.cpu if pool else 0.0)
    try:
        op_items = current_items(paths, name, items, pool)
        cap = args.cap or None
        jobs = data_jobs(paths, op, op_items, durations, only=args.mutant, cap=cap)
        note = ""
        if args.generic:
            from certify.mutants.generic import generic_jobs  # noqa: PLC0415

            more, note = generic_jobs(paths, op, op_items, durations, args.generic,
                                      cap=cap)
            written = {(j.module, j.source) for j in jobs}
            fresh = [j for j in more if (j.module, j.source) not in written]
            if len(fresh) < len(more):
                note += (f" {len(more) - len(fresh)} of them made a cell-file mutant's source "
                         "and count there.")
            jobs += fresh
    except (EditError, RuntimeError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    seen = {} if args.no_hints else last_seconds(paths.reports, name)
    if not args.no_hints:
        learn_seconds(jobs, seen)
        set_hints(jobs, last_killers(paths.reports, name))
    if args.list:
        for j in jobs:
            print(f"{name} {j.id} [{j.label}] {j.module}: {len(j.tests)} test(s), "
                  f"{j.cost:.1f} s measured, {len(j.over_cap)} over the cap; "
                  f"first {[j.hint] if j.hint else j.tests[:1]}")
        return rc
    if not jobs:
        print(f"{name}: no mutants")
        return rc
    print(f"{name}: {len(jobs)} mutant(s), {args.jobs} worker(s) ...", flush=True)
    results = run_jobs(jobs, paths.root, args.jobs, args.equivalent,
                       progress=lambda r: print(f"  {r.job.id}: {r.status}"
                                                + (f" by {r.killed_by}" if r.killed_by else "")
                                                + (" (its hint)" if r.by_hint else "")
                                                + f" ({r.seconds:.1f} s)", flush=True),
                       limit=args.time_limit, pool=pool, seen=(now := {}))
    seconds = time.perf_counter() - t0
    cpu = _children_cpu() + pool.cpu - cpu0
    report = op_report(name, results, seconds, args.jobs, archs, args.generic, note, cap,
                       {**seen, **now})
    report["cpu_s"] = round(cpu, 1)
    print(f"{name}: {score_text(report['score'])} in {seconds:.1f} s ({cpu:.1f} CPU seconds "
          "in the workers)")
    for r in report["mutants"] + report.get("generic", {}).get("mutants", []):
        if r["status"] not in (*CAUGHT, "equivalent", "not run"):
            print("  " + survivor_line(r))
    if args.mutant:
        print("  (some mutants only: no report written)")
    else:
        path = write_op_report(paths.reports, report)
        print(f"  wrote {path.relative_to(paths.root)}")
    if args.equivalent and any(r.job.equivalent and r.status != "survived" for r in results):
        print("  a mutant declared equivalent did not survive: its declaration is wrong")
        rc = 1
    if sum(report["score"].get(s, 0) for s in CAUGHT) < report["score"]["counted"]:
        rc = 1
    return rc


def _children_cpu() -> float:
    """User + system seconds of the finished subprocesses (the warm workers' children count in
    ``WarmPool.cpu``): the run's cost on cores of its own, which its wall time shows only on a
    machine nothing else loads."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
