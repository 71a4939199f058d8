"""Dispatch is measured, not assumed: at each shape the forward reaches on an arch, within each
numerics tier of the op, the variant the dispatch rules choose is within ``SLACK`` of the fastest
variant certified for that tier on that arch with a perf record at that shape.

The rules are read as the engine's dispatcher reads them: the first variant in file order of the
tier, on the arch, whose rule accepts the shape's axes. A variant that requires a package is
checked twice: with its packages (the machine that measured it) and without them (a machine where
the dispatcher skips it), so the fallback choice is held to the same slack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from certify.catalog.load import Catalog
from certify.catalog.rules import evaluate
from certify.catalog.schema import OpFile, Variant
from certify.harness.requirements import required
from certify.perf.records import PerfRecord
from certify.reach import ReachFile

SLACK = 1.10   # a dispatched variant may be at most 10 % slower than the fastest certified one


@dataclass(frozen=True)
class DispatchCheck:
    op: str
    arch: str
    tier: str
    axes: tuple[tuple[str, Any], ...]
    absent: tuple[str, ...]        # packages taken as not installed (the fallback choice)
    chosen: str | None
    chosen_us: float | None        # None: the chosen variant has no record here or is uncertified
    fastest: str | None            # None: no certified variant left is measured here
    fastest_us: float | None

    @property
    def problem(self) -> str | None:
        where = (f"{self.op} on {self.arch}, tier {self.tier}, at "
                 f"{dict(self.axes)}" + (f" without {', '.join(self.absent)}" if self.absent else ""))
        if self.chosen is None:
            return f"{where}: no variant's rule accepts the shape"
        if self.fastest is None:
            return (f"{where}: the rules choose {self.chosen}, and no certified variant of the "
                    "tier left there has a perf record")
        if self.chosen_us is None:
            return (f"{where}: the rules choose {self.chosen}, which has no perf record here or no "
                    f"certified receipt on the arch (fastest certified: {self.fastest} "
                    f"{self.fastest_us:.1f} us)")
        if self.chosen_us > SLACK * self.fastest_us:
            return (f"{where}: the rules choose {self.chosen} ({self.chosen_us:.1f} us), "
                    f"{self.chosen_us / self.fastest_us:.2f}x the fastest certified variant "
                    f"{self.fastest} ({self.fastest_us:.1f} us)")
        return None


def traced_shapes(reach: ReachFile, arch: str) -> dict[str, list[dict[str, Any]]]:
    """op -> the distinct axes of its calls in the arch's own mode, over every scenario."""
    out: dict[str, dict[tuple, dict[str, Any]]] = {}
    for sc in reach.scenarios.values():
        mode = sc.modes.get(arch)
        for call in (mode.calls if mode is not None else []):
            out.setdefault(call.op, {})[tuple(sorted(call.axes.items()))] = dict(call.axes)
    return {op: list(shapes.values()) for op, shapes in sorted(out.items())}


def rule_choice(op: OpFile, tier: str, arch: str, axes: dict[str, Any],
                absent: frozenset[str] = frozenset()) -> Variant | None:
    for v in op.variants:
        if (v.numerics == tier and arch in v.archs and not set(required(v)) & absent
                and evaluate(v.dispatch, axes)):
            return v
    return None


def check_dispatch(catalog: Catalog, reach: ReachFile, records: list[PerfRecord],
                   certified: Callable[[OpFile, str, str], bool]) -> list[DispatchCheck]:
    """Every check at every traced shape where some certified variant of a tier has a record.
    ``certified(op, variant, arch)``: whether the variant holds a fresh passing receipt there."""
    times = {(r.op, r.variant, r.arch, tuple(sorted(r.axes.items()))): r.us for r in records}
    return list(_checks(catalog, reach, times, certified, sorted({r.arch for r in records})))


def _checks(catalog, reach, times, certified, archs) -> Iterator[DispatchCheck]:
    for arch in archs:
        for name, shapes in traced_shapes(reach, arch).items():
            op = catalog.ops.get(name)
            if op is None:
                continue
            for axes in shapes:
                key = tuple(sorted(axes.items()))
                for tier in op.tiers():
                    timed = {v.name: times[(name, v.name, arch, key)] for v in op.variants
                             if v.numerics == tier and arch in v.archs
                             and (name, v.name, arch, key) in times and certified(op, v.name, arch)}
                    if not timed:
                        continue
                    packages = sorted({p for v in op.variants if v.numerics == tier
                                       for p in required(v)})
                    for absent in ([()] + ([tuple(packages)] if packages else [])):
                        pool = {n: us for n, us in timed.items()
                                if not set(required(op.variant(n))) & set(absent)}
                        chosen = rule_choice(op, tier, arch, axes, frozenset(absent))
                        fastest = min(pool, key=pool.__getitem__) if pool else None
                        yield DispatchCheck(name, arch, tier, key, tuple(absent),
                                            chosen.name if chosen else None,
                                            pool.get(chosen.name) if chosen else None,
                                            fastest, pool.get(fastest) if pool else None)
