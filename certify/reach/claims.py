"""The catalog's promises checked against the reach file (and against themselves).

Each check returns ``Finding``s with a severity: ``fail`` (a pre-merge claims test fails), ``warn`` (the
report lists it and the claims test warns), ``info`` (the report lists it). What fails and why:

- **uncovered** (fail): a reached (op, variant) on an arch with no cell that certifies it there and no
  ``not_certified`` note naming the variant: dispatch would run code no test ever compared with the
  spec. A note that names it turns this into **declared** (info): a known, stated gap, shown first in
  the report. The message names the op, the variant, the arch and the scenarios that reach it.
- **outside_domain** (warn): a traced axis value outside the axis domain the op file declares: the
  declared reach is what the engine's configuration rules and the certification read, so it is wrong,
  or the engine takes a shape its rules meant to refuse. A warning shown first in the report rather
  than a failure: the fix is the op file's or the engine's, and a cell cannot make it.
- **unknown_within** (fail): an op's ``within`` names an op the catalog does not have.
- **cells_over_limit** (fail, ``catalog_findings``): a variant with more cells than the at-most-three
  rule allows (as many as its compiled specialisations when those are more) unless the extra cells say
  what they add (``adds``).
- **why_repeats** (fail): two cells of one op give the same why.
- **runs_nowhere** (fail): a cell no (variant, arch) certifies: no test would ever drive it.
- **no_variant** (warn): an op the forward calls in a mode that no variant runs on that arch (the forward
  would stop there), in a mode the target's configuration rules accept. A warning, not a failure: it
  says an arch is not a deployment target yet, which is the engine's routing to refuse, not a cell's.
- **axis_gap** (warn): a reached axis value the variant's cells do not come near: a choice value no
  cell has, an int range reaching past twice (or below half) the cells' range. A warning: cells are
  representative points, and whether a cell at 32 speaks for 128 is a numerics argument the op's notes
  make, not a mechanical one.
- **outside_reach** (warn, "cost without coverage"): a cell of a variant no scenario dispatches, or
  whose axis values lie outside (not *near*, see ``NEAR``) the variant's traced reach. A warning: the
  scenarios sample deployment and do not enumerate it (short prompts, small batches between the traced
  ones are reached in practice), so such a cell may still certify a real shape; it is a cost question
  for a reviewer.
- **not_reached** (warn) / **within** (info): an op no scenario calls; with ``within`` naming a reached
  op it is reported as running inside that op instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from certify.catalog.load import Catalog
from certify.catalog.plan import targets, variants_of_cell
from certify.reach.tracing import AxisReach, Mode, ReachFile
from certify.catalog.schema import Cell, OpFile

Severity = Literal["fail", "warn", "info"]

#: A cell's int axis value is *near* the traced reach [lo, hi] when lo / NEAR <= value <= hi * NEAR:
#: one power-of-two step, the spacing cells are usually chosen at (a traced range ending at 8161 rows
#: is represented by a cell at 16384, not by one at 131072).
NEAR = 2
CELL_LIMIT = 3


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: Severity
    op: str
    variant: str | None
    message: str
    arch: str | None = None
    scenarios: tuple[str, ...] = ()
    cell: str | None = None
    axis: str | None = None       # axis_gap / outside_domain: the axis, what is reached, what cells have
    reached: str | None = None
    certified: str | None = None


def _names(scenarios: list[str], limit: int = 4) -> str:
    shown = ", ".join(scenarios[:limit])
    return shown + (f" and {len(scenarios) - limit} more" if len(scenarios) > limit else "")


def _cells_for(op: OpFile, variant: str, arch: str | None = None) -> list[Cell]:
    """The cells that certify ``variant`` (on ``arch``, when given)."""
    return [c for c in op.cells
            if any(v.name == variant for v in variants_of_cell(op, c))
            and (arch is None or c.archs is None or arch in c.archs)]


def _near(value: object, reach: AxisReach) -> bool:
    if reach.values is not None:
        return value in reach.values
    return isinstance(value, int) and reach.min / NEAR <= value <= reach.max * NEAR


def _scenarios_with(reach: ReachFile, op: str, variant: str, axis: str, pred) -> list[str]:
    return sorted({name for name, sc in reach.scenarios.items() for rec in sc.modes.values()
                   for c in rec.calls
                   if c.op == op and c.variant == variant and axis in c.axes and pred(c.axes[axis])})


# ------------------------------------------------------------------------------ against the reach


def _coverage(catalog: Catalog, reach: ReachFile) -> list[Finding]:
    out = []
    for op_name, variants in reach.reach.items():
        op = catalog.ops.get(op_name)
        if op is None:
            out.append(Finding("uncovered", "fail", op_name, None,
                               f"{op_name} is reached but has no cell file"))
            continue
        for variant, vr in variants.items():
            for arch in vr.archs():
                if _cells_for(op, variant, arch):
                    continue
                scen = vr.scenarios_on(arch)
                notes = [n for n in op.not_certified if variant in n.variants]
                if notes:
                    out.append(Finding("declared", "info", op_name, variant,
                                       f"{op_name}::{variant} is reached on {arch} ({_names(scen)}); "
                                       f"declared not certified: {notes[0].what}", arch, tuple(scen)))
                else:
                    out.append(Finding(
                        "uncovered", "fail", op_name, variant,
                        f"{op_name}::{variant} is reached on {arch} by scenario(s) {_names(scen)} but "
                        f"no cell certifies it on {arch} and no not_certified note names it (add a "
                        f"cell, or a not_certified entry with `variants: [{variant}]`)",
                        arch, tuple(scen)))
    return out


def _domains(catalog: Catalog, reach: ReachFile) -> list[Finding]:
    out = []
    for op_name, variants in reach.reach.items():
        op = catalog.ops.get(op_name)
        if op is None:
            continue
        bad: dict[str, tuple[list, set[str]]] = {}
        for variant in variants:
            for name, sc in reach.scenarios.items():
                for rec in sc.modes.values():
                    for c in rec.calls:
                        if c.op != op_name or c.variant != variant:
                            continue
                        for axis, value in c.axes.items():
                            if axis in op.axes and not op.axes[axis].contains(value):
                                vals, scen = bad.setdefault(axis, ([], set()))
                                if value not in vals:
                                    vals.append(value)
                                scen.add(name)
        for axis, (vals, scen) in sorted(bad.items()):
            a = op.axes[axis]
            dom = list(a.reach) if a.kind == "int" else list(a.values)
            s = sorted(scen)
            shown = ", ".join(map(str, sorted(vals, key=str)))
            out.append(Finding("outside_domain", "warn", op_name, None,
                               f"{op_name}: the forward reaches {axis} = {shown} ({_names(s)}), outside "
                               f"the axis domain {dom} its op file declares", scenarios=tuple(s),
                               axis=axis, reached=shown, certified=str(dom)))
    return out


def _no_variant(reach: ReachFile) -> list[Finding]:
    by: dict[tuple[str, str], tuple[str, set[str]]] = {}
    for name, sc in reach.scenarios.items():
        for key, rec in sc.modes.items():
            for op, why in rec.no_variant.items():
                by.setdefault((Mode.parse(key).arch, op), (why, set()))[1].add(name)
    return [Finding("no_variant", "warn", op, None,
                    f"{op}: the forward calls it on {arch} ({_names(sorted(s))}), where {why.split(': ', 1)[-1]}",
                    arch, tuple(sorted(s))) for (arch, op), (why, s) in sorted(by.items())]


def _axis_gaps(catalog: Catalog, reach: ReachFile) -> list[Finding]:
    out = []
    for op_name, variants in reach.reach.items():
        op = catalog.ops.get(op_name)
        if op is None:
            continue
        for variant, vr in variants.items():
            cells = _cells_for(op, variant)
            if not cells:
                continue  # the variant itself is uncovered or declared
            for axis, r in vr.axes.items():
                if axis not in op.axes:
                    continue
                have = [op.axes_of(c)[axis] for c in cells if axis in op.axes_of(c)]
                if r.values is not None:
                    missing = [v for v in r.values if v not in have]
                    if not missing:
                        continue
                    scen = _scenarios_with(reach, op_name, variant, axis, lambda v: v in missing)
                    got, cert = (", ".join(map(str, missing)),
                                 ", ".join(map(str, sorted(set(have), key=str))))
                    text = f"{axis} = {got} reached ({_names(scen)}); cells have {cert}"
                else:
                    ints = [v for v in have if isinstance(v, int)]
                    lo, hi = min(ints), max(ints)
                    above, below = r.max > hi * NEAR, r.min < lo / NEAR
                    if not (above or below):
                        continue
                    scen = _scenarios_with(reach, op_name, variant, axis,
                                           lambda v: v > hi * NEAR or v < lo / NEAR)
                    got, cert = r.text(), (f"{lo}..{hi}" if lo != hi else str(lo))
                    text = f"{axis} reached {got} ({_names(scen)}); cells at {cert}"
                out.append(Finding("axis_gap", "warn", op_name, variant, f"{op_name}::{variant}: {text}",
                                   scenarios=tuple(scen), axis=axis, reached=got, certified=cert))
    return out


def _reached_ops(catalog: Catalog, reach: ReachFile) -> tuple[set[str], dict[str, list[str]]]:
    """(ops called directly, op -> the reached ops it runs inside)."""
    direct = set(reach.reach)
    inside = {name: [w for w in op.within if w in direct]
              for name, op in catalog.ops.items() if name not in direct}
    return direct, inside


def _outside_reach(catalog: Catalog, reach: ReachFile) -> list[Finding]:
    out = []
    direct, inside = _reached_ops(catalog, reach)
    for name, op in sorted(catalog.ops.items()):
        for w in op.within:
            if w not in catalog.ops:
                out.append(Finding("unknown_within", "fail", name, None,
                                   f"{name}: within names {w!r}, which the catalog does not have"))
        if name not in direct:
            if inside[name]:
                out.append(Finding("within", "info", name, None,
                                   f"{name} is not reached as a separate call; it runs inside "
                                   f"{', '.join(inside[name])}"))
            else:
                why = (f" (within: {', '.join(op.within)}, none of them reached)" if op.within else "")
                out.append(Finding("not_reached", "warn", name, None,
                                   f"{name}: no scenario calls it{why}; its cells "
                                   f"({', '.join(c.id for c in op.cells)}) are cost without coverage"))
            continue
        for v in op.variants:
            vr = reach.variant(name, v.name)
            cells = _cells_for(op, v.name)
            if vr is None:
                if cells:
                    out.append(Finding("outside_reach", "warn", name, v.name,
                                       f"{name}::{v.name} is never dispatched by any scenario in any "
                                       f"mode: its cells ({', '.join(c.id for c in cells)}) are cost "
                                       f"without coverage"))
                continue
            for c in cells:
                far = [f"{axis}={val}" for axis, val in op.axes_of(c).items()
                       if axis in vr.axes and not _near(val, vr.axes[axis])]
                if far:
                    out.append(Finding("outside_reach", "warn", name, v.name,
                                       f"{name}::{v.name} cell {c.id}: {', '.join(far)} lies outside "
                                       f"the traced reach ("
                                       + "; ".join(f"{a.split('=')[0]} {vr.axes[a.split('=')[0]].text()}"
                                                   for a in far) + ")", cell=c.id))
    return out


def reach_findings(catalog: Catalog, reach: ReachFile) -> list[Finding]:
    return [*_coverage(catalog, reach), *_domains(catalog, reach), *_no_variant(reach),
            *_axis_gaps(catalog, reach), *_outside_reach(catalog, reach)]


# ------------------------------------------------------------------------------ the catalog itself


def catalog_findings(catalog: Catalog) -> list[Finding]:
    out = []
    for name, op in sorted(catalog.ops.items()):
        seen: dict[str, str] = {}
        for c in op.cells:
            if c.why in seen:
                out.append(Finding("why_repeats", "fail", name, None,
                                   f"{name}: cells {seen[c.why]} and {c.id} give the same why",
                                   cell=c.id))
            seen.setdefault(c.why, c.id)
        driven = {t.cell.id for t in targets(op)}
        for c in op.cells:
            if c.id not in driven:
                out.append(Finding("runs_nowhere", "fail", name, None,
                                   f"{name}: cell {c.id} is certified by no (variant, arch): no test "
                                   f"drives it", cell=c.id))
        for v in op.variants:
            cells = _cells_for(op, v.name)
            plain = [c.id for c in cells if c.adds is None]
            limit = max(CELL_LIMIT, v.specialisations)
            if len(plain) > limit:
                out.append(Finding(
                    "cells_over_limit", "fail", name, v.name,
                    f"{name}::{v.name} has {len(cells)} cells ({', '.join(c.id for c in cells)}); the "
                    f"at-most-three rule allows {limit} (its specialisations: {v.specialisations}). "
                    f"Give {len(plain) - limit} of them an `adds:` saying what they add over the others"))
    return out


def failures(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "fail"]
