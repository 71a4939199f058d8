"""tools/sm90_compile_check.py compiles a real sm_90 binary on this CPU machine, and ``--sass`` reads
it back: registers, spills and the SASS instruction mix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sass_reports_registers_and_the_instruction_mix(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))   # a cold cache: the binary is built here
    out = subprocess.run([sys.executable, "tools/sm90_compile_check.py", "--op", "rmsnorm", "--sass"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.strip() for line in out.stdout.splitlines() if line.startswith("    _")]
    assert lines, out.stdout                                   # one line per binary loaded
    for line in lines:
        m = re.fullmatch(r"(\w+): shared \d+ B, (\d+) registers, stack \d+ B, local \d+ B; "
                         r"(\d+) SASS instructions: (.*)", line)
        assert m, line
        counts = dict(re.findall(r"([A-Z0-9]+) (\d+)", m[4]))
        # a norm reads its row (LDG) and reduces it across the warp (SHFL)
        assert 0 < int(m[2]) <= 255 and int(m[3]) > 0 and int(counts["LDG"]) > 0
        assert int(counts["SHFL"]) > 0
    assert re.search(r"\d+ targets: \d+ OK, 0 FAIL", out.stdout)
