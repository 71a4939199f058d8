"""A cell that names its own input builder is certified through a copy of its op
(``certify.harness.extended.op_for_cell``); the copy keeps the op's harness contract
(``certify.catalog.mutants.CellFile.model_copy``), so the checks
split the same rows and the receipt's harness hash is the one ``certify run --outdated`` compares."""

from __future__ import annotations

from certify.catalog.cell_extensions import cell_inputs
from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.harness.contract import contract_of, harness_hash
from certify.harness.extended import op_for_cell


def test_cells_with_their_own_builder_keep_the_ops_contract_and_harness_hash():
    catalog = load_catalog(project_paths().cells)
    own = [(op, cell) for op in catalog.ops.values() for cell in op.cells
           if cell_inputs(op, cell) != op.inputs]
    assert own, "the catalog has cells with their own builder"
    for op, cell in own:
        copy = op_for_cell(op, cell)
        assert copy.inputs == cell_inputs(op, cell)
        assert contract_of(copy) == contract_of(op), f"{op.op}::{cell.id}"
        assert harness_hash(copy) == harness_hash(op), f"{op.op}::{cell.id}"
