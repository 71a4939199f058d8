"""The pydantic schema of a cell file, ``<cells dir>/<op>.yaml``: one op, its variants, its cells.

The JSON Schema for editors is exported from these models by ``certify schema``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from certify.catalog.rules import RuleError, parse_rule

Arch = Literal["cpu", "cpu-interpret", "sm_90", "sm_100", "sm_103"]
Tier = Literal["premerge", "postmerge", "ondemand"]
TIERS: tuple[str, ...] = ("premerge", "postmerge", "ondemand")
_IDENT = r"^[a-z][a-z0-9_]*$"
_CALLABLE = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
# The numerics tier every op has: its spec function and each cell's oracle.
EXACT = "exact"


# A field that says why, not what: left out of the content hash (``certify.receipts.codehash``), so
# rewording it leaves every receipt fresh.
NOT_HASHED = {"hashed": False}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Axis(Strict):
    """One axis of an op's reach domain: an integer range or a set of choices."""

    kind: Literal["int", "choice"]
    reach: tuple[int, int] | None = Field(None, description="inclusive [lo, hi] for an int axis")
    values: tuple[str | int | bool, ...] | None = Field(None, description="the choices of a choice axis")
    doc: str = Field("", json_schema_extra=NOT_HASHED)

    @model_validator(mode="after")
    def _domain(self) -> "Axis":
        if self.kind == "int" and (self.reach is None or self.reach[0] > self.reach[1]):
            raise ValueError("an int axis needs reach: [lo, hi] with lo <= hi")
        if self.kind == "choice" and not self.values:
            raise ValueError("a choice axis needs a non-empty values list")
        return self

    def contains(self, value: object) -> bool:
        if self.kind == "int":
            return isinstance(value, int) and not isinstance(value, bool) and \
                self.reach[0] <= value <= self.reach[1]
        return value in self.values


class Variant(Strict):
    """One compiled path of the op. ``dispatch`` is the rule the target uses to choose it (first
    match wins, in file order, among the variants that run on the current arch)."""

    name: str = Field(pattern=_IDENT)
    impl: str = Field(pattern=_CALLABLE + "|^spec$", description=(
        "module:function of the implementation, or 'spec': the spec function itself run in the "
        "cell's dtypes (its low-precision path, with the spec's rounding points), certified against "
        "its own float64 path"))
    archs: tuple[Arch, ...] = Field(min_length=1)
    dispatch: str = "true"
    numerics: str = Field(EXACT, pattern=_IDENT, description=(
        "the numerics tier this variant claims: 'exact' (the op's spec, the cells' oracles) or a "
        "tier of the op's numerics (its spec path, its bands); a variant is certified and "
        "dispatched within its tier only"))
    batch_invariant: bool | tuple[Arch, ...] = Field(True, description=(
        "whether a row's result depends neither on the other rows of a launch, nor on the batch "
        "size, nor on row order, bit for bit (the harness's metamorphic checks test it): true on "
        "every arch the variant runs on, false on none, or the archs it holds on"))
    specialisations: int = Field(1, ge=1, description=(
        "compiled specialisations of this variant (e.g. tile configurations chosen per shape): the "
        "at-most-three-cells rule allows as many cells as specialisations when they are more than three"))
    doc: str = Field("", json_schema_extra=NOT_HASHED)

    def invariant_on(self, arch: str) -> bool:
        """Whether the variant claims batch invariance on ``arch``."""
        claim = self.batch_invariant
        return claim if isinstance(claim, bool) else arch in claim

    @model_validator(mode="after")
    def _invariant_on_its_archs(self) -> Variant:
        claim = self.batch_invariant
        if not isinstance(claim, bool):
            outside = [a for a in claim if a not in self.archs]
            if outside:
                raise ValueError(f"batch_invariant names {', '.join(outside)}, where the variant "
                                 f"does not run (archs: {', '.join(self.archs)})")
        return self

    @field_validator("dispatch")
    @classmethod
    def _rule_parses(cls, v: str) -> str:
        try:
            parse_rule(v)
        except RuleError as e:
            raise ValueError(str(e)) from None
        return v


class OutputBand(Strict):
    """A tolerance band for one output, in units of the output dtype's ulp, with its derivation."""

    max_ulp: float = Field(gt=0, description="max |out - ref| / ulp(row max |ref|), per element")
    max_rel_rms: float = Field(gt=0, description="max rms(out - ref) / rms(ref), in units of dtype eps")
    derivation: str = Field(min_length=20, description="why this band: the rounding points it sums",
                            json_schema_extra=NOT_HASHED)
    measured_ulp: float | None = Field(None, description="worst case measured when the band was set",
                                       json_schema_extra=NOT_HASHED)
    allow_matching_inf: bool = Field(False, description="an inf equal to the reference's passes")


class Oracle(Strict):
    kind: Literal["bitwise", "tolerance"]
    against: str = Field("spec", description=(
        "bitwise only: 'spec' (the spec run in the same dtypes), 'spec64' (the spec's float64 path, "
        "each floating output rounded once to the variant's output dtype: 'float64 plus rounding'), "
        "or 'variant:<name>'"))
    outputs: dict[str, OutputBand] = Field(default_factory=dict)
    signed_zero_equal: bool = Field(False, description="-0.0 == +0.0 (only where the spec says so)")

    @model_validator(mode="after")
    def _consistent(self) -> "Oracle":
        if self.kind == "tolerance" and not self.outputs:
            raise ValueError("a tolerance oracle needs a band per output (outputs: {name: band})")
        if self.kind == "tolerance" and self.against != "spec":
            raise ValueError("a tolerance oracle compares against the float64 spec only")
        if self.against not in ("spec", "spec64") and not re.match(r"^variant:[a-z][a-z0-9_]*$",
                                                                     self.against):
            raise ValueError("against must be 'spec', 'spec64' or 'variant:<name>'")
        return self


class NumericsTier(Strict):
    """A numerics contract of an op beside its exact one (e.g. a product's operands rounded to bf16,
    as peer kernels ship it): the spec path that rounds where the contract rounds, and the bands every
    variant claiming the tier is held to against that path's float64 result, in every cell it
    serves. A variant of one tier is never judged by another tier's bands; its receipts also record
    its error against the exact spec (metrics ``exact.<output>.ulp`` / ``.rel_rms``)."""

    spec: str = Field(pattern=_CALLABLE, description=(
        "module:function of the tier's spec path (the op's spec signature and outputs)"))
    outputs: dict[str, OutputBand] = Field(min_length=1, description="a band per output")
    doc: str = Field(min_length=10, description="what the tier rounds, and where",
                     json_schema_extra=NOT_HASHED)

    def oracle(self) -> "Oracle":
        return Oracle(kind="tolerance", outputs=self.outputs)


class ExpectedFailure(Strict):
    """A (variant, arch) of a cell that is declared to fail, with the reason (pytest's strict xfail):
    its failing receipt reads ``expected failure``, and a passing one ``unexpected pass``, which
    ``certify run`` and the report flag until the declaration goes."""

    variant: str
    arch: Arch
    why: str = Field(min_length=10, description="why it fails, with the measured figures")


class Cell(Strict):
    id: str = Field(pattern=_IDENT)
    axes: dict[str, str | int | bool]
    why: str = Field(min_length=10, description="what this cell covers that the others do not",
                     json_schema_extra=NOT_HASHED)
    tier: Tier
    oracle: Oracle
    variants: tuple[str, ...] | None = Field(
        None, description="variants certified here; default: every variant whose rule accepts it")
    archs: tuple[Arch, ...] | None = Field(
        None, description="archs this cell runs on (default: every arch of its variants); for a "
                          "cell too large for the CPU, say so in its why")
    adds: str | None = Field(None, min_length=10, description=(
        "only for a cell beyond the at-most-three-cells rule of its variants (more when a variant has "
        "more compiled specialisations): what this extra cell adds that their other cells do not"),
        json_schema_extra=NOT_HASHED)
    expected_failures: tuple[ExpectedFailure, ...] = Field((), description=(
        "(variant, arch)s of this cell declared to fail, each with its reason; a declaration is not "
        "evidence and does not enter the receipt's hash"), json_schema_extra=NOT_HASHED)

    def expected_failure(self, variant: str, arch: str) -> ExpectedFailure | None:
        return next((e for e in self.expected_failures if e.variant == variant and e.arch == arch),
                    None)


class NotCertified(Strict):
    what: str = Field(min_length=5)
    why: str = Field(min_length=5)
    variants: tuple[str, ...] = Field((), description=(
        "variants this note declares not certified where the forward reaches them: the reach claims "
        "accept a reached variant with no cell when a note names it (and the report lists it)"))


class OpFile(Strict):
    """One op: ``op`` must equal the file's stem."""

    op: str = Field(pattern=_IDENT)
    summary: str = Field(min_length=10)
    spec: str = Field(pattern=_CALLABLE, description="module:function of the spec")
    inputs: str = Field(pattern=_CALLABLE, description="module:function building a Case from a cell")
    axes: dict[str, Axis] = Field(min_length=1)
    variants: tuple[Variant, ...] = Field(min_length=1)
    cells: tuple[Cell, ...] = Field(min_length=1)
    not_certified: tuple[NotCertified, ...] = ()
    numerics: dict[str, NumericsTier] = Field(default_factory=dict, description=(
        "numerics tiers beside 'exact', by name: each with its spec path and bands; variants "
        "claim one by their numerics field"))
    within: tuple[str, ...] = Field((), description=(
        "ops whose calls run this op inside them: it is certified on its own but never dispatched as a "
        "separate call, so the reach tracer sees it through them"))
    note: str = ""

    def axes_of(self, cell: Cell) -> dict[str, str | int | bool]:
        """A cell's full axis values: an axis with a single choice may be left out of the cell."""
        full = {n: a.values[0] for n, a in self.axes.items()
                if a.kind == "choice" and len(a.values) == 1}
        full.update(cell.axes)
        return full

    @field_validator("numerics")
    @classmethod
    def _tier_names(cls, v: dict[str, NumericsTier]) -> dict[str, NumericsTier]:
        for name in v:
            if name == EXACT or not re.match(_IDENT, name):
                raise ValueError(f"tier name {name!r}: a lower-case identifier other than {EXACT!r} "
                                 "(the exact tier is the op's own spec and cells)")
        return v

    def tiers(self) -> tuple[str, ...]:
        """The op's numerics tiers, 'exact' first."""
        return (EXACT, *self.numerics)

    def spec_of(self, variant: Variant) -> str:
        """The module:function of the spec a variant is certified against: its tier's."""
        return self.spec if variant.numerics == EXACT else self.numerics[variant.numerics].spec

    def oracle_of(self, variant: Variant, cell: Cell) -> Oracle:
        """The oracle a variant is judged by at a cell: the cell's, or its tier's bands."""
        return cell.oracle if variant.numerics == EXACT else self.numerics[variant.numerics].oracle()

    def impl_path(self, variant: Variant) -> str:
        """The module:function a variant runs ('spec' resolves to its tier's spec function)."""
        return self.spec_of(variant) if variant.impl == "spec" else variant.impl

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)

    def cell(self, cell_id: str) -> Cell:
        for c in self.cells:
            if c.id == cell_id:
                return c
        raise KeyError(cell_id)
