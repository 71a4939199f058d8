"""Load cell files. A malformed file gives one clear error naming the file, the line and the field, and
loading the other files goes on (``load_catalog`` returns the good ops and the errors side by side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from certify.plan import variants_of_cell
from certify.rules import rule_names
from certify.schema import OpFile


@dataclass(frozen=True)
class CatalogError(Exception):
    file: Path
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.message}"


@dataclass
class Catalog:
    ops: dict[str, OpFile] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    errors: list[CatalogError] = field(default_factory=list)


_CONSTRUCTOR = yaml.SafeLoader("")  # builds Python values from already-composed scalar nodes


def _to_python(node: yaml.Node, path: tuple, lines: dict[tuple, int]) -> Any:
    """Convert a composed YAML node to Python, recording the 1-based line of every path."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            key = _CONSTRUCTOR.construct_object(key_node, deep=True)
            out[key] = _to_python(value_node, path + (key,), lines)
            lines[path + (key,)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(n, path + (i,), lines) for i, n in enumerate(node.value)]
    return _CONSTRUCTOR.construct_object(node, deep=True)


def _locate(path: tuple, lines: dict[tuple, int]) -> int:
    for n in range(len(path), -1, -1):
        if path[:n] in lines:
            return lines[path[:n]]
    return 1


def _field_name(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(file)"


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
        if cell.oracle.kind == "bitwise" and cell.oracle.against == "spec" and any(
                v.impl == "spec" for v in variants_of_cell(op, cell)):
            return (("cells", i, "oracle", "against"),
                    "the spec's own path compared bitwise with itself proves nothing: use 'spec64'")
        against = cell.oracle.against
        if against.startswith("variant:") and against.split(":", 1)[1] not in variants:
            return ("cells", i, "oracle", "against"), f"unknown variant in {against!r}"
    return None


def load_op_file(path: Path) -> OpFile:
    """Load and validate one cell file; raise CatalogError (file, line, field) on the first problem."""
    path = Path(path)
    lines: dict[tuple, int] = {}
    try:
        node = yaml.compose(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise CatalogError(path, (mark.line + 1) if mark else 1, "(yaml)",
                           str(getattr(e, "problem", e))) from None
    if node is None:
        raise CatalogError(path, 1, "(file)", "the file is empty")
    data = _to_python(node, (), lines)
    if not isinstance(data, dict):
        raise CatalogError(path, 1, "(file)", "the top level must be a mapping")
    try:
        op = OpFile.model_validate(data)
    except ValidationError as e:
        # A typo shows up as an unknown field *and* a missing one: the unknown field explains both.
        err = sorted(e.errors(), key=lambda x: x["type"] != "extra_forbidden")[0]
        loc = tuple(p for p in err["loc"] if isinstance(p, int) or not str(p).startswith(
            ("tuple[", "list[", "dict[", "function-", "literal[")))
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "extra_forbidden":
            msg = "unknown field (a typo?)"
        extra = len(e.errors()) - 1
        if extra:
            msg += f" (and {extra} more problem{'s' if extra > 1 else ''} in this file)"
        raise CatalogError(path, _locate(loc, lines), _field_name(loc), msg) from None
    if op.op != path.stem:
        raise CatalogError(path, _locate(("op",), lines), "op",
                           f"op {op.op!r} must match the file name {path.stem!r}")
    problem = _cross_check(op)
    if problem:
        loc, msg = problem
        raise CatalogError(path, _locate(loc, lines), _field_name(loc), msg)
    return op


def load_catalog(cells_dir: Path) -> Catalog:
    cat = Catalog()
    for path in sorted(Path(cells_dir).glob("*.yaml")):
        try:
            op = load_op_file(path)
        except CatalogError as e:
            cat.errors.append(e)
            continue
        cat.ops[op.op] = op
        cat.files[op.op] = path
    return cat
