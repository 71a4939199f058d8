"""Property tests and hand-checkable guards of the PLE ops (spec/ops/ple.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.ops.ple import (
    NgramHashConfig,
    ngram_hash_values,
    ple_apply,
    ple_embed,
    ple_history_advance,
    ple_history_init,
    ple_ngram_hash,
    ple_ngram_ids,
)

F64 = torch.float64
U64 = (1 << 64) - 1
PRIMES = ((101, 103, 107, 109, 113, 127, 131, 137), (139, 149, 151, 157, 163, 167, 173, 179))

seeds = st.integers(min_value=0, max_value=2**31 - 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _model_config(seed: int, pad_id: int = 0) -> NgramHashConfig:
    """The model's shape of config (orders 2 and 3, 8 heads each) with drawn odd 64-bit multipliers.

    Half the multipliers have the top bit set, so products wrap and hashes exceed 2^63.
    """
    rnd = random.Random(seed)
    mults = tuple(tuple(tuple(rnd.getrandbits(64) | 1 for _ in range(n)) for _ in range(8))
                  for n in (2, 3))
    return NgramHashConfig(multipliers=mults, primes=PRIMES, pad_id=pad_id)


def _python_rows(ids: list[int], history: list[int], cfg: NgramHashConfig) -> tuple[list, list]:
    """The definition in Python integers (arbitrary precision, masked to 64 bits): (hashes, rows)."""
    seq = list(history) + list(ids)
    hashes, rows = [], []
    for t in range(len(ids)):
        pos = t + len(history)
        h_row, r_row = [], []
        for n, mults, p, offset in cfg.heads():
            h = 0
            for k in range(n):
                h ^= (seq[pos - k] * mults[k]) & U64
            h_row.append(h)
            r_row.append(h % p + offset)
        hashes.append(h_row)
        rows.append(r_row)
    return hashes, rows


def _guard_config() -> NgramHashConfig:
    """One head per order: order 2 with (7, 9) mod 13; order 3 with (2^64-1, 2^63+1, 2^63+1) mod 3."""
    return NgramHashConfig(multipliers=(((7, 9),), ((U64, (1 << 63) + 1, (1 << 63) + 1),)),
                           primes=((13,), (3,)), pad_id=1)


# ---------------------------------------------------------------- ple_ngram_hash


@pytest.mark.certify_property("ple_ngram_hash")
@given(seed=seeds, T=st.integers(1, 12), split=st.integers(0, 12), pad=st.integers(0, 5),
       big_ids=st.booleans())
def test_ngram_hash_property(seed: int, T: int, split: int, pad: int, big_ids: bool) -> None:
    cfg = _model_config(seed, pad_id=pad)
    rnd = random.Random(seed + 1)
    id_max = 2**31 - 1 if big_ids else 50
    ids_list = [rnd.randint(1, id_max) for _ in range(T)]
    ids = torch.tensor(ids_list, dtype=torch.int64)
    start = ple_history_init(pad)
    rows = ple_ngram_hash(ids, start, cfg)
    assert rows.dtype == torch.int64 and rows.shape == (T, 16)

    # Each head's rows stay in its own range [offset, offset + p).
    for k, (_, _, p, offset) in enumerate(cfg.heads()):
        assert torch.all((rows[:, k] >= offset) & (rows[:, k] < offset + p))
    assert int(rows.max()) < cfg.table_rows

    # Against the definition in Python integers, with the pad id before the sequence start.
    hashes, ref_rows = _python_rows(ids_list, [pad, pad], cfg)
    assert rows.tolist() == ref_rows
    values = ngram_hash_values(ids, start, cfg)
    assert [[v & U64 for v in row] for row in values.tolist()] == hashes

    # The first token's n-grams read the pad id: the window is (id_0, pad, pad).
    assert ple_ngram_ids(ids, start)[0].tolist() == [ids_list[0], pad, pad]

    # Streaming: two steps with the advanced history hash exactly as one step over the whole sequence.
    s = min(split, T)
    hist = ple_history_advance(start, ids[:s])
    assert hist.tolist() == ([pad, pad] + ids_list[:s])[-2:]
    streamed = torch.cat([ple_ngram_hash(ids[:s], start, cfg), ple_ngram_hash(ids[s:], hist, cfg)])
    assert torch.equal(streamed, rows)

    # Where the platform's int64 multiply wraps (two's complement, as on every torch build we run),
    # the limb arithmetic equals the native product: the form a kernel with uint64 multiplies computes.
    window = ple_ngram_ids(ids, start)
    for k, (n, mults, _, _) in enumerate(cfg.heads()):
        native = torch.zeros(T, dtype=torch.int64)
        for j in range(n):
            signed = mults[j] - (1 << 64) if mults[j] >= 1 << 63 else mults[j]
            native = native ^ (window[:, j] * signed)
        assert torch.equal(native, values[:, k])


@pytest.mark.certify_guard("ple_ngram_hash")
def test_ngram_hash_guard() -> None:
    cfg = _guard_config()          # pad = 1; G rows: head 0 at 0..12, head 1 at 13..15
    ids = torch.tensor([5])
    history = torch.tensor([1, 3])  # oldest first: (pad, 3), so the window is (5, 3, 1)
    assert ple_ngram_ids(ids, history).tolist() == [[5, 3, 1]]
    # Order 2: (5 * 7) XOR (3 * 9) = 35 XOR 27 = 0b100011 ^ 0b011011 = 0b111000 = 56; 56 mod 13 = 4.
    # Order 3, products mod 2^64: 5 (2^64 - 1) -> 2^64 - 5 = 0xFF..FB;
    #   3 (2^63 + 1) -> 2^63 + 3 = 0x80..03; 1 (2^63 + 1) = 0x80..01.
    #   XOR = 0xFF..F9 = 2^64 - 7 (as int64: -7).
    #   Unsigned: 2^64 = 4^32 = 1 mod 3, so (2^64 - 7) mod 3 = -6 mod 3 = 0 -> row 13 + 0 = 13.
    #   (Reading the bits as signed, -7 mod 3 = 2, would give row 15: the mod must be unsigned.)
    assert ngram_hash_values(ids, history, cfg).tolist() == [[56, -7]]
    assert ple_ngram_hash(ids, history, cfg).tolist() == [[4, 13]]
    assert ple_history_advance(history, ids).tolist() == [3, 5]
    # A new request: ids 2 at t = 0 with history (pad, pad) = (1, 1): order 2 = 14 XOR 9 = 7 -> row 7.
    assert ple_ngram_hash(torch.tensor([2]), ple_history_init(1), cfg)[0, 0].item() == 7


def test_hash_config_validation() -> None:
    with pytest.raises(ValueError):  # even multiplier
        NgramHashConfig(multipliers=(((8, 9),), ((1, 3, 5),)), primes=((13,), (3,)), pad_id=0)
    with pytest.raises(ValueError):  # repeated prime
        NgramHashConfig(multipliers=(((7, 9),), ((1, 3, 5),)), primes=((13,), (13,)), pad_id=0)
    with pytest.raises(ValueError):  # not a prime
        NgramHashConfig(multipliers=(((7, 9),), ((1, 3, 5),)), primes=((15,), (3,)), pad_id=0)


# ---------------------------------------------------------------- ple_embed


def _embed_inputs(seed: int, T: int, L: int, P: int, C: int, V: int, dtype: torch.dtype):
    g = _gen(seed)
    cfg = _model_config(seed, pad_id=seed % V)
    ids = torch.randint(0, V, (T,), generator=g)
    history = torch.randint(0, V, (2,), generator=g)
    x_emb = torch.randn(T, C, generator=g, dtype=F64).to(dtype)
    table = torch.randn(V, L * P, generator=g, dtype=F64).to(dtype)
    grid = torch.randn(cfg.table_rows, L * P // cfg.num_heads, generator=g, dtype=F64).to(dtype)
    w_ple = torch.randn(C, L * P, generator=g, dtype=F64).to(dtype)
    norm_w = (torch.rand(P, generator=g, dtype=F64) - 0.5).to(dtype)  # 1 + w in (0.5, 1.5)
    return cfg, ids, history, x_emb, table, grid, w_ple, norm_w


@pytest.mark.certify_property("ple_embed")
@given(seed=seeds, T=st.integers(1, 4), L=st.sampled_from([2, 4]), P=st.sampled_from([8, 16]),
       C=st.integers(2, 12))
def test_ple_embed_property(seed: int, T: int, L: int, P: int, C: int) -> None:
    V = 11
    cfg, ids, history, x_emb, table, grid, w_ple, norm_w = _embed_inputs(seed, T, L, P, C, V, F64)
    e = ple_embed(ids, history, x_emb, table, grid, w_ple, norm_w, cfg)
    assert e.dtype == F64 and e.shape == (T, L, P)

    # Float64 reference written out: scale, n-grams after the scale, norm over P per layer, combine.
    rows = ple_ngram_hash(ids, history, cfg)
    ngram = grid[rows].reshape(T, L, P)
    per_layer = math.sqrt(P) * table[ids].reshape(T, L, P) + ngram
    proj = ((x_emb @ w_ple) / math.sqrt(C)).reshape(T, L, P)
    context = proj / torch.sqrt(proj.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * (1 + norm_w)
    torch.testing.assert_close(e, (per_layer + context) / math.sqrt(2), rtol=1e-13, atol=1e-13)

    # The norm is per layer: every layer's context part, divided by 1 + w, has RMS 1 (exactly
    # sqrt(ms / (ms + eps)) with ms that layer's mean square), not only the union of the layers.
    ctx = math.sqrt(2) * e - per_layer
    rms = (ctx / (1 + norm_w)).pow(2).mean(dim=-1).sqrt()
    ms = proj.pow(2).mean(dim=-1)
    torch.testing.assert_close(rms, torch.sqrt(ms / (ms + 1e-6)), rtol=1e-10, atol=1e-10)

    # One rounding point: the bf16 result is the fp32 computation rounded once at the end.
    args32 = [t.float() for t in (x_emb, table, grid, w_ple, norm_w)]
    e32 = ple_embed(ids, history, *args32, cfg, act_dtype=torch.float32)
    e16 = ple_embed(ids, history, *args32, cfg)
    assert e16.dtype == torch.bfloat16 and torch.equal(e16, e32.to(torch.bfloat16))
    torch.testing.assert_close(e32.to(F64), e, rtol=1e-5, atol=1e-5)


@pytest.mark.certify_property("ple_embed")
@given(seed=seeds, T=st.integers(1, 6))
def test_ple_embed_per_row_history_is_each_row_alone(seed: int, T: int) -> None:
    # A history per row ([T, 2], decode rows of T requests): row t equals ple_embed of the one id
    # with its own request's history, bit for bit (the rows share nothing), in float64 and bf16.
    cfg, ids, _, x_emb, table, grid, w_ple, norm_w = _embed_inputs(seed, T, 2, 8, 5, 11, F64)
    histories = torch.randint(0, 11, (T, 2), generator=_gen(seed + 1))
    for dtype in (F64, torch.float32):
        args = [t.to(dtype) for t in (x_emb, table, grid, w_ple, norm_w)]
        e = ple_embed(ids, histories, args[0], *args[1:], cfg)
        for t in range(T):
            alone = ple_embed(ids[t:t + 1], histories[t], args[0][t:t + 1], *args[1:], cfg)
            assert torch.equal(e[t:t + 1], alone)
    with pytest.raises(ValueError, match="per-row history"):
        ple_ngram_ids(ids, histories[:, :1])


@pytest.mark.certify_guard("ple_embed")
def test_ple_embed_guard() -> None:
    # L = 2, P = 2, C = 2, the two-head guard config: token 5 after history (pad 1, 3) gathers G rows
    # 4 (order 2) and 13 (order 3), see test_ngram_hash_guard.
    cfg = _guard_config()
    table = torch.ones(6, 4, dtype=F64)
    table[5] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    grid = torch.ones(cfg.table_rows, 2, dtype=F64)
    grid[4] = torch.tensor([0.5, 1.5])    # layer 0's n-gram part
    grid[13] = torch.tensor([0.5, 2.5])   # layer 1's n-gram part
    x_emb = torch.tensor([[3.0, 4.0]], dtype=F64)
    w_ple = torch.tensor([[1.0, 1.0, 1.0, -1.0], [1.0, 1.0, 0.0, 0.0]], dtype=F64)
    norm_w = torch.tensor([0.5, -0.5], dtype=F64)
    e = ple_embed(torch.tensor([5]), torch.tensor([1, 3]), x_emb, table, grid, w_ple, norm_w, cfg)
    # x_emb @ W_ple = [7, 7, 3, -3]; per layer over P the norm gives [1, 1] and [1, -1] (eps ~1e-8
    # relative), times 1 + w = [1.5, 0.5]: context = [1.5, 0.5 | 1.5, -0.5].
    # n-grams + context = [0.5+1.5, 1.5+0.5 | 0.5+1.5, 2.5-0.5] = [2, 2 | 2, 2].
    # e = (sqrt(2) [1, 2 | 3, 4] + [2, 2 | 2, 2]) / sqrt(2) = [1, 2 | 3, 4] + sqrt(2).
    expected = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]], dtype=F64) + math.sqrt(2)
    torch.testing.assert_close(e, expected, rtol=1e-7, atol=1e-7)


# ---------------------------------------------------------------- ple_apply


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))


@pytest.mark.certify_property("ple_apply")
@given(seed=seeds, T=st.integers(1, 4), C=st.integers(2, 16), P=st.integers(1, 8))
def test_ple_apply_property(seed: int, T: int, C: int, P: int) -> None:
    g = _gen(seed)
    # x on a grid of quarters, so x + (a bf16 update of magnitude ~1) is exact in fp32.
    signs = 2 * torch.randint(0, 2, (T, C), generator=g) - 1
    x = (torch.randint(1, 9, (T, C), generator=g) * signs) / 4.0
    e_l = torch.randn(T, P, generator=g, dtype=F64)
    w_gate = torch.randn(P, C, generator=g, dtype=F64) / math.sqrt(C)
    w_out = torch.randn(C, P, generator=g, dtype=F64)
    norm_w = 0.5 * torch.randn(C, generator=g, dtype=F64)

    out64 = ple_apply(x.to(F64), e_l, w_gate, w_out, norm_w)
    z = (_gelu_tanh(x.to(F64) @ w_gate.T) * e_l) @ w_out.T
    update = z / torch.sqrt(z.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * (1 + norm_w)
    assert out64.dtype == F64
    torch.testing.assert_close(out64, x.to(F64) + update, rtol=1e-13, atol=1e-13)

    # fp32 stream, bf16 activations: the added term is rounded to bf16 once, the sum stays fp32.
    args32 = [t.float() for t in (e_l, w_gate, w_out, norm_w)]
    out32 = ple_apply(x, *args32)
    added = out32 - x
    assert out32.dtype == torch.float32
    assert torch.equal(added.to(torch.bfloat16).float(), added)
    torch.testing.assert_close(added.to(F64), update, rtol=2**-8, atol=2**-8 * float(update.abs().max()))
    # A bf16 hidden state comes back in bf16.
    assert ple_apply(x.to(torch.bfloat16), *args32).dtype == torch.bfloat16


@pytest.mark.certify_guard("ple_apply")
def test_ple_apply_guard() -> None:
    # x = [1, 2], W_gate = I: gelu_tanh(1) = 0.84119199, gelu_tanh(2) = 1.95459769 (erf-gelu would give
    # 0.84134475, 1.95449974). Times e = [2, 1]: a = [1.68238398, 1.95459769]; W_out = I;
    # rmsnorm: rms = sqrt((a0^2 + a1^2) / 2 + 1e-6) = 1.82357; times 1 + w = 1.5:
    # update = [1.38385999, 1.60777181]; x + update = [2.38385999, 3.60777181].
    x = torch.tensor([[1.0, 2.0]], dtype=F64)
    eye = torch.eye(2, dtype=F64)
    out = ple_apply(x, torch.tensor([[2.0, 1.0]], dtype=F64), eye, eye, torch.full((2,), 0.5, dtype=F64))
    torch.testing.assert_close(out, torch.tensor([[2.383859985209624, 3.6077718084756922]], dtype=F64),
                               rtol=1e-12, atol=1e-12)
