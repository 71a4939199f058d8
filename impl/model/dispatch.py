"""One dispatch mechanism for every op the engine runs: the variant rules of the cell files.

The engine never names a kernel. For each op call it states the op and the call's axis values (the
same axes the op's cell file declares: ``batch``, ``rows``, ``seq_len``, ``state_dtype`` ...), and
``Dispatcher.choose`` returns the first variant, in file order, that runs on the runtime arch and whose
``dispatch`` rule accepts those values: the rule certification reads to know which cells a variant
serves, so what runs and what is certified cannot disagree. Every choice is counted (``ran``) and, when
tracing, recorded with its axes (``trace``), so a forward always knows which variant of each op it ran.

Numerics tiers: the choice is made among the variants of the op's configured tier only
(``numerics``: op -> tier, default 'exact'), so a variant certified against one tier's bands never
stands in for another's.

A configuration may name the variant of an op (``pinned``: op -> variant, e.g. the MoE backend): that
variant is then the op's only candidate, and its rule must still accept each call.

Batch-invariant mode restricts the choice to the ops' reference variants (``impl: spec``, the spec's
own low-precision path): docs/spec.md, "Batch invariance" states the spec path is batch-invariant by
construction (row-wise math with a fixed reduction order), so in that mode a row's result cannot depend
on the rows sharing its launch, and the engine's logits equal spec/model.py's bit for bit. A fast
variant enters that mode only by becoming the reference, never by assumption.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from certify.catalog.load import Catalog
from certify.harness.target import resolve
from certify.catalog.rules import RuleError, evaluate
from certify.harness.requirements import missing
from certify.catalog.schema import EXACT, OpFile, Variant


@dataclass(frozen=True)
class OpCall:
    """One op call of a forward: the variant that ran and the axis values it ran at."""

    op: str
    variant: str
    axes: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "variant": self.variant, "axes": dict(self.axes)}


# Certification entries that copy whole planes into fresh outputs (the harness's convention), and the
# in-place core each wraps, which the engine calls on its own planes: what a step writes is its rows.
IN_PLACE_CORES: dict[str, str] = {
    "impl.kernels.qsa.triton_append:qsa_kv_append": "impl.kernels.qsa.triton_append:kv_append",
    "impl.kernels.qsa.triton_index:qsa_index_store": "impl.kernels.qsa.triton_index:index_store",
}


def is_torch_variant(variant: Variant) -> bool:
    """A variant written in torch alone: a reference (``impl: spec``) or one of impl/kernels'
    ``torch_*`` modules. A torch-only engine (``EngineConfig.torch_only``) dispatches these, the
    peer the benchmarks time the kernels against."""
    module = variant.impl.split(":")[0].rsplit(".", 1)[-1]
    return variant.impl == "spec" or module.startswith("torch_")


class DispatchError(RuntimeError):
    """No variant of an op can run a call (unknown op, no variant on the arch, no rule accepts)."""


class Dispatcher:
    """Chooses each op call's variant from the catalog; counts and optionally traces the choices."""

    def __init__(self, catalog: Catalog, arch: str, *, batch_invariant: bool = False,
                 torch_only: bool = False, numerics: Mapping[str, str] | None = None,
                 pinned: Mapping[str, str] | None = None):
        self.catalog = catalog
        self.arch = arch
        self.batch_invariant = batch_invariant
        self.torch_only = torch_only
        self.numerics = dict(numerics or {})  # op -> tier (default: exact)
        self.pinned = dict(pinned or {})      # op -> the one variant it may run
        self.ran: Counter[tuple[str, str]] = Counter()
        self.trace: list[OpCall] | None = None
        self._impls: dict[tuple[str, str], Callable] = {}
        self._cores: dict[str, Callable] = {}

    def start_trace(self) -> None:
        self.trace = []

    def stop_trace(self) -> list[OpCall]:
        trace, self.trace = self.trace or [], None
        return trace

    def op(self, name: str) -> OpFile:
        try:
            return self.catalog.ops[name]
        except KeyError:
            raise DispatchError(f"op {name!r} has no cell file in the catalog") from None

    def candidates(self, name: str) -> list[Variant]:
        """The variants of ``name`` this dispatcher may choose, in file order."""
        # a variant that calls a peer package is a candidate only where that package is installed
        tier = self.numerics.get(name, EXACT)
        runnable = [v for v in self.op(name).variants
                    if self.arch in v.archs and not missing(v) and v.numerics == tier]
        if self.batch_invariant:
            runnable = [v for v in runnable if v.impl == "spec"]
        if self.torch_only:
            # the torch compositions first, the references only where an op has none
            runnable = sorted((v for v in runnable if is_torch_variant(v)),
                              key=lambda v: v.impl == "spec")
        if name in self.pinned:
            runnable = [v for v in runnable if v.name == self.pinned[name]]
        return runnable

    def choose(self, name: str, **axes: Any) -> Variant:
        """The variant that runs this call. ``axes`` may hold more names than the op declares (the
        caller passes the step's context); only the op's own axes are read and recorded."""
        op = self.op(name)
        own = {k: v for k, v in axes.items() if k in op.axes}
        runnable = self.candidates(name)
        if not runnable:
            mode = " in batch-invariant mode (no reference variant)" if self.batch_invariant else ""
            tier = self.numerics.get(name, EXACT)
            of = f" of its {tier} tier" if tier != EXACT else ""
            pin = f" (the configuration names {self.pinned[name]!r})" if name in self.pinned else ""
            raise DispatchError(f"{name}: no variant{of} runs on {self.arch}{mode}{pin}")
        for variant in runnable:
            try:
                accepted = evaluate(variant.dispatch, own)
            except RuleError as err:
                raise DispatchError(f"{name}: variant {variant.name!r}'s rule {variant.dispatch!r} "
                                    f"cannot be decided from the call's axes {own}: {err}") from None
            if accepted:
                self.ran[(name, variant.name)] += 1
                if self.trace is not None:
                    self.trace.append(OpCall(name, variant.name, tuple(sorted(own.items()))))
                return variant
        raise DispatchError(f"{name}: no variant's rule accepts {own} on {self.arch}")

    def tier_spec(self, name: str, variant: Variant) -> Callable | None:
        """A reference variant's spec function where its tier is not the exact one (the exact
        tier's reference is the spec the op binding calls): None for the exact tier."""
        if variant.numerics == EXACT:
            return None
        key = (name, variant.name)
        if key not in self._impls:
            self._impls[key] = resolve(self.op(name).spec_of(variant))
        return self._impls[key]

    def impl(self, name: str, variant: Variant) -> Callable:
        """The callable of a non-reference variant (its ``impl`` path), resolved once."""
        key = (name, variant.name)
        if key not in self._impls:
            self._impls[key] = resolve(variant.impl)
        return self._impls[key]

    def core(self, impl: Callable) -> Callable:
        """The in-place core of a kernel variant whose certification entry writes whole-plane
        outputs (``IN_PLACE_CORES``): the same kernels on the engine's own planes."""
        path = f"{impl.__module__}:{impl.__name__}"
        if path not in self._cores:
            try:
                self._cores[path] = resolve(IN_PLACE_CORES[path])
            except KeyError:
                raise DispatchError(f"{path} writes whole-plane outputs and names no in-place core "
                                    f"in IN_PLACE_CORES") from None
        return self._cores[path]

    def variants_ran(self) -> dict[str, list[str]]:
        """op -> the variants that ran (sorted), over this dispatcher's life."""
        out: dict[str, set[str]] = {}
        for op, variant in self.ran:
            out.setdefault(op, set()).add(variant)
        return {op: sorted(vs) for op, vs in sorted(out.items())}
