"""The harness checks catch what an output comparison does not: a planted variant for each check
fails that check (and so its target), with a message naming op, variant, cell, tensor and index; the
clean variant passes every check that runs; every receipt records which checks ran."""

import textwrap

import pytest

from certify.catalog.load import load_op_file
from certify.catalog.schema import Variant
from certify.files.paths import project_paths
from certify.files.problem import FileProblem
from certify.harness.checks import CHECKS, certify_checked
from certify.receipts.store import make_receipt

PLANTED = "tests.framework.harness_variants"
NORM = textwrap.dedent("""\
    op: norm_h
    summary: the standalone gated norm, for the harness tests
    spec: spec.ops.norms:gated_rmsnorm
    inputs: spec.cases.gdn:gated_norm_case
    axes:
      rows: {{kind: int, reach: [1, 64]}}
      value_heads: {{kind: choice, values: [2]}}
      head_dim: {{kind: choice, values: [16]}}
    variants:
    {variants}
    cells:
      - id: rows_8
        axes: {{rows: 8}}
        why: eight rows, so that a launch of a subset is smaller
        tier: premerge
        oracle: {{kind: bitwise, against: spec}}
    {harness}""")
NAMES = ("clean", "writes_one_past_its_output", "scribbles_on_its_input", "reads_its_stale_output",
         "small_batches_rounded_otherwise", "ignores_strides", "refuses_views")


def norm_op(tmp_path, harness: str = ""):
    variants = "\n".join(f"  - {{name: {n}, impl: '{PLANTED}:norm_{n}', archs: [cpu]}}"
                         for n in NAMES)
    path = tmp_path / "norm_h.yaml"
    path.write_text(NORM.format(variants=variants, harness=harness))
    return load_op_file(path)


def run(op, variant):
    return certify_checked(op, variant, op.cells[0], "cpu")


def test_the_clean_variant_passes_every_check_that_runs(tmp_path):
    op = norm_op(tmp_path)
    outcome, harness = run(op, "clean")
    assert outcome.status == "passed", outcome.message
    assert list(harness["checks"]) == list(CHECKS)
    ran = {c for c, v in harness["checks"].items() if v.startswith("passed")}
    assert ran == {"inputs_untouched", "canary", "dirty_reuse", "views", "rows_order", "batch_size"}
    assert harness["checks"]["views"] == "passed: honours views of o, z, w"
    assert harness["checks"]["cuda_graph"].startswith("not run: a CUDA-graph replay needs")


@pytest.mark.parametrize("variant,check,where", [
    ("writes_one_past_its_output", "canary", "out: canary past the end written, first at flat "
                                              "index 256"),
    ("scribbles_on_its_input", "inputs_untouched", "input o: 1 of 256 element(s) differ, first at "
                                                    "(7, 1, 15)"),
    ("reads_its_stale_output", "dirty_reuse", "output out: 256 of 256 element(s) differ, first at "
                                              "(0, 0, 0)"),
    ("small_batches_rounded_otherwise", "batch_size", "output out: "),
])
def test_a_planted_variant_fails_its_check_and_its_target(tmp_path, variant, check, where):
    op = norm_op(tmp_path)
    outcome, harness = run(op, variant)
    assert harness["checks"][check].startswith("failed: "), harness["checks"]
    assert where in harness["checks"][check]
    assert outcome.status == "failed"
    assert f"norm_h::{variant}::rows_8::cpu: harness check {check} failed" in outcome.message
    receipt = make_receipt(op, variant, op.cells[0], "cpu", outcome, harness)
    assert receipt.status == "failed" and receipt.harness["checks"][check].startswith("failed")


def test_views_the_contract_admits_are_used_and_a_variant_that_ignores_strides_fails(tmp_path):
    op = norm_op(tmp_path, harness="harness:\n  views: [o, z]\n")
    assert run(op, "clean")[1]["checks"]["views"] == "passed: takes views of o, z; honours views of w"
    outcome, harness = run(op, "ignores_strides")
    assert harness["checks"]["views"].startswith("failed: non-contiguous, offset views of ['o', 'z']")
    assert outcome.status == "failed"
    outcome, harness = run(op, "refuses_views")
    assert harness["checks"]["views"].startswith("failed: views of ['o', 'z'] refused: ValueError")


def test_views_the_contract_does_not_admit_are_refused_or_honoured_never_misread(tmp_path):
    op = norm_op(tmp_path)
    outcome, harness = run(op, "refuses_views")
    assert outcome.status == "passed", outcome.message
    assert harness["checks"]["views"].startswith(
        "passed: refuses views of o, z, w (e.g. ValueError: the planted norm: tensors read by "
        "row-major offsets must be contiguous; not contiguous: o (shape (8, 2, 16)")
    outcome, harness = run(op, "ignores_strides")
    assert outcome.status == "failed"
    assert harness["checks"]["views"].startswith(
        "failed: non-contiguous, offset views the contract does not admit were neither refused nor "
        "honoured: views of ['o', 'z', 'w']: output out: ")


def test_a_declared_row_split_and_a_refusal_are_read(tmp_path):
    op = norm_op(tmp_path, harness="harness:\n  no_rows: the test declares the launch rowless\n")
    checks = run(op, "small_batches_rounded_otherwise")[1]["checks"]
    assert checks["batch_size"] == ("not run: the op has no row axis: the test declares the "
                                    "launch rowless")
    op = norm_op(tmp_path, harness="harness:\n  rows: {inputs: [o, z], outputs: [out]}\n")
    assert run(op, "clean")[1]["checks"]["rows_order"] == "passed"


def test_a_bad_harness_section_names_file_line_and_field(tmp_path):
    with pytest.raises(FileProblem) as e:
        norm_op(tmp_path, harness="harness:\n  rows: {inputs: [o]}\n  viewz: [o]\n")
    lines = (tmp_path / "norm_h.yaml").read_text().splitlines()
    assert lines[e.value.line - 1] == "  viewz: [o]" and "harness.viewz" in str(e.value)


def test_a_pool_row_no_request_owns_written_fails_the_unowned_rows_check():
    """The oracle compares the whole pool too; this check names the row as one the call does not
    own, and runs whatever the oracle says."""
    op = load_op_file(project_paths().cells / "gdn_decode.yaml")
    broken = Variant(name="broken", impl=f"{PLANTED}:decode_writes_a_spare_pool_row",
                     archs=("cpu",))
    op = op.model_copy(update={"variants": op.variants + (broken,)})
    cell = next(c for c in op.cells if c.axes["batch"] == 1)
    outcome, harness = certify_checked(op, "broken", cell, "cpu")
    assert harness["checks"]["inplace_unowned_rows"].startswith(
        "failed: in-place state_pool: 1 row(s) the call does not own written, first at"), harness
    assert outcome.status == "failed"
    outcome, harness = certify_checked(op, "torch", cell, "cpu")
    assert harness["checks"]["inplace_unowned_rows"] == "passed"


def test_outdated_selects_receipts_whose_checks_are_missing_or_of_other_code(tmp_path, monkeypatch):
    from certify.catalog.load import load_catalog
    from certify.harness import runner
    from certify.receipts.store import load_receipts, write_receipts
    from tests.framework.tmp_project import make_project

    project = make_project(tmp_path)
    cat, receipts = load_catalog(project / "cells"), project / "receipts"
    chosen = runner.select(cat, archs=["cpu"], only_outdated=True, receipts_dir=receipts)
    assert len(chosen) == 2
    runner.run_targets(chosen, receipts, show_progress=False)
    assert runner.select(cat, archs=["cpu"], only_outdated=True, receipts_dir=receipts) == []
    monkeypatch.setattr(runner, "harness_hash", lambda op: "other checks")
    assert len(runner.select(cat, archs=["cpu"], only_outdated=True, receipts_dir=receipts)) == 2
    monkeypatch.undo()
    old = [r.model_copy(update={"harness": {}}) for r in load_receipts(receipts)["cpu"].values()]
    write_receipts(receipts, old)
    assert "harness" not in (receipts / "cpu.jsonl").read_text()  # written as before the checks
    assert len(runner.select(cat, archs=["cpu"], only_outdated=True, receipts_dir=receipts)) == 2


def test_the_op_note_shows_each_receipts_checks_and_says_harness_not_run_for_older_ones(tmp_path):
    from certify.catalog.load import Catalog
    from certify.report import build_rows, op_markdown

    op = norm_op(tmp_path)
    cell = op.cells[0]
    books = {}
    for arch, variant in (("cpu", "clean"), ("cpu", "scribbles_on_its_input")):
        outcome, harness = certify_checked(op, variant, cell, arch)
        books.setdefault(arch, {})[(op.op, variant, cell.id)] = make_receipt(
            op, variant, cell, arch, outcome, harness)
    old, _ = certify_checked(op, "small_batches_rounded_otherwise", cell, "cpu")
    books["cpu"][(op.op, "small_batches_rounded_otherwise", cell.id)] = make_receipt(
        op, "small_batches_rounded_otherwise", cell, "cpu", old)
    note = op_markdown(op, build_rows(Catalog(ops={op.op: op}), books))
    section = note[note.index("## Harness checks"):]
    assert "| clean " in section and "current" in section and "FAIL" in section
    assert ("harness: not run (receipts made before the harness checks existed; their numbers stay "
            "fresh): `small_batches_rounded_otherwise` at `rows_8` on cpu") in section
    assert "- `clean` on cpu: honours views of o, z, w" in section


def test_a_wrong_batch_invariance_claim_fails_its_target():
    """ple_embed's torch variant: its batched GEMM rounds a row of a one-row launch otherwise than
    inside 128 rows, so it must not claim batch invariance; with the claim, the check fails it."""
    from certify.harness import contract

    op = load_op_file(project_paths().cells / "ple_embed.yaml")
    assert not op.variant("torch").batch_invariant
    claimed = op.variant("torch").model_copy(update={"batch_invariant": True})
    wrong = op.model_copy(update={"variants": tuple(claimed if v.name == "torch" else v
                                                    for v in op.variants)})
    contract.register(wrong, contract.contract_of(op))
    outcome, harness = certify_checked(wrong, "torch", op.cell("decode_rows_t128"), "cpu")
    assert harness["checks"]["batch_size"].startswith("failed: rows ["), harness["checks"]
    assert outcome.status == "failed"


def test_a_verifying_item_repeats_only_the_certifying_calls_checks(tmp_path):
    from certify.harness.verified import REPEATED, certify_verifying, standing_verdicts
    from certify.receipts.store import library_versions

    op = norm_op(tmp_path)
    cell, now = op.cells[0], library_versions()
    outcome, harness = run(op, "clean")
    receipt = make_receipt(op, "clean", cell, "cpu", outcome, harness)
    standing = standing_verdicts(receipt, op, "cpu", now)
    assert standing == harness["checks"]
    assert standing_verdicts(receipt.model_copy(update={"harness": {}}), op, "cpu", now) is None
    other = receipt.model_copy(update={"versions": receipt.versions | {"torch": "0.0"}})
    assert standing_verdicts(other, op, "cpu", now) is None   # not comparable: every check runs
    again, rec = certify_verifying(op, "clean", cell, "cpu", standing)
    assert again.status == "passed" and rec["checks"] == harness["checks"]
    assert rec["standing"] == list(REPEATED)
    # the certifying call's own checks still run: a scribbler fails whatever the receipt says
    bad, rec = certify_verifying(op, "scribbles_on_its_input", cell, "cpu", standing)
    assert bad.status == "failed" and rec["checks"]["inputs_untouched"].startswith("failed")
