"""YAML data files with line numbers: every loader of the framework reports a problem as file, line and
field (the cell files, the scenario file, the budgets file, the gate and reference files), through one
validated loader, ``load_validated``: the file's mapping, validated by a pydantic model, or
``FileProblem`` on the first problem.

Stricter than ``yaml.safe_load`` where a silent choice would hide a mistake: a key repeated in one
mapping is an error (naming both lines) rather than the last one winning, and a file that is not UTF-8
is an error naming the line and the byte offset rather than a ``UnicodeDecodeError``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from certify.files.problem import FileProblem
from certify.files.utf8 import NotUtf8Error, read_utf8

M = TypeVar("M", bound=BaseModel)
_CONSTRUCTOR = yaml.SafeLoader("")  # builds Python values from already-composed scalar nodes
# libyaml's parser where PyYAML has it (the same nodes and marks, about 10 times as fast: a catalog of
# ten thousand cells loads in a second), the pure-Python one otherwise
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlProblem(Exception):
    """A file that is not UTF-8, is not YAML, repeats a key, is empty, or is not a mapping:
    (line, field, message)."""

    def __init__(self, line: int, field: str, message: str):
        super().__init__(message)
        self.line, self.field, self.message = line, field, message


def _to_python(node: yaml.Node, path: tuple, lines: dict[tuple, int]) -> Any:
    """Convert a composed YAML node to Python, recording the 1-based line of every path."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        first_line: dict = {}
        for key_node, value_node in node.value:
            key = _CONSTRUCTOR.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise YamlProblem(line, field_name(path + (key,)),
                                  f"duplicate key {key!r} (first at line {first_line[key]})")
            first_line[key] = line
            out[key] = _to_python(value_node, path + (key,), lines)
            lines[path + (key,)] = line
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(n, path + (i,), lines) for i, n in enumerate(node.value)]
    return _CONSTRUCTOR.construct_object(node, deep=True)


def load_mapping(path: Path) -> tuple[dict, dict[tuple, int]]:
    """The file's top-level mapping and the line of every path in it; ``YamlProblem`` otherwise."""
    lines: dict[tuple, int] = {}
    try:
        node = yaml.compose(read_utf8(path), Loader=_LOADER)
    except NotUtf8Error as e:
        raise YamlProblem(e.line, "(file)", e.message) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise YamlProblem((mark.line + 1) if mark else 1, "(yaml)",
                          str(getattr(e, "problem", e))) from None
    if node is None:
        raise YamlProblem(1, "(file)", "the file is empty")
    data = _to_python(node, (), lines)
    if not isinstance(data, dict):
        raise YamlProblem(1, "(file)", "the top level must be a mapping")
    return data, lines


def locate(path: tuple, lines: dict[tuple, int]) -> int:
    """The line of ``path``, or of its nearest ancestor that has one."""
    for n in range(len(path), -1, -1):
        if path[:n] in lines:
            return lines[path[:n]]
    return 1


def field_name(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(file)"


def first_problem(e: ValidationError, lines: dict[tuple, int]) -> tuple[int, str, str]:
    """(line, field, message) of the one pydantic error worth showing first."""
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
    return locate(loc, lines), field_name(loc), msg


def load_validated(path: Path, model: type[M]) -> tuple[M, dict[tuple, int]]:
    """The file validated by ``model``, with the line of every path in it (for the caller's own
    cross-checks); ``FileProblem`` naming file, line and field on the first problem."""
    path = Path(path)
    try:
        data, lines = load_mapping(path)
    except YamlProblem as p:
        raise FileProblem(path, p.line, p.field, p.message) from None
    try:
        return model.model_validate(data), lines
    except ValidationError as e:
        raise FileProblem(path, *first_problem(e, lines)) from None
