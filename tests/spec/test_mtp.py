"""Property tests and hand-checkable guards of the MTP / speculative-decoding ops (spec/ops/mtp.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.ops.mtp import (
    acceptance_length,
    blocks_complete,
    greedy_argmax,
    greedy_verify,
    logits_cast,
    mtp_draft_input,
    rollback_commit,
)
from spec.ops.norms import rmsnorm
from spec.ops.ple import ple_history_advance

F64 = torch.float64
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- logits_cast


@pytest.mark.certify_property("logits_cast")
@given(seed=seeds, rows=st.integers(1, 4), V=st.integers(1, 300))
def test_logits_cast_property(seed: int, rows: int, V: int) -> None:
    g = _gen(seed)
    # Every bf16 bit pattern is drawable: normals, subnormals, +-0, +-inf and NaNs with payloads.
    bits = torch.randint(-(2**15), 2**15, (rows, V), generator=g, dtype=torch.int32).to(torch.int16)
    bits[0, 0] = 0x3F80  # 1.0, so no draw is all zeros or all NaN
    bf = bits.view(torch.bfloat16)
    out = logits_cast(bf)
    assert out.dtype == torch.float32 and out.shape == (rows, V)
    # Bitwise equal to torch's widening, NaN payloads included.
    assert torch.equal(out.view(torch.int32), bf.float().view(torch.int32))
    # Exact: the fp32 pattern is the bf16 pattern followed by 16 zero bits, and every value narrows
    # back losslessly (NaNs excepted: torch's narrowing quiets them, their payload was checked above).
    assert torch.equal(out.view(torch.int32) & 0xFFFF, torch.zeros_like(out, dtype=torch.int32))
    assert torch.equal((out.view(torch.int32) >> 16).to(torch.int16), bits)
    finite_or_inf = ~torch.isnan(out)
    assert torch.equal(out.to(torch.bfloat16).view(torch.int16)[finite_or_inf], bits[finite_or_inf])
    # An fp32 LM-head accumulator is rounded to bf16 first (the rounding point), then widened.
    acc = torch.randn(rows, V, generator=g) * 30
    expected = acc.to(torch.bfloat16).float()
    assert torch.equal(logits_cast(acc).view(torch.int32), expected.view(torch.int32))
    # Reference mode: float64 logits pass through unchanged.
    assert torch.equal(logits_cast(acc.to(F64)), acc.to(F64))


@pytest.mark.certify_guard("logits_cast")
def test_logits_cast_guard() -> None:
    # bf16 0x3F80 = 1.0 -> fp32 0x3F800000; 0xC020 = -2.5 -> 0xC0200000; 0x4049 = 3.140625 -> 0x40490000.
    bf = torch.tensor([0x3F80, 0xC020 - 0x10000, 0x4049], dtype=torch.int16).view(torch.bfloat16)
    out = logits_cast(bf)
    assert out.tolist() == [1.0, -2.5, 3.140625]
    patterns = [v & 0xFFFFFFFF for v in out.view(torch.int32).tolist()]
    assert patterns == [0x3F800000, 0xC0200000, 0x40490000]
    # fp32 input: 1 + 2^-9 rounds down to 1.0 (8 significant bits), 1 + 2^-8 is a tie -> even (1.0),
    # 1 + 3 * 2^-9 rounds up to 1 + 2^-7 = 1.0078125.
    acc = torch.tensor([1 + 2.0**-9, 1 + 2.0**-8, 1 + 3 * 2.0**-9])
    assert logits_cast(acc).tolist() == [1.0, 1.0, 1.0078125]


# ---------------------------------------------------------------- mtp_draft_input


def _draft_inputs(seed: int, T: int, C: int, V: int):
    g = _gen(seed)
    next_token = torch.randint(0, V, (T,), generator=g)
    h_prev = 3.0 * torch.randn(T, C, generator=g, dtype=F64)
    embed = torch.randn(V, C, generator=g, dtype=F64)
    norm_emb_w = 0.5 * torch.randn(C, generator=g, dtype=F64)
    norm_h_w = 0.5 * torch.randn(C, generator=g, dtype=F64)
    fc_w = torch.randn(C, 2 * C, generator=g, dtype=F64) / math.sqrt(2 * C)
    return next_token, h_prev, embed, norm_emb_w, norm_h_w, fc_w


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * (1 + w)


@pytest.mark.certify_property("mtp_draft_input")
@given(seed=seeds, T=st.integers(1, 4), C=st.integers(2, 16))
def test_mtp_draft_input_property(seed: int, T: int, C: int) -> None:
    V = 9
    next_token, h_prev, embed, w_e, w_h, fc_w = _draft_inputs(seed, T, C, V)
    out = mtp_draft_input(next_token, h_prev, embed, w_e, w_h, fc_w)
    # Float64 reference: embedding half first, then the hidden half, one linear map without bias.
    u = torch.cat([_rms(embed[next_token], w_e), _rms(h_prev, w_h)], dim=-1)
    ref = u @ fc_w.T
    assert out.dtype == F64 and out.shape == (T, C)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    # bf16 activations: each normed input and the output are rounded once (relative error <= 2^-9
    # each, round to nearest), so |h' - ref| <= 2^-9 (|fc| |u| + |ref|) plus fp32 noise; 2^-8 is the
    # bound checked (x2 margin). u is the float64 concatenation.
    args = [t.float() for t in (h_prev, embed, w_e, w_h, fc_w)]
    out16 = mtp_draft_input(next_token, *args)
    assert out16.dtype == torch.bfloat16
    bound = 2.0**-8 * (u.abs() @ fc_w.abs().T + ref.abs())
    assert torch.all((out16.to(F64) - ref).abs() <= bound)
    # Rounding points: with fc = [I | I], h' = bf16(bf16(rmsnorm(e)) + bf16(rmsnorm(h))) exactly.
    eye = torch.eye(C)
    got = mtp_draft_input(next_token, args[0], args[1], args[2], args[3], torch.cat([eye, eye], dim=1))
    e16 = rmsnorm(args[1][next_token], args[2]).to(torch.bfloat16).float()
    h16 = rmsnorm(args[0], args[3]).to(torch.bfloat16).float()
    assert torch.equal(got, (e16 + h16).to(torch.bfloat16))


@pytest.mark.certify_guard("mtp_draft_input")
def test_mtp_draft_input_guard() -> None:
    # embed(1) = [2, -2]: rms 2 -> [1, -1], times 1 + w_e = [2, 1.5] -> [2, -1.5].
    # h_prev = [5, 5]: rms 5 -> [1, 1], times 1 + w_h = [0.5, 1.25] -> [0.5, 1.25].
    # cat = [2, -1.5, 0.5, 1.25]; fc rows [1, 1, 0, 0] and [0, 0, 1, 1] -> h' = [0.5, 1.75]
    # (the other concatenation order would give [1.75, 0.5]).
    embed = torch.tensor([[1.0, 3.0], [2.0, -2.0], [4.0, 1.0]], dtype=F64)
    h_prev = torch.tensor([[5.0, 5.0]], dtype=F64)
    fc_w = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], dtype=F64)
    out = mtp_draft_input(torch.tensor([1]), h_prev, embed, torch.tensor([1.0, 0.5], dtype=F64),
                          torch.tensor([-0.5, 0.25], dtype=F64), fc_w)
    torch.testing.assert_close(out, torch.tensor([[0.5, 1.75]], dtype=F64), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- greedy_verify


def _ref_argmax(row: list[float]) -> int:
    vals = [-math.inf if math.isnan(v) else v for v in row]
    return min(i for i, v in enumerate(vals) if v == max(vals))


def _toy_logits(prefix: list[int], V: int, salt: int) -> torch.Tensor:
    """A deterministic 'trunk': small-integer logits (ties are common) drawn from the prefix."""
    key = salt
    for tok in prefix:
        key = (key * 1_000_003 + tok + 1) % (2**61 - 1)
    return torch.randint(0, 4, (V,), generator=_gen(key % (2**31))).to(torch.float32)


@pytest.mark.certify_property("greedy_verify")
@given(seed=seeds, R=st.integers(1, 4), k_max=st.integers(0, 7), V=st.integers(2, 6),
       p_accept=st.floats(0.0, 1.0))
def test_greedy_verify_property(seed: int, R: int, k_max: int, V: int, p_accept: float) -> None:
    g = _gen(seed)
    lens = torch.randint(0, k_max + 1, (R,), generator=g)
    logits = torch.randint(0, 3, (R, k_max + 1, V), generator=g).float()  # many ties
    preds = [[_ref_argmax(logits[r, i].tolist()) for i in range(k_max + 1)] for r in range(R)]
    drafts = torch.randint(0, V, (R, k_max), generator=g)
    accept = torch.rand(R, k_max, generator=g) < p_accept
    for r in range(R):
        for i in range(k_max):
            if accept[r, i]:
                drafts[r, i] = preds[r][i]  # d_{i+1} == p_i
    res = greedy_verify(logits, drafts, lens)

    for r in range(R):
        k = int(lens[r])
        a = 0
        while a < k and int(drafts[r, a]) == preds[r][a]:
            a += 1
        assert res.num_accepted[r] == a + 1 and 1 <= res.num_accepted[r] <= k + 1
        assert res.predictions[r].tolist() == preds[r][:k + 1] + [-1] * (k_max - k)
        assert res.emitted[r].tolist() == drafts[r, :a].tolist() + [preds[r][a]] + [-1] * (k_max - a)
    # Rows and drafts past a request's K are ignored: poisoning them changes nothing.
    poisoned_logits, poisoned_drafts = logits.clone(), drafts.clone()
    for r in range(R):
        poisoned_logits[r, int(lens[r]) + 1:] = float("nan")
        poisoned_drafts[r, int(lens[r]):] = -7
    poisoned = greedy_verify(poisoned_logits, poisoned_drafts, lens)
    assert all(torch.equal(x, y) for x, y in zip(poisoned, res))
    # Batch invariance: each request verified alone gives its row of the batched result.
    for r in range(R):
        alone = greedy_verify(logits[r:r + 1], drafts[r:r + 1], lens[r:r + 1])
        assert all(torch.equal(x[0], y[r]) for x, y in zip(alone, res))
    # All accepted: K + 1 tokens, the last one the bonus p_K. First rejected: 1 token, p_0.
    if k_max > 0:
        full = torch.full((1,), k_max)
        all_ok = torch.tensor([preds[0][:k_max]])
        res_ok = greedy_verify(logits[:1], all_ok, full)
        assert res_ok.num_accepted.item() == k_max + 1
        assert res_ok.emitted[0].tolist() == preds[0][:k_max] + [preds[0][k_max]]
        bad = all_ok.clone()
        bad[0, 0] = (preds[0][0] + 1) % V
        res_bad = greedy_verify(logits[:1], bad, full)
        assert res_bad.num_accepted.item() == 1
        assert res_bad.emitted[0].tolist() == [preds[0][0]] + [-1] * k_max

    # End to end: speculative greedy decoding emits exactly the plain greedy tokens.
    salt, steps = seed % 1000, 10
    plain = [1]
    while len(plain) < steps + 1:
        plain.append(int(greedy_argmax(_toy_logits(plain, V, salt))))
    spec = [1]
    draft_len = max(k_max, 1)
    while len(spec) < steps + 1:
        # A draft model that is right with probability p_accept.
        guess, ctx = [], list(spec)
        for _ in range(draft_len):
            tok = int(greedy_argmax(_toy_logits(ctx, V, salt)))
            if torch.rand(1, generator=g).item() >= p_accept:
                tok = (tok + 1) % V
            guess.append(tok)
            ctx.append(tok)
        rows = torch.stack([_toy_logits(spec + guess[:i], V, salt) for i in range(draft_len + 1)])
        out = greedy_verify(rows[None], torch.tensor([guess]), torch.tensor([draft_len]))
        spec.extend(out.emitted[0, :int(out.num_accepted[0])].tolist())
    assert spec[:steps + 1] == plain


@pytest.mark.certify_guard("greedy_verify")
def test_greedy_verify_guard() -> None:
    # Argmax rule: the lowest index among equal maxima; NaN counts as -inf.
    assert greedy_argmax(torch.tensor([5.0, 1.0, 5.0, 0.0])).item() == 0
    assert greedy_argmax(torch.tensor([float("nan"), 1.0, 3.0, 3.0])).item() == 2
    one_hot = lambda i: [9.0 if j == i else 1.0 for j in range(4)]  # noqa: E731
    logits = torch.tensor([
        [one_hot(2), one_hot(1), one_hot(3), one_hot(0)],          # p = [2, 1, 3, 0]
        [one_hot(2), one_hot(1), one_hot(3), one_hot(0)],          # p = [2, 1, 3, 0]
        [[5.0, 1.0, 5.0, 0.0], one_hot(2), one_hot(2), one_hot(2)],  # p_0 = 0 (tie 0 / 2), K = 2
    ])
    drafts = torch.tensor([[2, 1, 3], [2, 0, 3], [2, 2, 9]])
    res = greedy_verify(logits, drafts, torch.tensor([3, 3, 2]))
    # r0: d = p_0, p_1, p_2: all accepted, a = 3, emits 2, 1, 3 and the bonus p_3 = 0.
    # r1: d_1 = p_0 = 2, d_2 = 0 != p_1 = 1: a = 1, emits 2 then the correction p_1 = 1.
    # r2: d_1 = 2 != p_0 = 0 (the tie goes to index 0): a = 0, emits p_0 = 0 only.
    assert res.num_accepted.tolist() == [4, 2, 1]
    assert res.emitted.tolist() == [[2, 1, 3, 0], [2, 1, -1, -1], [0, -1, -1, -1]]
    assert res.predictions.tolist() == [[2, 1, 3, 0], [2, 1, 3, 0], [0, 2, 2, -1]]


# ---------------------------------------------------------------- acceptance_length


@pytest.mark.certify_property("acceptance_length")
@given(seed=seeds, steps=st.integers(1, 6), R=st.integers(1, 4), K=st.integers(1, 7))
def test_acceptance_length_property(seed: int, steps: int, R: int, K: int) -> None:
    g = _gen(seed)
    counts = []
    for _ in range(steps):
        logits = torch.randn(R, K + 1, 5, generator=g)
        drafts = torch.randint(0, 5, (R, K), generator=g)
        counts.append(greedy_verify(logits, drafts, torch.full((R,), K)).num_accepted)
    al = acceptance_length(torch.cat(counts))
    assert 1.0 <= al <= K + 1
    assert al == pytest.approx(sum(int(c) for step in counts for c in step) / (steps * R), rel=1e-15)
    assert acceptance_length([K + 1] * (steps * R)) == K + 1  # every draft accepted
    assert acceptance_length([1] * (steps * R)) == 1.0        # every first draft rejected


@pytest.mark.certify_guard("acceptance_length")
def test_acceptance_length_guard() -> None:
    # (1 + 2 + 4 + 1) / 4 = 2; a single step with 3 tokens: 3.
    assert acceptance_length(torch.tensor([1, 2, 4, 1])) == 2.0
    assert acceptance_length([3]) == 3.0


# ---------------------------------------------------------------- rollback_commit


def _toy_row(state: dict, token: int, salt: int) -> dict:
    """One verify row of a toy layer: a decaying outer-product state, a 3-wide conv window, the n-gram
    history and the plane length: the side-state kinds a verify step records."""
    g = _gen(salt * 131 + token)
    k, v = torch.randn(4, generator=g), torch.randn(4, generator=g)
    return {
        "gdn_state": 0.9 * state["gdn_state"] + torch.outer(k, v),
        "conv_window": torch.cat([state["conv_window"][1:], torch.tensor([float(token)])]),
        "ngram_history": ple_history_advance(state["ngram_history"], torch.tensor([token])),
        "plane_len": state["plane_len"] + 1,
    }


@pytest.mark.certify_property("rollback_commit")
@given(seed=seeds, R=st.integers(1, 4), k_max=st.integers(0, 7))
def test_rollback_commit_property(seed: int, R: int, k_max: int) -> None:
    g = _gen(seed)
    lens = torch.randint(0, k_max + 1, (R,), generator=g)
    starts, rows_run, records = [], [], {}
    for r in range(R):
        start = {
            "gdn_state": torch.randn(4, 4, generator=g),
            "conv_window": torch.randn(3, generator=g),
            "ngram_history": torch.randint(0, 50, (2,), generator=g),
            "plane_len": torch.randint(20, 70, (), generator=g),
        }
        tokens = torch.randint(0, 50, (int(lens[r]) + 1,), generator=g).tolist()
        state, trace = start, []
        for tok in tokens:
            state = _toy_row(state, tok, seed)
            trace.append(state)
        # Pad to K_max + 1 entries with poison that must never be picked.
        poison = {name: torch.full_like(t, -1) for name, t in trace[0].items()}
        trace += [poison] * (k_max - int(lens[r]))
        starts.append(start)
        rows_run.append(tokens)
        for name in start:
            records.setdefault(name, []).append(torch.stack([entry[name] for entry in trace]))
    records = {name: torch.stack(per_request) for name, per_request in records.items()}
    num_accepted = torch.stack([torch.randint(1, int(lens[r]) + 2, (), generator=g) for r in range(R)])

    committed = rollback_commit(records, num_accepted)
    for r in range(R):
        a = int(num_accepted[r]) - 1
        # rollback_commit(a + 1 accepted) picks entry a ...
        for name in records:
            assert torch.equal(committed[name][r], records[name][r, a])
        # ... which equals, bit for bit, running only the first a + 1 rows (docs/spec.md's oracle).
        replay = starts[r]
        for tok in rows_run[r][:a + 1]:
            replay = _toy_row(replay, tok, seed)
        for name, value in replay.items():
            assert torch.equal(committed[name][r], value)
        # Planes are truncated to the accepted length; only complete blocks keep their key.
        accepted_len = int(starts[r]["plane_len"]) + a + 1
        assert int(committed["plane_len"][r]) == accepted_len
        assert int(committed["blocks_complete"][r]) == accepted_len // 32
        after_all = int(records["plane_len"][r, int(lens[r])])
        assert int(committed["blocks_complete"][r]) <= after_all // 32


@pytest.mark.certify_guard("rollback_commit")
def test_rollback_commit_guard() -> None:
    # One request, K = 3: the plane held 62 tokens before the verify; after rows 0..3 it holds 63..66.
    records = {
        "plane_len": torch.tensor([[63, 64, 65, 66]]),
        "ngram_history": torch.tensor([[[7, 8], [8, 9], [9, 10], [10, 11]]]),
    }
    # 1 accepted: entry 0, length 63, one complete block: the key of block 1 (tokens 32..63), which
    # row 1 completed, is removed with the rollback.
    c1 = rollback_commit(records, torch.tensor([1]))
    assert c1["plane_len"].tolist() == [63] and c1["blocks_complete"].tolist() == [1]
    assert c1["ngram_history"].tolist() == [[7, 8]]
    # 3 accepted: entry 2, length 65, two complete blocks.
    c3 = rollback_commit(records, torch.tensor([3]))
    assert c3["plane_len"].tolist() == [65] and c3["blocks_complete"].tolist() == [2]
    assert c3["ngram_history"].tolist() == [[9, 10]]
    assert blocks_complete(torch.tensor([31, 32, 63, 64])).tolist() == [0, 1, 1, 2]
