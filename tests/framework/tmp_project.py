"""A throwaway project for the framework's end-to-end tests: one op (the standalone gated norm) with a
correct variant and a planted one declared to fail, its own cells and receipts folders, and the
``certify`` command run inside it with this checkout on the import path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OP = textwrap.dedent("""\
    op: norm_x
    summary: the standalone gated norm, for the expected-failure tests
    spec: spec.ops.norms:gated_rmsnorm
    inputs: spec.cases.gdn:gated_norm_case
    axes:
      rows: {{kind: int, reach: [1, 64]}}
      value_heads: {{kind: choice, values: [2]}}
      head_dim: {{kind: choice, values: [16]}}
    variants:
      - name: torch
        impl: impl.kernels.gdn.torch_ops:gated_rmsnorm
        archs: [cpu]
      - name: high
        impl: tests.framework.broken_variants:gated_rmsnorm_one_percent_high
        archs: [cpu]
    cells:
      - id: rows_4
        axes: {{rows: 4}}
        why: a small case for the expected-failure tests
        tier: premerge
        oracle: {{kind: bitwise, against: spec}}
        expected_failures:
          - variant: {declared}
            arch: cpu
            why: the planted variant is one percent high everywhere
    """)


def make_project(tmp: Path, declared: str = "high", extra_variant: str = "") -> Path:
    """The project in ``tmp``: ``declared`` is the variant its cell expects to fail;
    ``extra_variant`` (YAML list entries) joins the variants."""
    (tmp / "pyproject.toml").write_text('[tool.certify]\ncells = "cells"\nreceipts = "receipts"\n')
    (tmp / "cells").mkdir(exist_ok=True)
    text = OP.format(declared=declared)
    if extra_variant:
        text = text.replace("cells:\n", extra_variant + "cells:\n", 1)
    (tmp / "cells" / "norm_x.yaml").write_text(text)
    return tmp


def run_in(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python3 ARGS`` in the project, this checkout first on the import path."""
    return subprocess.run([sys.executable, *args], cwd=project,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=600)
