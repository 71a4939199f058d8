"""Disaggregated serving is off unless configured (``EngineConfig.role``), and every pair the target
cannot run is refused up front by a named rule, one test per refusal, shown by ``explain``."""

from __future__ import annotations

import pytest

from impl.model.engine import Engine
from impl.model.engine_config import (EngineConfig, PeerConfig, SpeculativeConfig, check,
                                      default_context, explain, transfer_backend)

K3 = SpeculativeConfig(draft_length=3)
TINY = dict(model="tiny", max_batch_size=2, max_num_tokens=64, max_seq_len=256)


def only(config: EngineConfig, ctx=None):
    refusals = check(config, ctx)
    assert len(refusals) == 1, refusals
    return refusals[0]


def peer(**kw) -> PeerConfig:
    return PeerConfig(**dict(model="tiny") | kw)


def test_aggregated_is_the_default_and_names_no_peer():
    c = EngineConfig(**TINY)
    assert c.role == "aggregated" and c.peer is None and c.transfer_backend is None
    assert check(c) == []


@pytest.mark.parametrize("role", ["context", "generation"])
@pytest.mark.parametrize("k_context,k_generation", [(0, 0), (3, 3), (0, 3)])
def test_the_pairs_the_target_runs_are_accepted(role, k_context, k_generation):
    spec = {0: None, 3: K3}
    own, other = (k_context, k_generation) if role == "context" else (k_generation, k_context)
    c = EngineConfig(**TINY, kv_cache_dtype="nvfp4", speculative=spec[own], role=role,
                     peer=peer(kv_cache_dtype="nvfp4", speculative=spec[other]))
    assert check(c) == []
    assert transfer_backend(c) == "gloo"


@pytest.mark.parametrize("role,side", [("context", "hands requests to"),
                                       ("generation", "continues requests from")],
                         ids=["context", "generation"])
def test_a_disaggregated_role_needs_its_peer(role, side):
    r = only(EngineConfig(**TINY, role=role))
    assert r.rule == "disaggregation_role_has_a_peer"
    assert r.reason == (f"role {role!r} {side} a peer engine; peer (how it stores a request's "
                        f"state and whether it drafts) is not set")


def test_an_aggregated_engine_names_no_peer_and_no_backend():
    r = only(EngineConfig(**TINY, peer=peer(), transfer_backend="gloo"))
    assert r.rule == "disaggregation_role_has_a_peer"
    assert r.reason == ("role 'aggregated' serves its requests alone; peer and transfer_backend "
                        "are read only by a context or generation engine")


@pytest.mark.parametrize("field,ours,theirs", [
    ("kv_cache_dtype", "bf16", "nvfp4"), ("state_dtype", "fp32", "bf16"),
    ("model", "tiny", "target"), ("tokens_per_block", 32, 64), ("model_dtype", "bf16", "fp32")])
def test_peers_store_state_alike(field, ours, theirs):
    r = only(EngineConfig(**TINY, role="generation", peer=peer(**{field: theirs})))
    assert r.rule == "disaggregated_peers_store_state_alike"
    assert r.reason == ("the transfer copies pages and states byte for byte, so both engines must "
                        f"store them alike: {field} is {ours!r} here and {theirs!r} at the peer")


def test_every_storage_difference_is_named():
    r = only(EngineConfig(**TINY, role="context",
                          peer=peer(kv_cache_dtype="fp8", state_dtype="bf16")))
    assert r.reason.endswith("kv_cache_dtype is 'bf16' here and 'fp8' at the peer; state_dtype is "
                             "'fp32' here and 'bf16' at the peer")


@pytest.mark.parametrize("role", ["context", "generation"])
def test_a_drafting_context_engine_needs_a_drafting_peer(role):
    c = (EngineConfig(**TINY, role="context", speculative=K3, peer=peer()) if role == "context"
         else EngineConfig(**TINY, role="generation", peer=peer(speculative=K3)))
    r = only(c)
    assert r.rule == "disaggregated_draft_layers_agree"
    assert r.reason.startswith("the context engine drafts (MTP) and the generation engine does not")


@pytest.mark.parametrize("theirs,what", [
    (SpeculativeConfig(draft_length=2), "draft_length 2 and index_share False"),
    (SpeculativeConfig(draft_length=3, index_share=True), "draft_length 3 and index_share True")],
    ids=["draft_length", "index_share"])
def test_drafting_peers_agree_on_the_draft_layer(theirs, what):
    r = only(EngineConfig(**TINY, role="context", speculative=K3, peer=peer(speculative=theirs)))
    assert r.rule == "disaggregated_draft_layers_agree"
    assert r.reason.startswith(f"the context engine drafts with draft_length 3 and index_share "
                               f"False, the generation engine with {what}")


def test_nccl_does_not_serve_the_cpu():
    r = only(EngineConfig(**TINY, role="generation", peer=peer(), transfer_backend="nccl"))
    assert r.rule == "transfer_backend_serves_the_device"
    assert r.reason == ("transfer_backend 'nccl' does not move cpu tensors between processes (gloo "
                        "moves CPU tensors, nccl CUDA tensors); the device 'cpu' needs 'gloo'")


def test_gloo_does_not_serve_cuda_pages():
    c = EngineConfig(**TINY, device="cuda", role="context", peer=peer(), transfer_backend="gloo")
    r = only(c, default_context(c, arch="sm_90"))   # what an H200 would answer
    assert r.rule == "transfer_backend_serves_the_device"
    assert r.reason.startswith("transfer_backend 'gloo' does not move cuda tensors")
    assert transfer_backend(c.model_copy(update={"transfer_backend": None})) == "nccl"


def test_a_backend_missing_from_the_torch_build_is_refused(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    r = only(EngineConfig(**TINY, role="context", peer=peer()))
    assert r.rule == "transfer_backend_serves_the_device"
    assert r.reason == "this torch build has no gloo backend for torch.distributed"


def test_explain_names_the_role_and_the_refusing_rule():
    text = explain(EngineConfig(**TINY, role="generation", peer=peer(kv_cache_dtype="fp8")))
    assert "role=generation transfer_backend=gloo" in text.splitlines()[0]
    assert "REFUSED by 1 rule(s): disaggregated_peers_store_state_alike" in text
    assert "[FAIL] disaggregated_peers_store_state_alike" in text
    assert "[PASS] disaggregation_role_has_a_peer" in text


def test_a_disaggregated_engine_serves_through_its_worker(weights):
    from impl.model.disagg.channel import TransferChannel
    from impl.model.disagg.workers import ContextWorker, GenerationWorker

    engine = Engine(EngineConfig(**TINY, role="context", peer=peer()), weights)
    with pytest.raises(RuntimeError, match="a context engine serves through the workers of "
                                           "impl.model.disagg, not generate"):
        engine.generate([])
    with pytest.raises(ValueError, match="a generation worker runs a generation engine; this "
                                         "one's role is 'context'"):
        GenerationWorker(engine, TransferChannel(peer=0))
    aggregated = Engine(EngineConfig(**TINY), weights)
    with pytest.raises(ValueError, match="a context worker runs a context engine; this one's role "
                                         "is 'aggregated'"):
        ContextWorker(aggregated, TransferChannel(peer=1))
    with pytest.raises(ValueError, match="the channel moves meta tensors; the engine's pages are "
                                         "on cpu"):
        ContextWorker(engine, TransferChannel(peer=1, device="meta"))
