"""The selection: mandatory items, the exact 0/1 knapsack per tier, LPT shards; and the whole
generator from the committed inputs."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from certify.lists.budgets import Budgets, load_budgets, pin_errors
from certify.lists.records import TIERS, load_durations, load_items
from certify.lists.risk import Item, build_items, feature_weight_total, reach_index
from certify.files.utf8 import read_utf8

# ------------------------------------------------------------------------------ selection


@dataclass
class TierResult:
    tier: str
    items: list[Item]
    cost: float
    risk: float
    budget: float | None       # seconds
    mandatory_cost: float
    gap: float | None          # the solver's proven relative gap (0: optimal)
    shards: list[list[Item]]


@dataclass
class Selection:
    items: list[Item]
    tiers: dict[str, TierResult]
    total_risk: float
    seconds: float
    unplaced_mandatory: list[str]

    def by_id(self) -> dict[str, Item]:
        return {it.id: it for it in self.items}


@contextlib.contextmanager
def _quiet_stdout():
    try:
        sys.stdout.flush()
        fd = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(fd, 1)
        os.close(fd)
        os.close(null)


def knapsack(values: np.ndarray, costs: np.ndarray, capacity: float) -> tuple[np.ndarray, float]:
    """Exact 0/1 knapsack: the 0/1 vector of most value with cost <= capacity, and the proven gap."""
    n = len(values)
    chosen = np.zeros(n, dtype=bool)
    if n == 0 or capacity <= 0:
        chosen[:] = (costs <= 0) & (values > 0) if n else chosen
        return chosen, 0.0
    free = costs <= 1e-12
    chosen[free] = values[free] > 0
    idx = np.where(~free & (values > 0) & (costs <= capacity))[0]
    if len(idx) == 0:
        return chosen, 0.0
    if costs[idx].sum() <= capacity:
        chosen[idx] = True
        return chosen, 0.0
    from scipy.optimize import Bounds, LinearConstraint, milp  # noqa: PLC0415
    with _quiet_stdout():  # HiGHS may print a debug line from C++
        res = milp(c=-values[idx], integrality=np.ones(len(idx)), bounds=Bounds(0, 1),
                   constraints=LinearConstraint(costs[idx][None, :], -np.inf, capacity),
                   options={"mip_rel_gap": 0.0, "time_limit": 5.0, "presolve": True})
    if res.x is None:
        raise RuntimeError(f"the knapsack solver failed: {res.message}")
    chosen[idx] = res.x > 0.5
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    return chosen, gap


def lpt(items: list[Item], shards: int) -> list[list[Item]]:
    """Longest processing time first: each item, most expensive first, to the least loaded shard."""
    out: list[list[Item]] = [[] for _ in range(shards)]
    load = [0.0] * shards
    for it in sorted(items, key=lambda i: (-i.cost, i.id)):
        k = min(range(shards), key=lambda s: (load[s], s))
        out[k].append(it)
        load[k] += it.cost
        it.shard = k + 1
    return out


def _can_run(it: Item, tb) -> bool:
    return it.arch in tb.archs and it.gpus <= tb.gpus


def select(items: list[Item], b: Budgets, reach: dict | None,
           budget_premerge: float | None = None) -> Selection:
    t0 = time.perf_counter()
    for it in items:
        it.tier, it.mandatory, it.why = "ondemand", None, ""
    pre, post = b.tiers["premerge"], b.tiers["postmerge"]
    # 1. mandatory items
    mandatory: dict[str, dict[str, str]] = {t: {} for t in TIERS}
    unplaced: list[str] = []
    for it in sorted(items, key=lambda i: i.id):
        for op in it.guards:
            if _can_run(it, pre):
                mandatory["premerge"].setdefault(it.id, f"the guard of op {op}")
    cells: dict[tuple[str, str], list[Item]] = defaultdict(list)
    for it in items:
        if it.kind == "cell":
            cells[(it.op, it.variant)].append(it)
    for (op, var), archs in sorted(reach_index(reach).items()):
        cands = sorted(cells.get((op, var), []), key=lambda i: (i.cost, i.id))
        ci = [c for c in cands if _can_run(c, pre)]
        if ci:
            mandatory["premerge"].setdefault(
                ci[0].id, f"the cheapest pre-merge-runnable cell of the reached variant {op}/{var}")
        for arch in sorted(archs):
            if arch in pre.archs:
                continue
            native = [c for c in cands if c.arch == arch and _can_run(c, post)]
            if native:
                mandatory["postmerge"].setdefault(
                    native[0].id, f"the cheapest cell of the reached variant {op}/{var} on {arch}")
            elif not ci:
                unplaced.append(f"{op}/{var} on {arch}: reached, but no cell item can run it")
    known = {it.id for it in items}
    for tier, pins in b.pinned.items():
        for iid, why in sorted(pins.items()):
            if iid in known:
                mandatory[tier].setdefault(iid, f"pinned by the budgets file: {why}")
            else:
                unplaced.append(f"pinned {iid}: no such item")
    for m in mandatory["premerge"]:
        mandatory["postmerge"].pop(m, None)
    results: dict[str, TierResult] = {}
    left = sorted(items, key=lambda i: i.id)
    for tier in TIERS:
        tb = b.tiers[tier]
        limit = tb.budget_seconds
        if tier == "premerge" and budget_premerge is not None:
            limit = budget_premerge * {"cpu_seconds": 1.0, "seconds": 1.0}.get(tb.unit, 60.0)
        must = [it for it in left if it.id in mandatory[tier]]
        for it in must:
            it.mandatory = mandatory[tier][it.id]
            it.why = f"mandatory {tier}: {it.mandatory}"
        # what an item costs on this tier's machine (a gate measured on its GPU: that cost)
        cost = {it.id: it.cost_on(tb.archs, tb.gpus) for it in left}
        must_ids = {it.id for it in must}
        mcost = sum(cost[it.id] for it in must)
        if tier == "ondemand" or limit is None:
            chosen = [it for it in left if it.id not in must_ids]
            gap = 0.0
            for it in chosen:
                it.why = it.why or ("did not fit the budgets of the earlier tiers" if tier == "ondemand"
                                    else f"{tier} is unlimited")
        else:
            cands = [it for it in left if it.id not in must_ids and _can_run(it, tb)
                     and not (tier == "premerge" and b.estimates.measured_only_premerge
                              and not it.measured)]
            vals = np.array([it.risk for it in cands], dtype=float)
            costs = np.array([cost[it.id] for it in cands], dtype=float)
            pick, gap = knapsack(vals, costs, limit - mcost)
            chosen = [it for it, p in zip(cands, pick) if p]
            for it in chosen:
                it.why = (f"packed into {tier} by the exact knapsack (risk {it.risk:.4g} for "
                          f"{cost[it.id]:.2f} s, {it.risk / max(cost[it.id], 1e-9):.4g} risk/s)")
        placed = must + chosen
        for it in placed:
            it.tier = tier
            it.cost = cost[it.id]
        placed.sort(key=lambda i: i.id)
        shards = lpt(placed, tb.shards)
        results[tier] = TierResult(tier, placed, sum(i.cost for i in placed),
                                   sum(i.risk for i in placed), limit, mcost, gap, shards)
        ids = {it.id for it in placed}
        left = [it for it in left if it.id not in ids]
    return Selection(items, results, feature_weight_total(items), time.perf_counter() - t0, unplaced)


# ------------------------------------------------------------------------------ the whole generator


@dataclass
class Inputs:
    budgets: Budgets
    records: list[dict]
    durations: dict[str, float]
    reach: dict | None
    ops: list[str]
    # last measured, arch -> gate name -> seconds
    gate_seconds: dict[str, dict[str, float]] = field(default_factory=dict)


def load_inputs(paths) -> Inputs:
    """The generator's inputs; ``FileProblem`` for the first problem of the budgets file, a pin that
    matches no item included."""
    b = load_budgets(paths.budgets)
    records = load_items(paths.lists / "items.json")
    bad_pins = pin_errors(paths.budgets, b, {r["id"] for r in records})
    if bad_pins:
        raise bad_pins[0]
    durations = load_durations(paths.lists / "durations.json")
    reach = json.loads(read_utf8(paths.reach)) if paths.reach.is_file() else None
    ops = sorted(p.stem for p in paths.cells.glob("*.yaml"))
    return Inputs(b, records, durations, reach, ops, gate_report_seconds(Path(paths.reports) / "gates"))


def gate_report_seconds(gates_dir: Path) -> dict[str, dict[str, float]]:
    """Each gate's cost as its committed reports measured it, by the arch it ran on and gate name:
    reports/gates/<gate>.json (``certify gates run --update-reports``) and a GPU arch's runs in
    reports/gates/<arch>/<gate>.json. Skipped runs and unreadable reports give none."""
    out: dict[str, dict[str, float]] = {}
    if not gates_dir.is_dir():
        return out
    paths = sorted(gates_dir.glob("*.json")) + sorted(gates_dir.glob("*/*.json"))
    for p in paths:
        try:
            r = json.loads(read_utf8(p))
        except (OSError, ValueError):
            continue
        if isinstance(r, dict) and r.get("status") not in (None, "skipped") and r.get("gate") \
                and float(r.get("seconds") or 0) > 0:
            arch = str(r.get("arch") or "cpu")
            out.setdefault(arch, {}).setdefault(r["gate"], float(r["seconds"]))
    return out


def generate(inp: Inputs, budget_premerge: float | None = None) -> Selection:
    items = build_items(inp.records, inp.durations, inp.budgets, inp.reach, inp.ops,
                        inp.gate_seconds)
    return select(items, inp.budgets, inp.reach, budget_premerge)
