"""One certification with its harness checks: ``certify_cell`` observed by the adversarial probe,
then the adversarial and metamorphic checks (``certify.harness.adversarial``,
``certify.harness.metamorphic``). Every entry point that writes a receipt or runs a cell item goes
through ``certify_checked``.

The checks' verdicts go into the receipt's ``harness`` record with the hash of this code and of the
op's contract (``certify.harness.contract.harness_hash``), never into its content hash: a change of
the checks re-runs them without staling the numbers. A failed check fails the target: its status
becomes ``failed`` and its message names the op, the variant, the cell, the check, the tensor and
the first offending index.
"""

from __future__ import annotations

import os
import time
from typing import Any

from certify.catalog.schema import Cell, OpFile
from certify.harness import adversarial, metamorphic
from certify.harness.archs import device_for
from certify.harness.contract import contract_of, harness_hash
from certify.harness.extended import certify_cell, op_for_cell
from certify.harness.target import (Outcome, build_case, resolve, run_spec, seed_for,
                                    variant_callable)

# The order a receipt lists its checks in.
CHECKS = ("inputs_untouched", "canary", "inplace_unowned_rows", "dirty_reuse", "views",
          "cuda_graph", "rows_order", "batch_size")


def certify_checked(op: OpFile, variant_name: str, cell: Cell, arch: str
                    ) -> tuple[Outcome, dict[str, Any]]:
    """``certify_cell`` and the harness checks: (the outcome, a failed check folded in; the
    receipt's ``harness`` record)."""
    op = op_for_cell(op, cell)  # the probe sees the inputs the certification builds
    try:
        probe = probe_for(op, variant_name, cell, arch)
    except Exception:  # noqa: BLE001 - certify_cell reports the same error as its outcome
        outcome = certify_cell(op, variant_name, cell, arch)
        return outcome, record(op, {c: adversarial.not_run("the certification raised")
                                    for c in CHECKS}, 0.0)
    outcome = certify_cell(op, variant_name, cell, arch, impl_override=probe)
    t0 = time.perf_counter()
    verdicts = run_checks(op, variant_name, cell, arch, probe, outcome)
    rec = record(op, verdicts, time.perf_counter() - t0)
    fold(outcome, op, variant_name, cell, arch, verdicts)
    return outcome, rec


def probe_for(op: OpFile, variant_name: str, cell: Cell, arch: str) -> adversarial.Probe:
    """The variant wrapped to observe its certifying call on the cell's inputs; raises where the
    variant or the case cannot be built (``certify_cell`` then reports the error)."""
    if arch == "cpu-interpret":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is imported
    return adversarial.Probe(variant_callable(op, variant_name),
                             build_case(op, cell, device_for(arch)))


def run_checks(op: OpFile, variant_name: str, cell: Cell, arch: str, probe: adversarial.Probe,
               outcome: Outcome) -> dict[str, str]:
    verdicts = dict(probe.verdicts)
    if probe.first is None:
        return verdicts | {c: adversarial.not_run("the variant raised") for c in CHECKS
                           if c not in verdicts}
    variant = op.variant(variant_name)
    verdicts["inplace_unowned_rows"] = _guarded(lambda: _unowned(op, variant, probe))
    if outcome.status != "passed":  # the calls below cost as much as the certifying one
        return verdicts | {c: adversarial.not_run(f"the certification {outcome.status}")
                           for c in CHECKS if c not in verdicts}
    contract = contract_of(op)
    seed = seed_for(op.op, cell.id)
    meta = metamorphic.check(probe, variant.invariant_on(arch), contract, seed)
    if meta["rows_order"] == adversarial.PASSED:
        # that call ran into the first call's dirty buffers and gave its bytes, row for row
        verdicts["dirty_reuse"] = adversarial.PASSED
    else:
        verdicts["dirty_reuse"] = _guarded(lambda: adversarial.dirty_reuse(probe))
    verdicts["views"] = _guarded(lambda: adversarial.views(probe, contract.views))
    verdicts["cuda_graph"] = _guarded(lambda: adversarial.cuda_graph(probe))
    return verdicts | meta


def _guarded(check) -> str:
    """A check's verdict; a variant that raises on a call the certifying one did not is a failure."""
    try:
        return check()
    except Exception as e:  # noqa: BLE001
        return adversarial.failed(f"the variant raised: {type(e).__name__}: {e}".splitlines()[0])


def _unowned(op: OpFile, variant, probe: adversarial.Probe) -> str:
    if not probe.case.inplace:
        return adversarial.unowned_rows(probe, None, None)
    if variant.impl == "spec":
        return adversarial.not_run("the variant is the spec, whose rows define what the call owns")
    try:
        ref = run_spec(resolve(op.spec_of(variant)), probe.case, reference=False)
    except Exception as e:  # noqa: BLE001 - a spec with no run in the storage dtypes
        return adversarial.not_run(f"the spec does not run in the case's dtypes ({type(e).__name__})")
    return adversarial.unowned_rows(probe, ref, None)


def record(op: OpFile, verdicts: dict[str, str], seconds: float) -> dict[str, Any]:
    return {"hash": harness_hash(op), "seconds": round(seconds, 3),
            "checks": {c: verdicts.get(c, adversarial.not_run("not reached")) for c in CHECKS}}


def failures(verdicts: dict[str, str]) -> dict[str, str]:
    return {c: v for c, v in verdicts.items() if v.startswith("failed")}


def fold(outcome: Outcome, op: OpFile, variant: str, cell: Cell, arch: str,
         verdicts: dict[str, str]) -> None:
    """A failed check fails the outcome, its message naming the target and the check."""
    bad = failures(verdicts)
    if not bad:
        return
    lines = [f"{op.op}::{variant}::{cell.id}::{arch}: harness check {c} {v}" for c, v in bad.items()]
    if outcome.status == "passed":
        outcome.status = "failed"
    outcome.message = "\n".join(filter(None, [outcome.message, *lines]))
