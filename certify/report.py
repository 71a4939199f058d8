"""``certify report``: the ops x cells x archs matrix and one note per op, written for a reviewer.

Everything here is a pure function of the catalog, the receipts, the reach file and the code's content
hashes, so the committed reports can be checked for staleness by regenerating them. The first section of
both the terminal report and coverage.md is what the forward reaches that nothing certifies
(``certify.reach_report``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tabulate import tabulate

from certify.atomic import atomic_write_text, locked
from certify.catalog import Catalog
from certify.harness import resolve
from certify.plan import targets, variants_of_cell
from certify.reach import ReachFile
from certify.reach_claims import Finding, catalog_findings, reach_findings
from certify.reach_report import cost_markdown, gaps_markdown, op_reach_markdown, terminal_gaps
from certify.receipts import Receipt, evidence_problems, freshness
from certify.schema import OpFile

STATUSES = ("certified", "failed", "stale", "invalid", "not run")
ARCH_ORDER = ("cpu", "cpu-interpret", "sm_90", "sm_100", "sm_103")


@dataclass(frozen=True)
class Row:
    op: str
    variant: str
    cell: str
    tier: str
    oracle: str
    status: dict[str, str]        # arch -> status; archs the variant does not run on are absent
    measured: dict[str, str]      # arch -> short worst-error text
    receipts: dict[str, Receipt]


def _archs(catalog: Catalog) -> list[str]:
    seen = {a for op in catalog.ops.values() for v in op.variants for a in v.archs}
    return [a for a in ARCH_ORDER if a in seen] + sorted(seen - set(ARCH_ORDER))


def _measured(r: Receipt | None, op: OpFile | None = None, cell_id: str | None = None) -> str:
    """The receipt's result in one phrase: for a tolerance cell the output nearest its band, as
    measured / band ulp (its name where the cell bands several outputs); bitwise, or how many
    elements differ."""
    if r is None:
        return ""
    ulps = {k[: -len(".ulp")]: v for k, v in r.metrics.items() if k.endswith(".ulp")}
    if ulps:
        bands = {}
        if op is not None and cell_id is not None:
            oracle = op.cell(cell_id).oracle
            bands = {n: b.max_ulp for n, b in (oracle.outputs or {}).items()} \
                if oracle.kind != "bitwise" else {}
        banded = {n: (v, bands[n]) for n, v in ulps.items() if bands.get(n)}
        if banded:
            name, (v, band) = max(banded.items(), key=lambda kv: kv[1][0] / kv[1][1])
            where = f" {name}" if len(banded) > 1 else ""
            return f"{v:.2f}/{band:g} ulp{where}"
        return f"{max(ulps.values()):.2f} ulp"
    mism = [v for k, v in r.metrics.items() if k.endswith(".mismatches")]
    if mism:
        return "bitwise" if max(mism) == 0 else f"{int(max(mism))} differ"
    return ""


def _oracle_text(op: OpFile, cell_id: str) -> str:
    o = op.cell(cell_id).oracle
    if o.kind == "bitwise":
        return f"bitwise vs {o.against}"
    bands = ", ".join(f"{n} {b.max_ulp:g}u" for n, b in o.outputs.items())
    return f"tol: {bands}"


def list_tier_text(declared: str, by_arch: dict[str, str]) -> str:
    """The list that runs a (variant, cell): one tier, or each tier with its archs where the lists
    split it by arch (e.g. pre-merge on the CPU, post-merge on the GPU)."""
    tiers = {t: [a for a in by_arch if by_arch[a] == t] for t in dict.fromkeys(by_arch.values())}
    if not tiers:
        return declared
    if len(tiers) == 1:
        return next(iter(tiers))
    return "; ".join(f"{t} ({', '.join(archs)})" for t, archs in tiers.items())


def build_rows(catalog: Catalog, books: dict[str, dict[tuple[str, str, str], Receipt]],
               listed: dict[str, str] | None = None, cells_dir: str = "certify/cells") -> list[Row]:
    """One row per (op, variant, cell). Its tier is the generated list that runs it (``listed``:
    item id -> tier, from the lists; ``cells_dir`` is the cell files' folder as item ids name it),
    else the cell's declared tier."""
    rows: dict[tuple[str, str, str], Row] = {}
    by_arch: dict[tuple[str, str, str], dict[str, str]] = {}
    for name in sorted(catalog.ops):
        op = catalog.ops[name]
        for t in targets(op):
            key = (name, t.variant.name, t.cell.id)
            if key not in rows:
                rows[key] = Row(name, t.variant.name, t.cell.id, t.cell.tier,
                                _oracle_text(op, t.cell.id), {}, {}, {})
            if listed is not None:
                item = f"{cells_dir}/{name}.yaml::{t.item_name}"
                by_arch.setdefault(key, {})[t.arch] = listed.get(item, t.cell.tier)
            r = books.get(t.arch, {}).get(key)
            rows[key].status[t.arch] = freshness(r, op, t.variant.name, t.cell, t.arch)
            rows[key].measured[t.arch] = _measured(r, op, t.cell.id)
            if r is not None:
                rows[key].receipts[t.arch] = r
    for key, tiers in by_arch.items():
        rows[key] = replace(rows[key], tier=list_tier_text(rows[key].tier, tiers))
    return list(rows.values())


def project_rows(paths, catalog: Catalog) -> list[Row]:
    """The rows as ``certify report`` writes them: the project's receipts, tiers from its lists."""
    from certify.lists.records import list_tiers  # noqa: PLC0415
    from certify.receipts import load_receipts  # noqa: PLC0415

    cells = Path(paths.cells)
    root = Path(paths.root)
    cells_dir = cells.relative_to(root).as_posix() if cells.is_relative_to(root) else "certify/cells"
    return build_rows(catalog, load_receipts(paths.receipts), list_tiers(paths.lists), cells_dir)


def _status_cell(row: Row, arch: str) -> str:
    if arch not in row.status:
        return "-"
    s = row.status[arch]
    m = row.measured.get(arch, "")
    return f"{s} ({m})" if m and s in ("certified", "failed") else s


def _attention_text(catalog: Catalog, row: Row, arch: str, status: str) -> str:
    if status != "invalid":
        return f"{arch}: {status}"
    op = catalog.ops[row.op]
    why = evidence_problems(row.receipts[arch], op, op.cell(row.cell), arch)
    return f"{arch}: invalid ({'; '.join(why)})"


def counts(rows: list[Row], archs: list[str]) -> list[list]:
    table = []
    for arch in archs:
        c = {s: 0 for s in STATUSES}
        for r in rows:
            if arch in r.status:
                c[r.status[arch]] += 1
        table.append([arch, *[c[s] for s in STATUSES]])
    return table


def op_summary(rows: list[Row], archs: list[str]) -> list[list]:
    """One row per op: per arch, certified of its (variant, cell) targets there, and what is not."""
    table = []
    for name in sorted({r.op for r in rows}):
        line = [name]
        for arch in archs:
            states = [r.status[arch] for r in rows if r.op == name and arch in r.status]
            if not states:
                line.append("-")
                continue
            ok = states.count("certified")
            rest = ", ".join(f"{n} {s}" for s in STATUSES if s != "certified"
                             and (n := states.count(s)))
            line.append(f"{ok}/{len(states)}" + (f" ({rest})" if rest else ""))
        table.append(line)
    return table


def _summary_lines(rows: list[Row], archs: list[str], fmt: str) -> list[str]:
    return [tabulate(counts(rows, archs), headers=["arch", *STATUSES], tablefmt=fmt), "",
            tabulate(op_summary(rows, archs), headers=["op (certified/targets)", *archs],
                     tablefmt=fmt)]


def findings_of(catalog: Catalog, reach: ReachFile | None) -> list[Finding]:
    return catalog_findings(catalog) + (reach_findings(catalog, reach) if reach else [])


def terminal_report(catalog: Catalog, rows: list[Row], reach: ReachFile | None = None,
                    matrix: bool = False) -> str:
    """The totals, the op x arch summary and the reach gaps; with ``matrix`` every (variant, cell)
    row as well (reports/coverage.md holds it either way)."""
    archs = _archs(catalog)
    out = [*_summary_lines(rows, archs, "simple"), ""]
    if catalog.errors:
        out.append("Cell files that could not be loaded (their ops are missing above):")
        out += [f"  {e}" for e in catalog.errors]
        out.append("")
    out.append(terminal_gaps(reach, findings_of(catalog, reach)))
    if matrix:
        out += ["", tabulate([[r.op, r.variant, r.cell, r.tier, *[_status_cell(r, a) for a in archs]]
                              for r in rows], headers=["op", "variant", "cell", "list", *archs],
                             tablefmt="simple")]
    else:
        out += ["", "every (variant, cell) row: reports/coverage.md, \"Matrix\" "
                "(or `certify report --matrix`)"]
    return "\n".join(out)


def coverage_markdown(catalog: Catalog, rows: list[Row], extras: list[str],
                      reach: ReachFile | None = None) -> str:
    archs = _archs(catalog)
    findings = findings_of(catalog, reach)
    md = ["# Certification coverage", "",
          "Generated by `certify report` from the cell files, the receipts and the reach file; do not "
          "edit by hand. Status per (variant, cell, arch): certified (a fresh passing receipt), failed "
          "(a fresh failing receipt), stale (the code changed since the receipt), invalid (a receipt "
          "that is no evidence of what it says: its arch, versions, seed, digests or metrics contradict "
          "it; the reason is under Needs attention), not run (no receipt, or one whose key appears "
          "twice in its file), - (the variant does not run on that arch).", ""]
    md += ["## Totals", "", *_summary_lines(rows, archs, "github"), ""]
    md += gaps_markdown(catalog, reach, rows, findings)
    attention = [r for r in rows if any(s != "certified" for s in r.status.values())]
    md += ["## Needs attention", ""]
    if catalog.errors:
        md += [f"- cell file error: `{e}`" for e in catalog.errors]
    if attention:
        md.append(tabulate([[r.op, r.variant, r.cell, r.tier,
                             ", ".join(_attention_text(catalog, r, a, s) for a, s in r.status.items()
                                       if s != "certified")]
                            for r in attention],
                           headers=["op", "variant", "cell", "list", "not certified"],
                           tablefmt="github"))
    if not attention and not catalog.errors:
        md.append("Nothing: every listed (variant, cell, arch) is certified.")
    declared = [(name, item) for name, op in sorted(catalog.ops.items()) for item in op.not_certified]
    if declared:
        md += ["", "## Declared not certified", "",
               "What the cell files say is outside their cells (details in each op's note):", ""]
        md += [f"- [{name}](ops/{name}.md): {item.what}" for name, item in declared]
    md += ["", *cost_markdown(findings)]
    if extras:
        md += [*extras, ""]
    md += ["## Matrix", ""]
    for name in sorted(catalog.ops):
        op_rows = [r for r in rows if r.op == name]
        md += [f"### [{name}](ops/{name}.md)", "", catalog.ops[name].summary, "",
               tabulate([[r.variant, r.cell, r.tier, r.oracle, *[_status_cell(r, a) for a in archs]]
                         for r in op_rows],
                        headers=["variant", "cell", "list", "oracle", *archs], tablefmt="github"),
               ""]
    return "\n".join(md)


def project_guards(paths) -> dict[str, list[tuple[str, str, str]]]:
    """op -> (test id, ``guard`` or ``property``, the list that runs it) for every test whose
    certify_guard / certify_property marker names the op, from the lists' item universe."""
    from certify.lists.records import list_tiers, load_items  # noqa: PLC0415

    items_file = Path(paths.lists) / "items.json"
    if not items_file.is_file():
        return {}
    listed = list_tiers(paths.lists) or {}
    out: dict[str, list[tuple[str, str, str]]] = {}
    for rec in load_items(items_file):
        for kind, key in (("guard", "guards"), ("property", "properties")):
            for op in rec.get(key, ()):
                out.setdefault(op, []).append((rec["id"], kind, listed.get(rec["id"], rec["tier"])))
    return {op: sorted(v) for op, v in out.items()}


def _guards_markdown(op: OpFile, guards: dict[str, list[tuple[str, str, str]]] | None) -> list[str]:
    if guards is None:
        return []
    md = ["## Tests that guard it", ""]
    mine = guards.get(op.op, [])
    if mine:
        md.append(tabulate([[f"`{i}`", kind, tier] for i, kind, tier in mine],
                           headers=["test", "kind", "list"], tablefmt="github"))
    else:
        md.append("No test names this op in a certify_guard or certify_property marker: only its "
                  "cells above check it.")
    return md + [""]


def op_markdown(op: OpFile, rows: list[Row], reach: ReachFile | None = None,
                findings: list[Finding] | None = None,
                guards: dict[str, list[tuple[str, str, str]]] | None = None) -> str:
    """The op's note: spec, variants, cells, reach, bands, status per arch, the tests that guard it,
    what stays certified and what is not."""
    archs = [a for a in ARCH_ORDER if any(a in v.archs for v in op.variants)]
    md = [f"# {op.op}", "", op.summary, "",
          f"- spec: `{op.spec}`", f"- inputs: `{op.inputs}`", ""]
    md += ["## Variants", "", tabulate(
        [[v.name, f"`{op.impl_path(v)}`" + (" (the spec's own low-precision path)"
                                            if v.impl == "spec" else ""), ", ".join(v.archs), f"`{v.dispatch}`",
          "yes" if v.batch_invariant else "no"] for v in op.variants],
        headers=["variant", "impl", "archs", "dispatch rule", "batch-invariant"],
        tablefmt="github"), ""]
    md += ["## Cells", "", tabulate(
        [[c.id, ", ".join(f"{k}={v}" for k, v in c.axes.items()), c.tier, _oracle_text(op, c.id),
          ", ".join(v.name for v in variants_of_cell(op, c)),
          c.why + (f" (adds: {c.adds})" if c.adds else "")] for c in op.cells],
        headers=["cell", "axes", "tier", "oracle", "variants", "why"], tablefmt="github"), ""]
    if reach is not None or findings is not None:
        md += op_reach_markdown(op, reach, findings or [])
    derivations = [(c.id, n, b) for c in op.cells for n, b in c.oracle.outputs.items()]
    if derivations:
        md += ["## Tolerance bands", ""]
        md += [f"- `{cid}` / `{n}`: {b.max_ulp:g} ulp, rel RMS {b.max_rel_rms:g} eps. {b.derivation}"
               for cid, n, b in derivations]
        md.append("")
    md += ["## Status", "", tabulate(
        [[r.variant, r.cell, *[_status_cell(r, a) for a in archs]] for r in rows],
        headers=["variant", "cell", *archs], tablefmt="github"), ""]
    md += _guards_markdown(op, guards)
    certified, not_certified = [], []
    for r in rows:
        for arch, s in r.status.items():
            (certified if s == "certified" else not_certified).append((r, arch, s))
    md += ["## What stays certified", ""]
    if certified:
        for r, arch, _ in certified:
            rc = r.receipts[arch]
            md.append(f"- `{r.variant}` at `{r.cell}` on {arch}: {_measured(rc) or 'passed'} "
                      f"(receipt {rc.date}, torch {rc.versions.get('torch', '?')}"
                      + (f", CPU dispatch {rc.versions['cpu_capability']}"
                         if not arch.startswith("sm_") and "cpu_capability" in rc.versions else "")
                      + ")")
    else:
        md.append("- nothing yet")
    md += ["", "## What is not certified", ""]
    for item in op.not_certified:
        md.append(f"- {item.what}: {item.why}")
    for r, arch, s in not_certified:
        md.append(f"- `{r.variant}` at `{r.cell}` on {arch}: {s}")
    if not op.not_certified and not not_certified:
        md.append("- nothing listed")
    if op.note.strip():
        md += ["", "## Note", "", op.note.strip()]
    return "\n".join(md) + "\n"


def report_extras(spec: str | None) -> list[str]:
    """Target-specific lines for the report, from ``[tool.certify] report_extras``."""
    return list(resolve(spec)()) if spec else []


def render_all(catalog: Catalog, rows: list[Row], extras: list[str],
               reach: ReachFile | None = None,
               guards: dict[str, list[tuple[str, str, str]]] | None = None) -> dict[str, str]:
    """Relative path -> content of every generated report (for staleness checks)."""
    findings = findings_of(catalog, reach)
    out = {"coverage.md": coverage_markdown(catalog, rows, extras, reach) + "\n"}
    for name, op in sorted(catalog.ops.items()):
        out[f"ops/{name}.md"] = op_markdown(op, [r for r in rows if r.op == name], reach, findings,
                                            guards)
    return out


def write_reports(reports_dir: Path, catalog: Catalog, rows: list[Row], extras: list[str],
                  reach: ReachFile | None = None,
                  guards: dict[str, list[tuple[str, str, str]]] | None = None) -> list[Path]:
    """Write every generated report and remove op notes of ops that no longer exist: each file
    atomically, the whole set under the reports directory's lock (``certify.atomic``)."""
    reports_dir = Path(reports_dir)
    rendered = render_all(catalog, rows, extras, reach, guards)
    with locked(reports_dir):
        for rel, text in rendered.items():
            atomic_write_text(reports_dir / rel, text)
        for old in (reports_dir / "ops").glob("*.md"):
            if f"ops/{old.name}" not in rendered:
                old.unlink()
    return [reports_dir / rel for rel in rendered]
