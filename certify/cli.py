"""certify: certify an implementation against its executable spec, cell by cell.

Cells (certify/cells/*.yaml) name the shapes and layouts each op's forward reaches; run certifies
them against the spec and writes receipts, verify re-runs receipts, trace records what the
model's scenarios reach, lists plans the pre-merge / post-merge / on-demand test lists from cost
budgets, gates runs the accuracy gates, diff says what a change did to the certification against a
git revision, plan writes the work as units for a scheduler, merge folds receipts written elsewhere
into the receipts, mutants runs each op's plausible bugs against its own tests, and report does
what is outdated, then writes reports/."""

from __future__ import annotations

import argparse
import json
import sys

from certify.harness.archs import choose_triton_mode, present_archs
from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.reach import load_reach, load_tracer, reach_text, run_trace
from certify.reach.claims import catalog_findings, reach_findings
from certify.catalog.plan import targets
from certify.receipts.store import load_receipts, prune_receipts
from certify.report import (SITE_DIR, project_guards, project_mutants, project_rows, report_extras,
                            terminal_report, write_reports)
from certify.harness.runner import absent_archs_problem, run_targets, select
from certify.files.problem import FileProblem
from certify.reach.scenarios import load_scenarios
from certify.catalog.mutants import CellFile
from certify.catalog.schema import TIERS


def _cmd_run(args: argparse.Namespace) -> int:
    paths = project_paths()
    catalog = load_catalog(paths.cells)
    for e in catalog.errors:
        print(f"error: {e}", file=sys.stderr)
    if not args.ray and (problem := absent_archs_problem(args.arch)):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    chosen = select(catalog, args.op, args.tier, args.arch, only_outdated=args.outdated,
                    receipts_dir=paths.receipts)
    ray_ok = True
    if args.ray:
        receipts, ray_ok = _run_on_ray(args, paths, catalog, chosen)
    else:
        receipts = run_targets(chosen, None if args.dry_run else paths.receipts)
    declared = {(r.op, r.variant, r.cell, r.arch): catalog.ops[r.op].cell(r.cell).expected_failure(
        r.variant, r.arch) for r in receipts}
    expected = [r for r in receipts if r.status != "passed" and declared[r.op, r.variant, r.cell, r.arch]]
    surprise = [r for r in receipts if r.status == "passed" and declared[r.op, r.variant, r.cell, r.arch]]
    bad = [r for r in receipts if r.status != "passed" and r not in expected]
    print(f"{len(receipts)} certification(s) run on {', '.join(args.arch or present_archs())}: "
          f"{len(receipts) - len(bad) - len(expected) - len(surprise)} passed, {len(bad)} not passed, "
          f"{len(expected)} expected failure(s), {len(surprise)} unexpected pass(es)")
    for r in bad:
        print(f"  {r.status.upper()} {r.op}::{r.variant}::{r.cell}::{r.arch}\n    "
              + r.message.replace("\n", "\n    "))
    for r in expected:
        print(f"  expected failure {r.op}::{r.variant}::{r.cell}::{r.arch}: "
              f"{declared[r.op, r.variant, r.cell, r.arch].why}")
    for r in surprise:
        print(f"  UNEXPECTED PASS {r.op}::{r.variant}::{r.cell}::{r.arch}: it is declared to fail; "
              f"remove its expected_failures entry from {r.op}'s cell file")
    return 1 if bad or surprise or catalog.errors or not ray_ok else 0


def _run_on_ray(args, paths, catalog, chosen):
    """The targets as Ray tasks (certify.harness.ray_run), what the workers finished merged back
    (also when some failed, or the run was interrupted): (the receipts, False where an arch was
    refused, a task failed on every attempt or the merge found a conflict)."""
    import time  # noqa: PLC0415

    from certify.harness.ray_run import run_on_ray  # noqa: PLC0415
    from certify.harness.requirements import why_skipped  # noqa: PLC0415
    from certify.receipts.merge import merge, merge_text  # noqa: PLC0415

    skipped = [t for t in chosen if why_skipped(t.variant)]
    for t in skipped:
        print(f"skipped {t.name}: {why_skipped(t.variant)}", file=sys.stderr)
    books = load_receipts(paths.receipts)
    cost = {t.name: r.seconds for t in chosen
            if (r := books.get(t.arch, {}).get((t.op.op, t.variant.name, t.cell.id)))}
    out = paths.root / "runs" / "ray" / time.strftime("%Y%m%d-%H%M%S")
    merged = None
    try:
        receipts, refused, failed = run_on_ray([t for t in chosen if t not in skipped], args.ray,
                                               paths, out, cost, args.ray_cpus)
    finally:  # what finished is kept, whatever stopped the run
        if not args.dry_run and out.is_dir():
            merged = merge(catalog, paths.receipts, [out])
            print(merge_text(merged, False))
    for line in refused:
        print(f"refused {line}", file=sys.stderr)
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    if failed:
        print(f"{len(failed)} target(s) failed on every attempt and have no receipt; "
              f"{len(receipts)} finished", file=sys.stderr)
    conflict = merged is not None and bool(merged.conflicts or merged.damaged)
    return receipts, not (refused or failed or conflict)


def _cmd_report(args: argparse.Namespace) -> int:
    paths = project_paths()
    catalog = load_catalog(paths.cells)
    did = "rendered from the receipts as they are (--no-run)"
    if not args.no_run:
        chosen = select(catalog, args.op, None, None, only_outdated=not args.all,
                        receipts_dir=paths.receipts)
        archs = ", ".join(present_archs())
        if chosen:
            print(f"certifying {len(chosen)} outdated or missing cell(s) on {archs} ...",
                  file=sys.stderr)
            made = run_targets(chosen, paths.receipts)
            passed = sum(r.status == "passed" for r in made)
            did = (f"certified {len(made)} outdated or missing target(s) on {archs}: {passed} "
                   f"passed, {len(made) - passed} not passed")
        else:
            did = f"nothing outdated on {archs}: every receipt here is fresh"
    if not args.op and not catalog.errors:  # the whole catalog is known: receipts of gone targets go
        live = {(t.arch, t.op.op, t.variant.name, t.cell.id)
                for op in catalog.ops.values() for t in targets(op)}
        for r in prune_receipts(paths.receipts, live):
            print(f"dropped the receipt of a target that no longer exists: {r.arch} {r.op} "
                  f"{r.variant} {r.cell}", file=sys.stderr)
    rows = project_rows(paths, catalog)
    extras = report_extras(paths.extras)
    reach = load_reach(paths.reach)
    print(terminal_report(catalog, rows, reach, matrix=args.matrix))
    if extras:
        print("\n" + "\n".join(extras))
    written = write_reports(paths.reports, catalog, rows, extras, reach, project_guards(paths),
                            project_mutants(paths))
    shown = (paths.reports.relative_to(paths.root) if paths.reports.is_relative_to(paths.root)
             else paths.reports)
    site = paths.reports / SITE_DIR
    if args.html or args.screenshot or (site / "index.html").is_file():
        from certify.report.html import write_project_site  # noqa: PLC0415 (loads matplotlib)

        written += write_project_site(paths, catalog, rows, reach, extras, site,
                                      args.screenshot, args.browser)
    print(f"\n{did}; wrote {len(written)} report file(s) under {shown}/")
    failed = any(s in ("failed", "unexpected pass") for r in rows for s in r.status.values())
    return 1 if (failed or catalog.errors) and args.strict else 0


def _cmd_trace(args: argparse.Namespace) -> int:
    """Trace the scenarios, write (or with --check compare) the reach file, print the claims."""
    paths = project_paths()
    run = run_trace(paths.tracer, paths.cells, paths.scenarios, workers=args.workers,
                    only=args.scenario)
    text = reach_text(run.reach)
    modes = len(run.reach.modes)
    print(f"traced {len(run.reach.scenarios)} scenario(s) x {modes} mode(s) in {run.seconds:.1f} s; "
          f"{sum(len(v) for v in run.reach.reach.values())} (op, variant)s reached")
    for name, sec in sorted(run.per_scenario.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  slowest: {name} {sec:.1f} s")
    rc = 0
    rel = paths.reach.relative_to(paths.root)
    if args.check:
        current = paths.reach.read_bytes() if paths.reach.is_file() else b""
        if current != text.encode():
            print(f"{rel} is stale: run `certify trace` and commit it")
            rc = 1
        else:
            print(f"{rel} is current")
    elif args.scenario:
        print("(some scenarios only: the reach file is not written)")
    else:
        from certify.files.atomic import atomic_write_text, locked  # noqa: PLC0415

        with locked(paths.reach.parent):
            atomic_write_text(paths.reach, text)
        print(f"wrote {rel}")
    catalog = load_catalog(paths.cells)
    findings = catalog_findings(catalog) + reach_findings(catalog, run.reach)
    by = {s: [f for f in findings if f.severity == s] for s in ("fail", "warn", "info")}
    print(f"claims: {len(by['fail'])} failing, {len(by['warn'])} warning(s), {len(by['info'])} note(s)")
    for f in by["fail"]:
        print(f"  FAIL {f.message}")
    if args.verbose:
        for f in by["warn"] + by["info"]:
            print(f"  {f.severity} {f.message}")
    return rc


def _cmd_merge(args: argparse.Namespace) -> int:
    """Fold worker receipt files into the receipts directory (certify.receipts.merge)."""
    from certify.receipts.merge import merge, merge_text  # noqa: PLC0415

    paths = project_paths()
    res = merge(load_catalog(paths.cells), paths.receipts, args.sources, dry_run=args.dry_run)
    print(merge_text(res, args.dry_run))
    return 1 if res.conflicts or res.damaged else 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from certify.files.atomic import atomic_write_text, locked  # noqa: PLC0415

    paths = project_paths()
    out = paths.schema / "cells.schema.json"
    with locked(paths.schema):
        atomic_write_text(out, schema_text())
    print(f"wrote {out.relative_to(paths.root)}")
    return 0


def schema_text() -> str:
    """The cell-file schema with the harness section (``certify.harness.contract``), which is read
    beside the schema so that it stays out of the content hash."""
    from certify.harness.contract import SECTION, HarnessContract  # noqa: PLC0415

    schema = CellFile.model_json_schema()
    harness = HarnessContract.model_json_schema(ref_template="#/$defs/{model}")
    schema.setdefault("$defs", {}).update(harness.pop("$defs", {}))
    schema["$defs"]["HarnessContract"] = harness
    schema["properties"][SECTION] = {"$ref": "#/$defs/HarnessContract", "description": (
        "what the op's calling contract admits, for the harness checks")}
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _cmd_check(args: argparse.Namespace) -> int:
    """Load every input the framework reads and print each problem as file, line and field: the cell
    files (their rules evaluated on every cell and over the axis domains, their spec, inputs and impl
    paths imported), the scenarios, the budgets file and its pins, and the receipts files."""
    from certify.lists.budgets import load_budgets, pin_errors  # noqa: PLC0415
    from certify.catalog.callables import callable_errors  # noqa: PLC0415
    from certify.lists import load_items  # noqa: PLC0415
    from certify.files.utf8 import NotUtf8Error  # noqa: PLC0415

    paths = project_paths()
    catalog = load_catalog(paths.cells)
    for e in catalog.errors:
        print(e)
    unresolved = callable_errors(catalog)
    for e in unresolved:
        print(e)
    print(f"{len(catalog.ops)} op(s) loaded, {len(catalog.errors)} file(s) with errors, "
          f"{len(unresolved)} path(s) that do not resolve")
    bad = bool(catalog.errors or unresolved)
    if paths.tracer and paths.scenarios.is_file():
        try:
            n = len(load_scenarios(paths.scenarios, load_tracer(paths.tracer).scenario_model))
            print(f"{n} scenario(s) loaded from {paths.scenarios.relative_to(paths.root)}")
        except FileProblem as e:
            print(e)
            bad = True
    if paths.budgets.is_file():
        items = paths.lists / "items.json"
        try:
            budgets = load_budgets(paths.budgets)
            pins = pin_errors(paths.budgets, budgets, {r["id"] for r in load_items(items)}) \
                if items.is_file() else []
        except (FileProblem, NotUtf8Error) as e:
            print(e)
            bad = True
        else:
            for e in pins:
                print(e)
            bad = bad or bool(pins)
            print(f"budgets loaded from {paths.budgets.relative_to(paths.root)}, "
                  f"{sum(len(p) for p in budgets.pinned.values())} pin(s), {len(pins)} pinning no test")
    damaged: list = []
    books = load_receipts(paths.receipts, damaged)
    for problem in damaged:
        print(problem)
    print(f"{sum(len(b) for b in books.values())} receipt(s) loaded from {len(books)} file(s), "
          f"{len(damaged)} damaged line(s)")
    return 1 if bad or damaged else 0


def _cmd_verify(args: argparse.Namespace) -> int:
    """Re-run receipts on this machine's archs and compare digests, metrics and status."""
    from certify.receipts.verify import MISMATCH, SKIPPED, select_receipts, verify_target  # noqa: PLC0415

    paths = project_paths()
    catalog = load_catalog(paths.cells)
    for e in catalog.errors:
        print(f"error: {e}", file=sys.stderr)
    chosen, left = select_receipts(catalog, paths.receipts, args.op, args.arch, args.budget)
    results = []
    for t, r in chosen:
        v = verify_target(t, r)
        results.append(v)
        if v.verdict != SKIPPED or args.verbose:
            print(v, flush=True)
    if args.verbose:
        for v in left:
            print(v)
    by: dict[str, int] = {}
    for v in results + left:
        by[v.verdict] = by.get(v.verdict, 0) + 1
    print(f"verified {len(results)} receipt(s): " + ", ".join(f"{n} {k}" for k, n in sorted(by.items())))
    return 1 if by.get(MISMATCH) or catalog.errors else 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from certify.report.diff import Snapshot, base_snapshot, compare, layout_of, render  # noqa: PLC0415

    paths = project_paths()
    layout = layout_of(paths)
    try:
        base, handle = base_snapshot(args.base, paths.root, layout)
    except ValueError as e:
        print(f"certify diff: {e}", file=sys.stderr)
        return 2
    with handle:
        text = render(compare(base, Snapshot.read(paths.root, layout)), args.base)
    if args.out:
        from certify.files.atomic import atomic_write_text  # noqa: PLC0415
        atomic_write_text(args.out, text)
    print(text, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    choose_triton_mode()
    p = argparse.ArgumentParser(prog="certify", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("report", help="certify what is outdated, then print and write the reports")
    r.add_argument("--no-run", action="store_true", help="only render from the receipts as they are")
    r.add_argument("--all", action="store_true", help="re-certify everything, not only the outdated")
    r.add_argument("--op", action="append", help="limit the certification step to these ops")
    r.add_argument("--strict", action="store_true", help="exit 1 when anything failed")
    r.add_argument("--matrix", action="store_true",
                   help="also print every (variant, cell) row (reports/coverage.md holds them)")
    r.add_argument("--html", action="store_true",
                   help=f"also write the static site under reports/{SITE_DIR}/ (rewritten anyway "
                        "whenever one is there), which opens from the file system")
    r.add_argument("--screenshot", action="store_true",
                   help=f"with the site, a full-page PNG of its index (reports/{SITE_DIR}/"
                        "index.png) taken in headless Chromium through playwright")
    r.add_argument("--browser", metavar="PATH",
                   help="the Chromium executable for --screenshot (default: chromium on PATH)")
    r.set_defaults(fn=_cmd_report)
    m = sub.add_parser("merge", help="fold receipt files written elsewhere (workers, other machines) "
                                     "into the receipts, idempotently; conflicts fail")
    m.add_argument("sources", nargs="+", help="receipt files, or folders searched for *.jsonl")
    m.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    m.set_defaults(fn=_cmd_merge)
    c = sub.add_parser("run", help="certify cells and write receipts")
    c.add_argument("--op", action="append", help="only this op (repeatable; default: every op)")
    c.add_argument("--tier", action="append", choices=TIERS,
                   help="only cells of this tier (repeatable; default: every tier)")
    c.add_argument("--arch", action="append", help="default: every arch this machine has")
    c.add_argument("--outdated", action="store_true", help="skip targets with a fresh receipt")
    c.add_argument("--dry-run", action="store_true", help="run, but write no receipts")
    c.add_argument("--ray", metavar="ADDRESS", help="run the targets as tasks on a Ray cluster "
                   "(local: one of this machine's own, started for the run; auto: the running one Ray "
                   "finds; else its address), longest first, and merge the workers' receipts back "
                   "(needs pip install -e '.[ray]')")
    c.add_argument("--ray-cpus", type=int, default=1, metavar="N",
                   help="CPUs (and torch threads) per Ray task (default 1); receipts record the "
                        "thread count, and some ops' last bits depend on it")
    c.set_defaults(fn=_cmd_run)
    v = sub.add_parser("verify", help="re-run receipts and compare their digests, metrics and status")
    v.add_argument("--op", action="append", help="only this op's receipts (repeatable)")
    v.add_argument("--arch", action="append", help="default: every arch this machine has")
    v.add_argument("--budget", type=float, default=None, metavar="S",
                   help="re-run the cheapest receipts whose recorded seconds fit in S")
    v.add_argument("-v", "--verbose", action="store_true", help="also list what was not re-run")
    v.set_defaults(fn=_cmd_verify)
    t = sub.add_parser("trace", help="trace the scenarios through the forward, write the reach file")
    t.add_argument("--check", action="store_true", help="compare with the committed reach file, "
                                                         "write nothing; exit 1 when it is stale")
    t.add_argument("--workers", type=int, default=None, help="processes (default: CPUs, at most 4)")
    t.add_argument("--scenario", action="append", help="trace only these (writes nothing)")
    t.add_argument("-v", "--verbose", action="store_true", help="print the warnings too")
    t.set_defaults(fn=_cmd_trace)
    s = sub.add_parser("schema", help="export the cell-file JSON Schema for editors")
    s.set_defaults(fn=_cmd_schema)
    k = sub.add_parser("check", help="load every cell file and report errors")
    k.set_defaults(fn=_cmd_check)
    df = sub.add_parser("diff", help="what the working tree's change did to the certification "
                                     "against a git revision (Markdown for a PR comment)")
    df.add_argument("base", metavar="BASE", help="the git revision to compare with (e.g. main)")
    df.add_argument("--out", metavar="FILE", default=None, help="also write the Markdown to FILE")
    df.set_defaults(fn=_cmd_diff)
    from certify.gating.cli import add_parser as add_gates_parser  # noqa: PLC0415 (its own module)
    from certify.lists.cli import add_parser as add_lists_parser  # noqa: PLC0415
    from certify.lists.cli import add_plan_parser  # noqa: PLC0415

    from certify.mutants.cli import add_parser as add_mutants_parser  # noqa: PLC0415

    add_lists_parser(sub)
    add_plan_parser(sub)
    add_mutants_parser(sub)
    add_gates_parser(sub)
    args = p.parse_args(argv)
    if not getattr(args, "fn", None):
        args = p.parse_args(["report", *(argv or [])])
    return args.fn(args)


if __name__ == "__main__":
    from certify.checkout import main as checkout_main  # the checkout's own code (certify.checkout)

    raise SystemExit(checkout_main())
