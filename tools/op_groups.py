"""Split the catalog's ops into N groups of about equal certification time, one line of
``--op NAME ...`` flags per group, for parallel ``certify run`` processes on one machine.

The time of an op is the sum of the ``seconds`` of its receipts in the given receipts file (ops
without one count as one second). Groups are filled longest op first, each into the group with the
least time so far.

    python3 tools/op_groups.py N reports/receipts/sm_90.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths


def op_seconds(receipts: Path) -> Counter:
    seconds: Counter = Counter()
    if receipts.exists():
        for line in receipts.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                seconds[r["op"]] += float(r.get("seconds") or 0.0)
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
    ops = sorted(load_catalog(project_paths().cells).ops)
    for g in groups(n, ops, op_seconds(receipts)):
        print(" ".join(f"--op {op}" for op in g))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
