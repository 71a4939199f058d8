"""Video input is off unless configured (``EngineConfig.multimodal``), and every combination the
engine cannot run with it is refused up front by a named rule, one test per refusal, shown by
``explain``."""

from __future__ import annotations

import pytest
import torch

from impl.model.engine import Engine
from impl.model.engine_config import (RULES, EngineConfig, PeerConfig, SpeculativeConfig, check,
                                      default_context, explain)
from impl.model.vision import vision_geometry
from spec.ops.vision import init_vision_weights

TINY = dict(model="tiny", max_batch_size=2, max_num_tokens=64, max_seq_len=256)
MM_RULES = ("multimodal_model_has_a_vision_tower", "multimodal_without_speculation",
            "multimodal_aggregated_only", "multimodal_without_cuda_graphs")


def only(config: EngineConfig, ctx=None):
    refusals = check(config, ctx)
    assert len(refusals) == 1, refusals
    return refusals[0]


def test_multimodal_is_off_by_default_and_the_tiny_model_accepts_it():
    assert EngineConfig().multimodal is False
    assert check(EngineConfig(**TINY, multimodal=True)) == []
    assert check(EngineConfig(**TINY, multimodal=True, batch_invariant=True)) == []


def test_a_model_without_a_vision_tower_is_refused():
    r = only(EngineConfig(multimodal=True))
    assert r.rule == "multimodal_model_has_a_vision_tower"
    assert r.reason == "multimodal needs a vision tower, and the target model has none"


def test_a_tower_that_reads_out_another_width_is_refused():
    tiny = EngineConfig(**TINY, multimodal=True)
    ctx = default_context(tiny)
    wide = default_context(tiny, ctx.model.model_copy(update={"hidden": 256}))
    reasons = {r.rule: r.reason for r in check(tiny, wide)}
    assert reasons["multimodal_model_has_a_vision_tower"] == (
        "the tiny vision tower reads out 128 wide rows; the model's hidden width is 256")


def test_speculation_is_refused_with_multimodal():
    r = only(EngineConfig(**TINY, multimodal=True, speculative=SpeculativeConfig(draft_length=1)))
    assert r.rule == "multimodal_without_speculation"
    assert "no mRoPE delta in the MTP path" in r.reason


@pytest.mark.parametrize("role", ["context", "generation"])
def test_a_disaggregated_role_is_refused_with_multimodal(role):
    r = only(EngineConfig(**TINY, multimodal=True, role=role, peer=PeerConfig(model="tiny")))
    assert r.rule == "multimodal_aggregated_only"
    assert r.reason.startswith(f"a {role} engine hands requests over without their frame positions")


def test_cuda_graphs_are_refused_with_multimodal():
    c = EngineConfig(**TINY, device="cuda", cuda_graphs=True, multimodal=True)
    gpu = default_context(c, arch="sm_90")
    without = {r.rule for r in check(c.model_copy(update={"multimodal": False}), gpu)}
    refused = {r.rule for r in check(c, gpu)} - without
    assert refused == {"multimodal_without_cuda_graphs"}


def test_explain_shows_the_rules_and_the_tower_only_when_on():
    on = explain(EngineConfig(**TINY, multimodal=True), receipts={})
    for name in MM_RULES:
        rule = next(r for r in RULES if r.name == name)
        assert f"  [PASS] {name}: {rule.statement}" in on
    assert " multimodal=True" in on
    assert "\n  vision_tower: torch (dispatch at {}); " in on
    off = explain(EngineConfig(**TINY), receipts={})
    assert "\n  vision_tower: not run (multimodal off)" in off
    refused = explain(EngineConfig(multimodal=True), receipts={})
    assert "[FAIL] multimodal_model_has_a_vision_tower" in refused


def test_the_engine_needs_the_towers_weights_in_the_models_dtype(weights):
    c = EngineConfig(**TINY, multimodal=True)
    with pytest.raises(ValueError, match="multimodal needs the vision tower's weights"):
        Engine(c, weights)
    geo = vision_geometry("tiny")
    fp32 = init_vision_weights(geo, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="vision weights: patch_w is torch.float32"):
        Engine(c, weights, vision=fp32)
    other = init_vision_weights(geo.__class__(out_width=64), torch.Generator().manual_seed(0),
                                dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"vision weights: w_out is \[64, 64\], the tiny tower "
                                         r"needs \[128, 64\]"):
        Engine(c, weights, vision=other)


def test_vision_weights_round_trip_and_a_wrong_file_is_refused(tmp_path):
    from impl.model.vision import load_vision, save_vision

    geo = vision_geometry("tiny")
    w = init_vision_weights(geo, torch.Generator().manual_seed(2), dtype=torch.bfloat16)
    path = tmp_path / "v.safetensors"
    save_vision(path, w, geo, {"steps": 1})
    back = load_vision(path, geo)
    assert all(torch.equal(a, b) for a, b in zip(w.as_dict().values(), back.as_dict().values()))
    with pytest.raises(ValueError, match="geometry"):
        load_vision(path, geo.__class__(out_width=64))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="not a vision tower file"):
        load_vision(tmp_path / "bad.safetensors", geo)
