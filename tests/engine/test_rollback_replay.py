"""Rollback replay (docs/spec.md, "Rollback / commit"): committing acceptance a after a verify of K+1
rows leaves, bit for bit, the state a verify of the first a+1 rows alone leaves, with the same kernels.

Two engines read the same prompts (same scheduling, so the same state) until every request waits
for verification. Engine A verifies K+1 rows a request and commits a+1 of them; engine B verifies
only the a+1 rows of each request, one request at a time, and keeps them all. Every piece of state
speculation touches is compared (impl/model/replay.py: GDN state and conv window of every GDN layer,
the PLE n-gram history, K / V bytes, index keys, the position plane, block keys and their valid
flags, pages left behind), for every KV and state storage dtype. Drafts are drawn tokens, not the
draft layer's guesses, so any acceptance pattern can be forced.

Both GDN commits are held to it (``EngineConfig.gdn_commit``): 'cached', at every draft length, and
'recompute' (the accepted rows re-run from the pre-verify state), at the draft lengths its rule admits
(1 .. RECOMPUTE_MAX_DRAFT). Both engines of a pair commit the same way, so a commit wrong alike in both
(one row short) passes the pair; it fails ``test_recompute_and_cached_commits_leave_the_same_state``
(the two commits leave the same bytes) and the spec's oracle (tests/engine/test_engine.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certify.harness.replay import assert_replay_equal, compare_states
from impl.model import engine as engine_mod
from impl.model.admission import Request
from impl.model.engine import Engine
from impl.model.model import Model
from impl.model.engine_config import RECOMPUTE_MAX_DRAFT, EngineConfig, SpeculativeConfig
from impl.model.ops import Ops
from impl.model.replay import engine_state
from spec.config import ModelConfig

TINY = ModelConfig.tiny()
DTYPES = [("bf16", "fp32"), ("bf16", "bf16"), ("fp8", "fp32"), ("fp8", "bf16"), ("nvfp4", "fp32"),
          ("nvfp4", "bf16")]


_PREFILLED: dict[tuple, Engine] = {}


def prefilled(weights, kv: str, state: str, k: int, prompt_lens: tuple[int, ...],
              invariant: bool = True, commit: str = "cached") -> Engine:
    """An engine whose requests have read their prompts and wait for verification (cached; callers
    get a copy)."""
    key = (kv, state, k, prompt_lens, invariant, commit)
    if key not in _PREFILLED:
        config = EngineConfig(model="tiny", kv_cache_dtype=kv, state_dtype=state,
                              max_batch_size=len(prompt_lens), max_num_tokens=128, max_seq_len=160,
                              batch_invariant=invariant, gdn_commit=commit,
                              speculative=SpeculativeConfig(draft_length=k))
        e = Engine(config, weights)
        gen = torch.Generator().manual_seed(sum(prompt_lens) + 7 * k)
        for i, n in enumerate(prompt_lens):
            e.submit(Request(request_id=f"r{i}", prompt=tuple(
                torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist()),
                max_new_tokens=64))
        while any(s.in_prompt for s in e.running.values()) or e.waiting:
            e.step()
        _PREFILLED[key] = e
    e = _PREFILLED[key]
    return copy.deepcopy(e, memo={id(e.weights): e.weights, id(e.model.w): e.model.w})


def _drafts(k: int, rids: list[str], seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {rid: torch.randint(0, TINY.vocab_size, (k,), generator=gen).tolist() for rid in rids}


def replay_pair(weights, kv, state, k, prompt_lens, accepted: dict[str, int], drafts_seed: int = 0,
                invariant: bool = True, commit: str = "cached"):
    """(state after commit, state of the shorter verify) for acceptance ``accepted`` (a per rid)."""
    a_eng = prefilled(weights, kv, state, k, prompt_lens, invariant, commit)
    b_eng = prefilled(weights, kv, state, k, prompt_lens, invariant, commit)
    rids = sorted(accepted)
    drafts = _drafts(k, rids, drafts_seed)
    vp = a_eng.verify_pass(drafts)
    a_eng.commit_pass(vp, {rid: accepted[rid] + 1 for rid in rids})
    for rid in rids:
        a = accepted[rid]
        vp = b_eng.verify_pass({rid: drafts[rid][:a]})
        b_eng.commit_pass(vp, {rid: a + 1})
    return engine_state(a_eng, rids), engine_state(b_eng, rids)


# Prompts ending just before, at, and just after 32-token page / block-key boundaries, so the K+1
# verify rows complete a block and the rollback removes its key again.
PROMPTS = (30, 32, 61)


@pytest.mark.parametrize("kv,state", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("extreme", ["all_rejected", "all_accepted"])
def test_commit_equals_shorter_verify(weights, kv, state, k, extreme):
    a = 0 if extreme == "all_rejected" else k
    got, want = replay_pair(weights, kv, state, k, PROMPTS, {f"r{i}": a for i in range(3)})
    assert_replay_equal(got, want, f"K={k}, a={a}, kv={kv}, state={state}")


@pytest.mark.postmerge
@pytest.mark.parametrize("kv,state", DTYPES)
@pytest.mark.parametrize("k", [2, 4, 5, 6])
@pytest.mark.parametrize("extreme", ["all_rejected", "all_accepted"])
def test_commit_equals_shorter_verify_every_k(weights, kv, state, k, extreme):
    a = 0 if extreme == "all_rejected" else k
    got, want = replay_pair(weights, kv, state, k, PROMPTS, {f"r{i}": a for i in range(3)})
    assert_replay_equal(got, want, f"K={k}, a={a}, kv={kv}, state={state}")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_drawn_acceptance_patterns(weights, data):
    """A batch of requests at different positions (prompts that straddle page and block-key
    boundaries), each with its own drawn acceptance, in a drawn storage format."""
    kv, state = data.draw(st.sampled_from(DTYPES), label="dtypes")
    k = data.draw(st.sampled_from([2, 3, 7]), label="K")
    lens = tuple(sorted(data.draw(st.lists(st.sampled_from([25, 29, 31, 32, 33, 62, 64]),
                                           min_size=2, max_size=3, unique=True), label="prompts")))
    accepted = {f"r{i}": data.draw(st.integers(0, k), label=f"a{i}") for i in range(len(lens))}
    got, want = replay_pair(weights, kv, state, k, lens, accepted,
                            drafts_seed=data.draw(st.integers(0, 99), label="drafts"))
    assert_replay_equal(got, want, f"K={k}, a={accepted}, kv={kv}, state={state}")


@pytest.mark.parametrize("commit", ["cached", "recompute"])
def test_default_mode_replays_too(weights, commit):
    """The default dispatch (torch GDN variants) keeps the oracle: its verify computes each row from
    the rows before it only, and its decode launches (the recomputing commit) each request's rows
    alone."""
    got, want = replay_pair(weights, "fp8", "bf16", 3, PROMPTS, {"r0": 0, "r1": 2, "r2": 3},
                            invariant=False, commit=commit)
    assert_replay_equal(got, want, f"default mode, gdn_commit={commit}")


# ---------------------------------------------------------------- the recomputing GDN commit

RECOMPUTE_K = list(range(1, RECOMPUTE_MAX_DRAFT + 1))


@pytest.mark.parametrize("kv,state", DTYPES)
@pytest.mark.parametrize("k", RECOMPUTE_K)
@pytest.mark.parametrize("extreme", ["all_rejected", "all_accepted"])
def test_recompute_commit_equals_shorter_verify(weights, kv, state, k, extreme):
    a = 0 if extreme == "all_rejected" else k
    got, want = replay_pair(weights, kv, state, k, PROMPTS, {f"r{i}": a for i in range(3)},
                            commit="recompute")
    assert_replay_equal(got, want, f"recompute, K={k}, a={a}, kv={kv}, state={state}")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_recompute_commit_drawn_acceptance_patterns(weights, data):
    """As ``test_drawn_acceptance_patterns``, for the recomputing commit at the draft lengths its
    rule admits: requests that accept different counts re-run different numbers of rows."""
    kv, state = data.draw(st.sampled_from(DTYPES), label="dtypes")
    k = data.draw(st.sampled_from(RECOMPUTE_K), label="K")
    lens = tuple(sorted(data.draw(st.lists(st.sampled_from([25, 29, 31, 32, 33, 62, 64]),
                                           min_size=2, max_size=3, unique=True), label="prompts")))
    accepted = {f"r{i}": data.draw(st.integers(0, k), label=f"a{i}") for i in range(len(lens))}
    got, want = replay_pair(weights, kv, state, k, lens, accepted,
                            drafts_seed=data.draw(st.integers(0, 99), label="drafts"),
                            commit="recompute")
    assert_replay_equal(got, want, f"recompute, K={k}, a={accepted}, kv={kv}, state={state}")


@pytest.mark.parametrize("kv,state", [("bf16", "fp32"), ("nvfp4", "bf16")])
@pytest.mark.parametrize("k", RECOMPUTE_K)
def test_recompute_and_cached_commits_leave_the_same_state(weights, kv, state, k):
    """In batch-invariant mode the spec stores the state after every verify row as K + 1 decode
    steps do, so re-running the accepted rows commits the bytes the cached commit copies."""
    accepted = {"r0": 0, "r1": k // 2, "r2": k}
    states = []
    for commit in ("cached", "recompute"):
        eng = prefilled(weights, kv, state, k, PROMPTS, commit=commit)
        vp = eng.verify_pass(_drafts(k, sorted(accepted), 5))
        eng.commit_pass(vp, {rid: a + 1 for rid, a in accepted.items()})
        states.append(engine_state(eng, sorted(accepted)))
    assert_replay_equal(*states, f"cached vs recompute, K={k}, kv={kv}, state={state}")


# ---------------------------------------------------------------- planted rollback bugs


def _mismatches(weights, k=3, accepted=None):
    accepted = accepted or {"r0": 1, "r1": 0, "r2": 2}
    got, want = replay_pair(weights, "bf16", "fp32", k, PROMPTS, accepted)
    return [str(m) for m in compare_states(got, want)]


def test_planted_state_committed_one_row_late(weights, monkeypatch):
    real = engine_mod.Engine._commit

    def late(self, plan, spans, out, num_accepted):
        return real(self, plan, spans, out, (num_accepted + 1).clamp(max=spans[0].rows))
    monkeypatch.setattr(engine_mod.Engine, "_commit", late)
    found = _mismatches(weights)
    assert any(m.startswith("gdn_state[0], request r0, value head") for m in found), found


def test_planted_conv_window_shifted_by_one(weights, monkeypatch):
    real = Ops.rollback_commit

    def shifted(self, records, num_accepted, **axes):
        if "conv_window" in records:
            w = records["conv_window"]
            records = dict(records, conv_window=torch.roll(w, 1, dims=1))
        return real(self, records, num_accepted, **axes)
    monkeypatch.setattr(Ops, "rollback_commit", shifted)
    found = _mismatches(weights)
    # r0 keeps entry 1 of 4 rows; a shift of the 4-entry record and of the replay's 2-entry record
    # move the same window there, so it is r1 (a = 0) and r2 (a = 2) that show it.
    assert any(m.startswith("conv_window[0], request r1, channel") for m in found), found


def test_planted_block_key_kept_after_its_block_lost_tokens(weights, monkeypatch):
    real = engine_mod.truncate_planes

    def keep_keys(planes, row, keep, upto):
        before = planes.block_key_valid.clone()
        real(planes, row, keep, upto)
        planes.block_key_valid.copy_(before)
    monkeypatch.setattr(engine_mod, "truncate_planes", keep_keys)
    # r0 reads 30 tokens: its verify rows 30..33 complete block 0 at position 31; a = 0 keeps 31
    # tokens, so block 0 loses its last token and its key must go.
    found = _mismatches(weights, accepted={"r0": 0, "r1": 0, "r2": 0})
    assert any(m.startswith("block_key_valid[3], request r0, block 0") for m in found), found


def test_planted_recompute_from_the_post_verify_state(weights, monkeypatch):
    """The recomputing commit re-runs the accepted rows from the state the verify step left (its
    last row's, as the cached path writes) instead of the pre-verify state."""
    real = Model.commit_gdn

    def from_last_row(self, record, cache, slots, num_accepted):
        for li, rows in record.inputs.items():   # the verify rows' recurrence, as if committed
            w = self.w.layers[li].mixer
            pool = cache.layers[li]
            full = torch.full((len(slots),), rows.q.shape[1])
            self._recompute_gdn(w, pool, rows, slots, full)
        return real(self, record, cache, slots, num_accepted)
    monkeypatch.setattr(Model, "commit_gdn", from_last_row)
    got, want = replay_pair(weights, "bf16", "fp32", 3, PROMPTS, {"r0": 1, "r1": 0, "r2": 2},
                            commit="recompute")
    found = [str(m) for m in compare_states(got, want)]
    assert any(m.startswith("gdn_state[0], request r0, value head") for m in found), found


def test_planted_ngram_history_not_rolled_back(weights, monkeypatch):
    real = Ops.rollback_commit

    def last_row(self, records, num_accepted, **axes):
        if "h" in records:
            num_accepted = torch.full_like(num_accepted, records["h"].shape[1])
        return real(self, records, num_accepted, **axes)
    monkeypatch.setattr(Ops, "rollback_commit", last_row)
    found = _mismatches(weights)
    assert any(m.startswith("ngram_history, request r0, history entry") for m in found), found
