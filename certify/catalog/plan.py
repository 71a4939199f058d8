"""Which certifications a catalog asks for: every (op, variant, cell, arch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from certify.catalog.rules import evaluate
from certify.catalog.schema import Cell, OpFile, Variant


@dataclass(frozen=True)
class Target:
    op: OpFile
    variant: Variant
    cell: Cell
    arch: str

    @property
    def name(self) -> str:
        return f"{self.op.op}::{self.variant.name}::{self.cell.id}::{self.arch}"

    @property
    def item_name(self) -> str:
        """The pytest item's name inside its cell file (its id: ``<cell file>::<item_name>``)."""
        return f"{self.variant.name}[{self.cell.id}-{self.arch}]"


def variants_of_cell(op: OpFile, cell: Cell) -> list[Variant]:
    """The variants a cell certifies: those it names, else every variant whose rule accepts it."""
    if cell.variants is not None:
        return [op.variant(n) for n in cell.variants]
    return [v for v in op.variants if evaluate(v.dispatch, op.axes_of(cell))]


def targets(op: OpFile) -> Iterator[Target]:
    for cell in op.cells:
        for variant in variants_of_cell(op, cell):
            for arch in variant.archs:
                if cell.archs is None or arch in cell.archs:
                    yield Target(op, variant, cell, arch)
