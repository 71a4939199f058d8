"""``certify lists``: generate the pre-merge / post-merge / on-demand test lists (or check them, or
explain one item's place) and print the tier table."""

from __future__ import annotations

import argparse
import sys

from certify.files.paths import project_paths
from certify.files.problem import FileProblem


def _cmd_lists(args: argparse.Namespace) -> int:
    """Generate the test lists (or check them, or explain one item's place), print the tier table."""
    import subprocess  # noqa: PLC0415
    import time  # noqa: PLC0415

    from certify.files.atomic import atomic_write_text, locked_all  # noqa: PLC0415
    from certify.lists import explain, generate, load_inputs, render_all  # noqa: PLC0415
    from certify.files.utf8 import NotUtf8Error  # noqa: PLC0415

    paths = project_paths()
    if args.collect:
        out = paths.lists / "items.json"
        rc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                             "--certify-items", str(out)], cwd=paths.root,
                            stdout=subprocess.DEVNULL).returncode
        if rc != 0:
            print(f"collection failed (exit {rc}): run `pytest --collect-only` to see why")
            return 1
        print(f"wrote {out.relative_to(paths.root)}")
        from certify.lists.records import load_items, prune_durations  # noqa: PLC0415
        dropped = prune_durations(paths.lists / "durations.json",
                                  {r["id"] for r in load_items(out)})
        if dropped:
            print(f"dropped the durations of {len(dropped)} item(s) no longer collected")
    try:
        inp = load_inputs(paths)
    except (FileProblem, NotUtf8Error) as e:
        print(f"error: {e}")
        return 1
    t0 = time.perf_counter()
    sel = generate(inp, budget_premerge=args.budget_premerge)
    seconds = time.perf_counter() - t0
    if args.explain:
        print(explain(sel, inp, args.explain))
        return 0
    files = render_all(inp, sel if args.budget_premerge is None else None)
    report = files["reports/lists.md"]
    if args.budget_premerge is not None:
        from certify.lists import report_text, sweep  # noqa: PLC0415
        report = report_text(inp, sel, sweep(inp))
    table = report.split("\n## ")[0]
    print(table.split("\n", 3)[3] if table.startswith("# ") else table)
    print(f"generated {len(sel.items)} items in {seconds * 1000:.0f} ms")
    where = {"lists": paths.lists, "reports": paths.reports}
    stale = []
    for key, text in sorted(files.items()):
        base, _, rel = key.partition("/")
        target = where[base] / rel
        if not target.is_file() or target.read_bytes() != text.encode():
            stale.append(target)
    orphans = [p for p in sorted(paths.lists.glob("shards/*.yml"))
               if f"lists/shards/{p.name}" not in files]
    if args.check or args.budget_premerge is not None:
        if args.budget_premerge is not None:
            print("(a what-if budget: nothing written)")
            return 0
        for t in stale + orphans:
            print(f"stale: {t.relative_to(paths.root)}")
        print("the lists are current" if not stale and not orphans else
              "the lists are stale: run `certify lists` and commit test_lists/ and reports/lists.*")
        return 1 if stale or orphans else 0
    with locked_all([paths.lists, paths.reports]):  # one set of lists, whole, per writer
        for t in orphans:
            t.unlink(missing_ok=True)
        for key, text in sorted(files.items()):
            base, _, rel = key.partition("/")
            target = where[base] / rel
            if not target.is_file() or target.read_bytes() != text.encode():
                atomic_write_text(target, text)
    print(f"wrote {len(stale)} changed file(s) of {len(files)} under "
          f"{paths.lists.relative_to(paths.root)}/ and {paths.reports.relative_to(paths.root)}/")
    return 0


def add_parser(sub) -> None:
    """The ``lists`` subcommand of ``certify`` (certify/cli.py)."""
    ls = sub.add_parser("lists", help="generate the pre-merge / post-merge / on-demand test lists")
    ls.add_argument("--budget-premerge", type=float, default=None, metavar="S",
                    help="what if the pre-merge budget were S (its unit): print, write nothing")
    ls.add_argument("--explain", metavar="ITEM", help="why an item (id or unique part) sits where it does")
    ls.add_argument("--check", action="store_true", help="compare with the committed lists, write "
                                                         "nothing; exit 1 when stale")
    ls.add_argument("--collect", action="store_true", help="first re-collect the item universe "
                                                           "(test_lists/items.json)")
    ls.set_defaults(fn=_cmd_lists)


def _cmd_plan(args: argparse.Namespace) -> int:
    """Print (or write) the work units (certify.lists.units)."""
    from certify.catalog.load import load_catalog  # noqa: PLC0415
    from certify.files.atomic import atomic_write_text  # noqa: PLC0415
    from certify.lists import load_inputs  # noqa: PLC0415
    from certify.lists.units import k8s_job, plan_json, plan_units, slurm_script  # noqa: PLC0415
    from certify.receipts.store import load_receipts  # noqa: PLC0415

    paths = project_paths()
    try:
        inp = load_inputs(paths)
    except FileProblem as e:
        print(f"error: {e}")
        return 1
    units = plan_units(inp, load_catalog(paths.cells), load_receipts(paths.receipts), args.arch,
                       args.outdated)
    if args.format in ("slurm", "k8s"):
        what = "a Slurm array" if args.format == "slurm" else "a Kubernetes Job"
        if len({(u["arch"], u["gpus"]) for u in units}) > 1:
            print(f"error: {what} runs on one kind of node: choose one --arch", file=sys.stderr)
            return 2
        if args.format == "k8s" and not args.image:
            print("error: --format k8s needs --image (the checkout's container image)",
                  file=sys.stderr)
            return 2
        if not units:
            print("nothing to schedule", file=sys.stderr)
            return 0
        text = slurm_script(units) if args.format == "slurm" else k8s_job(units, args.image)
    else:
        text = plan_json(units)
    if args.out:
        atomic_write_text(args.out, text)
        print(f"wrote {len(units)} unit(s) to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand of ``certify`` (certify/cli.py)."""
    pl = sub.add_parser("plan", help="the certification work as units (targets and gates) for a "
                                     "scheduler: JSON, a Slurm array or a Kubernetes Indexed Job")
    pl.add_argument("--arch", action="append", help="only units of this arch (repeatable)")
    pl.add_argument("--outdated", action="store_true",
                    help="only targets without a fresh receipt (and every gate)")
    pl.add_argument("--format", choices=("json", "slurm", "k8s"), default="json",
                    help="json (default): every unit with its cost, arch and hash; slurm: an array "
                         "job, one task per unit (one --arch); k8s: a Kubernetes Indexed Job, one "
                         "completion index per unit (one --arch, with --image)")
    pl.add_argument("--image", help="k8s: the container image holding the checkout at /workspace")
    pl.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    pl.set_defaults(fn=_cmd_plan)
