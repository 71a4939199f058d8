"""Items with their cost (measured or estimated) and their risk (the weight of the features they
exercise, shared among the items exercising each)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field


from certify.lists.budgets import Budgets

# ------------------------------------------------------------------------------ items with cost and risk


@dataclass
class Item:
    id: str
    declared: str
    arch: str
    kind: str                      # cell | gate | test
    cost: float
    measured: bool
    gpus: int
    op: str | None = None
    variant: str | None = None
    cell: str | None = None
    guards: tuple[str, ...] = ()
    features: list[str] = field(default_factory=list)
    risk: float = 0.0
    tier: str = "ondemand"
    why: str = ""
    mandatory: str | None = None   # the reason it is mandatory, in its tier
    shard: int = 0
    # a gate's measured cost on a GPU arch, by arch: a tier whose machine has that arch runs the
    # gate there (the engine takes the GPU when there is one), at this cost
    arch_cost: dict[str, float] = field(default_factory=dict)

    def cost_on(self, archs: tuple[str, ...], gpus: int) -> float:
        """The item's cost on a machine with ``archs`` and ``gpus`` GPUs."""
        if gpus:
            for arch in archs:
                if arch in self.arch_cost:
                    return self.arch_cost[arch]
        return self.cost

    @property
    def density(self) -> float:
        return self.risk / max(self.cost, 1e-9)

    def condition(self) -> tuple[str, int]:
        return (self.arch, self.gpus)


def gate_cost(g: dict, b: Budgets) -> float:
    est = b.estimates.gate
    per = lambda es: est.per_sample.get(es, est.default_per_sample)  # noqa: E731
    cost = est.engine_start + sum(n * per(es) for es, n in g["tasks"].values())
    paired = {t for t, _ in g["paired"]}
    if paired:  # the configuration compared with runs the same samples in the same run
        cost += est.engine_start + sum(n * per(es) for t, (es, n) in g["tasks"].items() if t in paired)
    return cost


def _flatten(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in sorted(d.items()):
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={json.dumps(v)}")
    return out


def reach_index(reach: dict | None) -> dict[tuple[str, str], dict[str, set[str]]]:
    """(op, variant) -> arch -> scenarios reaching it on that arch (any dispatch mode)."""
    out: dict[tuple[str, str], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for op, variants in (reach or {}).get("reach", {}).items():
        for var, summary in variants.items():
            for mode, scenarios in summary.get("modes", {}).items():
                out[(op, var)][mode.partition("/")[0]].update(scenarios)
    return out


def build_items(records: list[dict], durations: dict[str, float], b: Budgets, reach: dict | None,
                ops: list[str], gate_seconds: dict[str, dict[str, float]] | None = None
                ) -> list[Item]:
    """Items with cost (measured or estimated) and features; risk is set by ``_score``. An item's
    cost is its measured duration; a gate item without one takes its last ``certify gates run``
    cost on the gates' arch (``gate_seconds``: arch -> gate name -> seconds) when there is one,
    else the budgets' estimate, and keeps its measured costs on the GPU archs (``arch_cost``)."""
    gate_seconds = gate_seconds or {}
    gate_arch = b.conditions.gate_archs[0]
    reached = reach_index(reach)
    r = b.risk
    weights: dict[str, float] = {}
    items = []
    areas = sorted(r.areas, key=len, reverse=True)
    op_words = sorted(ops, key=len, reverse=True)
    for rec in records:
        arch = rec.get("arch") or "cpu"
        kind = "cell" if "cell" in rec else "gate" if "gate" in rec else "test"
        gpus = b.conditions.gate_gpus if kind == "gate" else \
            (1 if arch in b.conditions.gpu_archs else 0)
        if kind == "gate":
            arch = b.conditions.gate_archs[0]
        if rec["id"] in durations:
            cost, measured = durations[rec["id"]], True
        elif kind == "gate" and gate_seconds.get(gate_arch, {}).get(rec["gate"]["name"]):
            cost, measured = gate_seconds[gate_arch][rec["gate"]["name"]], True
        elif kind == "gate":
            cost, measured = gate_cost(rec["gate"], b), False
        else:
            cost, measured = b.estimates.by_arch.get(arch, b.estimates.by_tier[rec["tier"]]), False
        it = Item(id=rec["id"], declared=rec["tier"], arch=arch, kind=kind, cost=float(cost),
                  measured=measured, gpus=gpus, guards=tuple(rec.get("guards", ())))
        if kind == "gate":
            it.arch_cost = {a: by[rec["gate"]["name"]] for a, by in sorted(gate_seconds.items())
                            if a in b.conditions.gpu_archs and by.get(rec["gate"]["name"])}
        f = it.features
        if kind == "cell":
            c = rec["cell"]
            it.op, it.variant, it.cell = c["op"], c["variant"], c["cell"]
            reach_archs = reached.get((it.op, it.variant), {})
            scen = set().union(*reach_archs.values()) if reach_archs else set()
            vkey = f"variant:{it.op}/{it.variant}"
            weights[vkey] = (r.variant_reached + r.variant_per_scenario * len(scen)) if reach_archs \
                else r.variant_unreached
            f += [f"op:{it.op}", vkey, f"variant_arch:{it.op}/{it.variant}@{arch}",
                  f"cell:{it.op}/{it.cell}"]
        elif kind == "gate":
            g = rec["gate"]
            f += [f"gate:{g['name']}"] + [f"engine:{s}" for s in _flatten(g["engine"])] + \
                [f"task:{es}" for es, _ in g["tasks"].values()]
        else:
            path = rec["id"].split("::")[0]
            area = next((a for a in areas if path.startswith(a)), None)
            f += [f"area:{area or '(other)'}", f"file:{path}"]
            if area:
                weights[f"area:{area}"] = r.areas[area]
            f += [f"guard:{o}" for o in rec.get("guards", ())]
            f += [f"property:{o}" for o in rec.get("properties", ())]
            named = set(rec.get("guards", ())) | set(rec.get("properties", ()))
            rest = rec["id"]
            for o in op_words:  # ops the test names (longest first: ab_c before ab)
                if o in rest:
                    named.add(o)
                    rest = rest.replace(o, " ")
            f += [f"op:{o}" for o in sorted(named)]
            low = rec["id"].lower()
            f += [f"kw:{w}" for w in sorted(r.keywords) if re.search(rf"(?<![a-z0-9]){re.escape(w)}",
                                                                       low)]
        items.append(it)
    _score(items, b, weights)
    return items


def _score(items: list[Item], b: Budgets, explicit: dict[str, float]) -> None:
    r = b.risk
    base = {"op": r.op, "variant_arch": r.variant_arch, "cell": r.cell, "guard": r.guard,
            "property": r.property, "gate": r.gate, "engine": r.engine_setting, "task": r.task,
            "file": r.file, "area": r.default_area}
    count: dict[str, int] = defaultdict(int)
    for it in items:
        for f in set(it.features):
            count[f] += 1
    for it in items:
        it.features = sorted(set(it.features))
        total = 0.0
        for f in it.features:
            kind, _, rest = f.partition(":")
            w = explicit.get(f, r.keywords.get(rest) if kind == "kw" else base.get(kind, 0.0))
            total += w / count[f]
        it.risk = total


def feature_weight_total(items: list[Item]) -> float:
    return sum(it.risk for it in items)
