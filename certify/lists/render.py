"""The generated files: the lists, their report (reports/lists.md, .svg), the budget sweep and the
consolidation of small items."""

from __future__ import annotations

import json
from collections import defaultdict


from certify.lists.budgets import Budgets
from certify.lists.records import HEADER, LIST_FORMAT, TIERS
from certify.lists.risk import Item, build_items, gate_cost
from certify.lists.selection import Inputs, Selection, generate, select

# ------------------------------------------------------------------------------ writers


def _fmt_cost(s: float) -> str:
    return f"{s:.2f} s" if s < 600 else f"{s / 60:.1f} min"


def _unit_value(seconds: float, unit: str) -> float:
    return seconds / {"cpu_seconds": 1.0, "seconds": 1.0, "gpu_minutes": 60.0, "minutes": 60.0}[unit]


def list_text(sel: Selection, tier: str, b: Budgets, members: list[Item] | None = None,
              shard: tuple[int, int] | None = None) -> str:
    tr = sel.tiers[tier]
    tb = b.tiers[tier]
    members = tr.items if members is None else members
    cost = sum(i.cost for i in members)
    risk = sum(i.risk for i in members)
    lines = [HEADER.rstrip("\n"), f"version: {LIST_FORMAT}", f"tier: {tier}"]
    if shard:
        lines.append(f"shard: {{index: {shard[0]}, of: {shard[1]}}}")
    limit = "null" if tr.budget is None else f"{_unit_value(tr.budget, tb.unit):.6g}"
    lines.append(f"budget: {{unit: {tb.unit}, limit: {limit}, "
                 f"cost: {_unit_value(cost, tb.unit):.6g}}}")
    lines.append(f"risk: {{covered: {risk:.6g}, of_all: {sel.total_risk:.6g}, "
                 f"share: {risk / sel.total_risk if sel.total_risk else 0:.4f}}}")
    lines.append(f"items: {len(members)}")
    lines.append(f"estimated: {sum(1 for i in members if not i.measured)}")
    lines.append("blocks:")
    groups: dict[tuple[str, int], list[Item]] = defaultdict(list)
    for it in members:
        groups[it.condition()].append(it)
    for (arch, gpus), its in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"- condition: {{arch: {arch}, system_gpu_count: {{gte: {gpus}}}}}")
        lines.append("  tests:")
        for it in sorted(its, key=lambda i: i.id):
            flag = "" if it.measured else " ESTIMATED"
            tag = " mandatory" if it.mandatory else ""
            lines.append(f"  - {json.dumps(it.id)}  # {it.cost:.2f} s{flag}, risk {it.risk:.4g}{tag}")
    return "\n".join(lines) + "\n"


def render_lists(sel: Selection, b: Budgets) -> dict[str, str]:
    """relative path under the lists folder -> text: the tier lists and their shard files."""
    out = {}
    for tier in TIERS:
        out[f"{tier}.yml"] = list_text(sel, tier, b)
        shards = sel.tiers[tier].shards
        for k, members in enumerate(shards, 1):
            out[f"shards/{tier}-{k}-of-{len(shards)}.yml"] = list_text(sel, tier, b, members,
                                                                       (k, len(shards)))
    return out


# ------------------------------------------------------------------------------ consolidation


def consolidation(records: list[dict], b: Budgets) -> tuple[list[dict], float, float]:
    """Checks that can share an engine configuration run in one engine: every gate's task runs (and a
    paired check's runs of the configuration compared with) grouped by engine configuration; one engine
    per configuration runs each eval set once at the most samples any check asks for.
    Returns (proposals, cost as the gates are, cost consolidated)."""
    est = b.estimates.gate
    per = lambda es: est.per_sample.get(es, est.default_per_sample)  # noqa: E731
    gates = [r["gate"] for r in records if "gate" in r]
    separate = sum(gate_cost(g, b) for g in gates)
    engines: dict[str, dict] = {}
    for g in gates:
        runs = [(json.dumps(g["engine"], sort_keys=True), es, n, g["name"]) for es, n in
                g["tasks"].values()]
        for task, against in g["paired"]:
            es, n = g["tasks"][task]
            runs.append((json.dumps(against, sort_keys=True), es, n, f"{g['name']} (paired)"))
        for key, es, n, who in runs:
            e = engines.setdefault(key, {"engine": key, "sets": {}, "users": set()})
            e["sets"][es] = max(e["sets"].get(es, 0), n)
            e["users"].add(who)
    merged = sum(est.engine_start + sum(n * per(es) for es, n in e["sets"].items())
                 for e in engines.values())
    proposals = []
    for key, e in sorted(engines.items()):
        users = sorted(e["users"])
        if len(users) > 1:
            alone = 0.0
            for who in users:
                name = who.split(" ")[0]
                g = next(x for x in gates if x["name"] == name)
                if who.endswith("(paired)"):
                    alone += est.engine_start + sum(n * per(es) for t, (es, n) in g["tasks"].items()
                                                    if t in {p for p, a in g["paired"]
                                                             if json.dumps(a, sort_keys=True) == key})
                else:
                    alone += est.engine_start + sum(n * per(es) for es, n in g["tasks"].values())
            one = est.engine_start + sum(n * per(es) for es, n in e["sets"].items())
            proposals.append({"engine": key, "users": users, "alone": alone, "merged": one,
                              "saved": alone - one})
    return proposals, separate, merged


# ------------------------------------------------------------------------------ report


def sweep(inp: Inputs, fractions=(1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
          ) -> list[dict]:
    """The pre-merge list as its budget shrinks: cost, risk covered, guards kept, what moved out."""
    full = inp.budgets.tiers["premerge"].budget
    rows, prev = [], None
    items = build_items(inp.records, inp.durations, inp.budgets, inp.reach, inp.ops,
                        inp.gate_seconds)
    for fr in fractions:
        sel = select(items, inp.budgets, inp.reach, budget_premerge=full * fr)
        tr = sel.tiers["premerge"]
        ids = {i.id for i in tr.items}
        row = {"fraction": fr, "budget": full * fr, "cost": tr.cost, "risk": tr.risk,
               "share": tr.risk / sel.total_risk, "items": len(tr.items),
               "guards": sum(1 for i in tr.items if i.guards), "out": [], "lost_per_s": None}
        if prev is not None:
            row["out"] = sorted(prev["ids"] - ids)
            saved = prev["cost"] - tr.cost
            row["lost_per_s"] = (prev["risk"] - tr.risk) / saved if saved > 0 else 0.0
        row["ids"] = ids
        rows.append(row)
        prev = row
    return rows


def _bar(frac: float, width: int = 30) -> str:
    n = max(0, min(width, round(frac * width)))
    return "#" * n + "." * (width - n)


def report_text(inp: Inputs, sel: Selection, rows: list[dict]) -> str:
    b = inp.budgets
    lines = ["# Test lists", "",
             "Generated by `certify lists` (do not edit). Costs are seconds per item, measured "
             "(`test_lists/durations.json`) or estimated (flagged); risk is the weight of the features "
             "an item exercises, shared among the items exercising each (`certify/budgets.yaml`).", "",
             "| tier | items | estimated | cost | budget | used | risk covered | share of all risk | "
             "shards (max load) | solver gap |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for tier in TIERS:
        tr = sel.tiers[tier]
        tb = b.tiers[tier]
        unit = tb.unit.replace("_", " ")
        cost = f"{_unit_value(tr.cost, tb.unit):.1f} {unit}"
        budget = "-" if tr.budget is None else f"{_unit_value(tr.budget, tb.unit):.1f} {unit}"
        used = "-" if not tr.budget else f"{tr.cost / tr.budget:.0%}"
        loads = [sum(i.cost for i in s) for s in tr.shards]
        lines.append(f"| {tier} | {len(tr.items)} | {sum(1 for i in tr.items if not i.measured)} | "
                     f"{cost} | {budget} | {used} | {tr.risk:.2f} | {tr.risk / sel.total_risk:.1%} | "
                     f"{len(tr.shards)} ({_fmt_cost(max(loads) if loads else 0)}) | "
                     f"{'-' if tr.gap is None else f'{tr.gap:.1e}'} |")
    lines += ["", "Cost against budget, and share of all risk covered:", "", "```"]
    for tier in TIERS:
        tr = sel.tiers[tier]
        if tr.budget:
            lines.append(f"{tier:<10} cost {_bar(tr.cost / tr.budget)} {tr.cost / tr.budget:6.1%} of "
                         "budget")
        else:
            lines.append(f"{tier:<10} cost {_fmt_cost(tr.cost)} (no budget)")
        lines.append(f"{'':<10} risk {_bar(tr.risk / sel.total_risk)} {tr.risk / sel.total_risk:6.1%}"
                     " of all risk")
    lines += ["```", "", "## Mandatory items", ""]
    for tier in ("premerge", "postmerge"):
        m = [i for i in sel.tiers[tier].items if i.mandatory]
        g = sum(1 for i in m if i.mandatory.startswith("the guard"))
        pins = sum(1 for i in m if i.mandatory.startswith("pinned"))
        lines.append(f"- {tier}: {len(m)} ({g} guards, {len(m) - g - pins} cheapest cells of reached "
                     f"variants, {pins} pinned by the budgets file), "
                     f"{_fmt_cost(sum(i.cost for i in m))}")
    for u in sel.unplaced_mandatory:
        lines.append(f"- not placed: {u}")
    lines += ["", "## Shrinking the pre-merge budget", "",
              "Each row re-solves the pre-merge knapsack at a smaller budget; `lost per s saved` is the "
              "risk that left the list per second of cost saved against the row above. Guards never "
              "leave.", "",
              "| budget | cost | items | guards | risk covered | share | lost per s saved | "
              "moved out (lowest risk/s first) |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    by = sel.by_id()
    for r in rows:
        out = sorted(r["out"], key=lambda i: (by[i].density, i))
        shown = ", ".join(f"`{i.split('::')[-1]}`" for i in out[:3]) + (
            f" and {len(out) - 3} more" if len(out) > 3 else "")
        lost = "-" if r["lost_per_s"] is None else f"{r['lost_per_s']:.4f}"
        lines.append(f"| {r['budget']:.0f} s | {r['cost']:.1f} s | {r['items']} | {r['guards']} | "
                     f"{r['risk']:.2f} | {r['share']:.1%} | {lost} | {shown} |")
    proposals, separate, merged = consolidation(inp.records, b)
    lines += ["", "## Consolidation: one engine per configuration", "",
              f"The gates as written build {sum(1 for r in inp.records if 'gate' in r)} engines plus "
              f"one per paired configuration: {_fmt_cost(separate)} estimated; with every check run in "
              f"the engine of its configuration: {_fmt_cost(merged)} (saves {_fmt_cost(separate - merged)})."
              , "", "| engine configuration | checks that fit in it | alone | merged | saved |",
              "|---|---|---:|---:|---:|"]
    for p in proposals:
        lines.append(f"| `{p['engine']}` | {', '.join(p['users'])} | {_fmt_cost(p['alone'])} | "
                     f"{_fmt_cost(p['merged'])} | {_fmt_cost(p['saved'])} |")
    est = [i for i in sel.items if not i.measured]
    lines += ["", "## Estimated costs", "",
              f"{len(est)} of {len(sel.items)} items have no measured duration (estimated from "
              "`certify/budgets.yaml`: by arch, by declared tier, gates by samples); "
              "record them with `pytest --record-durations`."]
    kinds: dict[str, int] = defaultdict(int)
    for i in est:
        kinds[f"{i.kind} on {i.arch}, declared {i.declared}"] += 1
    for k, n in sorted(kinds.items()):
        lines.append(f"- {k}: {n}")
    return "\n".join(lines) + "\n"


def report_svg(sel: Selection, b: Budgets) -> str:
    """A small bar chart: per tier, cost against budget and the share of all risk covered."""
    w, row_h, left = 640, 70, 110
    h = 40 + row_h * len(TIERS)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           '<text x="10" y="20" font-weight="bold">cost against budget (blue), share of all risk '
           'covered (green)</text>']
    span = w - left - 90
    for k, tier in enumerate(TIERS):
        tr = sel.tiers[tier]
        y = 40 + k * row_h
        out.append(f'<text x="10" y="{y + 22}">{tier}</text>')
        if tr.budget:
            f = tr.cost / tr.budget
            out.append(f'<rect x="{left}" y="{y}" width="{span}" height="18" fill="#eee"/>')
            out.append(f'<rect x="{left}" y="{y}" width="{span * min(f, 1):.1f}" height="18" '
                       f'fill="#4878a8"/>')
            out.append(f'<text x="{left + span + 5}" y="{y + 14}">{f:.0%} of budget</text>')
        else:
            out.append(f'<text x="{left}" y="{y + 14}">no budget: {_fmt_cost(tr.cost)}</text>')
        s = tr.risk / sel.total_risk
        out.append(f'<rect x="{left}" y="{y + 24}" width="{span}" height="18" fill="#eee"/>')
        out.append(f'<rect x="{left}" y="{y + 24}" width="{span * s:.1f}" height="18" fill="#58a058"/>')
        out.append(f'<text x="{left + span + 5}" y="{y + 38}">{s:.0%} of risk</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render_all(inp: Inputs, sel: Selection | None = None) -> dict[str, str]:
    """Every generated file, keyed ``lists/<rel>`` (under the lists folder) or ``reports/<rel>``."""
    sel = sel or generate(inp)
    files = {f"lists/{k}": v for k, v in render_lists(sel, inp.budgets).items()}
    rows = sweep(inp)
    files["reports/lists.md"] = report_text(inp, sel, rows)
    files["reports/lists.svg"] = report_svg(sel, inp.budgets)
    files["reports/lists.json"] = sweep_json(sel, rows)
    return files


SWEEP_FORMAT = "lists-sweep/1"


def sweep_json(sel: Selection, rows: list[dict]) -> str:
    """The tiers and the pre-merge sweep as data, for the HTML report (it does not re-run the
    solver): per tier its items, cost, budget and share of all risk; per swept budget the same."""
    tiers = {t: {"items": len(tr.items), "cost": round(tr.cost, 3),
                 "budget": None if tr.budget is None else round(tr.budget, 3),
                 "share": round(tr.risk / sel.total_risk, 6)} for t, tr in sel.tiers.items()}
    points = [{"fraction": r["fraction"], "budget": round(r["budget"], 3), "cost": round(r["cost"], 3),
               "share": round(r["share"], 6), "items": r["items"], "guards": r["guards"],
               "out": r["out"]} for r in rows]
    return json.dumps({"format": SWEEP_FORMAT, "tiers": tiers, "sweep": points}, indent=1,
                      sort_keys=True) + "\n"
