"""``certify report --html``: a static site under ``<reports>/html/`` that opens from the file system.

``index.html`` holds the totals, the op x arch heatmap (a figure, and the same data as a table whose
cells carry ``data-op``, ``data-arch``, ``data-certified`` and ``data-targets`` for checking against
the receipts), what the forward reaches that nothing certifies, and the lists' risk against their
budget. ``ops/<op>.html`` is the op's note with each (variant, cell, arch)'s measured error as a
fraction of its band and the reach against the cells per axis; ``gates.html`` the gates with their
thresholds, intervals and rates. Every page is a pure function of the same inputs as the Markdown
report, so the committed site is checked for staleness by rendering it again.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import markdown as md_lib

from certify.files.atomic import atomic_write_bytes, atomic_write_text, locked
from certify.catalog.load import Catalog
from certify.catalog.plan import variants_of_cell
from certify.reach import ReachFile
from certify.report import plots
from certify.report.markdown import findings_of
from certify.report.reach_sections import gaps_markdown
from certify.report.rows import MEASURED, STATUSES, Row, _archs, counts, worst_banded
from certify.catalog.schema import OpFile

SCREENSHOT = "index.png"
STYLE_CSS = """body{font-family:'DejaVu Sans',sans-serif;max-width:1100px;margin:1em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;
font-size:13px}th{background:#f2f2f2}td.full{background:#d9efdf}td.part{background:#f8e3c4}
td.none{background:#f4cccc}img{max-width:100%}nav a{margin-right:1em}code{background:#f4f4f4}
details{margin:.5em 0}summary{cursor:pointer;font-weight:bold}
"""


@dataclass
class SiteData:
    """What the site is rendered from: the report's inputs, already loaded."""

    catalog: Catalog
    rows: list[Row]
    reach: ReachFile | None
    notes: dict[str, str]                          # op -> its Markdown note (reports/ops/<op>.md)
    gates: list[tuple[object, dict]] = field(default_factory=list)   # (GateResult, raw) per gate
    lists: dict | None = None                      # reports/lists.json


def band_fraction(row: Row, op: OpFile, arch: str) -> float | None:
    """The receipt's worst output as measured / band (0.0 for a bitwise match, inf for a bitwise
    mismatch); None without a receipt or metrics."""
    r = row.receipts.get(arch)
    if r is None:
        return None
    worst = worst_banded(r, op, row.cell)
    if worst:
        return worst[1] / worst[2]
    mism = [v for k, v in r.metrics.items() if k.endswith(".mismatches")]
    if mism:
        return 0.0 if max(mism) == 0 else math.inf
    return None


def heatmap_cells(data: SiteData) -> dict[tuple[str, str], dict]:
    """(op, arch) -> targets, certified, per-status counts and the worst fraction of a band among
    the rows with a fresh receipt, less the declared failures (their bars are on the op's page)."""
    out: dict[tuple[str, str], dict] = {}
    for r in data.rows:
        op = data.catalog.ops[r.op]
        for arch, status in r.status.items():
            c = out.setdefault((r.op, arch), {"targets": 0, "certified": 0, "worst": None,
                                              "counts": {s: 0 for s in STATUSES}})
            c["targets"] += 1
            c["counts"][status] += 1
            c["certified"] += status == "certified"
            f = band_fraction(r, op, arch) if status in MEASURED and status != "expected failure" \
                else None
            if f is not None:
                c["worst"] = f if c["worst"] is None else max(c["worst"], f)
    return out


def _page(title: str, body: str, depth: int = 0) -> str:
    up = "../" * depth
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}'
            f'</title><link rel="stylesheet" href="{up}style.css"></head><body>\n<nav><a href="{up}'
            f'index.html">coverage</a><a href="{up}gates.html">gates</a></nav>\n{body}\n</body></html>\n')


def _md(text: str) -> str:
    out = md_lib.markdown(text, extensions=["tables", "fenced_code"])
    return re.sub(r'href="(?:ops/)?([A-Za-z0-9_]+)\.md"', r'href="\1.html"', out)


def _table(headers: list[str], rows: list[list[str]], attrs: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table{attrs}><tr>{head}</tr>{body}</table>"


def _heatmap_table(ops: list[str], archs: list[str], cells: dict) -> str:
    rows = []
    for o in ops:
        tds = [f'<th><a href="ops/{o}.html">{html.escape(o)}</a></th>']
        for a in archs:
            c = cells.get((o, a))
            if c is None:
                tds.append(f'<td data-op="{o}" data-arch="{a}" data-targets="0">-</td>')
                continue
            kind = "full" if c["certified"] == c["targets"] else "none" if not c["certified"] else "part"
            rest = ", ".join(f"{n} {s}" for s, n in c["counts"].items() if n and s != "certified")
            worst = "" if c["worst"] is None else f"; worst {c['worst']:.3g} of band"
            tds.append(f'<td class="{kind}" data-op="{o}" data-arch="{a}" '
                       f'data-certified="{c["certified"]}" data-targets="{c["targets"]}" '
                       f'data-counts="{html.escape(json.dumps(c["counts"], sort_keys=True))}">'
                       f'{c["certified"]}/{c["targets"]}{html.escape(f" ({rest})" if rest else "")}'
                       f'{html.escape(worst)}</td>')
        rows.append("<tr>" + "".join(tds) + "</tr>")
    head = "".join(f"<th>{html.escape(a)}</th>" for a in archs)
    return (f'<table id="heatmap-table"><tr><th>op (certified/targets)</th>{head}</tr>'
            + "".join(rows) + "</table>")


def _folded(section_html: str, marker: str) -> str:
    """Everything from the paragraph or heading that contains ``marker`` on, inside one <details>."""
    at = section_html.find(marker)
    if at < 0:
        return section_html
    start = max(section_html.rfind("<p>", 0, at), section_html.rfind("<h", 0, at))
    return (section_html[:start] + f"<details><summary>{html.escape(marker)}</summary>"
            + section_html[start:] + "</details>")


def _lists_section(lists: dict | None) -> tuple[str, dict[str, str]]:
    if not lists:
        return "<p>No reports/lists.json: run <code>certify lists</code>.</p>", {}
    rows = [[t, v["items"], f"{v['cost']:.1f}", "-" if v["budget"] is None else f"{v['budget']:.1f}",
             f"{v['share']:.1%}"] for t, v in lists["tiers"].items()]
    table = _table(["list", "items", "cost (s)", "budget (s)", "share of all risk"], rows)
    pts = [(p["budget"], p["cost"], p["share"]) for p in lists["sweep"]]
    full = max(p[0] for p in pts) if pts else 0.0
    figures = {"figures/risk.svg": plots.risk_curve(pts, full)} if pts else {}
    img = '<p><img src="figures/risk.svg" alt="risk covered against the pre-merge budget"></p>' \
        if pts else ""
    return table + img, figures


def render_index(data: SiteData) -> tuple[str, dict[str, str]]:
    archs = _archs(data.catalog)
    ops = sorted(data.catalog.ops)
    cells = heatmap_cells(data)
    worst = {k: v["worst"] for k, v in cells.items()}
    text = {k: f"{v['certified']}/{v['targets']}" for k, v in cells.items()}
    figures = {"figures/heatmap.svg": plots.margin_heatmap(ops, archs, worst, text)}
    totals = _table(["arch", *STATUSES], [[str(c) for c in row] for row in counts(data.rows, archs)])
    gaps = _md("\n".join(gaps_markdown(data.catalog, data.reach, data.rows,
                                       findings_of(data.catalog, data.reach))))
    lists_html, lists_figs = _lists_section(data.lists)
    figures.update(lists_figs)
    body = ("<h1>Certification coverage</h1><p>Generated by <code>certify report --html</code> from "
            "the cell files, the receipts, the reach file, the gates' reports and the lists; do not "
            "edit. A status is certified (a fresh passing receipt), expected failure (declared by its "
            "cell, with the reason), unexpected pass, failed, stale (the code changed since), "
            "invalid (a receipt that contradicts itself) or not run.</p>"
            f"<h2>Totals</h2>{totals}"
            "<h2>Op x arch</h2><p>Colour: the worst measured error of the cells with a fresh receipt "
            "(less the declared failures) as a fraction of its band (red: past the band; grey: no "
            "target there). Each square: certified / targets.</p><p><img src=\"figures/heatmap.svg\" alt=\"op x arch heatmap\">"
            f"</p>{_heatmap_table(ops, archs, cells)}"
            f"{_folded(gaps, 'Reached axis values beyond the cells')}"
            f"<h2>Test lists</h2>{lists_html}"
            "<h2>Ops</h2><ul>" + "".join(f'<li><a href="ops/{o}.html">{o}</a>: '
                                         f'{html.escape(data.catalog.ops[o].summary)}</li>'
                                         for o in ops) + "</ul>")
    return _page("Certification coverage", body), figures


def _int_axis_rows(op: OpFile, data: SiteData) -> tuple[list[plots.AxisRow], list[str]]:
    """The integer axes that vary (over the reach and the cells) as rows; the fixed ones as text."""
    reached: dict[str, tuple[int, int]] = {}
    for v in (data.reach.reach.get(op.op, {}) if data.reach else {}).values():
        for axis, ar in v.axes.items():
            if ar.min is not None and ar.max is not None:
                lo, hi = reached.get(axis, (ar.min, ar.max))
                reached[axis] = (min(lo, ar.min), max(hi, ar.max))
    names = list(dict.fromkeys([*(a for c in op.cells for a in c.axes), *reached]))
    rows, fixed = [], []
    for axis in names:
        vals = tuple(sorted({c.axes[axis] for c in op.cells if isinstance(c.axes.get(axis), int)
                             and not isinstance(c.axes.get(axis), bool)}))
        got = reached.get(axis)
        if not vals and got is None:
            continue
        if len(set(vals) | set(got or ())) <= 1:
            fixed.append(f"{axis}={(vals or got)[0]}")
            continue
        if vals:
            rows.append(plots.AxisRow(axis, got, vals))
    return rows, fixed


def render_op(name: str, data: SiteData) -> tuple[str, dict[str, str]]:
    op = data.catalog.ops[name]
    rows = [r for r in data.rows if r.op == name]
    figures: dict[str, str] = {}
    parts = []
    bars = [plots.Bar(f"{r.variant} / {r.cell}", arch, f, s == "certified")
            for r in rows for arch, s in r.status.items()
            if (f := band_fraction(r, op, arch)) is not None and s in MEASURED]
    if bars:
        figures[f"figures/{name}-bands.svg"] = plots.band_bars(f"{name}: measured error / band", bars)
        parts.append(f'<h2>Measured against the bands</h2><p><img src="../figures/{name}-bands.svg" '
                     f'alt="{name} bands"></p>')
    axis_rows, fixed = _int_axis_rows(op, data)
    if axis_rows:
        figures[f"figures/{name}-reach.svg"] = plots.reach_axes(f"{name}: reached vs cells", axis_rows)
        parts.append(f'<h2>Reach against the cells</h2><p><img src="../figures/{name}-reach.svg" '
                     f'alt="{name} reach"></p>')
    if fixed:
        parts.append(f"<p>Axes with one value everywhere: {html.escape(', '.join(fixed))}.</p>")
    note = _md(data.notes.get(name, f"# {name}\n"))
    head, sep, rest = note.partition("<h2>")
    variants = sorted({v.name for c in op.cells for v in variants_of_cell(op, c)})
    parts.insert(0, f"<p>Variants with cells: {html.escape(', '.join(variants))}.</p>")
    return _page(name, head + "".join(parts) + sep + rest, depth=1), figures


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render_gates(data: SiteData) -> tuple[str, dict[str, str]]:
    figures: dict[str, str] = {}
    parts = ["<h1>Accuracy gates</h1><p>From reports/gates/: each gate's latest run. A statistical "
             "check fails when its exact one-sided sign-test p-value is at or below its level (the "
             "tier's family-wise rate shared among its checks); its false-fail rate is the check's "
             "exact size at that level and n, its power the chance it catches the stated "
             "regression.</p>"]
    for result, _raw in data.gates:
        r = result
        parts.append(f'<h2 id="{r.gate}">{html.escape(r.gate)}: {html.escape(r.status)}</h2><p>tier '
                     f'{r.tier}, {r.arch}, {r.date}, {r.seconds:.1f} s'
                     f'{html.escape(" (" + r.reason + ")") if r.reason else ""}</p>')
        rows = [[c.kind, c.task, c.status, _f(c.measured, ".2f"), _f(c.reference, ".2f"),
                 _f(c.threshold, ".2f"), _f(c.samples, "d"), f"{_f(c.worse, 'd')}/{_f(c.better, 'd')}",
                 _f(c.p_value, ".3g"), _f(c.level, ".3g"), _f(c.false_fail_rate, ".3g"),
                 _f(c.power, ".3f")] for c in r.checks]
        parts.append(_table(["kind", "task", "status", "measured", "reference", "threshold",
                             "samples", "worse/better", "p", "level", "false-fail rate", "power"],
                            rows))
        points = [plots.CheckPoint(f"{c.kind} {c.task}",
                                   c.measured if c.kind == "accuracy" else None,
                                   c.reference if c.kind == "accuracy" else None, c.samples,
                                   c.false_fail_rate, c.level, c.power, c.status != "failed")
                  for c in r.checks]
        if points:
            figures[f"figures/gate-{r.gate}.svg"] = plots.gate_checks(r.gate, points)
            parts.append(f'<p><img src="figures/gate-{r.gate}.svg" alt="{r.gate} checks"></p>')
    if not data.gates:
        parts.append("<p>No gate reports: run <code>certify gates run</code>.</p>")
    return _page("Accuracy gates", "".join(parts)), figures


def render_site(data: SiteData) -> dict[str, str]:
    """Relative path (under the site folder) -> content of every file of the site."""
    out: dict[str, str] = {"style.css": STYLE_CSS}
    index, figs = render_index(data)
    out["index.html"] = index
    out.update(figs)
    gates, figs = render_gates(data)
    out["gates.html"] = gates
    out.update(figs)
    for name in sorted(data.catalog.ops):
        page, figs = render_op(name, data)
        out[f"ops/{name}.html"] = page
        out.update(figs)
    return out


def write_site(site_dir: Path, files: dict[str, str]) -> list[Path]:
    """Write every file atomically under the folder's lock; remove pages and figures no longer
    rendered (the screenshot stays)."""
    site_dir = Path(site_dir)
    with locked(site_dir):
        for rel, text in files.items():
            atomic_write_text(site_dir / rel, text)
        for old in [*site_dir.glob("ops/*.html"), *site_dir.glob("figures/*.svg")]:
            if old.relative_to(site_dir).as_posix() not in files:
                old.unlink()
    return [site_dir / rel for rel in files]


def project_site(paths, catalog: Catalog, rows: list[Row], reach: ReachFile | None,
                 notes: dict[str, str]) -> SiteData:
    """The site's data as ``certify report`` has it: gates from <reports>/gates, lists from
    <reports>/lists.json."""
    from certify.gating.report import load_report  # noqa: PLC0415

    reports = Path(paths.reports)
    gates = [load_report(p) for p in sorted((reports / "gates").glob("*.json"))]
    lists_file = reports / "lists.json"
    lists = json.loads(lists_file.read_text()) if lists_file.is_file() else None
    return SiteData(catalog, rows, reach, notes, gates, lists)


def write_project_site(paths, catalog: Catalog, rows: list[Row], reach: ReachFile | None,
                       extras: list[str], site: Path, take_screenshot: bool = False,
                       browser: str | None = None) -> list[Path]:
    """``certify report --html``: the site from the same data as the Markdown report, and with
    ``take_screenshot`` its index.png (``browser``: the Chromium executable; default: on PATH)."""
    import shutil  # noqa: PLC0415

    from certify.report import project_guards, project_mutants, render_all  # noqa: PLC0415

    notes = {rel[len("ops/"):-len(".md")]: text for rel, text in
             render_all(catalog, rows, extras, reach, project_guards(paths),
                        project_mutants(paths)).items()
             if rel.startswith("ops/")}
    written = write_site(site, render_site(project_site(paths, catalog, rows, reach, notes)))
    if take_screenshot:
        browser = browser or shutil.which("chromium") or shutil.which("chromium-browser")
        written.append(screenshot(site, browser))
    return written


def screenshot(site_dir: Path, browser: str | None = None) -> Path:
    """A full-page PNG of index.html, taken in headless Chromium (playwright)."""
    from playwright.sync_api import sync_playwright  # noqa: PLC0415

    page_file = Path(site_dir).resolve() / "index.html"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser, args=BROWSER_ARGS)
        try:
            page = b.new_page(viewport={"width": 1200, "height": 900})
            page.goto(page_file.as_uri())
            png = page.screenshot(full_page=True)
        finally:
            b.close()
    out = Path(site_dir) / SCREENSHOT
    atomic_write_bytes(out, png)
    return out


BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
