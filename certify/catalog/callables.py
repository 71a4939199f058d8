"""The ``module:function`` paths a cell file names (its ``spec``, its input builder ``inputs`` and each
variant's ``impl``) must import and name a callable: ``certify check`` resolves every one, so a typo or
a moved function is an error naming file, line and field before any certification runs into it.

Loading a catalog does not import these modules (loading stays cheap and free of side effects); this
check does, once per module.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from certify.catalog.load import Catalog
from certify.catalog.cell_extensions import extension_callables
from certify.files.problem import FileProblem
from certify.files.yamlfile import YamlProblem, field_name, load_mapping, locate


@lru_cache(maxsize=None)
def _import_problem(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            return f"no module {module!r}"
        return f"importing {module!r} fails: {e}"
    except Exception as e:  # noqa: BLE001 (whatever the import raises is the problem to report)
        return f"importing {module!r} raises {type(e).__name__}: {e}"
    return None


def resolve_problem(dotted: str) -> str | None:
    """Why ``module:attribute`` does not resolve to a callable, or None when it does."""
    module, _, attribute = dotted.partition(":")
    problem = _import_problem(module)
    if problem:
        return problem
    obj = getattr(importlib.import_module(module), attribute, None)
    if obj is None:
        return f"module {module!r} has no {attribute!r}"
    if not callable(obj):
        return f"{dotted} is not callable"
    return None


def callable_errors(catalog: Catalog) -> list[FileProblem]:
    """Every spec, inputs and variant impl path of the loaded ops that does not resolve."""
    out: list[FileProblem] = []
    for name, op in sorted(catalog.ops.items()):
        path = catalog.files[name]
        try:
            _, lines = load_mapping(path)
        except YamlProblem:  # the file changed since it loaded; loading it again reports that
            lines = {}
        fields = [(("spec",), op.spec), (("inputs",), op.inputs)]
        fields += [(("variants", i, "impl"), v.impl) for i, v in enumerate(op.variants)
                   if v.impl != "spec"]
        fields += [(("numerics", tier, "spec"), t.spec) for tier, t in op.numerics.items()]
        fields += extension_callables(op)
        for loc, dotted in fields:
            problem = resolve_problem(dotted)
            if problem:
                out.append(FileProblem(path, locate(loc, lines), field_name(loc),
                                        f"{dotted} does not resolve: {problem}"))
    return out
