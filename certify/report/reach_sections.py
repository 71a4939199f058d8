"""Reach beside certification, for the report: what the forward reaches that nothing certifies (first),
the cells that cost without covering, and per op its reached axis ranges and the cells covering them.

Pure functions of the catalog, the reach file, the findings (``certify.reach.claims``) and the report's
rows (receipt statuses), so the committed reports stay checkable for staleness.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from tabulate import tabulate

from certify.catalog.load import Catalog
from certify.reach import ReachFile
from certify.reach.claims import NEAR, Finding, _cells_for
from certify.catalog.schema import OpFile

if TYPE_CHECKING:
    from certify.report.rows import Row


def _short(names: tuple[str, ...] | list[str], limit: int = 3) -> str:
    names = list(names)
    more = f" +{len(names) - limit}" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def unreceipted(catalog: Catalog, reach: ReachFile, rows: list[Row]) -> list[tuple[str, str, str]]:
    """Reached (op, variant, arch) whose cells exist but none holds a fresh passing receipt there."""
    certified = {(r.op, r.variant, a) for r in rows for a, s in r.status.items() if s == "certified"}
    out = []
    for op_name, variants in sorted(reach.reach.items()):
        op = catalog.ops.get(op_name)
        for variant, vr in variants.items():
            for arch in vr.archs():
                if op is not None and _cells_for(op, variant, arch) and \
                        (op_name, variant, arch) not in certified:
                    out.append((op_name, variant, arch))
    return out


def _by_kind(findings: list[Finding], *kinds: str) -> list[Finding]:
    return [f for f in findings if f.kind in kinds]


def _domain_groups(findings: list[Finding]) -> dict[tuple[str, str], list[str]]:
    """(axis, reached values) -> the ops whose declared domain they leave."""
    out: dict[tuple[str, str], list[str]] = {}
    for f in _by_kind(findings, "outside_domain"):
        out.setdefault((f.axis or "", f.reached or ""), []).append(f.op)
    return out


def _gap_rows(findings: list[Finding]) -> list[list[str]]:
    """One row per (op, variant): its axis gaps joined."""
    grouped: dict[tuple[str, str], list[Finding]] = {}
    for f in _by_kind(findings, "axis_gap"):
        grouped.setdefault((f.op, f.variant or ""), []).append(f)
    return [[f"{op}::{variant}", "; ".join(f"{f.axis} {f.reached} (cells: {f.certified})" for f in fs),
             _short(sorted({s for f in fs for s in f.scenarios}))]
            for (op, variant), fs in sorted(grouped.items())]


def refused_modes(reach: ReachFile) -> dict[str, tuple[str, list[str]]]:
    """mode -> (the target's first refusal reason, the scenarios it refuses there)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for name, sc in sorted(reach.scenarios.items()):
        for mode, rec in sorted(sc.modes.items()):
            if rec.refused is not None:
                reason, names = out.get(mode, (rec.refused, []))
                out[mode] = (reason, names + [name])
    return out


def gaps_markdown(catalog: Catalog, reach: ReachFile | None, rows: list[Row],
                  findings: list[Finding]) -> list[str]:
    """The report's first section: what the forward reaches that nothing certifies."""
    md = ["## Reached but not certified", ""]
    if reach is None:
        return md + ["No reach file: run `certify trace` to find what the forward reaches.", ""]
    uncovered = _by_kind(findings, "uncovered")
    declared = _by_kind(findings, "declared")
    no_variant = _by_kind(findings, "no_variant")
    domain = _by_kind(findings, "outside_domain")
    stale = unreceipted(catalog, reach, rows)
    reached = sum(len(v) for v in reach.reach.values())
    gap_rows = _gap_rows(findings)
    md += [f"The forward, traced over {len(reach.scenarios)} scenarios (modes {', '.join(reach.modes)}; "
           f"`certify trace` writes reports/reach.json), reaches {reached} (op, variant)s:", "",
           f"- with no cell that certifies them: **{len(uncovered)}** (a failing claim); declared not "
           f"certified: {len(declared)}",
           f"- reached beyond their cells' axis values: {len(gap_rows)} variants (an int range more than "
           f"{NEAR}x past the cells', or a choice no cell has)",
           f"- reached outside the axis domain their op file declares: {len(domain)} ops",
           f"- called on an arch where no variant runs: {len(no_variant)} (op, arch)",
           f"- cells exist but none holds a fresh passing receipt on the arch that reaches them: "
           f"{len(stale)} (op, variant, arch)", ""]
    if uncovered or declared:
        md.append(tabulate([[f.op, f.variant, f.arch, "no (fails)" if f.kind == "uncovered" else
                             "yes: " + f.message.split("declared not certified: ", 1)[-1],
                             _short(f.scenarios)] for f in [*uncovered, *declared]],
                           headers=["op", "variant", "arch", "declared", "reached by"],
                           tablefmt="github"))
        md.append("")
    if gap_rows:
        md += ["Reached axis values beyond the cells (each op's note says what its cells stand for):",
               "",
               tabulate(gap_rows, headers=["op::variant", "reached (cells)", "reached by"],
                        tablefmt="github"), ""]
    if domain:
        md += ["Reached outside the axis domain the op file declares:", ""]
        for (axis, reached), ops in _domain_groups(findings).items():
            first = next(f for f in domain if f.axis == axis and f.reached == reached)
            md.append(f"- {axis} = {reached} in {', '.join(ops)} (domain {first.certified}; "
                      f"{_short(first.scenarios)})")
        md.append("")
    if no_variant:
        by_arch: dict[str, list[str]] = {}
        for f in no_variant:
            by_arch.setdefault(f.arch or "?", []).append(f.op)
        md += ["Called where no variant runs (the forward would stop at the first; the configuration "
               "rules accept it):", ""]
        md += [f"- {arch}: {', '.join(ops)}" for arch, ops in sorted(by_arch.items())]
        md.append("")
    if stale:
        md += ["No fresh passing receipt on the arch that reaches them (cells exist: certify them):", ""]
        by: dict[str, list[str]] = {}
        for op, variant, arch in stale:
            by.setdefault(arch, []).append(f"{op}::{variant}")
        md += [f"- {arch}: {', '.join(items)}" for arch, items in sorted(by.items())]
        md.append("")
    refused = refused_modes(reach)
    if refused:
        md += ["Modes the target refuses to run (its configuration rules; nothing of them is reached):",
               ""]
        md += [f"- {mode} ({len(names)} of {len(reach.scenarios)} scenarios): {reason}"
               for mode, (reason, names) in refused.items()]
        md.append("")
    if not (uncovered or declared or no_variant or domain or stale or gap_rows):
        md += ["Nothing: every reached (op, variant) has a fresh certified cell on its arch.", ""]
    return md


def cost_markdown(findings: list[Finding]) -> list[str]:
    """Cells that cost without covering anything the forward reaches."""
    items = _by_kind(findings, "outside_reach", "not_reached", "within")
    if not items:
        return []
    md = ["## Cost without coverage", "",
          "Cells no traced scenario comes near (a cell is near an int reach within a factor of "
          f"{NEAR}), variants no scenario dispatches, and ops no scenario calls:", ""]
    md += [f"- {f.message}" for f in items if f.kind != "within"]
    within = _by_kind(findings, "within")
    if within:
        md += ["", "Not reached as separate calls (certified on their own, run inside other ops):", ""]
        md += [f"- {f.message}" for f in within]
    return md + [""]


def op_reach_markdown(op: OpFile, reach: ReachFile | None, findings: list[Finding]) -> list[str]:
    """One op's reach beside its cells, for its note."""
    md = ["## Reach", ""]
    if reach is None:
        return md + ["No reach file (`certify trace`).", ""]
    mine = [f for f in findings if f.op == op.op]
    variants = reach.reach.get(op.op, {})
    if not variants:
        inside = [f.message for f in mine if f.kind in ("within", "not_reached")]
        return md + [inside[0] if inside else "Not reached by any scenario.", ""]
    table = []
    for v in op.variants:
        vr = variants.get(v.name)
        cells = _cells_for(op, v.name)
        if vr is None:
            table.append([v.name, "not dispatched", "", ", ".join(c.id for c in cells) or "-"])
            continue
        axes = "; ".join(f"{a} {r.text()}" for a, r in vr.axes.items()
                         if not (a in op.axes and op.axes[a].kind == "choice"
                                 and len(op.axes[a].values) == 1))
        table.append([v.name, ", ".join(vr.modes), axes, ", ".join(c.id for c in cells) or "none"])
    md += [tabulate(table, headers=["variant", "reached in", "reached axes", "cells"],
                    tablefmt="github"), ""]
    gaps = [f for f in mine if f.kind in ("uncovered", "declared", "axis_gap", "outside_domain",
                                          "no_variant")]
    if gaps:
        md += ["Reached but not certified:", ""] + [f"- {f.message}" for f in gaps] + [""]
    cost = [f for f in mine if f.kind == "outside_reach"]
    if cost:
        md += ["Cost without coverage:", ""] + [f"- {f.message}" for f in cost] + [""]
    return md


def terminal_gaps(reach: ReachFile | None, findings: list[Finding], limit: int = 12) -> str:
    """The first lines the terminal report prints."""
    if reach is None:
        return "reach: no reach file (run `certify trace`)"
    uncovered = _by_kind(findings, "uncovered")
    declared = _by_kind(findings, "declared")
    out = [f"REACHED BUT NOT CERTIFIED ({len(reach.scenarios)} scenarios traced; reports/reach.json)"]
    out += [f"  NO CELL  {f.op}::{f.variant} on {f.arch} ({_short(f.scenarios)})" for f in uncovered]
    out += [f"  declared {f.op}::{f.variant} on {f.arch}" for f in declared]
    nv: dict[str, list[str]] = {}
    for f in _by_kind(findings, "no_variant"):
        nv.setdefault(f.arch or "?", []).append(f.op)
    out += [f"  no variant runs on {arch}: {_short(ops, 6)}" for arch, ops in sorted(nv.items())]
    out += [f"  refused on {mode} ({len(names)} scenarios): "
            f"{textwrap.shorten(reason, 110, placeholder=' [...]')}"
            for mode, (reason, names) in refused_modes(reach).items()]
    out += [f"  outside declared domain: {axis} = {reached} in {_short(ops, 4)}"
            for (axis, reached), ops in _domain_groups(findings).items()]
    gaps = _gap_rows(findings)
    out += [f"  beyond cells: {name}: {text}" for name, text, _ in gaps[:limit]]
    if len(gaps) > limit:
        out.append(f"  ... and {len(gaps) - limit} more variants beyond their cells (reports/coverage.md)")
    if len(out) == 1:
        out.append("  nothing")
    return "\n".join(out)
