"""How long ``certify plan`` takes at fleet scale: a synthetic project whose one op has N cells and one
variant on 4 archs (cpu, cpu-interpret, sm_90, sm_100), cells copied from a real op with varied axes,
its item universe written as ``certify lists --collect`` writes it; the command run there as a user
runs it, start-up included, its units counted (tests/framework/test_plan.py holds it under 10 s).

    python3 tools/plan_scale.py [N] [--keep DIR]      # default 10000; prints wall and CPU seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("cpu", "cpu-interpret", "sm_90", "sm_100")
OP = "norm_big"


def make_project(where: Path, n: int) -> Path:
    """The synthetic project in ``where``: ``cells/norm_big.yaml`` with ``n`` cells, the budgets file
    without pins, ``test_lists/items.json`` with one cell item per (cell, arch)."""
    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    (where / "pyproject.toml").write_text('[tool.certify]\ncells = "cells"\nreceipts = "receipts"\n')
    (where / "cells").mkdir(exist_ok=True)
    (where / "test_lists").mkdir(exist_ok=True)
    head = f"""op: {OP}
summary: the gated norm with many cells, for the planning scale test
spec: spec.ops.norms:gated_rmsnorm
inputs: spec.cases.gdn:gated_norm_case
axes:
  rows: {{kind: int, reach: [1, 64]}}
  value_heads: {{kind: choice, values: [2]}}
  head_dim: {{kind: choice, values: [16]}}
variants:
  - name: v
    impl: impl.kernels.gdn.torch_ops:gated_rmsnorm
    archs: [{", ".join(ARCHS)}]
cells:
"""
    cells = "".join(f"  - id: c{i}\n    axes: {{rows: {1 + i % 64}}}\n    why: synthetic cell {i}\n"
                    "    tier: premerge\n    oracle: {kind: bitwise, against: spec}\n"
                    for i in range(n))
    (where / "cells" / f"{OP}.yaml").write_text(head + cells)
    budgets = (ROOT / "certify" / "budgets.yaml").read_text()
    (where / "budgets.yaml").write_text(budgets[:budgets.index("\npinned:")] + "\npinned: {}\n")
    with (where / "pyproject.toml").open("a") as f:
        f.write('budgets = "budgets.yaml"\n')
    items = [{"id": f"cells/{OP}.yaml::v[c{i}-{arch}]", "tier": "premerge", "arch": arch,
              "cell": {"op": OP, "variant": "v", "cell": f"c{i}"}} for i in range(n) for arch in ARCHS]
    from certify.lists.records import items_text  # noqa: PLC0415

    (where / "test_lists" / "items.json").write_text(items_text(items))
    return where


def time_plan(project: Path) -> tuple[float, float, dict]:
    """Run ``certify plan --out plan.json`` in the project: its wall seconds, its CPU seconds (user
    and system, which other load on the machine does not inflate) and the plan."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "certify.cli", "plan", "--out", "plan.json"],
                         cwd=project, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise RuntimeError(f"certify plan failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, json.loads((project / "plan.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=10_000, help="cells (default 10000)")
    ap.add_argument("--keep", type=Path, help="build the project here and keep it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = make_project(args.keep or Path(tmp), args.n)
        wall, cpu, plan = time_plan(project)
    print(f"certify plan: {plan['totals']['units']} units ({args.n} cells x {len(ARCHS)} archs) "
          f"in {wall:.2f} s ({cpu:.2f} CPU s)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
