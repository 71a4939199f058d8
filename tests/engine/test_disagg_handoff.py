"""The hand-off itself, in one process (impl/model/disagg/handoff.py): it carries exactly the
request's state, its cost does not grow with the pools, and a hand-off that does not match the
generation engine is rejected naming the field at fault while the engine keeps serving its other
requests."""

from __future__ import annotations

import copy

import pytest
import torch

from impl.model.admission import Request
from impl.model.cache import GDNPool
from impl.model.disagg.handoff import TransferRejected, adopt, extract
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig, PeerConfig, SpeculativeConfig
from spec.config import ModelConfig
from tests.engine.test_step_cost import BytesWritten

TINY = ModelConfig.tiny()


def _configs(context: dict, generation: dict, **base) -> tuple[EngineConfig, EngineConfig]:
    base = dict(model="tiny", max_batch_size=2, max_num_tokens=64, max_seq_len=256) | base
    ctx, gen = EngineConfig(**base | context), EngineConfig(**base | generation)
    return (EngineConfig(**base | context, role="context", peer=PeerConfig.of(gen)),
            EngineConfig(**base | generation, role="generation", peer=PeerConfig.of(ctx)))


def _request(rid: str, n: int, new: int = 8, seed: int = 0) -> Request:
    gen = torch.Generator().manual_seed(seed)
    return Request(request_id=rid, prompt=tuple(torch.randint(0, TINY.vocab_size, (n,),
                                                              generator=gen).tolist()),
                   max_new_tokens=new)


def _read_prompt(engine: Engine, request: Request):
    """Step ``engine`` until ``request`` has read its prompt; returns its sequence."""
    engine.submit(request)
    while True:
        engine.step()
        seq = engine.sequence(request.request_id)
        if not seq.in_prompt:
            return seq


def _handoff(weights, config: EngineConfig, request: Request):
    engine = Engine(config, weights)
    seq = _read_prompt(engine, request)
    handoff = extract(engine, seq)
    engine.detach(seq)
    return handoff


def _state_bytes(engine: Engine, pages: int) -> int:
    """The bytes one request's state holds in ``engine``: its pages of every paged plane, its slot
    of every GDN pool and of the PLE history."""
    cache = engine.cache
    total = 0
    planes = [layer for layer in cache.layers if not isinstance(layer, GDNPool)]
    planes += [cache.mtp] if cache.mtp is not None else []
    for p in planes:
        for pool in (*p.k_cache, *p.v_cache) if isinstance(p.k_cache, tuple) else (p.k_cache,
                                                                                    p.v_cache):
            total += pages * pool[0].nbytes
        total += pages * sum(t[0].nbytes for t in (p.pos_plane, p.index_plane, p.block_keys,
                                                   p.block_key_valid))
    for layer in cache.layers:
        if isinstance(layer, GDNPool):
            total += layer.state[0].nbytes + layer.conv[0].nbytes
    return total + cache.ple_history[0].nbytes


@pytest.mark.parametrize("kv,k", [("bf16", 0), ("nvfp4", 3)])
def test_a_handoff_carries_exactly_the_requests_state(weights, kv, k):
    spec = SpeculativeConfig(draft_length=k) if k else None
    ctx, _ = _configs(dict(kv_cache_dtype=kv, speculative=spec),
                      dict(kv_cache_dtype=kv, speculative=spec))
    engine = Engine(ctx, weights)
    seq = _read_prompt(engine, _request("a", 70))
    handoff = extract(engine, seq)
    pages = engine.cache.pages.held[seq.slot]
    assert pages == -(-(70 + (k - 1 if k else 0)) // 32)   # the prompt, and the draft rows past it
    assert handoff.payload.numel() == handoff.manifest["payload_bytes"] == _state_bytes(engine,
                                                                                         pages)


def _transfer_bytes(weights, max_seq_len: int, kv: str, k_context: int = 0,
                    k_generation: int = 0) -> tuple[int, int]:
    spec = {0: None, 3: SpeculativeConfig(draft_length=3)}
    ctx, gen = _configs(dict(kv_cache_dtype=kv, speculative=spec[k_context]),
                        dict(kv_cache_dtype=kv, speculative=spec[k_generation]),
                        max_seq_len=max_seq_len)
    sender, receiver = Engine(ctx, weights), Engine(gen, weights)
    seq = _read_prompt(sender, _request("a", 70))
    with BytesWritten() as sent:
        handoff = extract(sender, seq)
        sender.detach(seq)
    with BytesWritten() as received:
        adopt(receiver, handoff)
    return sent.total, received.total


@pytest.mark.parametrize("kv,k_context,k_generation", [("bf16", 0, 0), ("nvfp4", 3, 3),
                                                       ("fp8", 0, 3)])
def test_a_transfer_costs_the_request_not_the_pool(weights, kv, k_context, k_generation):
    """extract + detach and adopt (with MTP on the generation engine only, the draft layer reading
    the prompt rows) at max_seq_len 1024 and 131072 (32 and 4096 pages a slot) write the same
    bytes: nothing is copied in proportion to the pools."""
    small = _transfer_bytes(weights, 1024, kv, k_context, k_generation)
    large = _transfer_bytes(weights, 131072, kv, k_context, k_generation)
    assert large == small, (small, large)
    assert min(small) > 0


def test_a_whole_pool_copy_would_be_seen(weights, monkeypatch):
    """The measure sees a transfer that copies a whole plane: a read that clones the pool first."""
    from impl.model.disagg import handoff as handoff_mod

    original = handoff_mod._paged_part

    def cloning(name, pool, n_pages):
        part = original(name, pool, n_pages)
        return handoff_mod.Part(part.name, part.dtype, part.shape,
                                lambda slot, pages: pool.clone()[pages.to(pool.device)],
                                part.write)
    monkeypatch.setattr(handoff_mod, "_paged_part", cloning)
    small = _transfer_bytes(weights, 1024, "bf16")[0]
    large = _transfer_bytes(weights, 131072, "bf16")[0]
    assert large > 2 * small, (small, large)


def test_extract_refuses_a_request_still_reading_its_prompt(weights):
    ctx, _ = _configs({}, {})
    engine = Engine(ctx, weights)
    engine.submit(_request("a", 100))
    engine.step()   # 64 of 100 prompt tokens
    with pytest.raises(ValueError, match=r"request 'a' has read 64 of its 100 prompt tokens"):
        extract(engine, engine.sequence("a"))


def _tampered(handoff, key: str, value):
    out = copy.copy(handoff)
    out.manifest = copy.deepcopy(handoff.manifest)
    *path, last = key.split(".")
    target = out.manifest
    for p in path:
        target = target[p]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return out


DELETE = object()
K2, K3 = SpeculativeConfig(draft_length=2), SpeculativeConfig(draft_length=3)

# (case, context fields, generation fields, manifest change, field named, message fragment)
MISMATCHES = [
    ("kv_dtype", dict(kv_cache_dtype="fp8"), {}, None, "kv_cache_dtype",
     "the hand-off is stored as 'fp8'; this engine stores 'bf16'"),
    ("state_dtype", dict(state_dtype="bf16"), {}, None, "state_dtype",
     "the hand-off is stored as 'bf16'; this engine stores 'fp32'"),
    ("draft_length", dict(speculative=K2), dict(speculative=K3), None, "draft layer",
     "the context engine drafted with draft_length 2 and index_share False; this engine drafts "
     "with draft_length 3"),
    ("drafts_to_a_plain_engine", dict(speculative=K3), {}, None, "draft layer",
     "the context engine drafted (draft_length 3); this engine does not draft"),
    ("no_prompt_rows", {}, dict(speculative=K3), None, "draft layer",
     "neither a draft layer's pages nor the prompt rows"),
    ("geometry", {}, {}, ("storage.geometry.ple_dim", 64), "geometry",
     "the sender's model geometry differs in ple_dim"),
    ("roles", {}, {}, ("roles.side_packed", True), "roles", "the sender registers"),
    ("missing_part", {}, {}, ("parts", "drop index_plane"), "parts",
     "part 8 is {'name': 'layer3.pos_plane', 'dtype': 'int32', 'shape': [3, 32]}; this engine "
     "reads {'name': 'layer3.index_plane'"),
    ("payload", {}, {}, ("payload_bytes", 12), "payload", "the parts hold"),
    ("format", {}, {}, ("format", 2), "format", "hand-off format 2; this engine reads format 1"),
    ("prompt_too_long", {}, {}, ("request.max_new_tokens", 250), "prompt",
     "has 70 tokens; with max_new_tokens 250"),
]


@pytest.mark.parametrize("case,context,generation,change,field,message", MISMATCHES,
                         ids=[m[0] for m in MISMATCHES])
def test_a_mismatched_handoff_fails_alone(weights, case, context, generation, change, field,
                                         message):
    """The generation engine serves request 'good'; a mismatched hand-off is rejected naming the
    field, leaves the engine as it was, and 'good' finishes with the aggregated engine's tokens."""
    good_ctx, gen = _configs(generation, generation)
    bad_ctx, _ = _configs(context, context)
    receiver = Engine(gen, weights)
    good = _request("good", 40, seed=1)
    adopt(receiver, _handoff(weights, good_ctx, good))
    receiver.step()
    bad = _handoff(weights, bad_ctx, _request("bad", 70))
    if change is not None:
        key, value = change
        if value == "drop index_plane":
            value = [p for p in bad.manifest["parts"] if "index_plane" not in p["name"]]
        bad = _tampered(bad, key, value)
    before = (dict(receiver.running), list(receiver.cache.pages.free), list(receiver.cache.lengths))
    with pytest.raises(TransferRejected) as err:
        adopt(receiver, bad)
    assert err.value.field == field and message in str(err.value), str(err.value)
    assert str(err.value).startswith(f"hand-off of request 'bad' rejected: {field}: ")
    assert (dict(receiver.running), list(receiver.cache.pages.free),
            list(receiver.cache.lengths)) == before
    while not receiver.idle:
        receiver.step()
    aggregated = Engine(gen.model_copy(update=dict(role="aggregated", peer=None)), weights)
    want = aggregated.generate([good]).results["good"].tokens
    assert receiver.finished[0].output == want


def test_a_repeated_request_id_is_rejected(weights):
    ctx, gen = _configs({}, {})
    receiver = Engine(gen, weights)
    adopt(receiver, _handoff(weights, ctx, _request("a", 40)))
    with pytest.raises(TransferRejected, match="request_id: is already being served"):
        adopt(receiver, _handoff(weights, ctx, _request("a", 50)))
    assert len(receiver.running) == 1


def _state(engine: Engine, seq) -> dict[str, object]:
    """Everything the engine holds for ``seq``, read here field by field from the pools (not
    through the hand-off's parts): page contents as bytes in block order, slot entries, lengths,
    tokens and drafts."""
    cache, slot = engine.cache, seq.slot
    pages = torch.tensor(cache.pages.pages_of(slot), dtype=torch.int64)
    out: dict[str, object] = {}

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    planes = {f"layer{i}": p for i, p in enumerate(cache.layers) if not isinstance(p, GDNPool)}
    if cache.mtp is not None:
        planes["mtp"] = cache.mtp
    for name, p in planes.items():
        for field_name, pool in p._asdict().items():
            for j, t in enumerate(pool if isinstance(pool, tuple) else (pool,)):
                out[f"{name}.{field_name}.{j}"] = as_bytes(t[pages])
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, GDNPool):
            out[f"layer{i}.state"] = as_bytes(layer.state[slot])
            out[f"layer{i}.conv"] = as_bytes(layer.conv[slot])
    out["ple_history"] = cache.ple_history[slot].clone()
    out["lengths"] = (cache.lengths[slot], cache.mtp_lengths[slot], len(pages))
    out["tokens"] = (list(seq.output), seq.pending, list(seq.drafts))
    return out


MODES = [("bf16", 0, 0, False), ("nvfp4", 3, 3, False), ("fp8", 0, 3, False),
         ("nvfp4", 0, 3, False), ("bf16", 0, 3, True)]


@pytest.mark.parametrize("kv,k_context,k_generation,share", MODES)
def test_the_adopted_state_is_the_aggregated_engines_bit_for_bit(weights, kv, k_context,
                                                                k_generation, share):
    """After the hand-off the generation engine holds, byte for byte, what an aggregated engine of
    its configuration holds after reading the same prompt in the same chunks: every page of every
    plane (trunk and draft layer), the GDN states and conv windows, the PLE history, the lengths,
    the first token and the drafts (with MTP on the generation engine only, the draft layer's
    pages come from the prompt rows it read; with IndexShare, with the trunk's selection rows)."""
    spec = {0: None, 3: SpeculativeConfig(draft_length=3, index_share=share)}
    ctx, gen = _configs(dict(kv_cache_dtype=kv, speculative=spec[k_context]),
                        dict(kv_cache_dtype=kv, speculative=spec[k_generation]))
    request = _request("a", 70, new=8, seed=3)
    receiver = Engine(gen, weights)
    seq = adopt(receiver, _handoff(weights, ctx, request))
    aggregated = Engine(gen.model_copy(update=dict(role="aggregated", peer=None)), weights)
    want = _state(aggregated, _read_prompt(aggregated, request))
    got = _state(receiver, seq)
    assert got.keys() == want.keys()
    for name in want:
        if isinstance(want[name], torch.Tensor):
            assert torch.equal(got[name], want[name]), name
        else:
            assert got[name] == want[name], name
