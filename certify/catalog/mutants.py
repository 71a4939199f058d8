"""A cell file's plausible bugs (``mutants:``), and the cell-file model that carries them.

Each mutant is one exact edit of a module its op runs (the module of a variant, or of the spec): the
text it finds, which must occur exactly once, and the text it puts in its place, with a one-line
description of the bug it plants. ``certify mutants`` runs each against the op's own cells, guard and
property tests (``certify.mutants``).

The mutants are prose to the receipts: the field is marked ``hashed: False``, and a receipt's content
hash reads only the variant, cell and numerics entries anyway (``certify.receipts.codehash``), so
adding, editing or removing a mutant leaves every receipt fresh. The field lives on a subclass of
``OpFile`` in this module, so that the schema module a receipt's hash reads stays as it is.
"""

from __future__ import annotations

from pydantic import Field

from certify.catalog.cell_extensions import ExtendedOpFile
from certify.catalog.schema import NOT_HASHED, OpFile, Strict

_IDENT = r"^[a-z][a-z0-9_]*$"
_MODULE = r"^[A-Za-z_][\w.]*$"
SPEC = "spec"   # the label of a mutant that edits the spec (it names no variant)


class Mutant(Strict):
    """One plausible bug of an op, as an exact edit of one module."""

    id: str = Field(pattern=_IDENT)
    bug: str = Field(min_length=10, description="the bug the edit plants, in one line")
    variant: str | None = Field(None, description=(
        "the variant whose code the edit changes; left out: the op's spec (its score is the spec's)"))
    module: str | None = Field(None, pattern=_MODULE, description=(
        "the module edited; default: the variant's impl module (an 'impl: spec' variant's: its spec's "
        "module), or the op's spec module where no variant is named"))
    find: str = Field(min_length=1, description="the exact text replaced; it occurs once in the module")
    replace: str = Field(description="the text put in its place")
    equivalent: str | None = Field(None, min_length=10, description=(
        "why the edit changes no result the op can produce: the mutant is not counted in the score "
        "and is run only with --equivalent, where it must survive"))

    @property
    def label(self) -> str:
        """The variant the mutant counts for, or ``spec``."""
        return self.variant or SPEC


class CellFile(ExtendedOpFile):
    """One op's cell file as loaded: the op (``OpFile`` with the cell fields of
    ``certify.catalog.cell_extensions``) and its plausible bugs."""

    mutants: tuple[Mutant, ...] = Field((), description=(
        "plausible bugs as exact edits of a variant or spec module, for `certify mutants`; prose to "
        "the receipts (not hashed)"), json_schema_extra=NOT_HASHED)

    def model_copy(self, *, update=None, deep: bool = False) -> "CellFile":
        """A copy that keeps the harness contract loaded with this file (``certify.harness.contract``
        keys contracts by object): a cell with its own builder is certified through a copy of its op
        (``certify.harness.extended.op_for_cell``), whose checks must split the op's rows and whose
        receipts must carry the op's harness hash."""
        from certify.harness.contract import contract_of, register  # noqa: PLC0415

        copy = super().model_copy(update=update, deep=deep)
        register(copy, contract_of(self))
        return copy

    def mutant_module(self, m: Mutant) -> str:
        """The module a mutant edits."""
        if m.module:
            return m.module
        if m.variant is None:
            return self.spec.partition(":")[0]
        return self.impl_path(self.variant(m.variant)).partition(":")[0]


def mutants_of(op: OpFile) -> tuple[Mutant, ...]:
    """An op's mutants (none for an ``OpFile`` built without them)."""
    return getattr(op, "mutants", ())
