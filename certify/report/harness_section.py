"""The op note's harness section: per receipt, which adversarial and batch-invariance checks ran
(``certify.harness.checks``) and their verdicts, and why the others did not run.

A receipt records its checks with the hash of the checks' code; one made under other checks reads
``stale`` (its numbers stay fresh: the content hash leaves the checks out), and one made before the
checks existed reads ``harness: not run``.
"""

from __future__ import annotations

from tabulate import tabulate

from certify.catalog.schema import OpFile
from certify.harness.checks import CHECKS
from certify.harness.contract import harness_hash
from certify.receipts.store import Receipt
from certify.report.rows import Row

MARK = {"passed": "pass", "failed": "FAIL", "not run": "-"}


def harness_state(receipt: Receipt, op: OpFile) -> str:
    """``current``, ``stale`` (checks of other code) or ``not run`` (no checks recorded)."""
    if not receipt.harness.get("checks"):
        return "not run"
    return "current" if receipt.harness.get("hash") == harness_hash(op) else "stale"


def _mark(verdict: str) -> str:
    return next((m for k, m in MARK.items() if verdict.startswith(k)), verdict)


def harness_markdown(op: OpFile, rows: list[Row]) -> list[str]:
    table, reasons, layouts = [], {}, {}
    unchecked = []
    for r in rows:
        for arch, receipt in sorted(r.receipts.items()):
            state = harness_state(receipt, op)
            if state == "not run":
                unchecked.append(f"`{r.variant}` at `{r.cell}` on {arch}")
                continue
            checks = receipt.harness["checks"]
            table.append([r.variant, r.cell, arch, state,
                          *[_mark(checks.get(c, "not run")) for c in CHECKS]])
            for c in CHECKS:
                v = checks.get(c, "not run: not recorded")
                if not v.startswith("passed"):
                    reasons.setdefault((c, v), []).append(f"{r.variant}/{r.cell}/{arch}")
                elif c == "views" and v != "passed":
                    layouts.setdefault((r.variant, arch), v.removeprefix("passed: "))
    md = ["## Harness checks", "",
          "Each receipt's adversarial checks (inputs untouched, canaries past each buffer, rows of "
          "in-place buffers the call does not own, a second call into dirty buffers, views, a "
          "CUDA-graph replay) and, for a variant claiming batch invariance, its metamorphic checks "
          "(rows in another order, a subset of the rows alone), bitwise. `pass`, `FAIL`, `-` (not "
          "run, the reasons below); `stale`: recorded under other checks' code (the numbers stay "
          "fresh).", ""]
    if table:
        md += [tabulate(table, headers=["variant", "cell", "arch", "harness", *CHECKS],
                        tablefmt="github"), ""]
    if unchecked:
        md.append("harness: not run (receipts made before the harness checks existed; their numbers "
                  "stay fresh): " + ", ".join(unchecked))
        md.append("")
    for (check, verdict), where in sorted(reasons.items()):
        shown = ", ".join(where[:6]) + (f" and {len(where) - 6} more" if len(where) > 6 else "")
        md.append(f"- `{check}` {verdict} ({shown})")
    if reasons:
        md.append("")
    if layouts:
        md += ["Views (non-contiguous, offset inputs; the first cell each variant was checked at):", ""]
        md += [f"- `{variant}` on {arch}: {what}" for (variant, arch), what in sorted(layouts.items())]
        md.append("")
    return md
