"""Certify one target with the cell fields of ``certify.catalog.cell_extensions``: a cell's own input
builder, and the set oracle of a selection. Every other cell goes to ``certify.harness.target``
unchanged. ``certify run``, the pytest items, ``certify verify`` and the Ray workers call this."""

from __future__ import annotations

import os
import time
import traceback
from typing import Callable

from certify.catalog.cell_extensions import cell_inputs, selection_of
from certify.catalog.schema import EXACT, Cell, OpFile
from certify.harness import oracles, target
from certify.harness.archs import device_for
from certify.harness.set_oracle import check_selection


def op_for_cell(op: OpFile, cell: Cell) -> OpFile:
    """The op as the cell builds its inputs: with the cell's own builder where it names one."""
    inputs = cell_inputs(op, cell)
    return op if inputs == op.inputs else op.model_copy(update={"inputs": inputs})


def certify_cell(op: OpFile, variant_name: str, cell: Cell, arch: str,
                 impl_override: Callable | None = None) -> target.Outcome:
    """``certify.harness.target.certify_cell`` for any cell: with its own builder where it names one,
    and through the set oracle where it has a selection. Never raises."""
    op = op_for_cell(op, cell)
    if selection_of(cell) is None:
        return target.certify_cell(op, variant_name, cell, arch, impl_override)
    return _certify_selection(op, variant_name, cell, arch, impl_override)


def _certify_selection(op: OpFile, variant_name: str, cell: Cell, arch: str,
                       impl_override: Callable | None) -> target.Outcome:
    t0 = time.perf_counter()
    ran = {"spec": False, "variant": False, "oracle": False}
    sel = selection_of(cell)
    try:
        variant = op.variant(variant_name)
        if variant.numerics != EXACT:
            raise ValueError(f"{variant_name} claims the tier {variant.numerics!r}: a set oracle "
                             "judges the exact tier only")
        if arch == "cpu-interpret":
            os.environ.setdefault("TRITON_INTERPRET", "1")
        impl = impl_override or target.variant_callable(op, variant_name)
        case = target.build_case(op, cell, device_for(arch))
        if sel.ids not in case.outputs:
            raise ValueError(f"the selection's ids {sel.ids!r} are not an output of the case "
                             f"({sorted(case.outputs)})")
        others = set(case.outputs) - {sel.ids}
        if others != set(cell.oracle.outputs):
            raise ValueError(f"the oracle's bands {sorted(cell.oracle.outputs)} must name exactly the "
                             f"outputs besides the ids {sorted(others)}")
        got = target.run_variant(impl, case)
        ran["variant"] = True
        digests = {name: target.tensor_digest(t) for name, t in got.items()}
        wide = {k: target._to64(v) for k, v in case.inputs.items()}
        scores = target.resolve(sel.scores)(**wide).cpu()
        bound = target.resolve(sel.bound)(**wide).cpu()
        ids = got[sel.ids].cpu()
        verdicts = [check_selection(sel.ids, ids, scores, bound, sel.ordered)]
        if others:
            ref = target.resolve(sel.given)(**wide, **{sel.ids: got[sel.ids].clone()})
            for name, band in cell.oracle.outputs.items():
                verdicts.append(oracles.tolerance(name, got[name].cpu(), ref[name].cpu(),
                                                  band.max_ulp, band.max_rel_rms,
                                                  band.allow_matching_inf))
        ran["spec"] = ran["oracle"] = True
        metrics: dict[str, float] = {}
        problems: list[str] = []
        for v in verdicts:
            metrics.update(v.metrics)
            problems += v.problems
        status = "passed" if not problems else "failed"
        return target.Outcome(status, metrics, "\n".join(problems), time.perf_counter() - t0, ran,
                              digests)
    except Exception as e:  # noqa: BLE001 - a crash in one cell must not stop the others
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return target.Outcome("error", {}, f"{tb}\n{traceback.format_exc(limit=-3)}",
                              time.perf_counter() - t0, ran)
