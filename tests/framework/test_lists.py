"""The generated test lists (certify.lists): current, deterministic, fast, sensible under a shrinking
budget, at least as good as a hand-written list of the same budget; the budgets file's errors."""

import fnmatch
import subprocess
import sys

import pytest

from certify.files.problem import FileProblem
from certify.lists.budgets import load_budgets
from certify.lists import (build_items, generate, items_text, list_tiers, load_inputs, render_all,
                           select, sweep)
from certify.files.paths import project_paths
from certify.pytest_plugin import UNIVERSE

PATHS = project_paths()
REGENERATE = "run `certify lists` (`certify lists --collect` when tests changed) and commit test_lists/"


@pytest.fixture(scope="module")
def inp():
    return load_inputs(PATHS)


def test_the_committed_lists_are_current(inp):
    where = {"lists": PATHS.lists, "reports": PATHS.reports}
    stale = []
    for key, text in render_all(inp).items():
        base, _, rel = key.partition("/")
        p = where[base] / rel
        if not p.is_file() or p.read_text() != text:
            stale.append(str(p.relative_to(PATHS.root)))
    assert not stale, f"stale: {stale}; {REGENERATE}"


def test_the_item_universe_is_current(request, tmp_path):
    """test_lists/items.json is what this suite collects (from this session when it collected the
    whole suite, else from a collection run)."""
    records = request.config.stash.get(UNIVERSE, None)
    if records is None:
        out = tmp_path / "items.json"
        subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                        "--certify-items", str(out)], cwd=PATHS.root, capture_output=True, timeout=120)
        text = out.read_text()
    else:
        text = items_text(records)
    committed = (PATHS.lists / "items.json").read_text()
    assert committed == text, f"test_lists/items.json is stale: {REGENERATE}"


def test_pytest_premerge_follows_the_premerge_list(request):
    tiers = list_tiers(PATHS.lists)
    assert tiers is not None
    for item in request.session.items:
        if item.nodeid in tiers:
            marks = {m.name for m in item.iter_markers()} & {"premerge", "postmerge", "ondemand"}
            assert marks == {tiers[item.nodeid]}, (item.nodeid, marks)


def test_generation_is_deterministic(inp):
    a = generate(inp)
    b = generate(inp)
    assert [(i.id, i.tier, i.shard) for i in a.items] == [(i.id, i.tier, i.shard) for i in b.items]
    assert all(t.gap is not None and t.gap <= 1e-9 for t in a.tiers.values())  # exact
    pre = a.tiers["premerge"]
    assert pre.cost <= pre.budget + 1e-6 or all(i.mandatory for i in pre.items)


def test_every_item_is_placed_once_and_guards_are_premerge(inp):
    sel = generate(inp)
    placed = [i.id for t in sel.tiers.values() for i in t.items]
    assert sorted(placed) == sorted(i.id for i in sel.items)
    assert all(i.tier == "premerge" for i in sel.items if i.guards)
    # the cheapest cell of a reached variant runs in the first tier that runs its arch: pre-merge for
    # the CPU archs, post-merge for a GPU arch (the pre-merge list runs on CI's CPU)
    first = {arch: next(t for t, b in inp.budgets.tiers.items() if arch in b.archs)
             for b in inp.budgets.tiers.values() for arch in b.archs}
    cheapest = [i for i in sel.items if (i.mandatory or "").startswith("the cheapest")]
    assert all(i.tier == first[i.arch] for i in cheapest), [
        (i.id, i.tier) for i in cheapest if i.tier != first[i.arch]]
    assert {i.tier for i in cheapest} == {"premerge", "postmerge"}


def test_shrinking_the_premerge_budget_moves_out_low_risk_per_second_first(inp):
    rows = sweep(inp)
    guards = {i.id for i in generate(inp).items if i.guards}
    by = {i.id: i for i in generate(inp).items}
    for prev, row in zip(rows, rows[1:]):
        assert guards <= row["ids"], "a guard left the pre-merge list"
        assert row["risk"] <= prev["risk"] + 1e-9 and row["cost"] <= prev["cost"] + 1e-9
        assert row["lost_per_s"] is not None and row["lost_per_s"] >= 0
        out = prev["ids"] - row["ids"]
        kept = [by[i] for i in row["ids"] if not by[i].mandatory]
        if out and kept:  # what leaves is, on average, worth less per second than what stays
            leave = sum(by[i].risk for i in out) / sum(by[i].cost for i in out)
            stay = sum(i.risk for i in kept) / sum(i.cost for i in kept)
            assert leave <= stay, (row["budget"], leave, stay)
    # The coverage lost per equal budget step grows as the budget shrinks (the cheap risk goes last),
    # up to what a 0/1 selection can differ from the relaxed one. The relaxed (fractional) optimum
    # F(B) is concave in the budget, so its equal-step losses never shrink; the exact 0/1 optimum
    # V(B) lies in [F(B) - r, F(B)], r the largest risk of one item the knapsack may leave out. So
    # each step's loss is at most the next step's plus 2 r. The bound is provable, not tuned: with
    # the durations of 2026-11-30 the first step lost 6.74 and the second 6.46 (r = 12.5), which a
    # plain sorted() comparison refused although both selections are optimal.
    # The steps compared are those of equal width: both ends at or above the mandatory items' cost
    # (the list at budget 0), below which the list cannot shrink and a step is cut short.
    floor = rows[-1]["cost"]
    full = [row for row in rows if row["budget"] >= floor]
    lost = [prev["risk"] - row["risk"] for prev, row in zip(full, full[1:])]
    assert len(lost) >= 3, (floor, [row["budget"] for row in rows])
    r = max(i.risk for i in by.values() if not i.mandatory)
    assert all(a <= b + 2 * r for a, b in zip(lost, lost[1:])), (lost, r)
    assert lost[-1] >= lost[0]      # over the whole sweep the loss per step grows


# A hand-written pre-merge list: what a person would pick within the same budget. The mandatory
# items (guards, cheapest cell of every reached variant, pins) first, then whole folders in the
# order someone would rank them, first fit.
BASELINE = ["tests/framework/*", "tests/spec/*", "tests/ops/*", "certify/cells/*-cpu]",
            "tests/engine/test_engine_config.py*", "tests/engine/test_admission.py*",
            "tests/engine/test_engine.py*", "tests/engine/*", "tests/tasks/*", "certify/cells/*"]


def test_the_generated_premerge_list_covers_at_least_a_hand_written_one(inp):
    sel = generate(inp)
    pre = sel.tiers["premerge"]
    budget = pre.budget
    runnable = [i for i in sel.items if i.arch in ("cpu", "cpu-interpret") and i.measured]
    chosen = {i.id: i for i in sel.items if i.mandatory and i.tier == "premerge"}
    cost = sum(i.cost for i in chosen.values())
    for pattern in BASELINE:
        for it in sorted(runnable, key=lambda i: i.id):
            if it.id not in chosen and fnmatch.fnmatch(it.id, pattern) and cost + it.cost <= budget:
                chosen[it.id] = it
                cost += it.cost
    base_risk = sum(i.risk for i in chosen.values())
    print(f"\nbudget {budget:.0f} s: generated {pre.risk:.2f} risk in {pre.cost:.1f} s "
          f"({len(pre.items)} items); hand-written {base_risk:.2f} in {cost:.1f} s ({len(chosen)})")
    assert cost <= budget
    assert pre.risk >= base_risk - 1e-9


@pytest.mark.parametrize("text, line, field", [
    ("tiers:\n  premerge: {budget: -3, archs: [cpu]}\n", 2, "tiers.premerge.budget"),
    ("tiers: {}\nestimates: 1\n", 2, "estimates"),
    ("tiers:\n  premerge:\n    archs: [cpu]\n    shardz: 2\n", 4, "tiers.premerge.shardz"),
    ("tiers: [\n", 2, "(yaml)"),
])
def test_budgets_errors_name_file_line_and_field(tmp_path, text, line, field):
    real = (PATHS.budgets).read_text()
    assert load_budgets(PATHS.budgets)  # the committed file loads
    p = tmp_path / "budgets.yaml"
    # the committed file with its tiers replaced, so the only problem is the planted one
    rest = real[real.index("\nconditions:"):]
    p.write_text(text + (rest if "estimates" not in text and "[\n" not in text else ""))
    with pytest.raises(FileProblem) as e:
        load_budgets(p)
    assert (e.value.line, e.value.field) == (line, field), str(e.value)
    assert str(p) in str(e.value)


def test_a_gate_without_a_pytest_duration_takes_its_reports_measured_cost(inp, tmp_path):
    """The lists cost a gate by its last committed `certify gates run` report, not the estimate."""
    import json

    from certify.lists.selection import gate_report_seconds

    gate = next(r for r in inp.records if "gate" in r and r["id"] not in inp.durations)
    name = gate["gate"]["name"]
    (tmp_path / f"{name}.json").write_text(json.dumps({"gate": name, "status": "passed",
                                                       "seconds": 1234.5}))
    (tmp_path / "skipped.json").write_text(json.dumps({"gate": "other", "status": "skipped",
                                                       "seconds": 3.0}))
    (tmp_path / "broken.json").write_text("{")
    seconds = gate_report_seconds(tmp_path)
    assert seconds == {"cpu": {name: 1234.5}}
    items = {i.id: i for i in build_items(inp.records, inp.durations, inp.budgets, inp.reach,
                                          inp.ops, seconds)}
    assert items[gate["id"]].cost == 1234.5 and items[gate["id"]].measured
    estimated = {i.id: i for i in build_items(inp.records, inp.durations, inp.budgets, inp.reach,
                                              inp.ops)}
    assert not estimated[gate["id"]].measured


def test_a_gate_measured_on_a_gpu_costs_that_on_a_tier_with_the_gpu(inp, tmp_path):
    """A gate's run on a GPU arch (reports/gates/<arch>/<gate>.json) is its cost on a tier whose
    machine has that arch and a GPU; a tier without one keeps the CPU cost."""
    import json

    from certify.lists.selection import gate_report_seconds

    gate = next(r for r in inp.records if "gate" in r and r["id"] not in inp.durations)
    name = gate["gate"]["name"]
    gpu_arch = inp.budgets.conditions.gpu_archs[0]
    (tmp_path / f"{name}.json").write_text(json.dumps({"gate": name, "status": "passed",
                                                       "seconds": 300.0, "arch": "cpu"}))
    (tmp_path / gpu_arch).mkdir()
    (tmp_path / gpu_arch / f"{name}.json").write_text(json.dumps(
        {"gate": name, "status": "passed", "seconds": 40.0, "arch": gpu_arch}))
    seconds = gate_report_seconds(tmp_path)
    assert seconds == {"cpu": {name: 300.0}, gpu_arch: {name: 40.0}}
    item = {i.id: i for i in build_items(inp.records, inp.durations, inp.budgets, inp.reach,
                                         inp.ops, seconds)}[gate["id"]]
    assert item.cost == 300.0 and item.arch_cost == {gpu_arch: 40.0}
    assert item.cost_on((gpu_arch, "cpu"), gpus=1) == 40.0
    assert item.cost_on(("cpu",), gpus=0) == 300.0
    assert item.cost_on((gpu_arch,), gpus=0) == 300.0   # the arch without its GPU: not there
    b = inp.budgets
    items = build_items(inp.records, inp.durations, b, inp.reach, inp.ops, seconds)
    placed = {i.id: i for i in select(items, b, inp.reach).items}[gate["id"]]
    tb = b.tiers[placed.tier]
    assert placed.cost == (40.0 if gpu_arch in tb.archs and tb.gpus else 300.0)
