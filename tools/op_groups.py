"""Split the ops with targets not yet fresh on an arch into N groups of about equal certification
time, one line of ``--op NAME ...`` flags per group, for parallel ``certify run --outdated``
processes on one machine.

The time of an op is the sum of the ``seconds`` of its outdated targets' last receipts in the given
receipts file (a target without one counts as one second); the arch is the file's name. Groups are
filled longest op first, each into the group with the least time so far.

    python3 tools/op_groups.py N reports/receipts/sm_90.jsonl
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from certify.catalog.load import load_catalog
from certify.harness.runner import select
from certify.files.paths import project_paths
from certify.receipts.store import load_receipts


def op_seconds(receipts: Path) -> Counter:
    """Seconds by op over the outdated targets of the receipts file's arch."""
    arch = receipts.stem
    last = load_receipts(receipts.parent).get(arch, {})
    outdated = select(load_catalog(project_paths().cells), archs=[arch], only_outdated=True,
                      receipts_dir=receipts.parent)
    seconds: Counter = Counter()
    for t in outdated:
        r = last.get((t.op.op, t.variant.name, t.cell.id))
        seconds[t.op.op] += r.seconds if r is not None else 1.0
    return seconds


def groups(n: int, ops: list[str], seconds: Counter) -> list[list[str]]:
    out: list[list[str]] = [[] for _ in range(max(1, n))]
    load = [0.0] * len(out)
    for op in sorted(ops, key=lambda o: (-seconds.get(o, 1.0), o)):
        i = min(range(len(out)), key=lambda j: load[j])
        out[i].append(op)
        load[i] += seconds.get(op, 1.0)
    return [g for g in out if g]


def main(argv: list[str]) -> int:
    n, receipts = int(argv[0]), Path(argv[1])
    seconds = op_seconds(receipts)
    for g in groups(n, sorted(seconds), seconds):
        print(" ".join(f"--op {op}" for op in g))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
