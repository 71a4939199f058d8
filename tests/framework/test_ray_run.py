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
    # First in one process on one thread, as a Ray task of one CPU runs torch, so both runs record
    # the same versions (on other thread counts merge would call it a platform difference).
    first = run_in(project, "-m", "certify.cli", "run", OMP_NUM_THREADS="1")
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]  # noisy fails bitwise
    assert "3 certification(s) run" in first.stdout, first.stdout[-3000:]
    before = (project / "receipts" / "cpu.jsonl").read_bytes()
    res = _certify(project, "run", "--ray", "local")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "CONFLICT nondeterminism: norm_x::noisy::rows_4 on cpu" in res.stdout, res.stdout
    assert "2 already held" in res.stdout, res.stdout
    assert (project / "receipts" / "cpu.jsonl").read_bytes() == before
    assert (project / "receipts" / "cpu.jsonl.conflicts").is_file()


# ------------------------------------------------------------------------------ the repository's cells

PRE_MERGE_ARCHS = ("cpu", "cpu-interpret")
SUBSET_MAX_SECONDS = 1.0
COMPARED = ("status", "hash", "digests", "metrics", "seed", "versions", "message")


def _premerge_cell_targets(subset: bool) -> tuple[list, dict[str, float]]:
    """The cell targets of test_lists/premerge.yml on the pre-merge archs, with their measured
    seconds by target name. ``subset``: per (op, arch), the cheapest of them, where it costs at most
    SUBSET_MAX_SECONDS (the whole list is some 150 targets and 300 s a run, a run each way, more
    than the pre-merge budget holds for one test; this keeps every op and both archs that fit, at
    about 10 s a run; the ``all`` parameter runs the whole list, on demand)."""
    from certify.catalog.load import load_catalog
    from certify.catalog.plan import targets
    from certify.files.paths import project_paths
    from certify.harness.requirements import why_skipped
    from certify.lists.records import list_ids
    from certify.receipts.store import load_receipts

    paths = project_paths()
    cells = paths.cells.relative_to(paths.root).as_posix()
    by_id = {f"{cells}/{op.op}.yaml::{t.item_name}": t
             for op in load_catalog(paths.cells).ops.values() for t in targets(op)}
    books = load_receipts(paths.receipts)
    durations = {}
    for i, t in by_id.items():
        r = books.get(t.arch, {}).get((t.op.op, t.variant.name, t.cell.id))
        if r is not None:
            durations[i] = r.seconds
    listed = [i for i in list_ids(paths.lists / "premerge.yml") if i in by_id]
    chosen = [i for i in listed if by_id[i].arch in PRE_MERGE_ARCHS and not why_skipped(by_id[i].variant)]
    if subset:
        cheapest: dict[tuple[str, str], str] = {}
        for i in sorted(chosen, key=lambda i: (durations.get(i, float("inf")), i)):
            cheapest.setdefault((by_id[i].op.op, by_id[i].arch), i)
        chosen = sorted(i for i in cheapest.values()
                        if durations.get(i, float("inf")) <= SUBSET_MAX_SECONDS)
    return [by_id[i] for i in chosen], {by_id[i].name: durations.get(i, 1.0) for i in chosen}


def _compared(receipts_dir: Path) -> dict:
    from certify.receipts.store import load_receipts

    return {(arch, key): {f: getattr(r, f) for f in COMPARED}
            for arch, book in load_receipts(receipts_dir).items() for key, r in book.items()}


@pytest.mark.parametrize("which", ["subset", pytest.param("all", marks=pytest.mark.ondemand)])
def test_the_premerge_cells_on_ray_equal_a_one_process_run(which, tmp_path, monkeypatch):
    """The repository's pre-merge cells, certified on a local Ray cluster (tasks of one CPU, torch
    on one thread) and in this process on one thread, give the same receipts: status, content hash,
    output digests, metrics, seed, versions and CPU dispatch. Receipts go to temporary folders."""
    import torch

    from certify.catalog.load import load_catalog
    from certify.files.paths import project_paths
    from certify.harness.ray_run import run_on_ray
    from certify.harness.runner import run_targets
    from certify.receipts.merge import merge

    from certify.harness.archs import present_archs

    missing = set(PRE_MERGE_ARCHS) - set(present_archs())
    if missing:
        pytest.skip(f"this machine lacks {sorted(missing)}, the pre-merge archs")
    paths = project_paths()
    chosen, seconds = _premerge_cell_targets(subset=which == "subset")
    assert {t.arch for t in chosen} == set(PRE_MERGE_ARCHS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_targets(chosen, tmp_path / "local", show_progress=False)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    receipts, refused, failed = run_on_ray(chosen, "local", paths, tmp_path / "workers", seconds, 1)
    assert not refused and not failed, (refused, [str(f) for f in failed])
    assert len(receipts) == len(chosen)
    res = merge(load_catalog(paths.cells), tmp_path / "ray", [tmp_path / "workers"])
    assert not res.conflicts and not res.left_out and not res.damaged, \
        ([str(c) for c in res.conflicts], res.left_out, res.damaged)
    local, ray_run = _compared(tmp_path / "local"), _compared(tmp_path / "ray")
    assert len(local) == len(chosen)
    differ = sorted(k for k in local if local[k] != ray_run.get(k))
    assert not differ and local.keys() == ray_run.keys(), \
        [(k, local[k], ray_run.get(k)) for k in differ[:3]]
