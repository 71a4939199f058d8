"""``certify verify``: re-run receipts and compare what they record with what the code does now.

A receipt is a claim: "at this content hash, on this arch, the variant wrote outputs with these
digests and these measured errors, and the oracle passed". Its hash says which code it speaks of, not
that the code does what it says: a receipt whose status was edited, or whose hash was recomputed over
changed code, still looks fresh. Re-running it is the evidence. A verification

- re-runs the target from the receipt's seed (the seed is ``seed_for(op, cell)``, so a receipt whose
  seed differs is already no evidence),
- requires the same status, and the receipt to be consistent with its band (``evidence_problems``),
- and, where the run is comparable (``not_comparable`` is None: the same library versions and the
  same CPU dispatch or GPU), the same digest of every output and the same metrics. Where it is not
  comparable (another CPU capability, thread count, torch build or GPU), fp32 sums may round
  differently while both runs are right, so only the status and the band are re-checked, and the
  verdict says why.

A committed GPU receipt is a claim that a re-run on that GPU checks; on a machine without it, the
verification of that arch is skipped with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from certify.harness.archs import present_archs
from certify.catalog.load import Catalog
from certify.harness.extended import certify_cell
from certify.harness.target import Outcome
from certify.catalog.plan import Target, targets
from certify.receipts.codehash import content_hash
from certify.receipts.store import (
    CPU_DISPATCH_SETTINGS,
    Receipt,
    evidence_problems,
    library_versions,
    load_receipts,
)
from certify.harness.requirements import versions as required_versions
from certify.harness.requirements import why_skipped

CONFIRMED = "confirmed"
CONFIRMED_BAND = "confirmed (status and band)"
MISMATCH = "MISMATCH"
SKIPPED = "skipped"

# Recorded keys that do not decide the bytes of a result.
_NOT_DECIDING = ("python",)
_CPU_DISPATCH_KEYS = ("cpu_capability", "threads", "cpu_model", "numpy_blas",
                      *(k.lower() for k in CPU_DISPATCH_SETTINGS))


@dataclass(frozen=True)
class Verification:
    target: str
    verdict: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.verdict:<28} {self.target}" + (f": {self.detail}" if self.detail else "")


def not_comparable(recorded: dict[str, str], now: dict[str, str], arch: str = "cpu") -> str | None:
    """Why digests recorded under ``recorded`` versions cannot be expected to equal a run under ``now``
    (each a receipt's ``versions``) on ``arch``, or None when they can. On a GPU arch the host CPU's
    dispatch decides nothing."""
    ignored = set(_NOT_DECIDING) | (set(_CPU_DISPATCH_KEYS) if arch.startswith("sm_") else set())
    keys = sorted((set(recorded) | set(now)) - ignored)
    diff = [f"{k} {recorded.get(k, '-')} here {now.get(k, '-')}" for k in keys
            if recorded.get(k) != now.get(k)]
    return ("recorded with " + ", ".join(diff)) if diff else None


def compare(receipt: Receipt, outcome: Outcome, now: dict[str, str]) -> tuple[list[str], str | None]:
    """(mismatches, why digests were not compared) between a receipt and a re-run of its target."""
    problems: list[str] = []
    if outcome.status != receipt.status:
        problems.append(f"status {outcome.status} now, {receipt.status} recorded"
                        + (f" ({outcome.message.splitlines()[0]})" if outcome.message else ""))
    why = not_comparable(receipt.versions, now, receipt.arch)
    if why is not None:
        return problems, why
    for name in sorted(set(receipt.digests) | set(outcome.digests)):
        a, b = receipt.digests.get(name), outcome.digests.get(name)
        if a != b:
            problems.append(f"output {name!r}: digest {b} now, {a} recorded")
    metrics = {k: round(v, 4) for k, v in outcome.metrics.items()}
    for k in sorted(set(receipt.metrics) | set(metrics)):
        if receipt.metrics.get(k) != metrics.get(k):
            problems.append(f"metric {k}: {metrics.get(k)} now, {receipt.metrics.get(k)} recorded")
    return problems, None


def verify_target(t: Target, receipt: Receipt) -> Verification:
    """Re-run one target and compare it with its receipt."""
    name = t.name
    reason = why_skipped(t.variant)
    if reason:
        return Verification(name, SKIPPED, reason)
    if receipt.hash != content_hash(t.op, t.variant.name, t.cell):
        return Verification(name, SKIPPED, "stale: the code changed since the receipt (re-certify)")
    invalid = evidence_problems(receipt, t.op, t.cell, t.arch)
    outcome = certify_cell(t.op, t.variant.name, t.cell, t.arch)
    now = library_versions() | required_versions(t.variant)
    problems, why = compare(receipt, outcome, now)
    problems = invalid + problems
    if problems:
        return Verification(name, MISMATCH, "; ".join(problems))
    if why is not None:
        return Verification(name, CONFIRMED_BAND, f"digests not compared: {why}")
    return Verification(name, CONFIRMED, f"{len(receipt.digests)} digest(s) equal")


def select_receipts(catalog: Catalog, receipts_dir: Path, ops: list[str] | None = None,
                    archs: list[str] | None = None, budget_s: float | None = None
                    ) -> tuple[list[tuple[Target, Receipt]], list[Verification]]:
    """The (target, receipt) pairs to re-run on this machine's archs, cheapest recorded first within
    ``budget_s`` seconds (by the receipts' own durations), and what is left out, with why."""
    have = set(archs or present_archs())
    books = load_receipts(receipts_dir)
    chosen: list[tuple[Target, Receipt]] = []
    left: list[Verification] = []
    for name, op in sorted(catalog.ops.items()):
        if ops and name not in ops:
            continue
        for t in targets(op):
            r = books.get(t.arch, {}).get((op.op, t.variant.name, t.cell.id))
            if r is None:
                continue
            if t.arch not in have:
                left.append(Verification(t.name, SKIPPED, f"arch {t.arch} is not on this machine"))
                continue
            chosen.append((t, r))
    chosen.sort(key=lambda tr: (tr[1].seconds, tr[0].name))
    if budget_s is not None:
        spent, kept = 0.0, []
        for t, r in chosen:
            if spent + r.seconds <= budget_s:
                kept.append((t, r))
                spent += r.seconds
            else:
                left.append(Verification(t.name, SKIPPED, f"over the budget of {budget_s:g} s "
                                                          f"(recorded {r.seconds:g} s)"))
        chosen = kept
    return chosen, left


__all__ = ["Verification", "not_comparable", "compare", "verify_target", "select_receipts",
           "CONFIRMED", "CONFIRMED_BAND", "MISMATCH", "SKIPPED"]
