"""The report's data: one row per (op, variant, cell) with its status, measured error and receipt
per arch, the counts and the op x arch summary, and the tests that guard each op.

Pure functions of the catalog, the receipts, the lists and the code's content hashes; the Markdown and
terminal renderers read these rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from certify.catalog.load import Catalog
from certify.catalog.plan import targets
from certify.receipts.store import Receipt, freshness
from certify.catalog.schema import EXACT, OpFile


STATUSES = ("certified", "expected failure", "unexpected pass", "failed", "stale", "invalid",
            "not run")
MEASURED = ("certified", "expected failure", "unexpected pass", "failed")  # a fresh receipt's result
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


def banded_outputs(r: Receipt, op: OpFile, cell_id: str) -> list[tuple[str, float, float,
                                                                      float | None, float]]:
    """A tolerance cell's banded outputs that the receipt measured, in the oracle's order: (name,
    measured ulp, band ulp, measured relative RMS or None, band relative RMS), as the variant is
    judged (its tier's bands for a tier variant); [] for a bitwise oracle."""
    known = {v.name: v for v in op.variants}
    cell = op.cell(cell_id)
    oracle = op.oracle_of(known[r.variant], cell) if r.variant in known else cell.oracle
    if oracle.kind == "bitwise":
        return []
    return [(n, r.metrics[f"{n}.ulp"], b.max_ulp, r.metrics.get(f"{n}.rel_rms"), b.max_rel_rms)
            for n, b in (oracle.outputs or {}).items() if b.max_ulp and f"{n}.ulp" in r.metrics]


def worst_banded(r: Receipt, op: OpFile, cell_id: str) -> tuple[str, float, float, int] | None:
    """Of a tolerance cell's banded outputs that the receipt measured, the one nearest its band:
    (name, measured ulp, band ulp, how many banded outputs were measured); None where none is."""
    banded = banded_outputs(r, op, cell_id)
    if not banded:
        return None
    name, v, band, _, _ = max(banded, key=lambda o: o[1] / o[2])
    return name, v, band, len(banded)


def measured_per_output(r: Receipt, op: OpFile, cell_id: str) -> str:
    """The receipt's result for every output: measured / band in ulp and in relative RMS (eps) for
    a tolerance cell, bitwise or how many elements differ for a bitwise one."""
    banded = banded_outputs(r, op, cell_id)
    if banded:
        return "; ".join(f"{n} {v:.2f}/{band:g} ulp"
                         + (f", rel RMS {rms:.2f}/{band_rms:g} eps" if rms is not None else "")
                         for n, v, band, rms, band_rms in banded)
    mism = {k[: -len(".mismatches")]: v for k, v in r.metrics.items() if k.endswith(".mismatches")
            and not k.startswith(EXACT_METRIC)}
    if mism:
        return "; ".join(f"{n} {'bitwise' if v == 0 else f'{int(v)} differ'}"
                         for n, v in mism.items())
    return _measured(r, op, cell_id)


EXACT_METRIC = "exact."  # a tier variant's error against the exact spec: recorded, never judged


def _measured(r: Receipt | None, op: OpFile | None = None, cell_id: str | None = None) -> str:
    """The receipt's result in one phrase: for a tolerance cell the output nearest its band, as
    measured / band ulp (its name where the cell bands several outputs); bitwise, or how many
    elements differ."""
    if r is None:
        return ""
    ulps = {k[: -len(".ulp")]: v for k, v in r.metrics.items()
            if k.endswith(".ulp") and not k.startswith(EXACT_METRIC)}
    if ulps:
        worst = worst_banded(r, op, cell_id) if op is not None and cell_id is not None else None
        if worst:
            name, v, band, n = worst
            return f"{v:.2f}/{band:g} ulp{f' {name}' if n > 1 else ''}"
        return f"{max(ulps.values()):.2f} ulp"
    mism = [v for k, v in r.metrics.items() if k.endswith(".mismatches")]
    if mism:
        return "bitwise" if max(mism) == 0 else f"{int(max(mism))} differ"
    return ""


def _oracle_text(op: OpFile, cell_id: str, variant: str | None = None) -> str:
    """The oracle a (variant, cell) is judged by: the cell's, or for a variant of another numerics
    tier, its tier's bands (named)."""
    v = op.variant(variant) if variant is not None else None
    o = op.oracle_of(v, op.cell(cell_id)) if v is not None else op.cell(cell_id).oracle
    if o.kind == "bitwise":
        return f"bitwise vs {o.against}"
    bands = ", ".join(f"{n} {b.max_ulp:g}u" for n, b in o.outputs.items())
    tier = f" ({v.numerics} tier)" if v is not None and v.numerics != EXACT else ""
    return f"tol: {bands}{tier}"


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
                                _oracle_text(op, t.cell.id, t.variant.name), {}, {}, {})
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
    from certify.receipts.store import load_receipts  # noqa: PLC0415

    cells = Path(paths.cells)
    root = Path(paths.root)
    cells_dir = cells.relative_to(root).as_posix() if cells.is_relative_to(root) else "certify/cells"
    return build_rows(catalog, load_receipts(paths.receipts), list_tiers(paths.lists), cells_dir)


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


def project_mutants(paths) -> dict[str, dict]:
    """op -> its latest ``certify mutants`` report (``<reports>/mutants/<op>.json``)."""
    from certify.mutants.report import load_mutants  # noqa: PLC0415

    return load_mutants(paths.reports)
