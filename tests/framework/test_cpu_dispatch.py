"""A bitwise claim on ``cpu`` holds at every CPU capability torch dispatches to, not only at this
machine's: each capability runs the bitwise ``cpu`` targets in a fresh interpreter (torch reads
``ATEN_CPU_CAPABILITY`` and oneDNN ``ONEDNN_MAX_CPU_ISA`` once, at start), so a machine with AVX512 also
checks what an AVX2-only or a baseline x86-64 CPU computes. A capability this CPU lacks is skipped
with what torch chose instead. Tolerance cells need no such run: their band holds on any rounding
order, and the receipts record which capability measured their error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from certify.files.paths import project_paths

# (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, what torch reports when the CPU has it)
CAPABILITIES = [
    ("default", "AVX2", "DEFAULT"),
    ("avx2", "AVX2", "AVX2"),
    ("avx512", "AVX512_CORE", "AVX512"),
    ("avx512", "AVX512_CORE_AMX", "AVX512"),
]

_SCRIPT = r"""
import json, sys, torch
from certify.catalog.load import load_catalog
from certify.harness.extended import certify_cell
from certify.files.paths import project_paths
from certify.catalog.plan import targets
catalog = load_catalog(project_paths().cells)
out = {"capability": str(torch.backends.cpu.get_cpu_capability()), "results": []}
for op in catalog.ops.values():
    for t in targets(op):
        if t.arch == "cpu" and t.cell.oracle.kind == "bitwise":
            o = certify_cell(t.op, t.variant.name, t.cell, t.arch)
            out["results"].append([t.name, o.status, o.message[:300]])
print(json.dumps(out))
"""


@pytest.mark.postmerge
@pytest.mark.parametrize("capability,isa,reported", CAPABILITIES,
                         ids=[f"{c}-{i}" for c, i, _ in CAPABILITIES])
def test_bitwise_cpu_cells_hold_at_the_capability(capability: str, isa: str, reported: str) -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "ONEDNN_MAX_CPU_ISA": isa}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                          cwd=project_paths().root, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["capability"] != reported:
        pytest.skip(f"this CPU cannot run {capability}: torch dispatched to {got['capability']}")
    assert got["results"], "no bitwise cpu target was run"
    bad = [r for r in got["results"] if r[1] != "passed"]
    assert not bad, f"{len(bad)} bitwise claim(s) fail at {capability} / {isa}:\n" + "\n".join(
        f"{name}: {status}: {msg}" for name, status, msg in bad)
