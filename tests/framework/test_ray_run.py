"""``certify run --ray local`` on a local Ray cluster of CI's two CPUs (certify/harness/ray_run.py):
the distributed run writes the receipts a one-process run writes, digests included; a worker that
dies mid-task is retried and the run converges; an arch no node offers is refused up front; a
variant whose bytes differ run to run is flagged when the workers' receipts are merged; a unit that
fails on every attempt is reported, and what the other units finished is merged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.framework.tmp_project import make_project, run_in

try:
    import ray  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI installs the ray extra (.ci/run): it may not be missing") from None
    pytest.skip("needs Ray: pip install -e '.[ray]'", allow_module_level=True)

NONDETERMINISTIC = """  - name: noisy
    impl: tests.framework.broken_variants:gated_rmsnorm_nondeterministic
    archs: [cpu]
"""
DIES = """  - name: dies
    impl: tests.framework.broken_variants:gated_rmsnorm_dies_once
    archs: [cpu, sm_90]
  - name: always_dies
    impl: tests.framework.broken_variants:gated_rmsnorm_always_dies
    archs: [cpu]
"""


def _certify(project: Path, *args: str) -> subprocess.CompletedProcess:
    return run_in(project, "-m", "certify.cli", *args, RAY_AUTH_MODE="disabled")


def _records(project: Path) -> dict:
    out = {}
    for line in (project / "receipts" / "cpu.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[(r["op"], r["variant"], r["cell"])] = {k: r[k] for k in
                                                   ("status", "hash", "digests", "metrics", "seed")}
    return out


def test_a_ray_run_writes_what_a_one_process_run_writes(tmp_path):
    project = make_project(tmp_path)
    assert _certify(project, "run").returncode == 0
    local = _records(project)
    shutil.rmtree(project / "receipts")
    res = _certify(project, "run", "--ray", "local")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "took 2 new" in res.stdout
    assert _records(project) == local
    workers = list((project / "runs" / "ray").glob("*/*/cpu.jsonl"))
    assert workers, "each worker writes its own receipts file"


def test_dead_workers_are_retried_failed_units_reported_absent_archs_refused(tmp_path):
    project = make_project(tmp_path, extra_variant=DIES)
    res = _certify(project, "run", "--ray", "local", "--op", "norm_x")
    out = res.stdout[-3000:] + res.stderr[-3000:]
    # always_dies kills every worker it lands on: it is reported after its 3 attempts (the first and
    # Ray's 2 retries), and what the others finished is merged
    assert res.returncode == 1, out
    assert "FAILED norm_x::always_dies::rows_4::cpu after 3 attempt(s): WorkerCrashedError" \
        in res.stderr, out
    assert "1 target(s) failed on every attempt and have no receipt; 3 finished" in res.stderr, out
    assert "took 3 new" in res.stdout, out
    assert (project / "died-once.marker").is_file(), "the planted variant killed its worker once"
    records = _records(project)
    assert records[("norm_x", "dies", "rows_4")]["status"] == "passed"
    assert {k[1] for k in records} == {"torch", "high", "dies"}
    res = _certify(project, "run", "--ray", "local", "--arch", "sm_90")
    assert res.returncode == 1
    assert "refused norm_x::dies::rows_4::sm_90: no node of the cluster offers sm_90" in res.stderr


def test_a_nondeterministic_variant_is_flagged_when_the_workers_receipts_merge(tmp_path):
    project = make_project(tmp_path, extra_variant=NONDETERMINISTIC)
    # Twice on Ray, so both runs record the same versions (a Ray task runs torch on the one CPU it
    # holds; a one-process run on all of them, and merge would call that a platform difference).
    first = _certify(project, "run", "--ray", "local")  # noisy fails its bitwise oracle
    assert "took 3 new" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
    before = (project / "receipts" / "cpu.jsonl").read_bytes()
    res = _certify(project, "run", "--ray", "local")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "CONFLICT nondeterminism: norm_x::noisy::rows_4 on cpu" in res.stdout, res.stdout
    assert "2 already held" in res.stdout, res.stdout
    assert (project / "receipts" / "cpu.jsonl").read_bytes() == before
    assert (project / "receipts" / "cpu.jsonl.conflicts").is_file()
