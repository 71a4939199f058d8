"""The HTML report: the committed site is what ``certify report --html`` writes, and it renders in a
real headless browser (Debian's chromium through playwright) with a heatmap that agrees with the
receipts, computed here independently of the report's rows.

The figures are byte-identical across numpy's x86 dispatch levels (rendered under
``NPY_DISABLE_CPU_FEATURES`` at X86_V2, X86_V3 and X86_V4 with the same bytes), so the staleness
check compares bytes.
"""

from __future__ import annotations

import math
import os
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.catalog.plan import targets
from certify.reach import load_reach
from certify.receipts.store import Receipt, freshness, load_receipts
from certify.report import (SITE_DIR, Row, project_guards, project_mutants, project_rows, render_all,
                            report_extras)

PATHS = project_paths()
SITE = PATHS.reports / SITE_DIR
REGENERATE = "run `certify report --html` and commit reports/html/"


def _site():
    from certify.report.html import project_site, render_site  # noqa: PLC0415

    cat = load_catalog(PATHS.cells)
    rows = project_rows(PATHS, cat)
    reach = load_reach(PATHS.reach)
    notes = {rel[4:-3]: text for rel, text in
             render_all(cat, rows, report_extras(PATHS.extras), reach, project_guards(PATHS),
                        project_mutants(PATHS)).items()
             if rel.startswith("ops/")}
    return render_site(project_site(PATHS, cat, rows, reach, notes))


def test_the_html_site_is_current_and_links_only_to_its_own_files():
    import re  # noqa: PLC0415

    files = _site()
    stale = [rel for rel, text in files.items()
             if not (SITE / rel).is_file() or (SITE / rel).read_text() != text]
    on_disk = {p.relative_to(SITE).as_posix() for p in SITE.rglob("*") if p.is_file()}
    orphaned = sorted(on_disk - set(files) - {"index.png", ".certify.lock"})
    assert not stale and not orphaned, f"stale: {stale[:10]}, orphaned: {orphaned}; {REGENERATE}"
    assert (SITE / "index.png").is_file(), "no screenshot: run `certify report --screenshot`"
    missing = []
    for rel, text in files.items():
        if rel.endswith(".html"):
            base = Path(rel).parent
            for ref in re.findall(r'(?:href|src)="([^"#:]+)"', text):
                target = os.path.normpath(base / ref).replace(os.sep, "/")
                if target not in files:
                    missing.append(f"{rel} -> {ref}")
    assert not missing, missing[:10]


def test_band_fraction_reads_the_worst_banded_output():
    from certify.report.html import band_fraction  # noqa: PLC0415

    cat = load_catalog(PATHS.cells)
    op = next(o for o in cat.ops.values() if any(c.oracle.kind != "bitwise" for c in o.cells))
    cell = next(c for c in op.cells if c.oracle.kind != "bitwise")
    bands = {n: b.max_ulp for n, b in cell.oracle.outputs.items()}
    name, band = next(iter(bands.items()))
    receipt = Receipt(op=op.op, variant="v", cell=cell.id, arch="cpu", status="passed",
                      metrics={f"{name}.ulp": 0.5 * band}, hash="h", date="2026-01-01")
    row = Row(op.op, "v", cell.id, cell.tier, "", {"cpu": "certified"}, {}, {"cpu": receipt})
    assert band_fraction(row, op, "cpu") == pytest.approx(0.5)
    widened = receipt.model_copy(update={"metrics": {f"{name}.ulp": 3.0 * band}})
    assert band_fraction(replace(row, receipts={"cpu": widened}), op, "cpu") == pytest.approx(3.0)
    differs = receipt.model_copy(update={"metrics": {"out.mismatches": 2.0}})
    assert math.isinf(band_fraction(replace(row, receipts={"cpu": differs}), op, "cpu"))
    assert band_fraction(replace(row, receipts={}), op, "cpu") is None


def test_write_site_removes_pages_it_no_longer_renders(tmp_path):
    from certify.report.html import write_site  # noqa: PLC0415

    write_site(tmp_path, {"index.html": "a", "ops/x.html": "x", "figures/x-bands.svg": "<svg/>"})
    (tmp_path / "index.png").write_bytes(b"png")
    write_site(tmp_path, {"index.html": "b"})
    assert (tmp_path / "index.html").read_text() == "b"
    assert not (tmp_path / "ops" / "x.html").exists()
    assert not (tmp_path / "figures" / "x-bands.svg").exists()
    assert (tmp_path / "index.png").exists()


def _expected_heatmap() -> dict[tuple[str, str], tuple[int, int]]:
    """(op, arch) -> (certified, targets), straight from the cell files and the receipts."""
    cat = load_catalog(PATHS.cells)
    books = load_receipts(PATHS.receipts)
    certified, total = Counter(), Counter()
    for op in cat.ops.values():
        for t in targets(op):
            key = (op.op, t.arch)
            total[key] += 1
            r = books.get(t.arch, {}).get((op.op, t.variant.name, t.cell.id))
            certified[key] += freshness(r, op, t.variant.name, t.cell, t.arch) == "certified"
    return {k: (certified[k], total[k]) for k in total}


def _browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_site_renders_in_a_headless_browser_with_the_receipts_heatmap():
    try:
        from playwright.sync_api import sync_playwright  # noqa: PLC0415
    except ImportError:
        sync_playwright = None
    browser = _browser()
    if sync_playwright is None or browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI installs chromium and playwright (.ci/run); neither may be missing")
        pytest.skip("needs Debian's chromium and playwright (pip install -e .[browser])")
    from certify.report.html import BROWSER_ARGS  # noqa: PLC0415

    expected = _expected_heatmap()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser, args=BROWSER_ARGS)
        try:
            page = b.new_page()
            page.goto((SITE / "index.html").resolve().as_uri())
            cells = page.eval_on_selector_all(
                "#heatmap-table td[data-op]",
                "tds => tds.map(t => [t.dataset.op, t.dataset.arch, t.dataset.certified || null, "
                "t.dataset.targets, t.textContent])")
            shown = {(o, a): (int(c), int(n)) for o, a, c, n, _ in cells if n != "0"}
            assert shown == expected
            for o, a, c, n, text in cells:
                if n != "0":
                    assert text.startswith(f"{c}/{n}"), (o, a, text)
            broken = []
            for rel in ["index.html", "gates.html", *sorted(f"ops/{o}.html" for o, _ in expected)]:
                page.goto((SITE / rel).resolve().as_uri())
                images = page.eval_on_selector_all(
                    "img", "imgs => imgs.map(i => [i.getAttribute('src'), i.complete && "
                    "i.naturalWidth > 0])")
                broken += [f"{rel}: {src}" for src, ok in images if not ok]
                assert page.title(), rel
            assert not broken, broken
        finally:
            b.close()
