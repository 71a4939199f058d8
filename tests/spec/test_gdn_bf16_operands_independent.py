"""gdn_prefill's bf16_operands tier against its six numbered lines (docs/spec.md, "Numerics tiers"),
written in numpy per (sequence, value head) in float64, with a bf16 / fp16 rounding written from
the formats' definitions (nearest, ties to even, once from the float64 value) and the blockwise
inverse of line 2 by forward substitution and merges. The rounding points apply in the float64
path too (they are the tier's contract), so both sides round the same values at the same points.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spec.ops.gdn import gdn_chunked_bf16_operands, gdn_prefill_bf16_operands
from tests.spec.test_gdn_independent import (CHUNK, _close, _layer, _state, _unit, np_gated_rmsnorm,
                                             np_gates, wy)

pytestmark = pytest.mark.premerge


def round_bits(x: np.ndarray, bits: int, min_exp: int) -> np.ndarray:
    """x rounded to ``bits`` significant bits (the implicit one included), nearest, ties to even,
    with the quantum fixed below the smallest normal ``2^(min_exp - 1)`` (subnormals). bf16 is
    (8, -125), fp16 (11, -13); no value here reaches either format's largest finite."""
    x = np.asarray(x, np.float64)
    _, e = np.frexp(x)
    quantum = np.ldexp(1.0, np.maximum(e, min_exp) - bits)
    return np.round(x / quantum) * quantum      # x / quantum is exact; np.round ties to even


def bf16(x):
    return round_bits(x, 8, -125)


def fp16(x):
    return round_bits(x, 11, -13)


def test_the_rounding_helpers_equal_torchs_casts_from_fp32():
    # An fp32 value rounds once to bf16 or fp16 in torch's cast: the public anchor of round_bits.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20000, generator=gen) * torch.exp(8 * torch.randn(20000, generator=gen))
    x = x[x.abs() < 6e4]
    for mine, dtype in ((bf16, torch.bfloat16), (fp16, torch.float16)):
        assert np.array_equal(mine(x.double().numpy()), x.to(dtype).double().numpy())


def _inverse_blockwise(A: np.ndarray) -> np.ndarray:
    """(I + A)^-1 of a strictly lower 64 x 64 A, line 2 of the tier: 8 x 8 diagonal blocks inverted
    (forward substitution) and rounded to fp16, then merged 8 -> 16 -> 32 -> 64, the lower-left
    block of [[X, 0], [L, Y]] being fp16(fp16(-(Y^-1 L)) X^-1), its inner dimension split in two
    halves rounded apart and added in fp16 in the last merge."""
    n = A.shape[0]
    inv = np.zeros((n, n))
    for b0 in range(0, n, 8):
        blk = np.eye(8)
        for r in range(8):          # row r of the inverse: e_r - sum_{j<r} A[r, j] row j
            for j in range(r):
                blk[r] -= A[b0 + r, b0 + j] * blk[j]
        inv[b0:b0 + 8, b0:b0 + 8] = fp16(blk)
    size = 8
    while size < n:
        for b0 in range(0, n, 2 * size):
            top, bot = slice(b0, b0 + size), slice(b0 + size, b0 + 2 * size)
            d = fp16(-(inv[bot, bot] @ A[bot, top]))
            x = inv[top, top]
            if 2 * size < n:
                inv[bot, top] = fp16(d @ x)
            else:
                h = size // 2
                inv[bot, top] = fp16(fp16(d[:, :h] @ x[:h]) + fp16(d[:, h:] @ x[h:]))
        size *= 2
    return inv


def tier_head(q, k, v, g, beta, S0, chunk: int = CHUNK):
    """One (sequence, value head) of the tier, lines 1-6 of docs/spec.md's "Numerics tiers", in
    float64 with the rounding points exact. Returns (o in bf16 values [T, V], final state)."""
    T, K = q.shape
    Q = bf16(np.stack([_unit(r) for r in q]))
    Kn = bf16(np.stack([_unit(r) for r in k]))
    scale = K ** -0.5
    S = np.array(S0, np.float64)
    out = np.empty((T, v.shape[1]))
    for c0 in range(0, T, chunk):
        C = min(chunk, T - c0)
        rows = slice(c0, c0 + C)
        c = np.cumsum([math.log2(math.exp(float(x)) + 1e-10) for x in g[rows]])
        pair = np.array([[2.0 ** (c[t] - c[i]) if i <= t else 0.0 for i in range(C)]
                         for t in range(C)])
        A = np.zeros((CHUNK, CHUNK))
        kk = Kn[rows] @ Kn[rows].T
        for t in range(C):
            for i in range(t):
                A[t, i] = fp16(beta[c0 + t] * pair[t, i] * kk[t, i])                  # line 1
        inv = _inverse_blockwise(A)[:C, :C]                                          # line 2
        Tm = bf16(inv * np.asarray(beta[rows])[None, :])                             # line 3
        Sb = bf16(S)
        gamma = 2.0 ** c
        D = bf16(v[rows] - bf16(gamma[:, None] * (Kn[rows] @ Sb)))                   # line 4
        v_new = bf16(Tm @ D)
        scores = bf16(scale * pair * (Q[rows] @ Kn[rows].T))                          # line 5
        out[rows] = bf16(scale * gamma[:, None] * (Q[rows] @ Sb) + scores @ v_new)
        S = 2.0 ** c[-1] * S + Kn[rows].T @ bf16(2.0 ** (c[-1] - c)[:, None] * v_new)  # line 6
    return out, S


def tier(q, k, v, g, beta, state):
    q, k, v, g, beta, state = (np.asarray(t, np.float64) for t in (q, k, v, g, beta, state))
    B, T, HK, K = q.shape
    HV, V = v.shape[2:]
    o, final = np.empty((B, T, HV, V)), np.empty((B, HV, K, V))
    for bi in range(B):
        for h in range(HV):
            kh = h // (HV // HK)
            o[bi, :, h], final[bi, h] = tier_head(q[bi, :, kh], k[bi, :, kh], v[bi, :, h],
                                                  g[bi, :, h], beta[bi, :, h], state[bi, h])
    return torch.from_numpy(o), torch.from_numpy(final)


@pytest.mark.second_formulation("spec.ops.gdn:gdn_chunked_bf16_operands",
                                "spec.ops.gdn:gdn_prefill_bf16_operands")
@pytest.mark.parametrize("T", (1, 64, 100))
def test_bf16_operands_tier_equals_its_six_lines(T):
    # Both sides round at the same points from float64 values that differ by summation order only
    # (~1e-16 relative); a bf16 result can differ only when a value lies that close to a rounding
    # midpoint, and none does on these seeds: the outputs agree to float64 rounding.
    HK, HV, K, V = 1, 3, 16, 16
    x = _layer(1200 + T, (1, T), HK, HV, K, V)
    S0 = _state(1300 + T, 1, HV, K, V)
    g, beta = np_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    o, final = tier(x["q"], x["k"], x["v"], g, beta, S0)
    o_spec, final_spec = gdn_chunked_bf16_operands(x["q"], x["k"], x["v"], torch.from_numpy(g),
                                                   torch.from_numpy(beta), S0)
    assert _close(o_spec, o) and _close(final_spec, final)
    assert torch.equal(torch.from_numpy(bf16(o_spec.numpy())), o_spec)       # o holds bf16 values
    res = gdn_prefill_bf16_operands(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"],
                                    x["dt_bias"], x["z"], x["norm_w"], S0)
    assert _close(res["final_state"], final)
    assert _close(res["out"], np_gated_rmsnorm(o, x["z"], x["norm_w"]))
    # wrong: the exact tier's result, which the roundings move by ~1e-3 relative.
    o_exact, _ = wy(x["q"], x["k"], x["v"], g, beta, S0)
    assert not _close(o_spec, o_exact, rtol=1e-5, atol=1e-5)
