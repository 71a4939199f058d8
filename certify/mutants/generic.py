"""Operator mutations of an op's variants, made by cosmic-ray (the ``mutants`` extra).

cosmic-ray's operators (an arithmetic or comparison operator swapped, a sign, a boolean, a number off
by one, a loop that runs no iteration...) are applied to the code each variant of the op runs: its
impl function (an ``impl: spec`` variant: its spec function) and the functions of the same module that
it reaches by name, transitively; ``raise`` and ``assert`` statements are left alone (their mutants
change only which bad inputs are refused). cosmic-ray's own runner rewrites the module file in place
and runs one test command for the whole session; here only its mutation operators are used
(``cosmic_ray.mutating.mutate_code``, on the source text in memory), and each mutant runs as a job
like the cell file's (``certify.mutants.runner``): on a copy, against the op's own tests that read the
module, cheapest first. Of the positions found, ``count`` are taken, spread evenly over the variants
and along each module, the same ones on every run. An operator mutation that makes the same source as a
cell-file mutant is that mutant (declared equivalent there, say, with its reason) and is not run twice.
"""

from __future__ import annotations

import ast
import importlib.util

from certify.catalog.mutants import SPEC
from certify.catalog.schema import OpFile
from certify.files.paths import ProjectPaths
from certify.harness.archs import present_archs
from certify.mutants.plan import Job, module_file, tests_for

OPERATORS = (
    "core/ReplaceBinaryOperator_Add_Sub", "core/ReplaceBinaryOperator_Sub_Add",
    "core/ReplaceBinaryOperator_Mul_Div", "core/ReplaceBinaryOperator_Div_Mul",
    "core/ReplaceBinaryOperator_FloorDiv_Mul", "core/ReplaceBinaryOperator_Mod_FloorDiv",
    "core/ReplaceBinaryOperator_LShift_RShift", "core/ReplaceBinaryOperator_RShift_LShift",
    "core/ReplaceBinaryOperator_BitAnd_BitOr", "core/ReplaceBinaryOperator_BitOr_BitAnd",
    "core/ReplaceComparisonOperator_Lt_LtE", "core/ReplaceComparisonOperator_LtE_Lt",
    "core/ReplaceComparisonOperator_Gt_GtE", "core/ReplaceComparisonOperator_GtE_Gt",
    "core/ReplaceComparisonOperator_Eq_NotEq", "core/ReplaceComparisonOperator_NotEq_Eq",
    "core/ReplaceUnaryOperator_USub_UAdd", "core/ReplaceTrueWithFalse",
    "core/ReplaceFalseWithTrue", "core/ReplaceAndWithOr", "core/ReplaceOrWithAnd",
    "core/NumberReplacer", "core/ZeroIterationForLoop",
)
MISSING = "cosmic-ray is not installed (pip install -e '.[mutants]'): no operator mutations"


def available() -> bool:
    return importlib.util.find_spec("cosmic_ray") is not None


def reached_lines(source: str, function: str) -> set[int]:
    """The lines of ``function`` and of the module's functions it reaches by name, transitively,
    less the lines of ``raise`` and ``assert`` statements."""
    tree = ast.parse(source)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    seen, todo = set(), [function]
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    lines: set[int] = set()
    for name in seen:
        node = defs[name]
        body_start = node.body[0].lineno
        lines |= set(range(body_start, node.end_lineno + 1))
        for n in ast.walk(node):
            if isinstance(n, (ast.Raise, ast.Assert)):
                lines -= set(range(n.lineno, n.end_lineno + 1))
        doc = ast.get_docstring(node, clean=False)
        if doc is not None:
            first = node.body[0]
            lines -= set(range(first.lineno, first.end_lineno + 1))
    return lines


def positions(source: str, lines: set[int]) -> list[tuple[str, int, int, int]]:
    """(operator, occurrence, line, column) of every mutation the operators offer on ``lines``."""
    import cosmic_ray.plugins  # noqa: PLC0415
    from cosmic_ray.ast import ast_nodes, get_ast  # noqa: PLC0415

    tree = get_ast(source)
    out = []
    for name in OPERATORS:
        operator = cosmic_ray.plugins.get_operator(name)()
        found = ((start, node) for node in ast_nodes(tree)
                 for start, _ in operator.mutation_positions(node))
        for occurrence, (start, _node) in enumerate(found):
            if start[0] in lines:
                out.append((name, occurrence, start[0], start[1]))
    return out


def _spread(items: list, count: int) -> list:
    if count >= len(items):
        return list(items)
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def generic_jobs(paths: ProjectPaths, op: OpFile, items: list[dict], durations: dict[str, float],
                 count: int, archs: list[str] | None = None,
                 cap: float | None = None) -> tuple[list[Job], str]:
    """Up to ``count`` operator mutations over the op's variants that run here, and a note."""
    if not available():
        return [], MISSING
    import cosmic_ray.plugins  # noqa: PLC0415
    from cosmic_ray.mutating import mutate_code  # noqa: PLC0415

    have = set(archs or present_archs())
    per_variant: dict[str, list] = {}
    seen_functions: set[str] = set()
    for v in op.variants:
        if not have & set(v.archs):
            continue
        path = op.impl_path(v)
        if path in seen_functions:
            continue
        seen_functions.add(path)
        module, _, function = path.partition(":")
        source = module_file(module).read_text()
        found = positions(source, reached_lines(source, function))
        label = SPEC if v.impl == "spec" else v.name
        per_variant.setdefault(label, []).extend((label, module, function, source, *p) for p in found)
    share = max(1, count // max(1, len(per_variant)))
    chosen = [c for found in per_variant.values() for c in _spread(found, share)][:count]
    jobs = []
    for variant, module, function, source, name, occurrence, line, col in chosen:
        mutated = mutate_code(source, cosmic_ray.plugins.get_operator(name)(), occurrence)
        if mutated is None or mutated == source:
            continue
        tests, cost, over = tests_for(paths, op, module, items, durations, archs, cap,
                                      None if variant == SPEC else variant)
        short = name.split("/", 1)[1]
        jobs.append(Job(op.op, f"{variant}.{function}.{line}.{short}.{occurrence}",
                        f"{short} at line {line}", variant, module, mutated, tests,
                        sum(cost.values()), kind="generic", where=f"{module}:{line}:{col} ({short})",
                        costs=cost, over_cap=over))
    found_total = sum(len(v) for v in per_variant.values())
    return jobs, f"{len(jobs)} of {found_total} positions in the code the variants reach."
