"""``certify merge`` folds receipts written elsewhere into the receipts directory: idempotently, and
never resolving a disagreement silently (certify/receipts/merge.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.receipts.merge import merge
from certify.receipts.store import load_receipts

from tests.framework.tmp_project import make_project, run_in

PATHS = project_paths()


def _copy_receipts(tmp: Path) -> Path:
    out = tmp / "receipts"
    out.mkdir()
    shutil.copy(PATHS.receipts / "cpu.jsonl", out / "cpu.jsonl")
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_merging_what_is_held_changes_no_byte(tmp_path):
    cat = load_catalog(PATHS.cells)
    held = _copy_receipts(tmp_path)
    before = (held / "cpu.jsonl").read_bytes()
    worker = _write(tmp_path / "w1" / "cpu.jsonl", _lines(held / "cpu.jsonl"))
    for _ in range(2):
        res = merge(cat, held, [worker.parent])
        assert (res.added, res.replaced, res.conflicts, res.left_out) == ([], [], [], [])
        assert res.collapsed == len(before.splitlines())
        assert (held / "cpu.jsonl").read_bytes() == before


def test_a_missing_receipt_is_added_and_a_second_merge_is_a_no_op(tmp_path):
    cat = load_catalog(PATHS.cells)
    held = _copy_receipts(tmp_path)
    full = (held / "cpu.jsonl").read_bytes()
    records = _lines(held / "cpu.jsonl")
    _write(held / "cpu.jsonl", records[1:])
    worker = _write(tmp_path / "w1" / "cpu.jsonl", records[:3])
    res = merge(cat, held, [worker])
    assert res.added == [("cpu", (records[0]["op"], records[0]["variant"], records[0]["cell"]))]
    assert res.collapsed == 2
    assert (held / "cpu.jsonl").read_bytes() == full
    assert merge(cat, held, [worker]).added == []


def test_other_bytes_from_the_same_code_are_a_conflict_kept_for_review(tmp_path):
    cat = load_catalog(PATHS.cells)
    held = _copy_receipts(tmp_path)
    before = (held / "cpu.jsonl").read_bytes()
    records = _lines(held / "cpu.jsonl")
    r = next(x for x in records if x.get("digests"))
    name = next(iter(r["digests"]))
    same_platform = {**r, "digests": {**r["digests"], name: "0" * 16}}
    other_platform = {**same_platform, "versions": {**r["versions"], "cpu_capability": "AVX2"}}
    res = merge(cat, held, [_write(tmp_path / "w1" / "cpu.jsonl", [same_platform]),
                            _write(tmp_path / "w2" / "cpu.jsonl", [other_platform])])
    assert [c.kind for c in res.conflicts] == ["nondeterminism", "platform"]
    assert name in str(res.conflicts[0]) and "cpu_capability" in str(res.conflicts[1])
    assert (held / "cpu.jsonl").read_bytes() == before
    review = _lines(held / "cpu.jsonl.conflicts")
    assert [x["kind"] for x in review] == ["nondeterminism", "platform"]
    assert review[0]["kept"]["digests"] == r["digests"]
    assert review[0]["other"]["digests"][name] == "0" * 16
    merge(cat, held, [tmp_path / "w1", tmp_path / "w2"])
    assert len(_lines(held / "cpu.jsonl.conflicts")) == 2, "a conflict is kept once"


def test_stale_and_unknown_receipts_are_left_out_and_said(tmp_path):
    cat = load_catalog(PATHS.cells)
    held = _copy_receipts(tmp_path)
    before = (held / "cpu.jsonl").read_bytes()
    r = _lines(held / "cpu.jsonl")[0]
    stale = {**r, "hash": "f" * 24, "digests": {}}
    unknown = {**r, "cell": "no_such_cell"}
    res = merge(cat, held, [_write(tmp_path / "w1" / "cpu.jsonl", [stale, unknown])])
    assert len(res.left_out) == 2 and "stale" in res.left_out[0] + res.left_out[1]
    assert any("no target of the catalog" in w for w in res.left_out)
    assert (held / "cpu.jsonl").read_bytes() == before


def test_the_command_merges_worker_files_and_fails_on_a_conflict(tmp_path):
    project = make_project(tmp_path)

    def certify(*args):
        return run_in(project, "-m", "certify.cli", *args)

    assert certify("run").returncode == 0
    made = (tmp_path / "receipts" / "cpu.jsonl").read_bytes()
    shutil.move(tmp_path / "receipts", tmp_path / "w1")
    res = certify("merge", "w1")
    assert res.returncode == 0 and "took 2 new" in res.stdout, res.stdout + res.stderr
    assert (tmp_path / "receipts" / "cpu.jsonl").read_bytes() == made
    res = certify("merge", "w1")
    assert res.returncode == 0 and "2 already held" in res.stdout, res.stdout
    records = _lines(tmp_path / "w1" / "cpu.jsonl")
    records[0]["digests"] = {k: "1" * 16 for k in records[0]["digests"]}
    _write(tmp_path / "w2" / "cpu.jsonl", records)
    res = certify("merge", "w2")
    assert res.returncode == 1 and "CONFLICT nondeterminism" in res.stdout, res.stdout
    assert (tmp_path / "receipts" / "cpu.jsonl").read_bytes() == made
    assert load_receipts(tmp_path / "receipts")["cpu"], "the held receipts stay"
