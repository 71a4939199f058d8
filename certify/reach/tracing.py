"""Reach: the (op, variant, axis values) the forward really takes, found by tracing scenarios.

``certify trace`` loads the scenarios (``certify.reach.scenarios``), asks the target's tracer (``[tool.certify]
tracer``, a ``Tracer``) what each scenario's forward calls in every *mode*, and writes the reach file
(``[tool.certify] reach``, JSON, deterministic, committed). The claims tests and the report read that file
(``certify.reach.claims``); a pre-merge test re-runs the tracer and fails when the file is stale.

Modes. A mode is (arch, batch-invariant or not): every runtime arch any variant of the catalog declares
(``cpu-interpret`` certifies kernels on behalf of a GPU arch and is never a runtime arch), each in the
default dispatch and in batch-invariant mode. Dispatch is pure catalog logic, so a tracer records what a
GPU arch would dispatch without the GPU. A mode the target would refuse to run (its own configuration
rules) is recorded as refused, with the reason; an op call no variant can run in a mode is recorded
under ``no_variant`` with the dispatcher's reason (the forward would stop there).

The reach file holds, per scenario and mode, the deduplicated calls (op, variant, axes) with how many
times each ran in the scenario's passes, and per (op, variant) a summary: the modes and scenarios that
reach it, and each axis' reached range (min / max of an int axis, the value set of a choice axis).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from certify.harness.archs import is_runtime_arch
from certify.catalog.load import Catalog, load_catalog
from certify.harness.target import resolve
from certify.reach.scenarios import ScenarioBase, load_scenarios
from certify.files.utf8 import read_utf8

FORMAT = "reach/1"
AxisValue = int | str | bool


@dataclass(frozen=True)
class Mode:
    arch: str
    batch_invariant: bool = False

    @property
    def key(self) -> str:
        return f"{self.arch}/batch_invariant" if self.batch_invariant else self.arch

    @classmethod
    def parse(cls, key: str) -> Mode:
        arch, _, flag = key.partition("/")
        return cls(arch, flag == "batch_invariant")


@dataclass
class ModeTrace:
    """What one scenario's forward does in one mode: its op calls (op, variant, axes) in order, and the
    ops it calls that no variant can run in that mode (op -> the dispatcher's reason); or why the
    target would not run the scenario in that mode at all (``refused``)."""

    calls: list[tuple[str, str, dict[str, AxisValue]]] = field(default_factory=list)
    no_variant: dict[str, str] = field(default_factory=dict)
    refused: str | None = None


class Tracer(Protocol):
    """The target's side of the tracer (named by ``[tool.certify] tracer``)."""

    scenario_model: type[ScenarioBase]

    def describe(self) -> dict[str, Any]:
        """What the tracer runs (e.g. the geometry), written into the reach file as is."""

    def trace(self, scenario: ScenarioBase, catalog: Catalog, modes: list[Mode]
              ) -> dict[str, ModeTrace]:
        """mode key -> the scenario's trace in that mode, for every mode given."""


def trace_modes(catalog: Catalog) -> list[Mode]:
    archs = sorted({a for op in catalog.ops.values() for v in op.variants for a in v.archs
                    if is_runtime_arch(a)}, key=lambda a: (a != "cpu", a))
    return [Mode(a, bi) for a in archs for bi in (False, True)]


# ------------------------------------------------------------------------------ the reach file


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CallRecord(_Record):
    op: str
    variant: str
    axes: dict[str, AxisValue]
    count: int  # how many times the scenario's passes made this call


class ModeRecord(_Record):
    calls: list[CallRecord] = []
    no_variant: dict[str, str] = {}   # op -> why no variant runs its calls in this mode
    refused: str | None = None


class ScenarioRecord(_Record):
    why: str
    modes: dict[str, ModeRecord]


class AxisReach(_Record):
    min: int | None = None      # int axes
    max: int | None = None
    values: list[AxisValue] | None = None  # choice axes (sorted)

    def text(self) -> str:
        if self.values is not None:
            return ", ".join(map(str, self.values))
        return str(self.min) if self.min == self.max else f"{self.min}..{self.max}"


class VariantReach(_Record):
    modes: dict[str, list[str]]   # mode key -> the scenarios that reach the variant in that mode
    axes: dict[str, AxisReach]    # over every mode and scenario

    @property
    def scenarios(self) -> list[str]:
        return sorted({s for names in self.modes.values() for s in names})

    def archs(self) -> list[str]:
        return sorted({Mode.parse(k).arch for k in self.modes})

    def scenarios_on(self, arch: str) -> list[str]:
        return sorted({s for k, names in self.modes.items() if Mode.parse(k).arch == arch
                       for s in names})


class ReachFile(_Record):
    format: str = FORMAT
    note: str = ("Generated by `certify trace`; do not edit. Per scenario and mode, the op calls "
                 "of the forward (deduplicated, with counts); per op and variant, the reached axes.")
    tracer: dict[str, Any]
    modes: list[str]
    scenarios: dict[str, ScenarioRecord]
    reach: dict[str, dict[str, VariantReach]]   # op -> variant -> its reach

    def variant(self, op: str, variant: str) -> VariantReach | None:
        return self.reach.get(op, {}).get(variant)


def _record(trace: ModeTrace) -> ModeRecord:
    if trace.refused is not None:
        return ModeRecord(refused=trace.refused)
    counts: Counter[tuple] = Counter()
    for op, variant, axes in trace.calls:
        counts[(op, variant, tuple(sorted(axes.items())))] += 1
    return ModeRecord(calls=[CallRecord(op=op, variant=v, axes=dict(ax), count=n)
                             for (op, v, ax), n in sorted(counts.items(), key=lambda kv: (
                                 kv[0][0], kv[0][1], json.dumps(kv[0][2])))],
                      no_variant=dict(sorted(trace.no_variant.items())))


def summarise(scenarios: dict[str, ScenarioRecord], catalog: Catalog
              ) -> dict[str, dict[str, VariantReach]]:
    """op -> variant -> the modes and scenarios that reach it and its reached axis ranges (a range for
    an int axis of the op file, the value set for a choice axis, whatever its values' type)."""
    modes: dict[tuple[str, str], dict[str, set[str]]] = {}
    values: dict[tuple[str, str], dict[str, set]] = {}
    for name, sc in scenarios.items():
        for key, rec in sc.modes.items():
            for c in rec.calls:
                modes.setdefault((c.op, c.variant), {}).setdefault(key, set()).add(name)
                axes = values.setdefault((c.op, c.variant), {})
                for axis, value in c.axes.items():
                    axes.setdefault(axis, set()).add(value)
    out: dict[str, dict[str, VariantReach]] = {}
    for (op, variant), by_mode in sorted(modes.items()):
        axes = {}
        declared = catalog.ops[op].axes if op in catalog.ops else {}
        for axis, vals in sorted(values[(op, variant)].items()):
            kind = declared[axis].kind if axis in declared else None
            if kind == "int" or (kind is None and all(isinstance(v, int) and not isinstance(v, bool)
                                                      for v in vals)):
                axes[axis] = AxisReach(min=min(vals), max=max(vals))
            else:
                axes[axis] = AxisReach(values=sorted(vals, key=lambda v: (str(type(v)), v)))
        out.setdefault(op, {})[variant] = VariantReach(
            modes={k: sorted(v) for k, v in sorted(by_mode.items())}, axes=axes)
    return out


def build_reach(tracer_info: dict[str, Any], catalog: Catalog,
                traced: dict[str, tuple[str, dict[str, ModeTrace]]]) -> ReachFile:
    """The reach file from each scenario's (why, mode key -> trace)."""
    scenarios = {name: ScenarioRecord(why=why, modes={k: _record(t) for k, t in sorted(by.items())})
                 for name, (why, by) in sorted(traced.items())}
    return ReachFile(tracer=tracer_info, modes=[m.key for m in trace_modes(catalog)],
                     scenarios=scenarios, reach=summarise(scenarios, catalog))


def _dump(value: Any, indent: str = "") -> str:
    """JSON with sorted keys, one line per value that fits in 100 columns and one line per call, so a
    change to the reach shows as a readable diff."""
    flat = json.dumps(value, sort_keys=True)
    a_call = isinstance(value, dict) and {"op", "variant"} <= set(value)
    if a_call or len(indent) + len(flat) <= 100 or not isinstance(value, (dict, list)) or not value:
        return flat
    inner = indent + " "
    if isinstance(value, list):
        return "[\n" + ",\n".join(inner + _dump(v, inner) for v in value) + "\n" + indent + "]"
    items = [f"{inner}{json.dumps(k)}: {_dump(v, inner)}" for k, v in sorted(value.items())]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"


def reach_text(reach: ReachFile) -> str:
    return _dump(reach.model_dump(mode="json", exclude_none=True)) + "\n"


def load_reach(path: Path) -> ReachFile | None:
    path = Path(path)
    if not path.is_file():
        return None
    return ReachFile.model_validate_json(read_utf8(path))


# ------------------------------------------------------------------------------ running the tracer


@dataclass
class TraceRun:
    reach: ReachFile
    seconds: float
    per_scenario: dict[str, float]


def load_tracer(spec: str | None) -> Tracer:
    if not spec:
        raise ValueError("no tracer: set [tool.certify] tracer = \"module:object\" in pyproject.toml")
    obj = resolve(spec)
    return obj() if isinstance(obj, type) else obj


_WORKER: dict[str, Any] = {}


def _init_worker(tracer_spec: str, cells: str, scenarios: str) -> None:
    tracer = load_tracer(tracer_spec)
    _WORKER.update(tracer=tracer, catalog=load_catalog(Path(cells)),
                   scenarios={s.name: s for s in load_scenarios(Path(scenarios),
                                                                tracer.scenario_model)})


def _trace_one(name: str) -> tuple[str, str, dict[str, ModeTrace], float]:
    t0 = time.perf_counter()
    sc = _WORKER["scenarios"][name]
    catalog = _WORKER["catalog"]
    traces = _WORKER["tracer"].trace(sc, catalog, trace_modes(catalog))
    return name, sc.why, traces, time.perf_counter() - t0


def run_trace(tracer_spec: str | None, cells: Path, scenarios_path: Path,
              workers: int | None = None, only: list[str] | None = None) -> TraceRun:
    """Trace every scenario (or the ``only`` ones) in every mode. ``workers`` processes share the
    scenarios (default: the CPUs this process may use, at most 4); each loads the tracer once."""
    t0 = time.perf_counter()
    tracer = load_tracer(tracer_spec)
    catalog = load_catalog(cells)
    if catalog.errors:
        raise ValueError("the catalog has errors; run `certify check`:\n"
                         + "\n".join(map(str, catalog.errors)))
    names = [s.name for s in load_scenarios(scenarios_path, tracer.scenario_model)
             if not only or s.name in only]
    args = (tracer_spec, str(cells), str(scenarios_path))
    workers = workers or min(4, len(os.sched_getaffinity(0)))
    if workers <= 1 or len(names) <= 1:
        _init_worker(*args)
        results = [_trace_one(n) for n in names]
    else:
        # spawn, not fork: the caller may be a threaded process (a pytest-xdist worker, torch's pools)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_init_worker, initargs=args) as pool:
            results = list(pool.map(_trace_one, names))
    traced = {name: (why, traces) for name, why, traces, _ in results}
    reach = build_reach(tracer.describe(), catalog, traced)
    return TraceRun(reach, time.perf_counter() - t0, {n: s for n, _, _, s in results})
