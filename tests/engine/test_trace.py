"""The reach tracer's driver (impl/model/trace.py) builds steps as the engine does.

The driver runs ``Model.trunk`` / ``Model.draft`` itself (the engine cannot run on meta tensors: it
reads token values), mirroring ``Engine.step``, ``_after_verify``, ``_commit`` and ``_draft``. These
tests hold it to the engine: on the tiny geometry, the real engine's dispatched calls and the driver's
name the same ops, with the same axes, over the same step kinds, with IndexShare on and off.
"""

from __future__ import annotations

import pytest
import torch

from certify.catalog.load import load_catalog
from certify.files.paths import project_paths
from certify.reach import Mode
from impl.model.admission import Request
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig, SpeculativeConfig
from impl.model.trace import TRACER, Scenario, forward_calls, index_share_honoured
from spec.config import ModelConfig
from spec.model import init_weights

TINY = ModelConfig.tiny()
CATALOG = load_catalog(project_paths().cells)


def _signature(calls) -> dict[str, set]:
    """op -> the set of (axis names, step kind) its calls state."""
    out: dict[str, set] = {}
    for c in calls:
        axes = dict(c.axes)
        out.setdefault(c.op, set()).add((tuple(sorted(axes)), axes.get("step")))
    return out


def _scenario(**kw) -> Scenario:
    return Scenario(name="s", why="a driver test scenario", max_num_tokens=40, **kw)


@pytest.mark.parametrize("share, kv, commit", [(False, "bf16", "cached"), (True, "nvfp4", "cached"),
                                               (False, "fp8", "recompute")])
def test_the_driver_reaches_what_the_engine_dispatches(share, kv, commit):
    weights = init_weights(TINY, seed=0, dtype=torch.bfloat16)
    config = EngineConfig(model="tiny", kv_cache_dtype=kv, max_batch_size=2, max_num_tokens=40,
                          max_seq_len=160, batch_invariant=True, gdn_commit=commit,
                          speculative=SpeculativeConfig(draft_length=2, index_share=share))
    engine = Engine(config, weights)
    engine.dispatcher.start_trace()
    gen = torch.Generator().manual_seed(1)
    engine.generate([Request(request_id=f"r{i}", max_new_tokens=6, prompt=tuple(
        torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist())) for i, n in enumerate([50, 37])])
    engine_calls = engine.dispatcher.stop_trace()

    meta = init_weights(TINY, dtype=torch.bfloat16, device="meta")
    common = dict(draft_length=2, index_share=share, kv_dtype=kv, gdn_commit=commit)
    driver_calls = []
    for sc in (_scenario(prefill=[{"chunk": 40, "context": 40, "last": False}], **common),
               _scenario(prefill=[{"chunk": 10, "context": 50}], **common),
               _scenario(verify=[{"requests": 2, "context": 60}], accepted=1, **common)):
        driver_calls += forward_calls(sc, CATALOG, TINY, meta)
    assert _signature(driver_calls) == _signature(engine_calls)
    assert ("gdn_decode" in _signature(engine_calls)) == (commit == "recompute")


def test_index_share_removes_the_draft_layers_own_selection_for_the_trunks_rows():
    meta = init_weights(TINY, dtype=torch.bfloat16, device="meta")

    def selections(share: bool) -> int:
        sc = _scenario(prefill=[{"chunk": 40, "context": 40}], draft_length=2, index_share=share)
        # a pass selects in qsa_topk_expand, or (IndexShare) in qsa_select for its own rows
        return sum(c.op in ("qsa_select", "qsa_topk_expand")
                   for c in forward_calls(sc, CATALOG, TINY, meta))

    if not index_share_honoured():
        pytest.skip("the engine does not pass the trunk's selection to the draft layer yet")
    # without sharing: one selection per trunk QSA layer, the draft pass over the chunk, one draft row
    assert selections(True) == selections(False) - 1


def test_a_mode_the_engine_refuses_is_recorded_with_the_rules_reason():
    from certify.catalog.load import Catalog

    sc = Scenario(name="s", why="batch-invariant on a GPU arch", decode=[{"requests": 1,
                                                                         "context": 64}])
    ops = dict(CATALOG.ops)
    moe = ops["moe"]
    ops["moe"] = moe.model_copy(update={"variants": [
        v.model_copy(update={"archs": ["cpu"]}) for v in moe.variants]})
    cut = Catalog(ops=ops, errors=CATALOG.errors)
    traces = TRACER.trace(sc, cut, [Mode("sm_90", True)])
    refused = traces["sm_90/batch_invariant"].refused
    assert "ops_run_on_the_arch" in refused and "of moe runs on sm_90" in refused, refused
    # the project's catalog runs it on the CPU; on sm_90 its GDN references claim no batch
    # invariance (they fail the checks there), so the mode is refused there by that rule
    assert TRACER.trace(sc, CATALOG, [Mode("cpu", True)])["cpu/batch_invariant"].refused is None
    refused = TRACER.trace(sc, CATALOG, [Mode("sm_90", True)])["sm_90/batch_invariant"].refused
    assert refused.startswith("batch_invariant_references_hold: gdn_decode's spec_lowp"), refused


def test_a_scenario_naming_the_moe_backend_traces_that_variant_in_every_mode():
    def moe_variants(backend: str) -> dict[str, set[str]]:
        sc = Scenario(name="s", why="a named MoE backend", decode=[{"requests": 4, "context": 64}],
                      moe_backend=backend)
        traces = TRACER.trace(sc, CATALOG, [Mode("cpu", False), Mode("sm_90", False)])
        return {k: {v for op, v, _ in t.calls if op == "moe"} for k, t in traces.items()}

    assert moe_variants("torch") == {"cpu": {"torch"}, "sm_90": {"torch"}}
    # without a name each arch's dispatch rules choose, and on sm_90 they choose another variant
    assert moe_variants("auto")["sm_90"] != {"torch"}


def test_a_frames_scenario_makes_the_calls_of_the_engines_multimodal_context_step():
    """Two frame prompts (4 and 8 frames, the run after BOS) submitted and read in one context step:
    the engine's calls (the tower at submission, then the trunk with the splice and mRoPE
    positions) and the driver's are the same, op for op and axis value for axis value."""
    from impl.model.vision import vision_geometry
    from spec.ops.vision import init_vision_weights

    geo = vision_geometry("tiny")
    sc = Scenario(name="s", why="frames in a context step", model="tiny", max_num_tokens=64,
                  prefill=[{"chunk": 22, "context": 22, "frames": 4},
                           {"chunk": 38, "context": 38, "frames": 8}])
    config = EngineConfig(model="tiny", max_batch_size=2, max_num_tokens=64, max_seq_len=64,
                          batch_invariant=True, multimodal=True)
    vision = init_vision_weights(geo, torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    engine = Engine(config, init_weights(TINY, seed=0, dtype=torch.bfloat16), vision=vision)
    engine.dispatcher.start_trace()
    for i, c in enumerate(sc.prefill):
        engine.submit(Request(request_id=f"r{i}", max_new_tokens=2,
                              prompt=c.prompt(geo.tokens_per_frame),
                              frames=torch.rand(c.frames, 3, 16, 16)))
    engine.step()
    engine_calls = engine.dispatcher.stop_trace()

    def calls(cs) -> list:
        return sorted((c.op, tuple(sorted(dict(c.axes).items()))) for c in cs)

    driver = forward_calls(sc, CATALOG)
    assert calls(driver) == calls(engine_calls)
    towers = [dict(c.axes)["frames"] for c in driver if c.op == "vision_tower"]
    assert towers == [4, 8]
    assert {dict(c.axes)["rope"] for c in driver if c.op == "qk_norm_rope"} == {"mrope"}


def test_the_reach_of_a_frames_scenario_is_its_tower_calls_on_every_mode():
    sc = Scenario(name="s", why="frames in a context step", model="tiny", max_num_tokens=64,
                  prefill=[{"chunk": 22, "context": 22, "frames": 4}])
    traces = TRACER.trace(sc, CATALOG, [Mode("cpu"), Mode("cpu", True), Mode("sm_90")])
    for key, t in traces.items():
        assert t.refused is None, (key, t.refused)
        assert [(op, ax) for op, _, ax in t.calls] == [
            ("vision_tower", {"frames": 4, "frame_size": 16, "act_dtype": "bfloat16"})], key


@pytest.mark.parametrize("fields, message", [
    (dict(prefill=[{"chunk": 22, "context": 22, "frames": 4}]), "the target model has none"),
    (dict(model="tiny", prefill=[{"chunk": 22, "context": 22, "frames": 3}]), "whole groups of 2"),
    (dict(model="tiny", prefill=[{"chunk": 10, "context": 10, "frames": 4}]), "cannot hold BOS"),
])
def test_a_frames_scenario_the_engine_cannot_serve_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Scenario(name="s", why="a frames scenario", **fields)
