"""EngineConfig routing: one test per refusal rule (name and exact message), explain, and the CLI."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from certify.catalog.load import Catalog
from impl.model import cli
from impl.model.engine_config import (RULES, ConfigRefused, EngineConfig, RuleContext,
                                      SpeculativeConfig, check, default_context, explain, route)


def spec(k: int, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(draft_length=k, **kw)


def only(config: EngineConfig, ctx: RuleContext | None = None):
    refusals = check(config, ctx)
    assert len(refusals) == 1, refusals
    return refusals[0]


def test_rule_names_unique_and_stated():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    assert all(r.statement.endswith(".") for r in RULES)


def test_default_and_tiny_accepted():
    for c in (EngineConfig(), EngineConfig(model="tiny", speculative=spec(7))):
        assert check(c) == []
        plan = c.build_plan()
        assert plan.choices["gdn_decode"].variant is not None


def test_extra_field_and_frozen():
    with pytest.raises(ValidationError):
        EngineConfig(kv_dtype="bf16")
    with pytest.raises(ValidationError):
        EngineConfig().max_batch_size = 3
    with pytest.raises(ValidationError):
        spec(8)


def test_kv_cache_dtype_supported():
    r = only(EngineConfig(kv_cache_dtype="fp16"))
    assert r.rule == "kv_cache_dtype_supported"
    assert r.reason == ("fp16 is not a value of the kv_dtype axis of qsa_kv_append, which allows "
                        "['bfloat16', 'fp8', 'nvfp4'] (and 1 more op(s))")


def test_model_dtype_supported():
    r = only(EngineConfig(model_dtype="fp16"))
    assert r.rule == "model_dtype_supported"
    assert r.reason.startswith("fp16 is not a value of the act_dtype axis of kv_fp8, which allows "
                               "['bfloat16'] (and ")


def test_moe_backend_names_a_variant_of_moe():
    """Every backend value but 'auto' and the foreign ones is a variant of moe, and every variant
    of moe is a backend value: the choice is the catalog's."""
    from typing import get_args

    from impl.model.engine_config import MOE_OP, MoeBackend
    variants = {v.name for v in default_context(EngineConfig()).catalog.ops[MOE_OP].variants}
    assert set(get_args(MoeBackend)) - {"auto", "trtllm", "cutedsl"} == variants


@pytest.mark.parametrize("backend", ["trtllm", "cutedsl"])
def test_moe_backend_without_kernels_refused(backend):
    r = only(EngineConfig(moe_backend=backend))
    assert r.rule == "moe_backend_supported"
    assert r.reason == (f"moe_backend {backend!r} is not a variant of moe (its variants: triton, "
                        "spec_lowp, torch; 'auto' lets their dispatch rules choose)")


def test_moe_backend_refused_where_its_variant_cannot_run():
    cpu = default_context(EngineConfig())
    gpu = RuleContext(cpu.model, cpu.catalog, "sm_90")
    for config, ctx, why in [
            (EngineConfig(moe_backend="triton"), cpu, "it runs on cpu-interpret, sm_90, not on cpu"),
            (EngineConfig(moe_backend="torch", batch_invariant=True), cpu,
             "batch-invariant mode runs reference variants (impl: spec) only"),
            (EngineConfig(device="cuda", moe_backend="triton", torch_only=True), gpu,
             "torch_only runs the variants written in torch only")]:
        r = only(config, ctx)
        assert r.rule == "moe_backend_supported"
        assert r.reason == (f"moe_backend {config.moe_backend!r}: moe's variant "
                            f"{config.moe_backend!r} cannot run: {why}")


def test_moe_backend_is_the_variant_every_moe_call_runs():
    cpu = default_context(EngineConfig())
    gpu = RuleContext(cpu.model, cpu.catalog, "sm_90")
    cases = [("auto", cpu, "spec_lowp"), ("torch", cpu, "torch"), ("spec_lowp", cpu, "spec_lowp"),
             ("auto", gpu, "triton"), ("triton", gpu, "triton"), ("torch", gpu, "torch"),
             ("spec_lowp", gpu, "spec_lowp")]
    for backend, ctx, want in cases:
        config = EngineConfig(device="cpu" if ctx.arch == "cpu" else "cuda", moe_backend=backend)
        assert check(config, ctx) == [], (backend, ctx.arch)
        assert route(config, ctx).choices["moe"].variant == want, (backend, ctx.arch)
        assert f"\n  moe: {want} (dispatch at" in explain(config, ctx, receipts={})
    with_ref = EngineConfig(moe_backend="spec_lowp", batch_invariant=True)
    assert check(with_ref, cpu) == []


def test_cli_drops_the_expert_copy(capsys):
    assert cli.main(["explain", "--preset", "tiny", "--no-moe-expert-copy"]) == 0
    out = capsys.readouterr().out
    assert "moe_expert_copy=False" in out and "memory beside the weights:" in out
    assert cli._config(cli._parser().parse_args(["explain"])).moe_expert_copy is True


def test_cuda_graphs_refuse_a_moe_backend_that_reads_the_host():
    gpu = default_context(EngineConfig(device="cuda"), arch="sm_90")
    assert check(EngineConfig(device="cuda", cuda_graphs=True, moe_backend="triton"), gpu) == []
    for backend in ("torch", "spec_lowp"):
        r = only(EngineConfig(device="cuda", cuda_graphs=True, moe_backend=backend), gpu)
        assert r.rule == "cuda_graphs_capture_on_cuda"
        assert r.reason.startswith(f"a decode step of this geometry dispatches moe::{backend}:")


def test_host_ple_tables_need_cuda():
    r = only(EngineConfig(ple_tables="host"))
    assert r.rule == "ple_host_tables_on_cuda"
    assert "device is 'cpu'" in r.reason
    with pytest.raises(ValidationError):
        EngineConfig(ple_tables="disk")


def test_state_dtype_fp16_refused():
    r = only(EngineConfig(state_dtype="fp16"))
    assert r.rule == "state_dtype_supported"
    assert r.reason == ("fp16 recurrent state is refused: the GDN state is stored in fp32 or bf16 only "
                        "(docs/spec.md, \"GDN layer\"), and no cell certifies an fp16 state pool")


def test_static_draft_length():
    r = only(EngineConfig(speculative=spec(3, dynamic_draft_length=True)))
    assert r.rule == "static_draft_length"
    assert r.reason == ("dynamic_draft_length is refused: the draft length is fixed when the engine is "
                        "built (state pools, verify widths and the certified cells depend on it)")


def test_draft_length_within_model():
    ctx = default_context(EngineConfig())
    small = RuleContext(ctx.model.model_copy(update={"max_draft_len": 3}), ctx.catalog, ctx.arch)
    r = only(EngineConfig(speculative=spec(5)), small)
    assert r.rule == "draft_length_within_model"
    assert r.reason == "draft_length 5 exceeds the target model's max_draft_len 3"


def test_verify_width_bf16_state_k7_refused():
    # without the 8-row bf16 cells the widest bf16 gdn_verify / rollback_commit cells hold K = 3
    ctx = default_context(EngineConfig())
    assert check(EngineConfig(state_dtype="bf16", speculative=spec(7)), ctx) == []
    narrow = _without_cell(_without_cell(ctx, "gdn_verify", "r8_b2_bf16"), "rollback_commit",
                           "k7_b2_bf16")
    assert check(EngineConfig(state_dtype="bf16", speculative=spec(3)), narrow) == []
    r = only(EngineConfig(state_dtype="bf16", speculative=spec(7)), narrow)
    assert r.rule == "verify_width_certified"
    assert r.reason == (
        "draft length 7 needs a cell of gdn_verify's variant 'torch' on cpu with rows >= 8 with "
        "state_dtype bfloat16; none is certified; draft length 7 needs a cell of rollback_commit's "
        "variant 'spec_lowp' on cpu with draft >= 7 with state_dtype bfloat16; none is certified")


def _without_cell(ctx: RuleContext, op_name: str, cell_id: str) -> RuleContext:
    op = ctx.catalog.ops[op_name]
    ops = dict(ctx.catalog.ops)
    ops[op_name] = op.model_copy(update={"cells": tuple(c for c in op.cells if c.id != cell_id)})
    return RuleContext(ctx.model, Catalog(ops=ops), ctx.arch)


def test_verify_width_k7_needs_an_8_row_cell():
    ctx = default_context(EngineConfig())
    assert check(EngineConfig(speculative=spec(7)), ctx) == []
    narrow = _without_cell(ctx, "gdn_verify", "r8_b2_fp32")
    r = only(EngineConfig(speculative=spec(7)), narrow)
    assert r.rule == "verify_width_certified"
    assert r.reason == ("draft length 7 needs a cell of gdn_verify's variant 'torch' on cpu with "
                        "rows >= 8 with state_dtype float32; none is certified")
    assert check(EngineConfig(speculative=spec(3)), narrow) == []  # r4 cells still certify K = 3


def test_verify_width_uses_the_dispatched_variant_on_the_arch():
    ctx = default_context(EngineConfig())
    interp = RuleContext(ctx.model, ctx.catalog, "cpu-interpret")
    # on cpu-interpret gdn_verify dispatches triton_split; greedy_verify has no variant there
    refusals = {r.rule: r for r in check(EngineConfig(speculative=spec(1)), interp)}
    assert set(refusals) == {"verify_width_certified", "ops_run_on_the_arch"}
    r = refusals["verify_width_certified"]
    assert r.reason == ("greedy_verify: no variant runs on cpu-interpret; "
                        "rollback_commit: no variant runs on cpu-interpret")


def test_nvfp4_needs_chunked_prefill_block_reuse_or_speculation():
    r = only(EngineConfig(kv_cache_dtype="nvfp4", enable_chunked_prefill=False))
    assert r.rule == "nvfp4_kv_needs_chunked_prefill_block_reuse_or_speculation"
    assert r.reason == "nvfp4 KV needs chunked prefill, block reuse or speculation; all three are off"
    for ok in (dict(enable_chunked_prefill=True), dict(enable_block_reuse=True),
               dict(speculative=spec(2))):
        base = dict(kv_cache_dtype="nvfp4", enable_chunked_prefill=False)
        assert check(EngineConfig(**{**base, **ok})) == []


def test_max_batch_size_within_reach():
    r = only(EngineConfig(max_batch_size=129, max_num_tokens=16384))
    assert r.rule == "max_batch_size_within_reach"
    assert r.reason == "max_batch_size 129 exceeds the batch reach of acceptance_length (128)"


def test_max_seq_len_within_reach():
    r = only(EngineConfig(max_seq_len=131073))
    assert r.rule == "max_seq_len_within_reach"
    assert r.reason == "max_seq_len 131073 exceeds the context reach of qk_norm_rope (131072)"


def test_tokens_per_block_other_than_the_specs_is_refused(capsys):
    assert check(EngineConfig(tokens_per_block=32), default_context(EngineConfig())) == []
    for tpb in (16, 64):
        r = only(EngineConfig(tokens_per_block=tpb))
        assert r.rule == "tokens_per_block_is_the_specs"
        assert r.reason.startswith(f"tokens_per_block {tpb}: a KV page is the QSA block")
    assert cli.main(["explain", "--tokens-per-block", "64"]) == 2
    assert "REFUSED by 1 rule(s): tokens_per_block_is_the_specs" in capsys.readouterr().out


def test_gdn_recompute_commit_up_to_draft_3():
    from impl.model.engine_config import RECOMPUTE_MAX_DRAFT
    assert RECOMPUTE_MAX_DRAFT == 3
    for k in range(1, 4):
        assert check(EngineConfig(speculative=spec(k), gdn_commit="recompute")) == []
    for k in range(4, 8):
        r = only(EngineConfig(speculative=spec(k), gdn_commit="recompute"))
        assert r.rule == "gdn_recompute_commit_up_to_draft_3"
        assert r.reason == (f"gdn_commit 'recompute' runs at draft length <= 3, the depth its replay "
                            f"tests certify; draft length {k} runs gdn_commit 'cached'")
        assert check(EngineConfig(speculative=spec(k))) == []   # the cached commit runs it
    r = only(EngineConfig(gdn_commit="recompute"))
    assert r.rule == "gdn_recompute_commit_up_to_draft_3"
    assert r.reason == ("gdn_commit 'recompute' re-runs the accepted rows of a verify step at its "
                        "commit; speculation is off, so no step verifies")


def test_gdn_commit_from_the_cli(capsys):
    assert cli.main(["explain", "--preset", "tiny", "--draft-length", "3",
                     "--gdn-commit", "recompute"]) == 0
    assert "gdn_commit=recompute" in capsys.readouterr().out
    assert cli.main(["explain", "--draft-length", "4", "--gdn-commit", "recompute"]) == 2
    assert "REFUSED by 1 rule(s): gdn_recompute_commit_up_to_draft_3" in capsys.readouterr().out


def test_token_budget_holds_a_step():
    r = only(EngineConfig(max_batch_size=8, max_num_tokens=31, speculative=spec(3)))
    assert r.rule == "token_budget_holds_a_step"
    assert r.reason == ("max_num_tokens 31 cannot hold one full generation step: "
                        "max_batch_size 8 x 4 row(s) = 32")


def test_every_refusal_listed_before_anything_is_built():
    c = EngineConfig(state_dtype="fp16", moe_backend="cutedsl", kv_cache_dtype="nvfp4",
                     enable_chunked_prefill=False)
    with pytest.raises(ConfigRefused) as e:
        route(c)
    assert [r.rule for r in e.value.refusals] == [
        "moe_backend_supported", "state_dtype_supported",
        "nvfp4_kv_needs_chunked_prefill_block_reuse_or_speculation"]
    for r in e.value.refusals:
        assert r.rule in str(e.value)


def test_explain_accepted_lists_variant_per_op():
    c = EngineConfig(model="tiny", speculative=spec(3))
    ctx = default_context(c)
    text = explain(c, ctx, receipts={})
    assert "ACCEPTED" in text
    assert "[FAIL]" not in text
    for name in ctx.catalog.ops:
        assert f"\n  {name}: " in text
    assert ("  gdn_verify: torch (dispatch at {'batch': 8, 'state_dtype': 'float32', 'rows': 4}); "
            "NOT certified receipt at 0/5 cell(s) on cpu") in text
    assert "  gdn_verify: certified by gdn_verify::torch::r4_b16_fp32 (rows=4)" in text
    no_spec = explain(EngineConfig(model="tiny"), ctx, receipts={})
    assert "  gdn_verify: not run (speculation off)" in no_spec


def test_explain_names_every_rule_and_the_features_settings():
    """explain lists every rule with its statement (the MoE backend's, the recomputing GDN
    commit's and the KV page size's among them), the settings that select the features, the moe
    variant they run and the expert copy's decision."""
    c = EngineConfig(model="tiny", speculative=spec(3), gdn_commit="recompute", moe_backend="torch")
    text = explain(c, receipts={})
    for rule in RULES:
        assert f"  [PASS] {rule.name}: {rule.statement}" in text
    for name in ("moe_backend_supported", "gdn_recompute_commit_up_to_draft_3",
                 "tokens_per_block_is_the_specs"):
        assert name in {r.name for r in RULES}
    for setting in ("moe_backend=torch", "gdn_commit=recompute", "moe_expert_copy=True"):
        assert setting in text
    assert "\n  moe: torch (dispatch at" in text
    assert "\n  second expert copy: 0.000 GiB (none: moe runs torch" in text


def test_explain_refused_names_rules():
    text = explain(EngineConfig(state_dtype="fp16"), receipts={})
    assert "REFUSED by 1 rule(s): state_dtype_supported" in text
    assert "[FAIL] state_dtype_supported" in text
    assert "variants on" not in text


def test_cli_exit_codes(capsys):
    assert cli.main(["explain", "--preset", "tiny", "--draft-length", "3"]) == 0
    out = capsys.readouterr().out
    assert "ACCEPTED" in out and "gdn_decode: torch" in out
    assert cli.main(["explain", "--preset", "tiny", "--kv-dtype", "nvfp4", "--state-dtype", "fp16",
                     "--no-chunked-prefill"]) == 2
    out = capsys.readouterr().out
    assert "nvfp4_kv_needs_chunked_prefill_block_reuse_or_speculation" in out
    assert cli.main(["explain", "--draft-length", "8"]) == 2
    assert "draft_length: Input should be less than or equal to 7" in capsys.readouterr().out


def test_ops_run_on_the_arch():
    c = EngineConfig(model="tiny", batch_invariant=True)
    assert check(c) == []
    ctx = default_context(c)
    ops = dict(ctx.catalog.ops)
    dec = ops["gdn_decode"]
    ops["gdn_decode"] = dec.model_copy(update={"variants": [v for v in dec.variants
                                                            if v.impl != "spec"]})
    cut = RuleContext(ctx.model, Catalog(ops=ops, errors=ctx.catalog.errors), ctx.arch)
    r = only(c, cut)
    assert r.rule == "ops_run_on_the_arch"
    assert r.reason == ("no reference variant (impl: spec, batch-invariant mode) of gdn_decode "
                        f"runs on {ctx.arch}")
    assert check(EngineConfig(model="tiny"), cut) == []   # the default dispatch still has torch
    # On sm_90 every forward op has a variant in the default dispatch. The batch-invariant mode is
    # refused there: the GDN references claim batch invariance on the CPU only.
    gpu = RuleContext(ctx.model, ctx.catalog, "sm_90")
    assert check(EngineConfig(model="tiny", device="cuda"), gpu) == []
    r = only(EngineConfig(model="tiny", device="cuda", batch_invariant=True), gpu)
    assert r.rule == "batch_invariant_references_hold"
    assert r.reason.startswith("gdn_decode's spec_lowp claims no batch invariance on sm_90")
    spec = EngineConfig(model="tiny", device="cuda", batch_invariant=True,
                        speculative=SpeculativeConfig(draft_length=3))
    assert "gdn_verify's spec_lowp claims no batch invariance on sm_90" in only(spec, gpu).reason
    # Without its sm_90 variants an op refuses the forward there, named.
    hc = ops["hc_inject_norm"]
    ops["hc_inject_norm"] = hc.model_copy(update={"variants": [
        v.model_copy(update={"archs": [a for a in v.archs if a != "sm_90"]}) for v in hc.variants]})
    cut = RuleContext(ctx.model, Catalog(ops=ops, errors=ctx.catalog.errors), "sm_90")
    r = only(EngineConfig(model="tiny", device="cuda"), cut)
    assert r.rule == "ops_run_on_the_arch"
    assert r.reason == "no variant of hc_inject_norm runs on sm_90"


def test_device_present():
    cpu = RuleContext(default_context(EngineConfig()).model, default_context(EngineConfig()).catalog,
                      "cpu")
    r = only(EngineConfig(model="tiny", device="cuda"), cpu)
    assert r.rule == "device_present"
    assert r.reason == "device 'cuda' was asked for, and this machine has no CUDA device"
    gpu = RuleContext(cpu.model, cpu.catalog, "sm_90")
    assert check(EngineConfig(model="tiny", device="cuda"), gpu) == []


def test_explain_batch_invariant_lists_reference_variants():
    c = EngineConfig(model="tiny", batch_invariant=True)
    text = explain(c, receipts={})
    assert "batch_invariant=True" in text
    assert "  gdn_decode: spec_lowp (dispatch at" in text


def test_cli_generate(capsys):
    args = ["generate", "--random-weights", "--max-batch-size", "2", "--max-num-tokens", "32",
            "--max-seq-len", "128", "--random-prompts", "2", "--prompt-len", "20",
            "--max-new-tokens", "4"]
    assert cli.main(args + ["--draft-length", "2"]) == 0
    out = capsys.readouterr().out
    assert "8 tokens in" in out and "tokens/s" in out and "acceptance length" in out
    assert "gdn_verify=torch" in out
    assert cli.main(args + ["--prompt", "x" * 200]) == 2
    out = capsys.readouterr().out
    assert "req0: REJECTED" in out and "req1: [" in out and "req2: [" in out
    assert cli.main(["generate", "--random-weights", "--preset", "target", "--prompt", "a"]) == 2


def test_cli_generate_from_a_checkpoint(tmp_path, capsys):
    import torch

    from impl.model.checkpoint import save_checkpoint
    from spec.config import ModelConfig
    from spec.model import init_weights
    cfg = ModelConfig.tiny()
    path = tmp_path / "tiny.safetensors"
    save_checkpoint(path, init_weights(cfg, seed=3, dtype=torch.bfloat16), cfg)
    args = ["generate", "--checkpoint", str(path), "--max-batch-size", "2", "--max-num-tokens",
            "32", "--max-seq-len", "128", "--prompt", "abc", "--max-new-tokens", "3",
            "--batch-invariant"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "3 tokens in" in out and "gdn_decode=spec_lowp" in out


def test_the_engine_routes_on_the_geometry_it_serves():
    """A checkpoint's geometry, not the preset's, decides the rules: a tiny model without an MTP
    layer is refused speculation when the engine is built, though the tiny preset has one."""
    import torch

    from impl.model.engine import Engine
    from spec.config import ModelConfig
    from spec.model import init_weights

    cfg = ModelConfig(**{**ModelConfig.tiny().model_dump(), "mtp_layers": 0})
    weights = init_weights(cfg, seed=0, dtype=torch.bfloat16)
    config = EngineConfig(model="tiny", max_batch_size=2, max_num_tokens=64, max_seq_len=64,
                          speculative=spec(3))
    assert route(config)   # the preset alone is accepted
    with pytest.raises(ConfigRefused) as e:
        Engine(config, weights, cfg=cfg)
    assert [r.rule for r in e.value.refusals] == ["draft_length_within_model"]
    assert "mtp_layers=0" in str(e.value)


def test_cli_generate_names_a_missing_or_damaged_checkpoint(tmp_path, capsys):
    missing = tmp_path / "absent.safetensors"
    assert cli.main(["generate", "--checkpoint", str(missing), "--prompt", "a"]) == 2
    out = capsys.readouterr().out
    assert f"--checkpoint {missing}: no such file" in out and "Traceback" not in out
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"not a safetensors file")
    assert cli.main(["generate", "--checkpoint", str(damaged), "--prompt", "a"]) == 2
    assert f"checkpoint {damaged}: not a readable safetensors file" in capsys.readouterr().out


def test_explain_answers_for_another_arch(capsys):
    """A reviewer on a CPU machine asks what the H200 would run."""
    assert cli.main(["explain", "--device", "cuda", "--arch", "sm_90", "--draft-length", "3"]) == 0
    out = capsys.readouterr().out
    assert "arch: sm_90" in out and "variants on sm_90:" in out
    assert "\n  moe: triton (dispatch at" in out
    assert cli.main(["explain", "--arch", "sm_75"]) == 2
    assert "--arch sm_75: no variant runs there" in capsys.readouterr().out


def test_cli_options_offer_the_configs_own_values(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "--kv-dtype", "int4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'int4'" in err and "'nvfp4'" in err
    assert cli.main(["explain", "--state-dtype", "fp16"]) == 2   # admitted, then refused by a rule
    assert "REFUSED by 1 rule(s): state_dtype_supported" in capsys.readouterr().out


def test_cuda_graphs_capture_on_cuda():
    r = only(EngineConfig(cuda_graphs=True))
    assert r.rule == "cuda_graphs_capture_on_cuda"
    assert r.reason == "cuda_graphs needs device 'cuda' (the configuration's device is 'cpu')"
    gpu = default_context(EngineConfig(device="cuda"), arch="sm_90")
    assert check(EngineConfig(device="cuda", cuda_graphs=True), gpu) == []
    # The verify step's trunk captures too: its kernels read no value on the host.
    assert check(EngineConfig(device="cuda", cuda_graphs=True, speculative=spec(3)), gpu) == []
    config = EngineConfig(device="cuda", cuda_graphs=True, batch_invariant=True)
    graphs = [x for x in check(config, gpu) if x.rule == "cuda_graphs_capture_on_cuda"]
    assert len(graphs) == 1 and "batch-invariant" in graphs[0].reason
    # A verify step that dispatches the torch MoE composition is refused, naming the verify step.
    r = only(EngineConfig(device="cuda", cuda_graphs=True, speculative=spec(3), moe_backend="torch"),
             gpu)
    assert r.rule == "cuda_graphs_capture_on_cuda"
    assert r.reason.startswith("a verify step of this geometry dispatches moe::torch:")
    # The tiny geometry captures (its index scores pad to 16 heads), with every KV format: a
    # kernel KV append quantises inside, so the codecs' references are not part of the step.
    for kv in ("bf16", "fp8", "nvfp4"):
        tiny = EngineConfig(model="tiny", device="cuda", cuda_graphs=True, max_seq_len=256,
                            kv_cache_dtype=kv)
        assert check(tiny, default_context(tiny, arch="sm_90")) == []
    # Without the Triton index scores the decode step dispatches their reference: refused, named.
    ctx = default_context(tiny, arch="sm_90")
    ops = dict(ctx.catalog.ops)
    scores = ops["qsa_index_scores"]
    ops["qsa_index_scores"] = scores.model_copy(update={"variants": [
        v for v in scores.variants if v.impl == "spec"]})
    cut = RuleContext(ctx.model, Catalog(ops=ops, errors=ctx.catalog.errors), "sm_90")
    refused = check(tiny, cut)
    assert [x.rule for x in refused] == ["cuda_graphs_capture_on_cuda"], refused
    assert refused[0].reason.startswith("a decode step of this geometry dispatches "
                                        "qsa_index_scores::spec_lowp")
