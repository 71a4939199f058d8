"""Load cell files. A malformed file gives one clear error naming the file, the line and the field, and
loading the other files goes on (``load_catalog`` returns the good ops and the errors side by side)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from pydantic import ValidationError


from certify.files.problem import FileProblem
from certify.catalog.plan import targets, variants_of_cell
from certify.catalog.rules import evaluate, rule_names
from certify.catalog.cell_extensions import extension_problem
from certify.catalog.mutants import CellFile, mutants_of
from certify.catalog.schema import OpFile
from certify.files.yamlfile import YamlProblem, field_name, first_problem, load_mapping, locate
from certify.harness import contract as harness_contract


@dataclass
class Catalog:
    ops: dict[str, OpFile] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    errors: list[FileProblem] = field(default_factory=list)


def _domain_points(op: OpFile, names: set[str]) -> Iterator[dict[str, Any]]:
    """The axis values a rule is evaluated at beside the cells: every combination, over the axes the
    rule reads, of each choice and both ends of each int range."""
    per_axis = []
    for name in sorted(names):
        axis = op.axes[name]
        values = axis.values if axis.kind == "choice" else sorted(set(axis.reach))
        per_axis.append([(name, v) for v in values])
    for combination in itertools.product(*per_axis):
        yield dict(combination)


def _rule_problem(op: OpFile) -> tuple[tuple, str] | None:
    """A dispatch rule that raises where it is evaluated (a type mismatch such as ``dtype < 3``, a
    division by an axis that can be 0): evaluated on every cell and over the axis domains, so the
    error comes from loading, not from a dispatch at run time."""
    for i, v in enumerate(op.variants):
        where = [(f"cell {c.id!r}", op.axes_of(c)) for c in op.cells]
        where += [("the axis domain point", point)
                  for point in _domain_points(op, rule_names(v.dispatch))]
        for what, axes in where:
            try:
                evaluate(v.dispatch, axes)
            except Exception as e:  # noqa: BLE001 (any exception of a rule is the file's error)
                shown = {k: axes[k] for k in sorted(rule_names(v.dispatch)) if k in axes}
                return (("variants", i, "dispatch"),
                        f"the rule raises at {what} {shown}: {type(e).__name__}: {e}")
    return None


def _cross_check(op: OpFile) -> tuple[tuple, str] | None:
    """Checks across fields, each error placed on the entry it belongs to."""
    variants = {v.name for v in op.variants}
    seen: set[str] = set()
    for i, v in enumerate(op.variants):
        if v.name in seen:
            return ("variants", i, "name"), f"variant name {v.name!r} repeats"
        seen.add(v.name)
        unknown = rule_names(v.dispatch) - set(op.axes)
        if unknown:
            return ("variants", i, "dispatch"), f"the rule reads unknown axes {sorted(unknown)}"
        if v.numerics not in op.tiers():
            return (("variants", i, "numerics"),
                    f"unknown numerics tier {v.numerics!r} (the op's: {list(op.tiers())})")
    for tier, t in op.numerics.items():
        if not any(v.numerics == tier for v in op.variants):
            return ("numerics", tier), f"no variant claims the tier {tier!r}"
    for i, item in enumerate(op.not_certified):
        for j, v in enumerate(item.variants):
            if v not in variants:
                return (("not_certified", i, "variants", j),
                        f"unknown variant {v!r} (known: {sorted(variants)})")
    ids: set[str] = set()
    for i, cell in enumerate(op.cells):
        if cell.id in ids:
            return ("cells", i, "id"), f"cell id {cell.id!r} repeats"
        ids.add(cell.id)
    for i, cell in enumerate(op.cells):
        for name, axis in op.axes.items():
            if name not in op.axes_of(cell):
                return ("cells", i, "axes"), f"axis {name!r} has no value"
            if not axis.contains(op.axes_of(cell)[name]):
                dom = axis.reach if axis.kind == "int" else list(axis.values)
                return ("cells", i, "axes", name), f"{op.axes_of(cell)[name]!r} is outside the axis domain {dom}"
        for name in cell.axes:
            if name not in op.axes:
                return ("cells", i, "axes", name), f"unknown axis {name!r}"
        for j, v in enumerate(cell.variants or ()):
            if v not in variants:
                return ("cells", i, "variants", j), f"unknown variant {v!r} (known: {sorted(variants)})"
        for j, e in enumerate(cell.expected_failures):
            if e.variant not in variants:
                return (("cells", i, "expected_failures", j, "variant"),
                        f"unknown variant {e.variant!r} (known: {sorted(variants)})")
    problem = _rule_problem(op)  # before the checks below, which evaluate the rules
    if problem:
        return problem
    planned = {(t.variant.name, t.cell.id, t.arch) for t in targets(op)}
    for i, cell in enumerate(op.cells):
        for j, e in enumerate(cell.expected_failures):
            if (e.variant, cell.id, e.arch) not in planned:
                return (("cells", i, "expected_failures", j),
                        f"{e.variant} is not certified at {cell.id} on {e.arch}: nothing to expect")
    for i, cell in enumerate(op.cells):
        if cell.oracle.kind == "bitwise" and cell.oracle.against == "spec" and any(
                v.impl == "spec" for v in variants_of_cell(op, cell)):
            return (("cells", i, "oracle", "against"),
                    "the spec's own path compared bitwise with itself proves nothing: use 'spec64'")
        against = cell.oracle.against
        if against.startswith("variant:") and against.split(":", 1)[1] not in variants:
            return ("cells", i, "oracle", "against"), f"unknown variant in {against!r}"
    mutant_ids: set[str] = set()
    for i, m in enumerate(mutants_of(op)):
        if m.id in mutant_ids:
            return ("mutants", i, "id"), f"mutant id {m.id!r} repeats"
        mutant_ids.add(m.id)
        if m.variant is not None and m.variant not in variants:
            return (("mutants", i, "variant"),
                    f"unknown variant {m.variant!r} (known: {sorted(variants)}; leave it out for the spec)")
        if m.find == m.replace:
            return ("mutants", i, "replace"), "the edit replaces its text with the same text"
    return None


def load_op_file(path: Path) -> OpFile:
    """Load and validate one cell file; raise FileProblem (file, line, field) on the first problem."""
    path = Path(path)
    try:
        data, lines = load_mapping(path)
    except YamlProblem as p:
        raise FileProblem(path, p.line, p.field, p.message) from None
    # The harness section is read beside the schema, so that it never enters the content hash.
    section = data.pop(harness_contract.SECTION, None)
    try:
        op = CellFile.model_validate(data)
    except ValidationError as e:
        raise FileProblem(path, *first_problem(e, lines)) from None
    harness_contract.register(op, harness_contract.parse(path, section, lines))
    if op.op != path.stem:
        raise FileProblem(path, locate(("op",), lines), "op",
                           f"op {op.op!r} must match the file name {path.stem!r}")
    problem = _cross_check(op) or extension_problem(op)
    if problem:
        loc, msg = problem
        raise FileProblem(path, locate(loc, lines), field_name(loc), msg)
    return op


def load_catalog(cells_dir: Path) -> Catalog:
    cat = Catalog()
    for path in sorted(Path(cells_dir).glob("*.yaml")):
        try:
            op = load_op_file(path)
        except FileProblem as e:
            cat.errors.append(e)
            continue
        cat.ops[op.op] = op
        cat.files[op.op] = path
    return cat
