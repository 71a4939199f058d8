"""Peer packages a variant calls (a vendor kernel library, say): whether they are installed here,
why a target is skipped without them, and the versions a receipt records.

A variant's module declares them in a module-level ``REQUIRES = ("some_package",)`` and imports them
inside its functions, so the module (and the catalog) loads without them. The declaration is read
from the module's source, without importing it: asking costs no import and runs no module code.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from functools import lru_cache

from certify.catalog.schema import Variant


@lru_cache(maxsize=None)
def _declared_in(module: str) -> tuple[str, ...]:
    from certify.receipts.codehash import project_module_file

    path = project_module_file(module)
    if path is None:
        return ()
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REQUIRES"
                                                 for t in node.targets)):
            value = ast.literal_eval(node.value)
            if not (isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)):
                raise ValueError(f"{path}: REQUIRES must be a tuple of package names, not {value!r}")
            return tuple(value)
    return ()


def required(variant: Variant) -> tuple[str, ...]:
    """The packages ``variant``'s module declares in ``REQUIRES`` (none for the spec itself)."""
    if variant.impl == "spec":
        return ()
    return _declared_in(variant.impl.partition(":")[0])


@lru_cache(maxsize=None)
def installed(name: str) -> bool:
    """Whether package ``name`` is installed here (found without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing(variant: Variant) -> list[str]:
    """The packages ``variant`` requires that are not installed here."""
    return [name for name in required(variant) if not installed(name)]


def why_skipped(variant: Variant) -> str | None:
    """The reason a target of ``variant`` cannot run here, or None when it can."""
    gone = missing(variant)
    if not gone:
        return None
    return f"variant {variant.name} requires {', '.join(gone)}, not installed on this machine"


def versions(variant: Variant) -> dict[str, str]:
    """The required packages' versions (``__version__``; 'unknown' where a package has none)."""
    return {name: str(getattr(importlib.import_module(name), "__version__", "unknown"))
            for name in required(variant)}
