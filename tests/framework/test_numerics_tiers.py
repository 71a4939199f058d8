"""Numerics tiers as data: a variant claims a tier, is judged by the tier's spec path and bands
only, records its error against the exact spec beside its verdict, and is dispatched within its
tier; the engine takes the tier by configuration and refuses one that cannot run."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from certify.catalog.load import Catalog, load_op_file
from certify.files.paths import project_paths
from certify.files.problem import FileProblem
from certify.harness.target import certify_cell
from certify.receipts.codehash import content_hash
from impl.model.dispatch import DispatchError, Dispatcher
from impl.model.engine_config import EngineConfig, RuleContext, check
from spec.config import ModelConfig

OP = textwrap.dedent("""\
    op: norm_t
    summary: the standalone gated norm with an fp8-input tier
    spec: spec.ops.norms:gated_rmsnorm
    inputs: spec.cases.gdn:gated_norm_case
    axes:
      rows: {kind: int, reach: [1, 64]}
      value_heads: {kind: choice, values: [2]}
      head_dim: {kind: choice, values: [16]}
    variants:
      - name: torch
        impl: impl.kernels.gdn.torch_ops:gated_rmsnorm
        archs: [cpu]
      - name: fp8_in
        impl: tests.framework.tier_variants:gated_rmsnorm_from_fp8
        archs: [cpu]
        numerics: fp8_input
    numerics:
      fp8_input:
        spec: tests.framework.tier_variants:gated_rmsnorm_fp8_input
        doc: o rounded to e4m3 before the norm
        outputs:
          out: {max_ulp: 2, max_rel_rms: 1, derivation: the norm's two bf16 roundings plus a tie}
    cells:
      - id: rows_4
        axes: {rows: 4}
        why: a small case for the tier tests
        tier: premerge
        oracle:
          kind: tolerance
          outputs:
            out: {max_ulp: 2, max_rel_rms: 1, derivation: the norm's two bf16 roundings plus a tie}
    """)


def _op(tmp_path: Path, text: str = OP):
    path = tmp_path / "norm_t.yaml"
    path.write_text(text)
    return load_op_file(path)


def test_a_tier_variant_is_judged_by_its_tier_and_records_its_exact_error(tmp_path):
    op = _op(tmp_path)
    cell = op.cell("rows_4")
    tiered = certify_cell(op, "fp8_in", cell, "cpu")
    assert tiered.status == "passed", tiered.message
    assert tiered.metrics["out.ulp"] <= 2
    # against the exact spec the fp8 input costs far more than the exact bands allow
    assert tiered.metrics["exact.out.ulp"] > 8
    exact = certify_cell(op, "torch", cell, "cpu")
    assert exact.status == "passed" and not any(k.startswith("exact.") for k in exact.metrics)


def test_the_same_kernel_claiming_the_exact_tier_fails_the_cells_bands(tmp_path):
    op = _op(tmp_path, OP.replace("    numerics: fp8_input\n", "    numerics: exact\n", 1).replace(
        "numerics:\n  fp8_input:", "numerics:\n  unused:").replace(
        "  - name: fp8_in", "  - name: placeholder\n    impl: spec\n    archs: [cpu]\n"
        "    numerics: unused\n  - name: fp8_in"))
    out = certify_cell(op, "fp8_in", op.cell("rows_4"), "cpu")
    assert out.status == "failed" and "ulp > band" in out.message


def test_the_tiers_bands_are_in_its_variants_hash_only(tmp_path):
    op = _op(tmp_path)
    wider = _op(tmp_path, OP.replace("      out: {max_ulp: 2", "      out: {max_ulp: 3", 1))
    cell = op.cell("rows_4")
    assert content_hash(op, "fp8_in", cell) != content_hash(wider, "fp8_in", cell)
    assert content_hash(op, "torch", cell) == content_hash(wider, "torch", cell)


@pytest.mark.parametrize("edit, field, message", [
    (("    numerics: fp8_input\n", "    numerics: fp4_input\n"), "variants[1].numerics",
     "unknown numerics tier 'fp4_input'"),
    (("    numerics: fp8_input\n", ""), "numerics.fp8_input", "no variant claims the tier"),
    (("  fp8_input:\n", "  exact:\n"), "numerics", "other than 'exact'"),
])
def test_a_bad_tier_is_refused_naming_its_field(tmp_path, edit, field, message):
    with pytest.raises(FileProblem) as err:
        _op(tmp_path, OP.replace(*edit, 1))
    assert err.value.field.startswith(field) and message in err.value.message, str(err.value)


def _project_catalog() -> Catalog:
    from certify.catalog.load import load_catalog
    return load_catalog(project_paths().cells)


def test_the_dispatcher_chooses_within_the_configured_tier():
    cat = _project_catalog()
    axes = dict(batch=1, seq_len=100, key_heads=16, value_heads=48, head_dim=128)
    exact = Dispatcher(cat, "cpu").choose("gdn_prefill", **axes)
    tiered = Dispatcher(cat, "cpu", numerics={"gdn_prefill": "bf16_operands"}).choose(
        "gdn_prefill", **axes)
    assert exact.numerics == "exact" and tiered.name == "spec_bf16_operands"
    with pytest.raises(DispatchError, match="bf16_operands tier"):
        Dispatcher(cat, "cpu-interpret", numerics={"gdn_prefill": "bf16_operands"}).choose(
            "gdn_prefill", **axes)


def test_the_engine_refuses_a_tier_that_cannot_run_naming_the_rule():
    cat = _project_catalog()
    ctx = RuleContext(ModelConfig.tiny(), cat, "cpu")
    ok = EngineConfig(model="tiny", numerics={"gdn_prefill": "bf16_operands"})
    assert not [r for r in check(ok, ctx) if r.rule == "numerics_tier_runs_on_the_arch"]
    for numerics, why in (({"gdn_prefill": "fp4"}, "has no numerics tier 'fp4'"),
                          ({"no_such_op": "exact"}, "is not an op of the catalog")):
        refused = [r for r in check(EngineConfig(model="tiny", numerics=numerics), ctx)
                   if r.rule == "numerics_tier_runs_on_the_arch"]
        assert refused and why in refused[0].reason
    # on an arch where no variant of the tier runs (the interpreter has none)
    ctx_interp = RuleContext(ModelConfig.tiny(), cat, "cpu-interpret")
    refused = [r for r in check(ok, ctx_interp) if r.rule == "numerics_tier_runs_on_the_arch"]
    assert refused and "no variant of gdn_prefill's bf16_operands tier runs on cpu-interpret" in \
        refused[0].reason
