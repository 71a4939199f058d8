"""The engine against spec/model.py on the tiny config with random weights.

Every model pass the engine makes (context chunks, decode, mixed, MTP verify with commit, draft
passes) is replayed through the reference forward (tests/engine/spec_replay.py). In batch-invariant
mode the engine runs every op's reference variant, so every pass must match bit for bit: what is
tested there is the engine itself (slots, pages, block tables, chunking, the state pool, verify
records, commit and rollback). In the default mode the GDN ops run their torch variants, and the
logits are held to a tolerance derived from the reference's own bf16 error (see
test_default_mode_within_derived_tolerance).
"""

from __future__ import annotations

import pytest
import torch

from impl.model import engine as engine_mod
from impl.model import model as model_mod
from impl.model.admission import Request
from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig, SpeculativeConfig
from spec.config import ModelConfig
from spec.model import init_weights
from tests.engine.spec_replay import first_mismatch, replay, token_logits, widen

TINY = ModelConfig.tiny()
BF16 = torch.bfloat16
STATE = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_LEN = 160


def _requests(lengths: list[int], new: int = 6, seed: int = 1) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    return [Request(request_id=f"r{i}", prompt=tuple(torch.randint(0, TINY.vocab_size, (n,),
                                                                   generator=gen).tolist()),
                    max_new_tokens=new) for i, n in enumerate(lengths)]


def _engine(weights, *, kv="bf16", state="fp32", k=None, budget=40, batch=4, invariant=True,
            chunked=True, device="cpu", graphs=False, commit="cached",
            prefill_graph="eager") -> Engine:
    config = EngineConfig(model="tiny", device=device, kv_cache_dtype=kv, state_dtype=state,
                          max_batch_size=batch, max_num_tokens=budget, max_seq_len=MAX_LEN,
                          enable_chunked_prefill=chunked, batch_invariant=invariant,
                          speculative=None if k is None else SpeculativeConfig(draft_length=k),
                          cuda_graphs=graphs, gdn_commit=commit, prefill_graph=prefill_graph)
    return Engine(config, weights, log_calls=True)


def _replay(e: Engine, weights):
    return replay(e.calls, weights, TINY, kv_dtype=e.config.kv_cache_dtype,
                  state_dtype=STATE[e.config.state_dtype], max_len=MAX_LEN + 8)


# Prompts of 37, 5 and 70 tokens under a 40-token budget: chunks that cross 32-token page edges, a
# request that finishes its prompt while another is still reading (a mixed step), a 1-token chunk.
LENGTHS = [37, 5, 70]


@pytest.mark.parametrize("kv,state", [("bf16", "fp32"), ("fp8", "bf16"), ("nvfp4", "fp32"),
                                      ("bf16", "bf16"), ("fp8", "fp32"), ("nvfp4", "bf16")])
def test_plain_decoding_matches_spec_bitwise(weights, kv, state):
    e = _engine(weights, kv=kv, state=state)
    rep = e.generate(_requests(LENGTHS))
    assert set(rep.step_kinds) == {"context", "mixed", "decode"}, rep.step_kinds
    passes = _replay(e, weights)
    assert len(passes) == rep.steps
    assert first_mismatch(passes) is None, first_mismatch(passes)


@pytest.mark.parametrize("kv,state,k", [("bf16", "fp32", 3), ("fp8", "bf16", 1),
                                        ("nvfp4", "fp32", 7), ("bf16", "bf16", 2),
                                        ("fp8", "fp32", 5), ("nvfp4", "bf16", 3)])
def test_speculative_decoding_matches_spec_bitwise(weights, kv, state, k):
    """Context, verify, commit (the cached-replay oracle) and draft passes, bit for bit."""
    e = _engine(weights, kv=kv, state=state, k=k, budget=40 if k < 7 else 48)
    rep = e.generate(_requests(LENGTHS))
    assert set(rep.step_kinds) == {"context", "verify"}, rep.step_kinds
    passes = _replay(e, weights)
    kinds = {p.what.split()[0] for p in passes}
    assert kinds == {"trunk", "commit", "draft"}, kinds
    assert first_mismatch(passes) is None, first_mismatch(passes)


@pytest.mark.parametrize("kv,state,k", [("bf16", "fp32", 1), ("fp8", "bf16", 2),
                                        ("nvfp4", "fp32", 3), ("bf16", "bf16", 3)])
def test_recompute_commit_matches_spec_bitwise(weights, kv, state, k):
    """The recomputing GDN commit (the accepted rows re-run from the pre-verify state) against the
    spec's cached-replay oracle, pass for pass, at the draft lengths its rule admits."""
    e = _engine(weights, kv=kv, state=state, k=k, commit="recompute")
    # forced counts 1 .. K + 1 in turn (random weights' drafts are rarely accepted)
    e.force_accept = lambda rid, a: 1 + (e.steps + int(rid[1:])) % (k + 1)
    rep = e.generate(_requests(LENGTHS))
    assert set(rep.step_kinds) == {"context", "verify"}, rep.step_kinds
    assert "gdn_decode" in rep.variants   # the commit's re-run: no decode step runs with speculation
    assert {n for r in rep.results.values() for n in r.num_accepted} == set(range(1, k + 2))
    passes = _replay(e, weights)
    assert {p.what.split()[0] for p in passes} == {"trunk", "commit", "draft"}
    assert first_mismatch(passes) is None, first_mismatch(passes)


def test_speculative_tokens_equal_plain_greedy(weights):
    """In batch-invariant mode speculation changes how tokens are computed, never which."""
    plain = _engine(weights).generate(_requests(LENGTHS, new=10))
    for k in (1, 3):
        spec = _engine(weights, k=k).generate(_requests(LENGTHS, new=10))
        for rid, res in plain.results.items():
            assert spec.results[rid].tokens == res.tokens, (k, rid)


def test_batched_requests_equal_each_alone(weights):
    """Requests of different lengths batched together (their prompts chunked at other points than
    when alone, at 32-token page edges by a 32-token budget) give the same tokens as each run alone,
    from bit-for-bit equal logits (an fp32 state carries exactly across chunks)."""
    reqs = _requests([33, 64, 95, 7], new=5)
    together = _engine(weights, budget=32)
    res = together.generate(reqs)
    assert together.step_kinds.get("mixed", 0) > 0
    for r in reqs:
        alone = _engine(weights, budget=32, batch=1)
        one = alone.generate([r])
        assert one.results[r.request_id].tokens == res.results[r.request_id].tokens
        a, b = token_logits(together.calls, r), token_logits(alone.calls, r)
        assert len(a) == len(b) == 5
        assert all(torch.equal(x, y) for x, y in zip(a, b)), r.request_id


def _errors_vs(passes64, passes_lowp):
    """Per pass: relative RMS error of the logits against float64 (rows pooled)."""
    out = []
    for p64, p in zip(passes64, passes_lowp):
        ref = p64.spec_logits
        denom = ref.pow(2).mean().sqrt()
        out.append(((p.engine_logits.double() - ref).pow(2).mean().sqrt() / denom).item())
    return out


@pytest.mark.parametrize("kv,state", [("bf16", "fp32"), ("bf16", "bf16"), ("fp8", "fp32"),
                                      ("fp8", "bf16"), ("nvfp4", "fp32"), ("nvfp4", "bf16")])
@pytest.mark.parametrize("k", [None, 3])
def test_default_mode_within_derived_tolerance(weights, kv, state, k):
    """Default mode: the GDN ops run their torch variants, certified to the same bands as the spec's
    own bf16 path, so each pass's logits should lie about as far from the float64 ideal of the same
    weights as the reference's bf16 logits do. That distance is large on this random-weight model
    (10-38% relative RMS, measured): the expert inputs are quantised to nvfp4, where a bf16-sized
    difference moves a value by a whole 4-bit step, and routing flips. So the bound is relative to
    it: engine error <= 2 x reference error + 2^-9 (half a bf16 ulp, for passes where both are tiny).
    Measured: at most 1.10x (nvfp4 KV, fp32 state); a slot that keeps its previous request's GDN state
    measured 4.3x at its first pass (test_planted_stale_state_fails_the_tolerance)."""
    worst = _default_mode_ratio(weights, kv, state, k)
    assert worst[0] <= 2 * worst[1] + 2 ** -9, (
        f"pass {worst[2]}: engine {worst[0]:.3g} vs reference {worst[1]:.3g}")


def _default_mode_ratio(weights, kv, state, k, batch=4, device="cpu", graphs=False,
                        prefill_graph="eager"):
    """(engine error, reference error, pass) of the pass where the engine is furthest over 2x."""
    e = _engine(weights, kv=kv, state=state, k=k, invariant=False, batch=batch, device=device,
                graphs=graphs, prefill_graph=prefill_graph)
    e.generate(_requests(LENGTHS))
    assert not graphs or e.graphs.replays > 0
    assert prefill_graph == "eager" or e.prefill_graphs.replays > 0
    assert any(v != "spec_lowp" for vs in e.dispatcher.variants_ran().values() for v in vs)
    lowp = _replay(e, weights)
    ideal = replay(e.calls, widen(weights), TINY, kv_dtype=kv, state_dtype=STATE[state],
                   max_len=MAX_LEN + 8)
    err_engine = _errors_vs(ideal, [type(p)(p.what, p.engine_logits, p.engine_logits) for p in lowp])
    err_spec = [((p.spec_logits.double() - q.spec_logits).pow(2).mean().sqrt()
                 / q.spec_logits.pow(2).mean().sqrt()).item() for p, q in zip(lowp, ideal)]
    i = max(range(len(lowp)), key=lambda j: err_engine[j] - 2 * err_spec[j])
    return err_engine[i], err_spec[i], f"{i} ({lowp[i].what})"


def test_planted_stale_state_fails_the_tolerance(weights, monkeypatch):
    """Three requests on two slots, the third keeping the GDN state of the request before it."""
    monkeypatch.setattr(engine_mod.GDNPool, "reset", lambda self, slot: None)
    got, ref, where = _default_mode_ratio(weights, "bf16", "fp32", None, batch=2)
    assert got > 2 * ref + 2 ** -9, (got, ref, where)


@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_verify_steps_record_their_states_in_the_pools_verify_buffer(weights, monkeypatch, state):
    """In the default mode the fast gdn_verify writes each verify step's states into its GDN layer's
    verify buffer (impl/model/cache.py), which commit then reads: the record's states are views of
    that buffer, and the tokens and logits equal those of an engine whose verify steps allocate
    their states afresh."""
    from impl.model.cache import GDNPool

    def run() -> tuple[Engine, list]:
        e = _engine(weights, state=state, k=3, invariant=False)
        real, seen = e.model.commit_gdn, []

        def commit(record, cache, slots, num_accepted):
            seen.append([(record.states[li], layer.verify_states)
                         for li, layer in enumerate(cache.layers) if isinstance(layer, GDNPool)])
            return real(record, cache, slots, num_accepted)
        monkeypatch.setattr(e.model, "commit_gdn", commit)
        e.generate(_requests(LENGTHS))
        return e, seen

    shared, seen = run()
    assert seen and all(buf is not None and rec.untyped_storage().data_ptr()
                        == buf.untyped_storage().data_ptr()
                        for step in seen for rec, buf in step)
    monkeypatch.setattr(GDNPool, "verify_scratch", lambda self, requests, rows: None)
    fresh, seen = run()
    assert all(rec.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
               for step in seen for rec, buf in step)
    assert [s.output for s in shared.finished] == [s.output for s in fresh.finished]
    trunk = lambda e: [c.logits for c in e.calls if c.kind == "trunk"]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(trunk(shared), trunk(fresh), strict=True))


# ---------------------------------------------------------------- planted bugs


def _mismatch_with(weights, monkeypatch, **kw) -> str | None:
    e = _engine(weights, **kw)
    e.generate(_requests(LENGTHS))
    try:
        return first_mismatch(_replay(e, weights))
    except AssertionError as err:  # the reference disagrees on a position before any logits differ
        return str(err)


def test_planted_commit_one_row_late_fails(weights, monkeypatch):
    real = engine_mod.Engine._commit

    def late(self, plan, spans, out, num_accepted):
        return real(self, plan, spans, out, (num_accepted + 1).clamp(max=self.k + 1))
    monkeypatch.setattr(engine_mod.Engine, "_commit", late)
    assert _mismatch_with(weights, monkeypatch, k=3) is not None


def test_planted_recompute_one_row_short_fails(weights, monkeypatch):
    """The recomputing commit re-runs one accepted row fewer: the rollback replay cannot see it (both
    of its engines re-run the same rows); the spec's oracle does."""
    real = model_mod.Model._recompute_gdn

    def short(self, w, pool, rows, slots, num_accepted):
        return real(self, w, pool, rows, slots, (num_accepted - 1).clamp(min=0))
    monkeypatch.setattr(model_mod.Model, "_recompute_gdn", short)
    assert _mismatch_with(weights, monkeypatch, k=3, commit="recompute") is not None


def test_planted_ngram_history_not_advanced_fails(weights, monkeypatch):
    real = model_mod.ple_history_advance
    monkeypatch.setattr(model_mod, "ple_history_advance",
                        lambda h, ids: h if ids.numel() == 1 else real(h, ids))
    assert _mismatch_with(weights, monkeypatch) is not None


def test_planted_page_alias_is_refused(weights, monkeypatch):
    """A block table that maps a request's second block onto its first page: the KV append refuses
    two tokens in one slot before any logits are computed."""
    real = engine_mod.EngineCache.ensure_pages

    def alias(self, slot, length):
        real(self, slot, length)
        if self.pages.block_table[slot, 1] >= 0:
            self.pages.block_table[slot, 1] = self.pages.block_table[slot, 0]
    monkeypatch.setattr(engine_mod.EngineCache, "ensure_pages", alias)
    with pytest.raises(ValueError, match="same slot"):
        _engine(weights).generate(_requests(LENGTHS))


def test_planted_slot_state_not_reset_fails(weights, monkeypatch):
    """Three requests on two slots: the third inherits the GDN state of the request before it."""
    monkeypatch.setattr(engine_mod.GDNPool, "reset", lambda self, slot: None)
    e = _engine(weights, batch=2)
    e.generate(_requests(LENGTHS))
    assert first_mismatch(_replay(e, weights)) is not None


# ---------------------------------------------------------------- API, admission, hooks


def test_bad_request_fails_alone(weights):
    good = _requests([20, 9], new=4)
    bad = Request(request_id="bad", prompt=(1, 2, TINY.vocab_size), max_new_tokens=4)
    mixed = _engine(weights).generate([good[0], bad, good[1]])
    alone = _engine(weights).generate(good)
    assert "bad" in mixed.results and "vocab" not in (mixed.results["bad"].error or "x")[:0]
    assert "token 2" in mixed.results["bad"].error
    for r in good:
        assert mixed.results[r.request_id].tokens == alone.results[r.request_id].tokens
        assert mixed.results[r.request_id].error is None


@pytest.mark.parametrize("k", [1, 3, 7])
def test_forced_acceptance_gives_exact_acceptance_lengths(weights, k):
    for forced, want in ((lambda rid, a: 1, 1.0), (lambda rid, a: k + 1, float(k + 1))):
        e = _engine(weights, k=k, budget=48)
        e.force_accept = forced
        rep = e.generate(_requests([12, 40], new=9))
        assert rep.acceptance_length == want
        assert all(len(r.tokens) == 9 for r in rep.results.values())


def test_report_names_variants_and_rates(weights):
    rep = _engine(weights, invariant=False).generate(_requests([10], new=3))
    assert rep.variants["gdn_decode"] == ["torch"] and rep.variants["rmsnorm"] == ["spec_lowp"]
    assert rep.generated_tokens == 3 and rep.tokens_per_second > 0


@pytest.mark.parametrize("backend,want", [("auto", "spec_lowp"), ("torch", "torch"),
                                          ("spec_lowp", "spec_lowp")])
def test_the_engine_runs_the_configured_moe_backend(weights, backend, want):
    config = EngineConfig(model="tiny", max_batch_size=1, max_num_tokens=32, max_seq_len=64,
                          moe_backend=backend)
    rep = Engine(config, weights).generate(_requests([10], new=2))
    assert rep.variants["moe"] == [want]
    assert len(rep.results["r0"].tokens) == 2


def test_weights_must_match_the_configuration():
    w32 = init_weights(TINY, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="model_dtype"):
        Engine(EngineConfig(model="tiny", max_batch_size=2, max_num_tokens=64, max_seq_len=128), w32)


def test_index_share_reuses_the_trunks_selection(weights, monkeypatch):
    """IndexShare: every draft pass over rows the trunk just computed expands exactly the trunk's
    last-QSA-layer selection at the same positions, and scores no index of its own for them; the
    speculative rows past the trunk score their own. Speculation still never changes the tokens."""
    from impl.model.ops import Ops
    seen = []
    real_expand, real_scores, real_fused = Ops.qsa_expand, Ops.qsa_index_scores, Ops.qsa_topk_expand

    def expand(self, selected, positions, context_lens, *, axes):
        seen.append(("expand", selected.clone(), positions.clone()))
        return real_expand(self, selected, positions, context_lens, axes=axes)

    def fused(self, scores, positions, context_lens, *a, axes):  # a pass with no shared selection
        selected, tokens = real_fused(self, scores, positions, context_lens, *a, axes=axes)
        seen.append(("expand", selected.clone(), positions.clone()))
        return selected, tokens

    def scores(self, q_index, *a, axes):
        seen.append(("scores", q_index.shape[0], None))
        return real_scores(self, q_index, *a, axes=axes)
    monkeypatch.setattr(Ops, "qsa_expand", expand)
    monkeypatch.setattr(Ops, "qsa_index_scores", scores)
    monkeypatch.setattr(Ops, "qsa_topk_expand", fused)
    config = EngineConfig(model="tiny", max_batch_size=4, max_num_tokens=40, max_seq_len=MAX_LEN,
                          batch_invariant=True,
                          speculative=SpeculativeConfig(draft_length=3, index_share=True))
    e = Engine(config, weights, log_calls=True)
    shared = e.generate(_requests(LENGTHS, new=8))
    # One QSA layer in the tiny trunk (layer 3) and one in the draft layer: one expansion a pass.
    passes = [c for c in e.calls if c.kind != "commit"]
    expands = [s for s in seen if s[0] == "expand"]
    assert len(passes) == len(expands)
    trunk_sel: dict[tuple[str, int], torch.Tensor] = {}
    shared_rows = own_passes = 0
    for call, (_, selected, positions) in zip(passes, expands):
        keys = [(rid, start + i) for rid, start, ids, _ in call.spans for i in range(len(ids))]
        if call.kind == "trunk":
            trunk_sel = dict(zip(keys, selected))
        elif call.spans[0][3] == "prefill":      # the draft layer reads rows the trunk computed
            for key, row in zip(keys, selected):
                assert torch.equal(row, trunk_sel[key]), key
                shared_rows += 1
        else:   # speculative rows past the committed trunk (maybe where a rejected row was)
            own_passes += 1
    assert shared_rows > 0 and own_passes > 0
    # Index scores ran for trunk passes and the speculative draft rows only.
    n_scores = sum(1 for s in seen if s[0] == "scores")
    assert n_scores == sum(1 for c in passes if c.kind == "trunk") + own_passes
    plain = _engine(weights).generate(_requests(LENGTHS, new=8))
    for rid, res in plain.results.items():
        assert shared.results[rid].tokens == res.tokens


def test_forward_ops_list_is_what_the_forward_dispatches(weights):
    """The configuration rule ops_run_on_the_arch reads FORWARD_OPS / SPECULATION_OPS / KV_CODEC_OPS:
    a forward must dispatch exactly those."""
    from impl.model.ops import FORWARD_OPS, INDEX_SHARE_OPS, KV_CODEC_OPS, SPECULATION_OPS
    plain = _engine(weights, kv="fp8", invariant=False)
    plain.generate(_requests(LENGTHS, new=3))
    unshared = set(FORWARD_OPS) - set(INDEX_SHARE_OPS)
    assert set(plain.dispatcher.variants_ran()) == unshared | {KV_CODEC_OPS["fp8"]}
    spec = _engine(weights, kv="nvfp4", k=2)
    spec.generate(_requests(LENGTHS, new=3))
    ran = set(spec.dispatcher.variants_ran())
    assert ran == (unshared - {"gdn_decode", "gdn_conv_update"}) | set(SPECULATION_OPS) | {
        KV_CODEC_OPS["nvfp4"]}
    shared = Engine(EngineConfig(model="tiny", max_batch_size=4, max_num_tokens=40,
                                 max_seq_len=MAX_LEN, speculative=SpeculativeConfig(
                                     draft_length=2, index_share=True)), weights)
    shared.generate(_requests(LENGTHS, new=3))
    # the shared passes expand the trunk's selection; qsa_select serves rows handed -2 (none today)
    assert "qsa_expand" in INDEX_SHARE_OPS and "qsa_expand" in shared.dispatcher.variants_ran()


def test_the_engine_runs_gdn_prefill_at_the_configured_numerics_tier(weights):
    """EngineConfig.numerics picks gdn_prefill's bf16_operands tier: its variant runs every prefill
    chunk, the rest of the forward is the exact tier's, and the greedy tokens are those of a run."""
    config = EngineConfig(model="tiny", max_batch_size=4, max_num_tokens=40, max_seq_len=MAX_LEN,
                          numerics={"gdn_prefill": "bf16_operands"})
    e = Engine(config, weights)
    rep = e.generate(_requests(LENGTHS))
    ran = e.dispatcher.variants_ran()
    assert ran["gdn_prefill"] == ["spec_bf16_operands"]
    assert [len(r.tokens) for r in rep.results.values()] == [6, 6, 6]
    exact = Engine(config.model_copy(update={"numerics": {}}), weights)
    exact.generate(_requests(LENGTHS))
    assert "spec_bf16_operands" not in exact.dispatcher.variants_ran()["gdn_prefill"]
