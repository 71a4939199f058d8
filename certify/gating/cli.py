"""``certify gates``: run, list and check the gates (certify/gates/*.yaml).

    certify gates run NAME [NAME ...]      # or --tier premerge; --record writes missing references;
                                           # --jobs N runs the gates in N worker processes
    certify gates render                   # re-judge every report from its stored per-sample scores
    certify gates list                     # every gate, its tier, checks and last measured cost
    certify gates check                    # load every gate and reference file against the target
                                           # (a reference is checked against itself too); errors
                                           # name file, line and field

``run`` shows a progress bar per engine run (with ``--jobs``, labelled by gate, beside one over the
gates), prints each check's verdict with its exact p-value and level, false-fail rate and power, and
writes ``<gate>.json`` (with every run's per-sample scores) and ``summary.md`` into runs/gates/
(untracked; ``--report-dir DIR`` elsewhere), or with ``--update-reports`` into the committed
reports/gates/. Each check runs at its share of its tier's family-wise rate, the
family being every gate file of the tier, whichever gates this command runs. ``render`` judges the
stored scores again under the current statistics and references, without running the engine. Exit 1 when a gate failed, lacked a
reference, or a file had errors (a --record run whose checks lacked references and recorded them
exits 0: its status is `recorded`, not a pass); a skipped gate (the target cannot run here, e.g. no
checkpoint) is reported with its reason and is not a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from certify.gating.judge import tier_families
from certify.gating.report import render, write_report
from certify.gating.run import run_gate, run_gates_in_jobs
from certify.gating.files import ReferenceStore, gate_settings, load_gates, load_target
from certify.files.paths import project_paths
from certify.catalog.schema import TIERS


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=True)


UNTRACKED_REPORTS = Path("runs") / "gates"


def report_dir(args: argparse.Namespace, settings) -> Path:
    """Where ``run`` writes its reports: the committed reports/gates/ only with --update-reports (its
    costs and date are this machine's and today's), else --report-dir, else runs/gates/ under the
    project root (ignored by git)."""
    if args.update_reports:
        return Path(settings.reports)
    if args.report_dir:
        return Path(args.report_dir)
    return project_paths().root / UNTRACKED_REPORTS


def _cmd_run(args: argparse.Namespace) -> int:
    settings = gate_settings()
    target = load_target(settings.target)
    loaded = load_gates(settings.gates, target)
    store = ReferenceStore(settings.references)
    for e in [*loaded.errors, *store.errors]:
        print(f"error: {e}", file=sys.stderr)
    if args.jobs < 1:
        print(f"error: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 1
    names = list(args.names or [])
    unknown = [n for n in names if n not in loaded.gates]
    if unknown:
        print(f"error: unknown gate(s) {unknown}; known: {sorted(loaded.gates)}", file=sys.stderr)
        return 1
    chosen = [g for n, g in sorted(loaded.gates.items())
              if (not names or n in names) and (not args.tier or g.tier in args.tier)]
    if not chosen:
        print("no gate selected", file=sys.stderr)
        return 1
    bad = [bool(loaded.errors or store.errors)]
    out_dir = report_dir(args, settings)
    families = tier_families(loaded.gates.values())   # every gate file of a tier, run or not
    with _progress() as bar:
        runs: dict[str, int] = {}

        def run_bar(label: str, done: int, total: int) -> None:
            """One bar per engine run, created at its first report."""
            if label not in runs:
                runs[label] = bar.add_task(label, total=total)
            bar.update(runs[label], completed=done, total=total)

        def finish(result) -> None:
            bar.console.print(result.summary(), soft_wrap=True)
            if result.recorded:
                bar.console.print(f"  recorded references: {', '.join(result.recorded)}", soft_wrap=True)
            if result.status != "skipped" and not args.no_report:
                write_report(result, out_dir, loaded.gates)
            bad[0] |= result.status in ("failed", "no reference")  # recorded: what --record asked for

        if args.jobs > 1 and len(chosen) > 1:
            # longest first (last measured cost): the jobs then end close together
            from certify.lists.selection import gate_report_seconds

            last = gate_report_seconds(settings.reports)   # a gate never measured sorts first
            order = sorted(chosen, key=lambda g: (-last.get(g.gate, float("inf")), g.gate))
            task = bar.add_task(f"{len(order)} gates in {args.jobs} jobs", total=len(order))

            def done(result) -> None:
                finish(result)
                bar.advance(task)

            def error(name: str, e: BaseException) -> None:
                bar.console.print(f"error: gate {name} raised {type(e).__name__}: {e}", soft_wrap=True)
                bad[0] = True
                bar.advance(task)

            run_gates_in_jobs(order, settings.target, store, args.jobs, families=families,
                              record=args.record,
                              overwrite=args.overwrite, on_result=done, on_error=error,
                              on_progress=lambda gate, label, d, t: run_bar(f"{gate}: {label}", d, t))
        else:
            for gate in chosen:
                finish(run_gate(gate, target, store, family=families.get(gate.tier),
                                progress=run_bar, record=args.record, overwrite=args.overwrite))
    for path in store.save():
        print(f"wrote {path.relative_to(settings.gates.parent.parent)}")
    return 1 if bad[0] else 0


def _last_cost(settings, name: str) -> str:
    path = settings.reports / f"{name}.json"
    if not path.is_file():
        return "not measured"
    r = json.loads(path.read_text())
    return f"{r['seconds']:.1f} s on {r['arch']} ({r['date']})"


def _cmd_render(args: argparse.Namespace) -> int:
    settings = gate_settings()
    loaded = load_gates(settings.gates)
    store = ReferenceStore(settings.references)
    for e in [*loaded.errors, *store.errors]:
        print(f"error: {e}", file=sys.stderr)
    done, left = render(settings.reports, loaded.gates, store)
    for name in done:
        print(f"re-rendered {name}")
    for why in left:
        print(f"left as it is: {why}")
    return 1 if loaded.errors or store.errors else 0


def _cmd_list(args: argparse.Namespace) -> int:
    """Every gate: the generated list that runs it (its declared tier beside it where the lists
    moved it), its checks and its last measured cost."""
    from certify.lists.records import list_tiers  # noqa: PLC0415

    settings = gate_settings()
    loaded = load_gates(settings.gates)
    paths = project_paths()
    listed = list_tiers(paths.lists) or {}
    gates_dir = Path(settings.gates)
    rel = gates_dir.relative_to(paths.root).as_posix() if gates_dir.is_relative_to(paths.root) \
        else gates_dir.as_posix()

    def runs_in(name: str, g) -> str:
        return listed.get(f"{rel}/{name}.yaml::{name}", g.tier)

    for name, g in sorted(loaded.gates.items(),
                          key=lambda kv: (TIERS.index(runs_in(*kv)), kv[0])):
        checks = ", ".join(f"{c.kind}:{c.task}" for c in g.checks)
        tier = runs_in(name, g)
        moved = f" (declared {g.tier})" if tier != g.tier else ""
        print(f"{tier:<10} {name:<28} {checks}  [{_last_cost(settings, name)}]{moved}")
    for e in loaded.errors:
        print(f"error: {e}")
    return 1 if loaded.errors else 0


def _cmd_check(args: argparse.Namespace) -> int:
    settings = gate_settings()
    loaded = load_gates(settings.gates, load_target(settings.target))
    store = ReferenceStore(settings.references)
    for e in [*loaded.errors, *store.errors]:
        print(e)
    print(f"{len(loaded.gates)} gate(s) loaded, {len(loaded.errors) + len(store.errors)} file(s) "
          "with errors")
    return 1 if loaded.errors or store.errors else 0


def add_parser(sub) -> None:
    """The ``gates`` subcommand of ``certify`` (certify/cli.py)."""
    g = sub.add_parser("gates", help="accuracy gates on the trained checkpoint")
    gsub = g.add_subparsers(dest="gates_cmd", required=True)
    r = gsub.add_parser("run", help="run gates by name or tier, print and write their reports")
    r.add_argument("names", nargs="*", help="gate names (default: every gate of the --tier)")
    r.add_argument("--tier", action="append", choices=TIERS,
                   help="run every gate of this tier (repeatable; with names: only those of it)")
    r.add_argument("--record", action="store_true",
                   help="write a reference for every configuration run that has none")
    r.add_argument("--overwrite", action="store_true", help="with --record: replace existing ones")
    r.add_argument("--no-report", action="store_true", help="write no report")
    r.add_argument("--report-dir", metavar="DIR", default=None,
                   help=f"write the reports here (default: {UNTRACKED_REPORTS}/ under the project "
                        "root, which git ignores)")
    r.add_argument("--update-reports", action="store_true",
                   help="write the reports into the committed reports/gates/ instead (the record "
                        "`certify lists` and `certify gates list` read gate costs from)")
    r.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                   help="run the gates in N worker processes, longest first, each with 1/N of the "
                        "cores (OMP_NUM_THREADS, unless set); their references are merged here")
    r.set_defaults(fn=_cmd_run)
    rd = gsub.add_parser("render", help="re-judge every report from its stored per-sample scores "
                                        "under the current statistics (no engine run)")
    rd.set_defaults(fn=_cmd_render)
    ls = gsub.add_parser("list", help="every gate with the list that runs it, its checks and its "
                                      "last measured cost")
    ls.set_defaults(fn=_cmd_list)
    k = gsub.add_parser("check", help="load every gate and reference file; errors name the line")
    k.set_defaults(fn=_cmd_check)
