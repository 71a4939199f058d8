"""``certify lists --explain ITEM``: why an item sits where it does."""

from __future__ import annotations



from certify.lists.selection import Inputs, Selection

def explain(sel: Selection, inp: Inputs, query: str) -> str:
    by = sel.by_id()
    it = by.get(query)
    if it is None:
        hits = sorted(i for i in by if query in i)
        if len(hits) != 1:
            return (f"no item matches {query!r}" if not hits else
                    f"{len(hits)} items match {query!r}:\n  " + "\n  ".join(hits[:20]))
        it = by[hits[0]]
    tr = sel.tiers[it.tier]
    lines = [f"{it.id}",
             f"  tier: {it.tier} (declared {it.declared}), shard {it.shard} of {len(tr.shards)}",
             f"  condition: arch {it.arch}, GPUs >= {it.gpus}",
             f"  cost: {it.cost:.2f} s ({'measured' if it.measured else 'ESTIMATED: no measurement'})",
             f"  risk: {it.risk:.4g} ({it.density:.4g} per s); features: {', '.join(it.features)}",
             f"  why: {it.why}"]
    if not it.mandatory and it.tier != "premerge":
        pre = sel.tiers["premerge"]
        tb = inp.budgets.tiers["premerge"]
        if not (it.arch in tb.archs and it.gpus <= tb.gpus):
            lines.append(f"  not pre-merge: needs arch {it.arch} / {it.gpus} GPU(s); the pre-merge "
                         f"machine has {', '.join(tb.archs)} and {tb.gpus} GPU(s)")
        elif not it.measured and inp.budgets.estimates.measured_only_premerge:
            lines.append("  not pre-merge: its cost is only estimated (record it with "
                         "`pytest --record-durations`)")
        else:
            packed = [i for i in pre.items if not i.mandatory]
            worst = min((i.density for i in packed), default=0.0)
            lines.append(f"  not pre-merge: the budget ({pre.budget:.0f} s, {pre.cost:.1f} s used) "
                         f"is better spent: the packed pre-merge items' lowest risk/s is {worst:.4g}; "
                         f"adding this one would exceed the budget or displace more risk")
    return "\n".join(lines)
