"""A cell item that verifies its committed receipt runs the checks of the certifying call itself
(the probe: inputs untouched, canaries) and lets the receipt's verdicts of the checks that call the
variant again stand, where the receipt is of the same code and the same checks, made on a platform
whose digests this run compares (``certify.receipts.verify.not_comparable``), and none of its
checks failed. The item fails anyway when the digests do not reproduce; elsewhere (other code,
other checks, another platform) every check runs (``certify.harness.checks.certify_checked``).

This keeps the pre-merge list's cost near what it was: the repeated calls (a second full launch and
the row subsets) would add about two thirds to its cell items.
"""

from __future__ import annotations

import time
from typing import Any

from certify.catalog.schema import Cell, OpFile
from certify.harness.checks import CHECKS, certify_checked, fold, probe_for, record
from certify.harness.contract import harness_hash
from certify.harness.extended import certify_cell, op_for_cell
from certify.harness.target import Outcome
from certify.receipts.store import Receipt
from certify.receipts.verify import not_comparable

# The checks that call the variant (or the spec) again.
REPEATED = ("inplace_unowned_rows", "dirty_reuse", "views", "cuda_graph", "rows_order", "batch_size")


def standing_verdicts(committed: Receipt | None, op: OpFile, arch: str, now: dict[str, str]
                      ) -> dict[str, str] | None:
    """The committed receipt's verdicts where they stand for this run (see the module), else None.
    The caller has checked that the receipt's content hash is today's."""
    if committed is None:
        return None
    checks = committed.harness.get("checks") or {}
    if not checks or committed.harness.get("hash") != harness_hash(op) or \
            not_comparable(committed.versions, now, arch) is not None or \
            any(v.startswith("failed") for v in checks.values()):
        return None
    return checks


def certify_verifying(op: OpFile, variant_name: str, cell: Cell, arch: str,
                      standing: dict[str, str] | None) -> tuple[Outcome, dict[str, Any]]:
    """``certify_checked``, or with ``standing`` verdicts only the certifying call's checks."""
    if standing is None:
        return certify_checked(op, variant_name, cell, arch)
    op = op_for_cell(op, cell)  # the probe sees the inputs the certification builds
    try:
        probe = probe_for(op, variant_name, cell, arch)
    except Exception:  # noqa: BLE001 - the full path reports the error as its outcome
        return certify_checked(op, variant_name, cell, arch)
    outcome = certify_cell(op, variant_name, cell, arch, impl_override=probe)
    t0 = time.perf_counter()
    verdicts = dict(probe.verdicts)
    verdicts |= {c: standing[c] for c in REPEATED if c in standing and c in CHECKS}
    rec = record(op, verdicts, time.perf_counter() - t0) | {"standing": list(REPEATED)}
    fold(outcome, op, variant_name, cell, arch, verdicts)
    return outcome, rec
