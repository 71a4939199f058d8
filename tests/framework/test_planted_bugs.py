"""A variant that is wrong is caught by the generated certifications, and the report names the cell."""

import pytest

from certify.catalog.load import Catalog, load_op_file
from certify.harness.target import build_case, certify_cell, run_spec
from certify.files.paths import project_paths
from certify.receipts.store import make_receipt
from certify.report import build_rows, op_markdown
from certify.catalog.schema import Variant
from spec.ops import gdn

CELLS = project_paths().cells


def with_broken(op_name: str, impl: str):
    op = load_op_file(CELLS / f"{op_name}.yaml")
    broken = Variant(name="broken", impl=impl, archs=("cpu",))
    return op.model_copy(update={"variants": op.variants + (broken,)})


def test_a_state_committed_one_row_late_fails_every_verify_cell():
    op = with_broken("gdn_verify", "tests.framework.broken_variants:verify_state_one_row_late")
    for cell in op.cells:
        outcome = certify_cell(op, "broken", cell, "cpu")
        assert outcome.status == "failed", cell.id
        assert "states:" in outcome.message and "band" in outcome.message


def test_a_gate_sign_flipped_in_one_specialisation_fails_that_cell_only_and_the_report_says_so():
    op = with_broken("gdn_decode", "tests.framework.broken_variants:decode_beta_sign_flipped_at_batch_32")
    cheap = [c for c in op.cells if c.axes["batch"] <= 32]
    receipts = {}
    for cell in cheap:
        outcome = certify_cell(op, "broken", cell, "cpu")
        receipts[("gdn_decode", "broken", cell.id)] = make_receipt(op, "broken", cell, "cpu", outcome)
        assert outcome.status == ("failed" if cell.axes["batch"] == 32 else "passed"), cell.id
    rows = build_rows(Catalog(ops={"gdn_decode": op}), {"cpu": receipts})
    broken_rows = {r.cell: r.status["cpu"] for r in rows if r.variant == "broken"}
    assert broken_rows["b32_bf16"] == "failed" and broken_rows["b1_fp32"] == "certified"
    note = op_markdown(op, [r for r in rows if r.op == "gdn_decode"])
    assert "- `broken` at `b32_bf16` on cpu: failed" in note


@pytest.mark.parametrize("rows", [2, 4])
def test_the_spec_itself_tells_the_rows_apart(rows):
    """Guard against a vacuous oracle: consecutive recorded states really differ."""
    op = load_op_file(CELLS / "gdn_verify.yaml")
    cell = next(c for c in op.cells if c.axes["rows"] == rows)
    states = run_spec(gdn.gdn_verify, build_case(op, cell, "cpu"), reference=True)["states"]
    assert (states[:, 1:] - states[:, :-1]).abs().max() > 0.01
