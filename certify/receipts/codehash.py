"""The content hash of a certification target: its code and numbers, never its prose.

A receipt is fresh while its hash equals the hash of what it certified as it is today: the spec
function's module and the project modules it imports, the variant's, the input builder's, the cell and
variant entries, and the oracle's modules. A content hash survives checkouts and rebases, where file
times do not.

Only what can change a result is hashed. A module counts by its syntax tree with docstrings, bare
string statements and comments left out, and without line or column numbers, so a corrected comment,
a rewritten docstring or a moved blank line leaves every receipt fresh, and any change to code stales
the receipts whose closure holds the module. The tree is written out in a form that is the same under
every Python the project supports (fields that are empty or None are left out, as newer Pythons add
such fields). A cell or variant entry counts by its fields less those marked ``hashed: False`` in
``certify.catalog.schema`` (``why``, ``doc``, ``derivation``...).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

from certify.files.paths import project_paths
from certify.catalog.cell_extensions import cell_inputs, selection_of
from certify.catalog.schema import EXACT, Cell, OpFile

ORACLE_MODULES = ("certify.harness.oracles", "certify.harness.target")
# Hashed only for a cell with a set oracle (certify.catalog.cell_extensions), beside ORACLE_MODULES.
SET_ORACLE_MODULES = ("certify.harness.set_oracle", "certify.harness.extended")


@lru_cache(maxsize=None)
def project_module_file(name: str) -> Path | None:
    """The source file of a module of this project, or None (a third-party or built-in module)."""
    top = name.partition(".")[0]
    if top != name and project_module_file(top) is None:
        return None  # never import a third-party package just to locate one of its submodules
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    path = Path(spec.origin).resolve()
    root = project_paths().root.resolve()
    return path if root in path.parents and "site-packages" not in path.parts else None


def _imports(tree: ast.Module, path: Path, module: str) -> set[str]:
    out: set[str] = set()
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _is_prose(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
        and isinstance(node.value.value, str)


def _form(node: object) -> str:
    """A syntax tree written out without positions, and without fields that are empty or None."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            if isinstance(value, list):
                value = [v for v in value if not _is_prose(v)]
            fields.append(f"{name}={_form(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_form(v) for v in node) + "]"
    return repr(node)


def code_form(source: str) -> str:
    """What of a module's source can change what it does: its syntax tree without docstrings, bare
    string statements, comments or positions."""
    return _form(ast.parse(source))


def code_digest(source: str) -> str:
    return hashlib.sha256(code_form(source).encode()).hexdigest()


@lru_cache(maxsize=None)
def module_closure(module: str) -> tuple[tuple[str, str], ...]:
    """(module, ``code_digest`` of its source) for a project module and every project module it
    imports."""
    seen: dict[str, str] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = project_module_file(name)
        if path is None:
            continue
        source = path.read_text()
        seen[name] = code_digest(source)
        todo.extend(_imports(ast.parse(source), path, name))
    return tuple(sorted(seen.items()))


def hashed_fields(model: BaseModel) -> dict:
    """A schema entry's fields less those marked ``hashed: False`` (its prose), nested entries alike."""
    out = {}
    for name, info in type(model).model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("hashed") is False:
            continue
        out[name] = _hashed_value(getattr(model, name))
    return out


def _hashed_value(value: object) -> object:
    if isinstance(value, BaseModel):
        return hashed_fields(value)
    if isinstance(value, dict):
        return {k: _hashed_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_hashed_value(v) for v in value]
    return value


def content_hash(op: OpFile, variant_name: str, cell: Cell) -> str:
    variant = op.variant(variant_name)
    spec = op.spec_of(variant)
    inputs = cell_inputs(op, cell)  # the cell's own builder (an edge case) or the op's
    parts = {
        "spec": [spec, module_closure(spec.partition(":")[0])],
        "variant": [hashed_fields(variant), module_closure(op.impl_path(variant).partition(":")[0])],
        "inputs": [inputs, module_closure(inputs.partition(":")[0])],
        "cell": hashed_fields(cell),
        "oracle": [module_closure(m) for m in ORACLE_MODULES],
    }
    if variant.numerics != EXACT:  # the tier's bands judge it, and the exact spec is measured too
        parts["numerics"] = [hashed_fields(op.numerics[variant.numerics]),
                             module_closure(op.spec.partition(":")[0])]
    selection = selection_of(cell)
    if selection is not None:  # its fields, the modules of its callables and of the oracle
        callables = [c for c in (selection.scores, selection.bound, selection.given) if c]
        parts["selection"] = [hashed_fields(selection),
                              [module_closure(c.partition(":")[0]) for c in callables],
                              [module_closure(m) for m in SET_ORACLE_MODULES]]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
