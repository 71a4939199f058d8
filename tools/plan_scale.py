"""How long planning takes at fleet scale: a synthetic catalog of N cells x 4 archs (one op, one
variant on cpu, cpu-interpret, sm_90 and sm_100, cells copied from a real op with varied axes), its
targets listed and each one's content hash taken, as ``certify plan`` does per unit.

    python3 tools/plan_scale.py [N]      # default 10000
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from certify.catalog.load import load_catalog  # noqa: E402
from certify.catalog.plan import targets  # noqa: E402
from certify.files.paths import project_paths  # noqa: E402
from certify.receipts.codehash import content_hash  # noqa: E402

ARCHS = ("cpu", "cpu-interpret", "sm_90", "sm_100")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    op = load_catalog(project_paths().cells).ops["gated_rmsnorm"]
    cell, variant = op.cells[0], op.variants[0]
    big = op.model_copy(update={
        "variants": (variant.model_copy(update={"name": "v", "archs": ARCHS}),),
        "cells": tuple(cell.model_copy(update={"id": f"c{i}", "variants": None,
                                               "axes": {**cell.axes, "rows": 1 + i % 64}})
                       for i in range(n))})
    t0 = time.perf_counter()
    units = [{"op": big.op, "variant": t.variant.name, "cell": t.cell.id, "arch": t.arch,
              "hash": content_hash(big, t.variant.name, t.cell)} for t in targets(big)]
    print(f"{len(units)} units ({n} cells x {len(ARCHS)} archs) planned in "
          f"{time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
