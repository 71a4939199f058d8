"""What a mutant runs: the mutated source, and the op's own tests that can see the edit, cheapest first.

A mutant edits one module. It runs against the op's cells whose certification reads that module (the
module is in the target's content-hash closure: the spec's, the variant's, the input builder's or the
oracle's modules and the project modules they import), on the archs this machine has, and against
every test whose ``certify_guard`` or ``certify_property`` marker names the op (from the lists' item
universe, ``test_lists/items.json``). The tests run cheapest first by their measured durations
(``test_lists/durations.json``), so a mutant is killed by the cheapest test that can see it. A mutant
runs its tests up to a cap on their measured seconds (``CAP_S``, ``--cap``): the costliest cells (the
large shapes through Triton's interpreter) stay out of a run that must fit CI's minutes, and the tests
left out are named in the report, so a survivor says what it was not run against.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from certify.catalog.mutants import Mutant, mutants_of
from certify.catalog.plan import Target, targets
from certify.catalog.schema import OpFile
from certify.files.paths import ProjectPaths
from certify.files.problem import FileProblem
from certify.files.yamlfile import YamlProblem, field_name, load_mapping, locate
from certify.harness.archs import present_archs
from certify.harness.requirements import why_skipped
from certify.receipts.codehash import ORACLE_MODULES, module_closure

UNMEASURED_S = 2.0   # the cost assumed for a test with no measured duration
CAP_S = 60.0         # the measured seconds of tests one mutant runs at most (the cheapest first)


class EditError(ValueError):
    """A mutant's edit that cannot be applied: its text is not found once, or the result is no Python."""


@dataclass
class Job:
    """One mutant, ready to run: its module's mutated source and its tests, cheapest first."""

    op: str
    id: str
    bug: str
    label: str            # the variant it counts for, or "spec"
    module: str
    source: str           # the mutated module
    tests: list[str]      # pytest item ids, cheapest first
    cost: float           # the measured (or assumed) seconds of every test
    kind: str = "data"    # data: from the cell file; generic: an operator mutation
    equivalent: str | None = None
    where: str = ""       # for a generic mutant: function, line and operator
    costs: dict[str, float] = field(default_factory=dict)
    over_cap: list[str] = field(default_factory=list)   # tests left out by the cap
    hint: str | None = None   # the test that killed it last time, run first (certify.mutants.hints)


def module_file(module: str) -> Path:
    """The source file of a project module, found without importing it (its parents are imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise EditError(f"module {module!r} has no Python source file")
    return Path(spec.origin)


def apply_edit(source: str, find: str, replace: str, what: str) -> str:
    """``source`` with the one occurrence of ``find`` replaced; EditError when it is not exactly one
    or when the result does not parse."""
    n = source.count(find)
    if n != 1:
        raise EditError(f"{what}: the text to replace occurs {n} times (it must occur once): {find!r}")
    out = source.replace(find, replace, 1)
    try:
        ast.parse(out)
    except SyntaxError as e:
        raise EditError(f"{what}: the edited module does not parse: {e}") from None
    return out


def target_modules(t: Target) -> set[str]:
    """The project modules whose code a target's certification runs: its content-hash closure."""
    roots = [t.op.spec_of(t.variant), t.op.impl_path(t.variant), t.op.inputs]
    if t.variant.numerics != "exact":
        roots.append(t.op.spec)
    names = {m for r in roots for m, _ in module_closure(r.partition(":")[0])}
    return names | {m for o in ORACLE_MODULES for m, _ in module_closure(o)}


def cell_item_id(paths: ProjectPaths, t: Target) -> str:
    cells = paths.cells.relative_to(paths.root).as_posix()
    return f"{cells}/{t.op.op}.yaml::{t.item_name}"


def op_tests(op: str, items: list[dict]) -> list[str]:
    """The ids of the tests whose guard or property marker names the op."""
    return [r["id"] for r in items if op in r.get("guards", ()) or op in r.get("properties", ())]


def tests_for(paths: ProjectPaths, op: OpFile, module: str, items: list[dict],
              durations: dict[str, float], archs: list[str] | None = None,
              cap: float | None = None, variant: str | None = None
              ) -> tuple[list[str], dict, list[str]]:
    """The item ids a mutant of ``module`` runs, cheapest first, their costs, and the ids left out
    because the cumulative measured cost passed ``cap`` seconds. The first test always runs, and so
    does the cheapest cell of ``variant`` (the variant the mutant edits), whatever the cap."""
    have = set(archs or present_archs())
    run = [t for t in targets(op)
           if t.arch in have and not why_skipped(t.variant) and module in target_modules(t)]
    ids = [cell_item_id(paths, t) for t in run]
    own = [cell_item_id(paths, t) for t in run if t.variant.name == variant]
    ids += [i for i in op_tests(op.op, items) if i not in ids]
    cost = {i: durations.get(i, UNMEASURED_S) for i in ids}
    order = {i: n for n, i in enumerate(ids)}
    ranked = sorted(ids, key=lambda i: (cost[i], order[i]))
    if cap is None:
        return ranked, cost, []
    kept, total = [], 0.0
    for i in ranked:
        if kept and total + cost[i] > cap:
            break
        kept.append(i)
        total += cost[i]
    cheapest_own = min(own, key=lambda i: (cost[i], order[i]), default=None)
    if cheapest_own is not None and cheapest_own not in kept:
        kept.append(cheapest_own)
    return kept, {i: cost[i] for i in kept}, [i for i in ranked if i not in kept]


def data_jobs(paths: ProjectPaths, op: OpFile, items: list[dict], durations: dict[str, float],
              archs: list[str] | None = None, only: list[str] | None = None,
              cap: float | None = CAP_S) -> list[Job]:
    """The op's cell-file mutants as jobs. An edit that does not apply (a stale mutant: its module
    changed under it) is an EditError naming the cell file, the line and the field of its ``find``."""
    jobs = []
    for n, m in enumerate(mutants_of(op)):
        if only and m.id not in only:
            continue
        try:
            jobs.append(data_job(paths, op, m, items, durations, archs, cap))
        except EditError as e:
            raise EditError(str(_find_problem(paths, op.op, n, str(e)))) from None
    return jobs


def _find_problem(paths: ProjectPaths, op: str, n: int, message: str) -> FileProblem:
    file = paths.cells / f"{op}.yaml"
    loc = ("mutants", n, "find")
    try:
        _, lines = load_mapping(file)
    except (OSError, YamlProblem):
        lines = {}
    return FileProblem(file, locate(loc, lines), field_name(loc), message)


def data_job(paths: ProjectPaths, op: OpFile, m: Mutant, items: list[dict],
             durations: dict[str, float], archs: list[str] | None = None,
             cap: float | None = CAP_S) -> Job:
    module = op.mutant_module(m)
    source = apply_edit(module_file(module).read_text(), m.find, m.replace, f"{op.op}/{m.id}")
    tests, cost, over = tests_for(paths, op, module, items, durations, archs, cap, m.variant)
    return Job(op.op, m.id, m.bug, m.label, module, source, tests, sum(cost.values()),
               equivalent=m.equivalent, costs=cost, over_cap=over)
