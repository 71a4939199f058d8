"""The committed CPU receipts carry their harness checks: each records the checks of today's code,
and every batch-invariance claim of a variant on a CPU arch has a receipt whose metamorphic checks
passed there (an op whose launch has no row axis says why in its cell file instead)."""

from certify.catalog.load import load_catalog
from certify.catalog.plan import targets
from certify.files.paths import project_paths
from certify.harness.archs import present_archs
from certify.harness.contract import contract_of, harness_hash
from certify.receipts.store import load_receipts

PATHS = project_paths()
CPU_ARCHS = {"cpu", "cpu-interpret"}
METAMORPHIC = ("rows_order", "batch_size")


def _cpu_targets():
    cat = load_catalog(PATHS.cells)
    books = load_receipts(PATHS.receipts)
    for op in cat.ops.values():
        for t in targets(op):
            if t.arch in CPU_ARCHS & set(present_archs()):
                yield t, books.get(t.arch, {}).get((op.op, t.variant.name, t.cell.id))


def test_every_cpu_receipt_records_the_checks_of_todays_code():
    bad = [t.name for t, r in _cpu_targets()
           if r is None or r.harness.get("hash") != harness_hash(t.op)]
    assert not bad, (f"{len(bad)} receipt(s) without today's harness checks (re-make them: "
                     "`certify run --arch ARCH --outdated`):\n" + "\n".join(bad))


def test_every_batch_invariance_claim_has_a_passing_metamorphic_receipt_on_each_cpu_arch():
    checked, rowless, missing = {}, set(), {}
    for t, r in _cpu_targets():
        if not t.variant.invariant_on(t.arch):
            continue
        key = (t.op.op, t.variant.name, t.arch)
        if contract_of(t.op).no_rows:
            rowless.add(key)
            continue
        checks = (r.harness.get("checks", {}) if r else {})
        if all(checks.get(c) == "passed" for c in METAMORPHIC):
            checked[key] = t.cell.id
        else:
            missing.setdefault(key, []).append(f"{t.cell.id}: {checks.get('batch_size', 'no receipt')}")
    unchecked = {k: v for k, v in missing.items() if k not in checked}
    assert not unchecked, "claims without a passing metamorphic receipt:\n" + "\n".join(
        f"{'::'.join(k)}: {'; '.join(v)}" for k, v in sorted(unchecked.items()))
    assert checked and not rowless & set(checked)
