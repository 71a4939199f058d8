"""A variant module's ``REQUIRES``: a target whose peer package is not installed is skipped (no
receipt, no failure), the engine never dispatches to it, and a receipt records the package's
version. The declaration is read from the module's source, never by importing it."""

from __future__ import annotations

import yaml

from certify.catalog.load import load_op_file
from certify.harness.target import Outcome
from certify.files.paths import project_paths
from certify.catalog.plan import Target
from certify.receipts.store import load_receipts, make_receipt
from certify.harness.requirements import missing, required, why_skipped
from certify.harness.runner import run_targets

OP = project_paths().cells / "gated_rmsnorm.yaml"
ABSENT = "no_such_package_for_certify_tests"


def _op_with(module: str):
    """gated_rmsnorm with its torch variant's function taken from tests/framework/<module>.py."""
    op = load_op_file(OP)
    variants = [v.model_copy(update={"impl": f"tests.framework.{module}:gated_rmsnorm"})
                if v.name == "torch" else v for v in op.variants]
    return op.model_copy(update={"variants": variants})


def test_missing_names_only_the_packages_not_installed():
    v = _op_with("peer_absent").variant("torch")
    assert required(v) == (ABSENT,) and missing(v) == [ABSENT]
    assert ABSENT in why_skipped(v) and "torch" in why_skipped(v)
    assert required(_op_with("peer_yaml").variant("torch")) == ("yaml",)
    assert why_skipped(_op_with("peer_yaml").variant("torch")) is None
    plain = load_op_file(OP)
    assert required(plain.variant("torch")) == () and required(plain.variant("spec_lowp")) == ()


def test_the_flashinfer_variants_declare_their_package():
    for name, variant in (("gdn_decode", "flashinfer"), ("gdn_prefill", "flashinfer_chunked")):
        op = load_op_file(project_paths().cells / f"{name}.yaml")
        assert required(op.variant(variant)) == ("flashinfer",)


def test_a_target_whose_package_is_absent_is_skipped_without_a_receipt(tmp_path, capsys):
    op = _op_with("peer_absent")
    runs = Target(op, op.variant("torch"), op.cells[0], "cpu")
    stays = Target(op, op.variant("spec_lowp"), op.cells[0], "cpu")
    receipts = run_targets([runs, stays], tmp_path, show_progress=False)
    assert [r.variant for r in receipts] == ["spec_lowp"]       # the other target still runs
    books = load_receipts(tmp_path)
    assert all(r.variant != "torch" for book in books.values() for r in book.values())
    assert f"skipped {runs.name}" in capsys.readouterr().err


def test_a_receipt_records_the_required_packages_version():
    op = _op_with("peer_yaml")
    r = make_receipt(op, "torch", op.cells[0], "cpu", Outcome("passed"))
    assert r.versions["yaml"] == yaml.__version__ and "torch" in r.versions


def test_the_engine_does_not_dispatch_to_a_variant_whose_package_is_absent():
    from certify.catalog.load import Catalog
    from impl.model.dispatch import Dispatcher
    op = _op_with("peer_absent")
    present = Dispatcher(Catalog(ops={op.op: load_op_file(OP)}), "cpu")
    absent = Dispatcher(Catalog(ops={op.op: op}), "cpu")
    assert "torch" in [v.name for v in present.candidates(op.op)]
    assert "torch" not in [v.name for v in absent.candidates(op.op)]
