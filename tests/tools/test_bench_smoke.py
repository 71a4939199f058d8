"""Every benchmark script (each ``bench/*.py`` but the helper ``bench_common.py``) has a ``--smoke``
path, and it runs on the CPU at this revision, as ``python3 bench/NAME.py --smoke`` from outside any
checkout with nothing on ``PYTHONPATH``: the script finds the project through ``bench/bench_common.py``
and its cell files through the framework's fallback root, as on the GPU machine where nothing is
installed. A new script without a smoke path fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from certify.files.paths import _find_root

ROOT = Path(__file__).resolve().parents[2]
HELPERS = {"bench_common.py"}   # imported by the scripts, not run
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name not in HELPERS)


def test_there_are_bench_scripts():
    assert SCRIPTS and "bench_common.py" not in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_has_a_smoke_path(script):
    assert '"--smoke"' in (ROOT / "bench" / script).read_text(encoding="utf-8"), (
        f"bench/{script} has no --smoke path: add one that runs on the CPU at tiny shapes and "
        "writes nothing (see bench/gdn_decode.py)")


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


def test_perf_records_check_each_variant_on_the_inputs_the_reference_saw(tmp_path):
    """gdn_decode updates its state in place: the timed calls of one variant must not leave the
    next variant checking a state the float64 reference never saw (it then fails its band)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "perf_records.py"), "--smoke",
                          "--op", "gdn_decode"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    timed = [line for line in res.stdout.splitlines() if line.startswith("smoke ") and " us (" in line]
    assert len(timed) >= 2, res.stdout[-2000:]     # a variant checked after another's timed calls
