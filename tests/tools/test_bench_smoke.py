"""Every benchmark script with a ``--smoke`` path runs it on the CPU at this revision, as
``python3 bench/NAME.py --smoke`` from outside any checkout with nothing on ``PYTHONPATH``: the script
finds the project through ``bench/bench_common.py`` and its cell files through the framework's
fallback root, as on the GPU machine where nothing is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from certify.files.paths import _find_root

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if '"--smoke"' in p.read_text())


def test_the_framework_falls_back_to_its_checkout_outside_any_project(tmp_path):
    assert _find_root(tmp_path) == ROOT


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_bench_script_smoke_runs(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "smoke" in res.stdout, res.stdout[-2000:]
    assert not list(tmp_path.iterdir()), "a smoke run writes nothing"
