"""Dispatch is measured: on the committed perf records (reports/perf/, bench/perf_records.py on the
GPU), at every traced shape, the variant the dispatch rules choose within a numerics tier is within
10 % of the fastest variant certified for that tier there; a planted slow rule fails the check."""

from __future__ import annotations

import pytest

from certify.catalog.load import Catalog, load_catalog
from certify.files.paths import project_paths
from certify.perf import check_dispatch, load_perf, perf_dir
from certify.perf.records import PerfRecord, write_perf
from certify.reach import load_reach
from certify.receipts.store import freshness, load_receipts

pytestmark = pytest.mark.premerge


def _certified_on(paths):
    books = load_receipts(paths.receipts)

    def certified(op, variant, arch) -> bool:
        book = books.get(arch, {})
        return any(freshness(book.get((op.op, variant, c.id)), op, variant, c, arch) == "certified"
                   for c in op.cells)
    return certified


def _setup():
    paths = project_paths()
    return paths, load_catalog(paths.cells), load_reach(paths.reach), load_perf(perf_dir(paths))


def test_the_committed_records_hold_the_dispatch_rules_to_ten_percent():
    paths, catalog, reach, records = _setup()
    if not records:
        pytest.skip("no perf records committed under reports/perf/ yet (bench/perf_records.py "
                    "writes them on the GPU machine)")
    checks = check_dispatch(catalog, reach, records, _certified_on(paths))
    assert {c.op for c in checks} >= {"gdn_prefill"}, "no perf record at a traced gdn_prefill shape"
    assert {c.tier for c in checks if c.op == "gdn_prefill"} == {"exact", "bf16_operands"}
    problems = [c.problem for c in checks if c.problem]
    assert not problems, "\n".join(problems)


def _plant_first(catalog: Catalog, op_name: str, variant: str) -> Catalog:
    op = catalog.ops[op_name]
    moved = [v for v in op.variants if v.name == variant]
    planted = op.model_copy(update={"variants": tuple(moved + [v for v in op.variants
                                                               if v.name != variant])})
    return Catalog(ops={**catalog.ops, op_name: planted}, files=catalog.files)


def test_a_planted_slow_rule_fails_on_the_committed_records():
    paths, catalog, reach, records = _setup()
    if not records:
        pytest.skip("no perf records committed under reports/perf/ yet")
    certified = _certified_on(paths)
    # the slowest certified exact variant with records, moved to the front of the file
    times = {}
    for r in records:
        if r.op == "gdn_prefill" and catalog.ops["gdn_prefill"].variant(r.variant).numerics == \
                "exact" and certified(catalog.ops["gdn_prefill"], r.variant, r.arch):
            times[r.variant] = max(times.get(r.variant, 0.0), r.us)
    slow = max(times, key=times.get)
    checks = check_dispatch(_plant_first(catalog, "gdn_prefill", slow), reach, records, certified)
    assert any(c.problem and f"choose {slow}" in c.problem for c in checks)


def _record(variant: str, us: float, axes: dict) -> PerfRecord:
    return PerfRecord(op="gdn_prefill", variant=variant, arch="sm_90", axes=axes, us=us,
                      how="graph", script="test", date="2026-12-03")


def test_records_round_trip_and_a_missing_fallback_record_is_named(tmp_path):
    paths, catalog, reach, _ = _setup()
    axes = dict(batch=1, head_dim=128, key_heads=16, seq_len=8192, value_heads=48)
    recs = [_record("gluon_chunked", 1000.0, axes), _record("triton_chunked", 1500.0, axes),
            _record("flashinfer_chunked", 400.0, axes)]
    write_perf(tmp_path, recs)
    write_perf(tmp_path, [_record("gluon_chunked", 1010.0, axes)])   # replaces its record
    loaded = load_perf(tmp_path)
    assert len(loaded) == 3 and {r.variant: r.us for r in loaded}["gluon_chunked"] == 1010.0
    checks = [c for c in check_dispatch(catalog, reach, loaded, lambda op, v, arch: True)
              if dict(c.axes)["seq_len"] == 8192]
    exact = [c for c in checks if c.tier == "exact"]
    assert exact and not exact[0].problem
    tier = {c.absent: c for c in checks if c.tier == "bf16_operands"}
    assert not tier[()].problem            # flashinfer_chunked is first and fastest
    # without flashinfer the rules fall back to spec_bf16_operands, which has no record here
    assert "choose spec_bf16_operands" in tier[("flashinfer",)].problem
    slow = recs + [_record("spec_bf16_operands", 60000.0, axes)]
    checks = [c for c in check_dispatch(catalog, reach, slow, lambda op, v, arch: True)
              if dict(c.axes)["seq_len"] == 8192 and c.tier == "bf16_operands"]
    assert [c for c in checks if c.absent == ("flashinfer",)][0].problem is None


def test_a_damaged_record_names_its_file_line_and_field(tmp_path):
    from certify.files.problem import FileProblem
    (tmp_path / "sm_90.jsonl").write_text('{"op": "x"}\n')
    with pytest.raises(FileProblem) as err:
        load_perf(tmp_path)
    assert err.value.line == 1 and err.value.field in ("variant", "arch", "axes", "us")
