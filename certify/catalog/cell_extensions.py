"""Cell-file fields beside ``certify.catalog.schema``: a cell's own input builder (an edge case the
op's builder never draws) and the set oracle of a selection.

Both fields live on subclasses in this module, so that the schema module every receipt's hash reads
stays as it is. They are marked ``hashed: False`` for the generic entry hash and are hashed on their
own by ``certify.receipts.codehash`` where a cell sets them (the builder's module closure, the set
oracle's fields and modules), so a cell without them keeps the hash it had.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from certify.catalog.schema import NOT_HASHED, Cell, OpFile, Strict

_CALLABLE = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
_IDENT = r"^[a-z][a-z0-9_]*$"


class SetOracle(Strict):
    """A selection judged as a set: the ids output holds valid, distinct ids per row, and the set is a
    top-k of ``scores`` recomputed in float64 within ``bound`` at the k-th boundary: a selected score
    i and a score j left out pass while s_j - s_i <= b_i + b_j (and, with ``ordered``, consecutive
    slots likewise). The cell's own oracle then judges every other output against ``given``: the
    spec's float64 result computed from the variant's selection."""

    ids: str = Field(pattern=_IDENT, description="the output holding the selected ids [rows, k]")
    scores: str = Field(pattern=_CALLABLE, description=(
        "module:function(**inputs) -> float64 scores [rows, n] the selection ranks, run on the "
        "inputs widened to float64"))
    given: str | None = Field(None, pattern=_CALLABLE, description=(
        "module:function(**inputs, <ids>=ids) -> {output: float64 tensor}: the other outputs from "
        "the variant's selection; required when the case has outputs besides the ids"))
    bound: str = Field(pattern=_CALLABLE, description=(
        "module:function(**inputs) -> float64 [rows, n]: per score, a derived bound on how far the "
        "score the variant ranks (in its own dtype) may lie from the float64 score"))
    ordered: bool = Field(False, description="ids are listed best first (within the bound)")
    derivation: str = Field(min_length=20, description="why the bound holds: the rounding it sums",
                            json_schema_extra=NOT_HASHED)


class ExtendedCell(Cell):
    """A cell with the fields of this module."""

    inputs: str | None = Field(None, pattern=_CALLABLE, description=(
        "module:function building this cell's Case instead of the op's builder: an edge case (zero "
        "rows, saturating values, planted near ties) that the op's seeded random inputs never draw; "
        "seeded from (op, cell) like any builder"), json_schema_extra=NOT_HASHED)
    selection: SetOracle | None = Field(None, description=(
        "the set oracle of a selection (see SetOracle); the cell's oracle judges the other outputs"),
        json_schema_extra=NOT_HASHED)

    @model_validator(mode="after")
    def _selection_oracle(self) -> "ExtendedCell":
        if self.selection is not None and self.oracle.kind != "tolerance":
            raise ValueError("a cell with a selection judges its other outputs with a tolerance "
                             "oracle (a band per output the selection's weights give)")
        return self


class ExtendedOpFile(OpFile):
    """One op's cell file with the cell fields of this module."""

    cells: tuple[ExtendedCell, ...] = Field(min_length=1)


def cell_inputs(op: OpFile, cell: Cell) -> str:
    """The module:function that builds a cell's inputs: its own, else the op's."""
    return getattr(cell, "inputs", None) or op.inputs


def selection_of(cell: Cell) -> SetOracle | None:
    return getattr(cell, "selection", None)


def extension_problem(op: OpFile) -> tuple[tuple, str] | None:
    """Checks of these fields across the file, each placed on its entry."""
    for i, cell in enumerate(op.cells):
        sel = selection_of(cell)
        if sel is not None and sel.ids in cell.oracle.outputs:
            return (("cells", i, "oracle", "outputs"),
                    f"{sel.ids!r} is judged by the selection; the oracle's bands name the other outputs")
        if sel is not None and cell.oracle.outputs and sel.given is None:
            return (("cells", i, "selection", "given"),
                    "the other outputs need the spec's result from the variant's selection (given)")
    return None


def extension_callables(op: OpFile) -> list[tuple[tuple, str]]:
    """(location, module:function) of every callable these fields name, for ``certify check``."""
    out: list[tuple[tuple, str]] = []
    for i, cell in enumerate(op.cells):
        if getattr(cell, "inputs", None):
            out.append((("cells", i, "inputs"), cell.inputs))
        sel = selection_of(cell)
        if sel is not None:
            out += [(("cells", i, "selection", f), getattr(sel, f))
                    for f in ("scores", "bound", "given") if getattr(sel, f)]
    return out
