"""The report's first screen: the op x arch summary counts every target where it runs, and a
certified cell shows its nearest output's measured error against that output's band."""

from __future__ import annotations

from types import SimpleNamespace

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.report import Row, _measured, op_summary


def _row(op, variant, status):
    return Row(op, variant, "c", "premerge", "", status, {}, {})


def test_the_summary_counts_each_arch_and_names_what_is_not_certified():
    rows = [_row("a", "v1", {"cpu": "certified", "sm_90": "certified"}),
            _row("a", "v2", {"sm_90": "failed"}),
            _row("a", "v3", {"sm_90": "stale"}),
            _row("b", "v1", {"cpu": "certified"})]
    assert op_summary(rows, ["cpu", "sm_90"]) == [
        ["a", "1/1", "1/3 (1 failed, 1 stale)"],
        ["b", "1/1", "-"]]


def test_a_certified_cell_shows_its_nearest_output_against_its_band():
    op = load_catalog(project_paths().cells).ops["gdn_decode"]
    cell = next(c for c in op.cells if c.oracle.kind != "bitwise" and len(c.oracle.outputs) > 1)
    (a, band_a), (b, band_b) = [(n, o.max_ulp) for n, o in cell.oracle.outputs.items()][:2]
    variant = op.variants[0].name
    near_a = SimpleNamespace(variant=variant,
                             metrics={f"{a}.ulp": 0.9 * band_a, f"{b}.ulp": 0.1 * band_b})
    near_b = SimpleNamespace(variant=variant,
                             metrics={f"{a}.ulp": 0.1 * band_a, f"{b}.ulp": 0.9 * band_b})
    assert _measured(near_a, op, cell.id) == f"{0.9 * band_a:.2f}/{band_a:g} ulp {a}"
    assert _measured(near_b, op, cell.id) == f"{0.9 * band_b:.2f}/{band_b:g} ulp {b}"
    assert _measured(SimpleNamespace(metrics={"x.mismatches": 0.0})) == "bitwise"


def test_the_op_note_shows_every_output_against_its_band():
    """The matrix shows a cell's nearest output; the op note shows each, in ulp and relative RMS,
    for every fresh receipt (certified or not), as measured against the band it is judged by."""
    from certify.report import op_markdown, project_rows
    from certify.report.rows import measured_per_output
    paths = project_paths()
    catalog = load_catalog(paths.cells)
    op = catalog.ops["gdn_decode"]
    cell = next(c for c in op.cells if c.oracle.kind != "bitwise" and len(c.oracle.outputs) > 1)
    (a, ba), (b, bb) = list(cell.oracle.outputs.items())[:2]
    r = SimpleNamespace(variant=op.variants[0].name, metrics={
        f"{a}.ulp": 0.9 * ba.max_ulp, f"{a}.rel_rms": 0.5 * ba.max_rel_rms,
        f"{b}.ulp": 0.1 * bb.max_ulp, f"{b}.rel_rms": 0.2 * bb.max_rel_rms})
    assert measured_per_output(r, op, cell.id) == (
        f"{a} {0.9 * ba.max_ulp:.2f}/{ba.max_ulp:g} ulp, rel RMS {0.5 * ba.max_rel_rms:.2f}/"
        f"{ba.max_rel_rms:g} eps; {b} {0.1 * bb.max_ulp:.2f}/{bb.max_ulp:g} ulp, rel RMS "
        f"{0.2 * bb.max_rel_rms:.2f}/{bb.max_rel_rms:g} eps")
    bop, bcell = next((o, c) for o in catalog.ops.values() for c in o.cells
                      if c.oracle.kind == "bitwise")
    bitwise = SimpleNamespace(variant=bop.variants[0].name,
                              metrics={"o.mismatches": 0.0, "s.mismatches": 3.0})
    assert measured_per_output(bitwise, bop, bcell.id) == "o bitwise; s 3 differ"
    rows = [row for row in project_rows(paths, catalog) if row.op == op.op]
    note = op_markdown(op, rows)
    shown = [row for row in rows for arch, s in row.status.items() if s == "certified"]
    assert shown
    for row in shown:
        for arch, s in row.status.items():
            if s == "certified":
                rc = row.receipts[arch]
                line = f"- `{row.variant}` at `{row.cell}` on {arch}: " \
                       f"{measured_per_output(rc, op, row.cell)}"
                assert line in note
                for name in op.cell(row.cell).oracle.outputs:
                    assert f"{name} {rc.metrics[f'{name}.ulp']:.2f}/" in line, (line, name)


def test_the_list_column_names_the_list_that_runs_each_arch():
    from certify.report import list_tier_text
    assert list_tier_text("premerge", {"cpu": "premerge", "sm_90": "premerge"}) == "premerge"
    assert list_tier_text("premerge", {"cpu": "premerge", "cpu-interpret": "premerge",
                                       "sm_90": "postmerge"}) == \
        "premerge (cpu, cpu-interpret); postmerge (sm_90)"
    assert list_tier_text("ondemand", {}) == "ondemand"


def test_the_matrix_rows_take_their_tier_from_the_generated_lists():
    from certify.report import project_rows
    paths = project_paths()
    rows = project_rows(paths, load_catalog(paths.cells))
    split = [r for r in rows if ";" in r.tier]
    assert split, "no (variant, cell) runs in two lists: the lists' tiers did not reach the rows"
    assert all("(sm_90)" in r.tier or "sm_90" in r.tier for r in split)


def test_an_op_note_names_the_tests_that_guard_it():
    from certify.report import op_markdown, project_guards
    paths = project_paths()
    guards = project_guards(paths)
    catalog = load_catalog(paths.cells)
    assert guards.get("moe"), "no guard or property test of moe in the item universe"
    note = op_markdown(catalog.ops["moe"], [], guards=guards)
    section = note.split("## Tests that guard it", 1)[1].split("\n## ", 1)[0]
    for test_id, _, _ in guards["moe"]:
        assert f"`{test_id}`" in section
    bare = op_markdown(catalog.ops["moe"], [], guards={})
    assert "only its cells above check it" in bare
