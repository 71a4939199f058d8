"""The second expert copy's rule (impl/model/expert_copy.py) and the memory plan that counts it
(impl/model/memory.py): the plan equals what the engine's cache allocates; the declared large launch is
the kernel's; a copy is kept only where a large launch of another layout is reachable and not
dropped, and its bytes count in the plan."""

from __future__ import annotations

import pytest
import torch

from impl.model.cache import EngineCache
from impl.model.engine import Engine
from impl.model.engine_config import (EngineConfig, RuleContext, SpeculativeConfig, default_context,
                                      engine_memory, explain)
from impl.model.expert_copy import (CHECKPOINT_LAYOUT, LARGE_LAUNCHES, LargeLaunch, expert_copy)
from impl.model.memory import memory_plan, memory_shortfall
from spec.config import ModelConfig

TINY, TARGET = ModelConfig.tiny(), ModelConfig.target()
_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tensor_bytes(*objs: object) -> int:
    """The bytes of every tensor reachable from ``objs`` (tensors, sequences, dataclasses), once."""
    seen: set[int] = set()

    def walk(o: object) -> int:
        if id(o) in seen:
            return 0
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            return o.numel() * o.element_size()
        if isinstance(o, (list, tuple)):
            return sum(walk(x) for x in o)
        if hasattr(o, "__dataclass_fields__"):
            return sum(walk(getattr(o, f)) for f in o.__dataclass_fields__)
        return 0

    return sum(walk(o) for o in objs)


@pytest.mark.parametrize("model", [TINY, TARGET], ids=["tiny", "target"])
@pytest.mark.parametrize("kv", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("state,mtp", [("fp32", True), ("bf16", False)])
def test_the_plan_is_what_the_cache_allocates(model, kv, state, mtp):
    slots, max_seq_len, rows = 3, 70, 4 if mtp else 0
    cache = EngineCache.allocate(model, slots, max_seq_len, torch.bfloat16, kv, _DTYPE[state],
                                 torch.device("meta"), with_mtp=mtp, verify_rows=rows)
    copy = expert_copy(None, 1, True, model)
    plan = memory_plan(model, slots=slots, max_seq_len=max_seq_len, kv_dtype=kv, state_dtype=state,
                       model_dtype="bf16", with_mtp=mtp, expert_copy=copy, verify_rows=rows)
    planes = [layer for layer in cache.layers if not hasattr(layer, "state")] + (
        [cache.mtp] if mtp else [])
    pools = [layer for layer in cache.layers if hasattr(layer, "state")]
    assert plan.pages == cache.pages.num_pages
    assert plan.kv_pages == tensor_bytes(*planes)
    assert plan.state_pools == tensor_bytes(*(p.state for p in pools), *(p.conv for p in pools),
                                            cache.ple_history)
    assert plan.verify_states == tensor_bytes(*(p.verify_states for p in pools))
    assert (plan.verify_states > 0) == mtp
    assert plan.total == tensor_bytes(cache.layers, cache.mtp, cache.ple_history)


@pytest.mark.parametrize("commit,counted", [("cached", True), ("recompute", False)])
def test_the_cached_commit_counts_its_verify_states(commit, counted):
    config = EngineConfig(model="target", max_batch_size=128, max_seq_len=2048, state_dtype="fp32",
                          speculative=SpeculativeConfig(draft_length=3), gdn_commit=commit)
    plan = engine_memory(config, default_context(config))
    one = TARGET.gdn_value_heads * TARGET.gdn_d_k * TARGET.gdn_d_v * 4    # an fp32 state
    want = TARGET.num_gdn_layers * config.cache_slots * 4 * one if counted else 0
    assert plan.verify_states == want
    assert any("verify states" in line for line in plan.lines()) == counted


def test_a_plan_larger_than_the_free_memory_is_refused_naming_its_parts():
    config = EngineConfig(model="target", max_batch_size=128, max_seq_len=2048,
                          speculative=SpeculativeConfig(draft_length=3))
    plan = engine_memory(config, default_context(config))
    assert memory_shortfall(plan, plan.total) is None
    why = memory_shortfall(plan, plan.total - 1)
    assert why is not None and "GDN verify states (cached commit)" in why
    assert f"{plan.total / 2**30:.2f} GiB" in why
    assert f"recompute' keeps no verify states ({plan.verify_states / 2**30:.3f} GiB less)" in why
    plain = engine_memory(config.model_copy(update={"speculative": None}), default_context(config))
    assert "recompute" not in memory_shortfall(plain, 0)


def test_the_engine_counts_its_spare_graph_slot():
    one = EngineConfig(model="tiny", max_seq_len=64)
    ctx = default_context(one)
    assert engine_memory(one.model_copy(update={"cuda_graphs": True}), ctx).state_pools == \
        engine_memory(one.model_copy(update={"max_batch_size": 9}), ctx).state_pools


def test_the_declared_large_launch_is_the_kernels_bm64_regime():
    from impl.kernels.moe.triton_moe import ROWS_PER_EXPERT_FOR_BM64, regime

    (launch,) = LARGE_LAUNCHES
    assert launch.variant == "triton" and launch.pairs_per_expert == ROWS_PER_EXPERT_FOR_BM64
    for model in (TINY, TARGET):
        rows, k, e = launch.first_rows(model), model.moe_top_k, model.num_experts
        assert regime(rows * k, e)[0] == "bm64"
        assert regime((rows - 1) * k, e)[0] != "bm64"
    assert launch.first_rows(TARGET) == 410


def test_no_moe_variant_reads_a_second_layout_so_no_copy_is_kept():
    assert all(ll.layout == CHECKPOINT_LAYOUT for ll in LARGE_LAUNCHES)
    gpu = default_context(EngineConfig(device="cuda"), arch="sm_90")
    for backend in ("auto", "triton", "torch", "spec_lowp"):
        config = EngineConfig(device="cuda", moe_backend=backend, max_num_tokens=16384)
        assert engine_memory(config, gpu).expert_copy.bytes == 0
    text = explain(EngineConfig(device="cuda", max_num_tokens=16384), gpu, receipts={})
    assert ("  second expert copy: 0.000 GiB (none: triton's large launch (from 410 rows a step) "
            "reads the checkpoint's layout: no second copy)") in text


# A large launch of another layout, as a backend with one would declare it.
OTHER = (LargeLaunch("triton", 8, "swizzled", 0.5625),)


def test_a_copy_is_kept_only_where_its_launch_is_reached_and_not_dropped():
    rows = OTHER[0].first_rows(TARGET)
    kept = expert_copy("triton", rows, True, TARGET, OTHER)
    assert kept.kept and kept.bytes == round(TARGET.routed_expert_params() * 0.5625)
    assert 60 * 2**30 < kept.bytes < 70 * 2**30   # 49 layers of 1.36 GB: the seed's ~63 GiB
    for got, why in [(expert_copy("triton", rows - 1, True, TARGET, OTHER), "never reaches"),
                     (expert_copy("triton", rows, False, TARGET, OTHER), "moe_expert_copy is off"),
                     (expert_copy("torch", rows, True, TARGET, OTHER), "no large launch")]:
        assert not got.kept and got.bytes == 0 and why in got.reason, got


def test_a_kept_copy_counts_in_the_memory_plan():
    rows = OTHER[0].first_rows(TARGET)
    plans = [memory_plan(TARGET, slots=8, max_seq_len=8192, kv_dtype="bf16", state_dtype="fp32",
                         model_dtype="bf16", with_mtp=False,
                         expert_copy=expert_copy("triton", rows, keep, TARGET, OTHER))
             for keep in (True, False)]
    assert plans[0].kv_pages == plans[1].kv_pages
    assert plans[0].total - plans[1].total == plans[0].expert_copy.bytes > 0


def test_an_engine_reports_the_memory_it_holds():
    from spec.model import init_weights

    config = EngineConfig(model="tiny", max_batch_size=2, max_num_tokens=32, max_seq_len=64,
                          speculative=SpeculativeConfig(draft_length=2))
    e = Engine(config, init_weights(TINY, seed=0, dtype=torch.bfloat16))
    c = e.cache
    assert e.memory.total == tensor_bytes(c.layers, c.mtp, c.ple_history)
    assert e.memory == engine_memory(config, RuleContext(TINY, default_context(config).catalog,
                                                         "cpu"))
