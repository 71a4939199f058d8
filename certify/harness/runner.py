"""``certify run``: certify the targets of the catalog on the archs this machine has, with progress,
and merge each receipt as its target finishes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from certify.harness.archs import present_archs
from certify.catalog.load import Catalog
from certify.harness.checks import certify_checked
from certify.harness.contract import harness_hash
from certify.catalog.plan import Target, targets
from certify.receipts.store import (UP_TO_DATE, Receipt, freshness, load_receipts, make_receipt,
                                    write_receipts)
from certify.harness.requirements import why_skipped


def select(catalog: Catalog, ops: list[str] | None = None, tiers: list[str] | None = None,
           archs: list[str] | None = None, only_outdated: bool = False,
           receipts_dir: Path | None = None) -> list[Target]:
    have = set(archs or present_archs())
    books = load_receipts(receipts_dir) if (only_outdated and receipts_dir) else {}
    chosen = []
    for name, op in sorted(catalog.ops.items()):
        if ops and name not in ops:
            continue
        for t in targets(op):
            if t.arch not in have or (tiers and t.cell.tier not in tiers):
                continue
            if only_outdated:
                r = books.get(t.arch, {}).get((op.op, t.variant.name, t.cell.id))
                if freshness(r, op, t.variant.name, t.cell, t.arch) in UP_TO_DATE and \
                        r.harness.get("hash") == harness_hash(op):
                    continue  # fresh numbers whose harness checks ran under today's checks
            chosen.append(t)
    return chosen


def absent_archs_problem(archs: list[str] | None) -> str | None:
    """Why ``certify run --arch`` cannot run here: an asked arch this machine lacks, whose targets
    could only error, and whose error receipts would replace those made where the arch is."""
    absent = [a for a in archs or [] if a not in present_archs()]
    if not absent:
        return None
    return (f"certify run --arch {', '.join(absent)}: not on this machine (it has "
            f"{', '.join(present_archs())}); run it where the arch is, or through --ray")


def run_targets(chosen: list[Target], receipts_dir: Path | None, show_progress: bool = True
                ) -> list[Receipt]:
    """Run each target, write its receipt as soon as it finishes (when a directory is given: merged
    under the directory's lock, see ``write_receipts``), return them. An interrupt or a kill after k
    targets leaves their k receipts written; a merge costs milliseconds beside a target's run. A
    target whose variant requires a package that is not installed here is skipped, said on stderr, and
    leaves no receipt: its last receipt (made where the package was) stands."""
    out: list[Receipt] = []
    disable = not show_progress or os.environ.get("CI") == "true"
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, disable=disable, transient=True) as progress:
        task = progress.add_task("certifying", total=len(chosen))
        for t in chosen:
            progress.update(task, description=f"{t.op.op} {t.variant.name} {t.cell.id} {t.arch}")
            reason = why_skipped(t.variant)
            if reason:
                print(f"skipped {t.name}: {reason}", file=sys.stderr)
                progress.advance(task)
                continue
            outcome, harness = certify_checked(t.op, t.variant.name, t.cell, t.arch)
            receipt = make_receipt(t.op, t.variant.name, t.cell, t.arch, outcome, harness)
            if receipts_dir is not None:
                write_receipts(receipts_dir, [receipt])
            out.append(receipt)
            progress.advance(task)
    return out
