"""The content hash covers code and numbers, never prose: a reworded docstring, comment, ``why`` or
``derivation`` leaves every committed receipt fresh, and a code edit stales exactly the receipts whose
closure holds the edited module."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

from certify.receipts import codehash
from certify.catalog.load import load_catalog
from certify.receipts.codehash import ORACLE_MODULES, code_form, content_hash, module_closure
from certify.files.paths import project_paths
from certify.receipts.store import freshness, load_receipts

PATHS = project_paths()


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(PATHS.cells)


@pytest.fixture(scope="module")
def receipts(catalog):
    """(arch, op, variant, cell) -> receipt, for every committed receipt of a current target."""
    out = {}
    for arch, book in load_receipts(PATHS.receipts).items():
        for (op, variant, cell), r in book.items():
            if op in catalog.ops and any(c.id == cell for c in catalog.ops[op].cells):
                out[(arch, op, variant, cell)] = r
    return out


def _closure(op, variant_name: str) -> set[str]:
    variant = op.variant(variant_name)
    mods = {op.spec, op.impl_path(variant), op.inputs}
    out = {m for path in mods for m, _ in module_closure(path.partition(":")[0])}
    return out | {m for o in ORACLE_MODULES for m, _ in module_closure(o)}


def _hashed_modules(catalog) -> set[str]:
    return {m for op in catalog.ops.values() for v in op.variants for m in _closure(op, v.name)}


def reworded(source: str) -> str:
    """``source`` with every docstring, bare string statement and comment rewritten, and blank lines
    added: what a prose-only edit does."""
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    def at(row: int, col: int, unit: str = "char") -> int:  # ast counts UTF-8 bytes, tokenize chars
        if unit == "byte":
            col = len(lines[row - 1].encode()[:col].decode())
        return offsets[row - 1] + col

    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            edits.append((at(node.lineno, node.col_offset, "byte"),
                          at(node.end_lineno, node.end_col_offset, "byte"),
                          '"""Reworded: what it does,\n\n    and why, in other words."""'))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            edits.append((at(*tok.start), at(*tok.end), "# reworded comment"))
    for start, end, text in sorted(edits, reverse=True):
        source = source[:start] + text + source[end:]
    return "# a new first comment\n\n" + source.replace("\n\n\n", "\n\n\n\n")


def test_rewording_prose_keeps_every_hashed_module_s_code_form(catalog):
    mods = _hashed_modules(catalog)
    assert len(mods) > 20 and {"certify.harness.oracles", "certify.harness.target"} <= mods
    for name in sorted(mods):
        source = codehash.project_module_file(name).read_text()
        edited = reworded(source)
        assert edited != source or ('"""' not in source and "#" not in source), name
        assert code_form(edited) == code_form(source), name


@pytest.mark.parametrize("edit", [
    lambda s: s + "\n_EDITED = 1\n",                      # a new statement
    lambda s: s.replace("return ", "return -", 1),        # a changed expression
    lambda s: s.replace("def ", "def edited_", 1),        # a renamed function
])
def test_any_code_edit_changes_the_code_form(edit):
    source = (Path(codehash.__file__).parents[1] / "harness" / "oracles.py").read_text()
    assert code_form(edit(source)) != code_form(source)


def test_rewording_cell_and_variant_prose_keeps_every_hash(catalog):
    for op in catalog.ops.values():
        for cell in op.cells:
            bands = {k: b.model_copy(update={"derivation": "reworded: " + b.derivation,
                                             "measured_ulp": 123.0})
                     for k, b in cell.oracle.outputs.items()}
            new_cell = cell.model_copy(update={
                "why": "reworded: " + cell.why, "adds": cell.adds and "reworded: " + cell.adds,
                "oracle": cell.oracle.model_copy(update={"outputs": bands})})
            variants = tuple(v.model_copy(update={"doc": "reworded"}) for v in op.variants)
            new_op = op.model_copy(update={"variants": variants, "note": "reworded",
                                           "summary": "reworded summary"})
            for v in op.variants:
                assert content_hash(new_op, v.name, new_cell) == content_hash(op, v.name, cell)


def test_a_band_or_axis_edit_changes_the_hash(catalog):
    op = catalog.ops["gated_rmsnorm"]
    cell = next(c for c in op.cells if c.oracle.kind == "tolerance")
    name, band = next(iter(cell.oracle.outputs.items()))
    wider = cell.model_copy(update={"oracle": cell.oracle.model_copy(update={
        "outputs": {**cell.oracle.outputs, name: band.model_copy(update={"max_ulp": band.max_ulp * 2})}})})
    variant = op.variants[0].name
    assert content_hash(op, variant, wider) != content_hash(op, variant, cell)
    moved = cell.model_copy(update={"axes": {**cell.axes, "_planted": 1}})
    assert content_hash(op, variant, moved) != content_hash(op, variant, cell)


@pytest.fixture
def edited_module(monkeypatch, tmp_path):
    """Swap one module's source for an edited copy, as an edit of the working tree would."""
    real = codehash.project_module_file

    def swap(name: str, edit):
        target = real(name)
        copy = tmp_path / target.name
        copy.write_text(edit(target.read_text()))
        monkeypatch.setattr(codehash, "project_module_file",
                            lambda m: copy if m == name else real(m))
        module_closure.cache_clear()

    yield swap
    monkeypatch.undo()
    module_closure.cache_clear()


@pytest.mark.parametrize("module", ["spec.numerics", "certify.harness.oracles"])
def test_a_prose_edit_leaves_every_committed_receipt_fresh(catalog, receipts, edited_module, module):
    before = {k: freshness(r, catalog.ops[k[1]], k[2], catalog.ops[k[1]].cell(k[3]))
              for k, r in receipts.items()}
    assert sum(v == "certified" for v in before.values()) > 100
    edited_module(module, reworded)
    after = {k: freshness(r, catalog.ops[k[1]], k[2], catalog.ops[k[1]].cell(k[3]))
             for k, r in receipts.items()}
    assert after == before


@pytest.mark.parametrize("module", ["spec.ops.gdn", "spec.ops.norms", "impl.kernels.norms.triton_rmsnorm"])
def test_a_code_edit_stales_exactly_the_receipts_whose_closure_holds_it(catalog, receipts,
                                                                        edited_module, module):
    fresh = {k for k, r in receipts.items()
             if freshness(r, catalog.ops[k[1]], k[2], catalog.ops[k[1]].cell(k[3])) != "stale"}
    holds = {k for k in fresh if module in _closure(catalog.ops[k[1]], k[2])}
    assert holds and holds != fresh
    edited_module(module, lambda s: s + "\n_EDITED = 1\n")
    stale = {k for k in fresh
             if freshness(receipts[k], catalog.ops[k[1]], k[2], catalog.ops[k[1]].cell(k[3])) == "stale"}
    assert stale == holds
