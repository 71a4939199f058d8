"""A disaggregated pair (a context and a generation engine in two processes, hand-offs over gloo)
gives the greedy tokens of the aggregated engine, and with MTP its acceptance counts too: the drafts
are the aggregated engine's only when the draft layer's planes (or, with MTP on the generation
engine only, the prompt rows it reads) arrive intact.

Both engines run batch-invariant: the generation engine adopts requests as they arrive, so which
requests share its steps depends on timing, and a request's tokens must not. One test runs the
default dispatch on one request, whose steps are then those of the aggregated engine.

The fast tests hold prompts of 32, 64, 65 and 300 tokens (a page, a page and one token, past the
sparse selection's window of 5 blocks); the slow one the lengths 32 to 6000 with the page and chunk
boundaries 2048, 2049, 4096 and 4097. Planted in the transfer, a lost block key, V block scale or
draft-layer plane, or shuffled prompt rows, fail the fast nvfp4 test. The index plane of the last,
partial block is read only once that block is full and behind the local window, 32 or more tokens
after the prompt: its transfer is held by tests/engine/test_disagg_handoff.py, which compares the
adopted state byte for byte.
"""

from __future__ import annotations

import pytest

from impl.model.engine import Engine
from impl.model.engine_config import EngineConfig
from tests.engine.disagg_pair import PairJob, load_weights, pair_configs, requests, run_pairs, spec

FAST = (32, 64, 65, 300)
FULL = (32, 2048, 2049, 4096, 4097, 6000)
# (context draft length, generation draft length): no MTP, MTP on both, MTP on the generation only
MODES = ((0, 0), (3, 3), (0, 3))


def _base(kv: str, budget: int, max_len: int, invariant: bool = True, batch: int = 4) -> dict:
    return dict(model="tiny", kv_cache_dtype=kv, max_batch_size=batch, max_num_tokens=budget,
                max_seq_len=max_len, batch_invariant=invariant)


def _aggregated(base: dict, reqs, ks) -> callable:
    """The aggregated engine's reports for each draft length in ``ks``, run in the parent."""
    def run():
        weights = load_weights()
        return {k: Engine(EngineConfig(**base, speculative=spec(k)), weights).generate(reqs)
                for k in ks}
    return run


def _check(pair, reference, reqs, mode) -> None:
    assert not pair.errors, pair.errors
    for r in reqs:
        want = reference.results[r.request_id]
        assert pair.tokens[r.request_id] == want.tokens, (mode, r.request_id)
        assert pair.accepted[r.request_id] == want.num_accepted, (mode, r.request_id)


def _run_modes(tmp_path, kv, lengths, budget, max_len):
    base = _base(kv, budget, max_len)
    reqs = requests(lengths)
    jobs = [PairJob(*pair_configs(base, kc, kg), reqs) for kc, kg in MODES]
    pairs, refs = run_pairs(jobs, tmp_path, _aggregated(base, reqs, {kg for _, kg in MODES}))
    for (kc, kg), pair in zip(MODES, pairs):
        _check(pair, refs[kg], reqs, (kc, kg))
    # MTP on the generation engine only drafts as the aggregated engine does: accepted drafts occur
    assert any(n > 1 for r in reqs for n in pairs[2].accepted[r.request_id])
    return pairs


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_pair_tokens_equal_aggregated(tmp_path, kv):
    _run_modes(tmp_path, kv, FAST, budget=256, max_len=384)


@pytest.mark.postmerge
@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_pair_tokens_equal_aggregated_32_to_6000_tokens(tmp_path, kv):
    """Six prompts of 32 to 6000 tokens in 2048-token chunks over four slots (slots and pages
    reused on both engines), each mode against the aggregated engine."""
    _run_modes(tmp_path, kv, FULL, budget=2048, max_len=6144)


def test_default_dispatch_pair_equals_aggregated_for_one_request(tmp_path):
    """Outside batch-invariant mode, one request: the pair runs the aggregated engine's passes
    (the same chunks, the same decode and verify rows), so its tokens and acceptance counts equal
    the aggregated engine's bit for bit too."""
    base = _base("nvfp4", 128, 384, invariant=False, batch=1)
    reqs = requests((300,))
    jobs = [PairJob(*pair_configs(base, kc, kg), reqs) for kc, kg in MODES]
    pairs, refs = run_pairs(jobs, tmp_path, _aggregated(base, reqs, {0, 3}))
    for (kc, kg), pair in zip(MODES, pairs):
        _check(pair, refs[kg], reqs, (kc, kg))


def test_a_mismatched_handoff_fails_alone_over_gloo(tmp_path):
    """The context rank sends one hand-off whose manifest says fp8 pages: the generation engine
    rejects that request alone, naming the field, and serves the others to the aggregated tokens."""
    base = _base("bf16", 128, 384)
    reqs = requests((40, 65, 90))
    bad = reqs[1].request_id
    job = PairJob(*pair_configs(base, 0, 0), reqs,
                  tamper=((bad, "storage.kv_cache_dtype", "fp8"),))
    (pair,), refs = run_pairs([job], tmp_path, _aggregated(base, reqs, {0}))
    assert pair.errors == {bad: f"hand-off of request {bad!r} rejected: kv_cache_dtype: the "
                                f"hand-off is stored as 'fp8'; this engine stores 'bf16'"}
    for r in reqs:
        if r.request_id != bad:
            assert pair.tokens[r.request_id] == refs[0].results[r.request_id].tokens
