"""The catalog's claims about this target's tests and files (the reach claims, the cell rules and the
certifying check are in test_reach.py)."""

from certify.catalog.load import load_catalog
from certify.catalog.claims import marked_tests
from certify.files.paths import project_paths

PATHS = project_paths()


def test_every_cell_file_loads():
    cat = load_catalog(PATHS.cells)
    assert not cat.errors, "\n".join(map(str, cat.errors))
    assert cat.ops, "no cell files found"


def test_every_op_has_a_guard_and_a_property_test():
    cat = load_catalog(PATHS.cells)
    marks = marked_tests([PATHS.root / "tests"])
    missing = [f"{op}: no {kind.removeprefix('certify_')} test (mark one with "
               f"@pytest.mark.{kind}({op!r}))"
               for op in sorted(cat.ops) for kind in ("certify_guard", "certify_property")
               if not marks.get(op, {}).get(kind)]
    assert not missing, "\n".join(missing)
