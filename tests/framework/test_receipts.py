"""Receipts: the freshness rule (content hash), the evidence rule (a receipt consistent with its
arch, versions, seed, digests and band) and the per-arch files."""

from pathlib import Path

import pytest

from certify.catalog.load import load_op_file
from certify.harness.target import Outcome, certify_cell
from certify.files.paths import project_paths
from certify.receipts.codehash import content_hash
from certify.receipts.store import (
    evidence_problems,
    freshness,
    load_receipts,
    make_receipt,
    write_receipts,
)

OP = project_paths().cells / "gated_rmsnorm.yaml"


@pytest.fixture(scope="module")
def op():
    return load_op_file(OP)


@pytest.fixture(scope="module")
def passed(op):
    """A real passing receipt of the op's first cell (a tolerance oracle) on the CPU."""
    cell = op.cells[0]
    assert cell.oracle.kind == "tolerance"
    outcome = certify_cell(op, "torch", cell, "cpu")
    assert outcome.status == "passed", outcome.message
    return make_receipt(op, "torch", cell, "cpu", outcome)


def test_a_fresh_passing_receipt_certifies(op, passed):
    assert freshness(passed, op, "torch", op.cells[0], "cpu") == "certified"
    assert passed.seed and set(passed.digests) == set(op.cells[0].oracle.outputs)
    assert passed.versions["cpu_capability"] and passed.versions["threads"]


def test_a_forged_status_is_no_evidence(op, passed):
    """A failed receipt whose status was edited to passed: its metrics exceed the band."""
    cell = op.cells[0]
    name, band = next(iter(cell.oracle.outputs.items()))
    forged = passed.model_copy(update={"metrics": {**passed.metrics,
                                                   f"{name}.ulp": band.max_ulp * 3}})
    assert freshness(forged, op, "torch", cell, "cpu") == "invalid"
    assert "against a band" in " ".join(evidence_problems(forged, op, cell, "cpu"))
    no_digest = passed.model_copy(update={"digests": {}})
    assert freshness(no_digest, op, "torch", cell, "cpu") == "invalid"
    reseeded = passed.model_copy(update={"seed": passed.seed + 1})
    assert freshness(reseeded, op, "torch", cell, "cpu") == "invalid"


def test_a_cross_arch_copy_is_no_evidence(op, passed):
    """A CPU receipt copied into the sm_90 file, as is or with its arch edited."""
    cell = op.cells[0]
    assert freshness(passed, op, "torch", cell, "sm_90") == "invalid"
    relabelled = passed.model_copy(update={"arch": "sm_90"})
    why = " ".join(evidence_problems(relabelled, op, cell, "sm_90"))
    assert freshness(relabelled, op, "torch", cell, "sm_90") == "invalid"
    assert "cannot come from sm_90" in why
    gpu = relabelled.model_copy(update={"versions": {"torch": "2.13.0+cu130", "cuda": "13.0",
                                                     "gpu": "NVIDIA H200"}})
    assert freshness(gpu, op, "torch", cell, "sm_90") == "certified"


def test_a_key_twice_in_one_file_is_not_counted(op, passed, tmp_path: Path):
    line = passed.model_dump_json()
    other = passed.model_copy(update={"cell": op.cells[1].id}).model_dump_json()
    (tmp_path / "cpu.jsonl").write_text("\n".join([line, other, line]) + "\n")
    problems: list = []
    book = load_receipts(tmp_path, problems)["cpu"]
    assert passed.key not in book and len(book) == 1
    assert [p.line for p in problems] == [1, 3] and "appears twice" in problems[0].message


def test_a_failing_receipt_reads_failed_and_no_receipt_reads_not_run(op):
    cell = op.cells[0]
    r = make_receipt(op, "torch", cell, "cpu", Outcome("failed", {}, "boom"))
    assert freshness(r, op, "torch", cell, "cpu") == "failed"
    assert freshness(None, op, "torch", cell) == "not run"


def test_changing_the_cell_makes_the_receipt_stale(op):
    cell = op.cells[0]
    r = make_receipt(op, "torch", cell, "cpu", Outcome("passed"))
    edited = cell.model_copy(update={"axes": {**cell.axes, "rows": 7}})
    assert freshness(r, op, "torch", edited) == "stale"


def test_changing_the_variant_entry_makes_the_receipt_stale(op):
    cell = op.cells[0]
    r = make_receipt(op, "torch", cell, "cpu", Outcome("passed"))
    v = op.variants[0].model_copy(update={"dispatch": "rows > 1"})
    assert freshness(r, op.model_copy(update={"variants": (v,)}), "torch", cell) == "stale"


def test_the_hash_covers_the_source_of_the_modules_involved(op, monkeypatch):
    """Editing any project module the spec imports (here spec.numerics) changes the hash."""
    from certify.receipts import codehash

    cell = op.cells[0]
    before = content_hash(op, "torch", cell)
    real = codehash.module_closure.__wrapped__

    def edited(module):
        out = dict(real(module))
        if "spec.numerics" in out:
            out["spec.numerics"] = "0" * 64
        return tuple(sorted(out.items()))

    monkeypatch.setattr(codehash, "module_closure", edited)
    assert content_hash(op, "torch", cell) != before
    assert "spec.numerics" in dict(real("spec.ops.norms"))


def test_the_hash_ignores_library_versions(op, passed):
    r = passed.model_copy(update={"versions": {**passed.versions, "torch": "0.0.1"}})
    assert freshness(r, op, "torch", op.cells[0], "cpu") == "certified"


def test_receipt_files_keep_the_latest_record_per_key(op, tmp_path: Path):
    cell = op.cells[0]
    first = make_receipt(op, "torch", cell, "cpu", Outcome("failed", {}, "old"))
    write_receipts(tmp_path, [first])
    second = make_receipt(op, "torch", cell, "cpu", Outcome("passed", {"out.ulp": 0.5}))
    other = make_receipt(op, "torch", op.cells[1], "sm_90", Outcome("passed"))
    write_receipts(tmp_path, [second, other])
    books = load_receipts(tmp_path)
    assert sorted(books) == ["cpu", "sm_90"]
    assert len((tmp_path / "cpu.jsonl").read_text().splitlines()) == 1
    assert books["cpu"][("gated_rmsnorm", "torch", cell.id)].status == "passed"


def test_pruning_drops_only_the_receipts_of_targets_that_are_gone(op, tmp_path: Path):
    from certify.receipts.store import prune_receipts

    a, b = op.cells[0], op.cells[1]
    kept = make_receipt(op, "torch", a, "cpu", Outcome("passed"))
    gone = make_receipt(op, "torch", b, "cpu", Outcome("passed"))
    other_arch = make_receipt(op, "torch", a, "sm_90", Outcome("error", {}, "did not compile"))
    write_receipts(tmp_path, [kept, gone, other_arch])
    live = {("cpu", op.op, "torch", a.id)}
    dropped = prune_receipts(tmp_path, live)
    assert {(r.arch, r.cell) for r in dropped} == {("cpu", b.id), ("sm_90", a.id)}
    books = load_receipts(tmp_path)
    assert list(books["cpu"]) == [kept.key] and books.get("sm_90", {}) == {}
    assert prune_receipts(tmp_path, live) == []                      # idempotent
