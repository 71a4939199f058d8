"""Second formulations of the model-level spec ops, checked against the spec functions.

The spec under spec/ is the definition every implementation is certified against, so it has to be
checked, not only trusted. For each op below this file writes the definition a second time, from the
prose of docs/spec.md and the function's docstring, in a deliberately different computational
form (explicit Python loops per token / row / head, ``math.fsum``, Python integers, brute force), and
compares the two in float64 on seeded random inputs:

- hyper-connections (spec/ops/hc.py): ``hc_inject_norm`` per token with ``math.fsum``;
  ``sinkhorn`` as a loop over nested lists, columns then rows each round, plus the row sums (1 after
  every round) and the column sums (converged after 20 rounds); ``hc_first_projection`` per token
  and logit (fsum dot, closed-form sigmoid, l_res read row-major, exp without the max shift the spec
  applies, which Sinkhorn cancels); ``hc_pre`` and ``hc_up_projection`` per (token, stream, channel);
- PLE (spec/ops/ple.py): ``ple_ngram_ids`` / ``ple_history_advance`` on Python lists; the n-gram rows
  with Python's unbounded integers masked to 64 bits (the spec uses 16-bit limbs); ``ple_embed`` as
  an explicit gather per (token, layer, element); ``ple_apply`` per token with the closed tanh gelu;
- QSA (spec/ops/qsa.py): ``dense_causal_gqa`` per (query, head) with scores, exp and sums by
  ``math.fsum``; ``qsa_sparse_gqa`` as a per-query loop over the selected token positions that reads
  K and V from the per-sequence arrays by position (no pages at all), while the spec reads them from
  pages written with its own ``empty_planes`` / ``qsa_kv_append`` through a shuffled block table;
  ``qsa_index_scores`` per (row, block, index head);
- MTP (spec/ops/mtp.py): ``logits_cast`` on the bit patterns with Python integers (round to nearest
  even by the bias formula); ``greedy_argmax`` as a linear scan with a strict ``>``; ``greedy_verify``
  per request; ``acceptance_length`` by ``math.fsum``; ``mtp_draft_input`` per token;
- ``linear`` (spec/ops/linear.py): per-output fsum dot; ``nvfp4_linear`` (spec/ops/moe.py): both operands
  decoded element by element (nibble, e2m1 grid value, block scale, global scale) and an fsum dot.

Every comparison is paired with a deliberately wrong variant of the same second formulation (eps
outside the sqrt, rows normalised before columns, l_res read column-major, the n-gram added before
the sqrt(P) scale, the other GQA head mapping, attention over every causal token instead of the
selected ones, the highest index among tied maxima, truncation instead of rounding, the swapped
nibble order, ...) that must *not* match the spec on the same inputs, so each test shows it can fail.

Tolerances: both sides compute the same real-number function in float64 with O(10) to O(1000)
roundings per output on values of order 1 (Sinkhorn: 20 rounds of divisions, each contracting the
error of the one before), so they agree to a few 1e-15 relative; rtol 1e-12 (atol 1e-13 for values
that can be near 0) leaves margin for summation-order differences only, while every wrong variant is
off by 1e-6 or more. Integer results (ids, rows, argmax, verify) and bit patterns (logits_cast) are
compared exactly. The few bf16 checks allow the rare one-ulp difference that fp32's own error can
cause at a bf16 rounding boundary.
"""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from spec.ops.hc import (hc_first_projection, hc_inject_norm, hc_pre, hc_up_projection,
                         sinkhorn)
from spec.ops.kv_storage import (E2M1_GRID, nvfp4_global_scale, nvfp4_quantize)
from spec.ops.linear import linear
from spec.ops.moe import nvfp4_linear
from spec.ops.mtp import (acceptance_length, greedy_argmax, greedy_verify, logits_cast,
                          mtp_draft_input)
from spec.ops.ple import (NgramHashConfig, ple_apply, ple_embed, ple_history_advance,
                          ple_ngram_hash, ple_ngram_ids)
from spec.ops.qsa import (dense_causal_gqa, empty_planes, qsa_index_scores, qsa_kv_append,
                          qsa_sparse_gqa)

F64 = torch.float64
RTOL = 1e-12   # float64 rounding differences only (see the module docstring)
ATOL = 1e-13
EPS = 1e-6     # the model's rmsnorm eps (docs/spec.md), also the HC inject norm's
U64 = (1 << 64) - 1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _dot(a, b) -> float:
    return math.fsum(x * y for x, y in zip(a, b))


def _rms_list(row: list[float], w: list[float], eps: float = EPS) -> list[float]:
    """Zero-centred rmsnorm of one row: ``x_i / sqrt(mean x^2 + eps) * (1 + w_i)``."""
    denom = math.sqrt(math.fsum(v * v for v in row) / len(row) + eps)
    return [v / denom * (1.0 + wi) for v, wi in zip(row, w)]


# ---------------------------------------------------------------- hyper-connections


def second_inject_norm(X: torch.Tensor, eps: float = EPS, channel_major: bool = False,
                       eps_outside_sqrt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: v = the streams one after the other (stream 0 first), r = 1/sqrt(mean v^2 + eps)."""
    T, n, C = X.shape
    vs, rs = [], []
    for t in range(T):
        streams = X[t].tolist()
        if channel_major:
            v = [streams[i][c] for c in range(C) for i in range(n)]
        else:
            v = [streams[i][c] for i in range(n) for c in range(C)]
        ms = math.fsum(x * x for x in v) / len(v)
        rs.append(1.0 / (math.sqrt(ms) + eps if eps_outside_sqrt else math.sqrt(ms + eps)))
        vs.append(v)
    return torch.tensor(vs, dtype=F64), torch.tensor(rs, dtype=F64)


def second_sinkhorn(M: list[list[float]], iters: int, rows_first: bool = False) -> list[list[float]]:
    """Sinkhorn-Knopp on one n x n list of lists: each round divides every column by its sum, then
    every row by its sum (``rows_first`` swaps the two: the wrong variant)."""
    n = len(M)
    M = [row[:] for row in M]

    def cols(M):
        sums = [math.fsum(M[i][j] for i in range(n)) for j in range(n)]
        return [[M[i][j] / sums[j] for j in range(n)] for i in range(n)]

    def rows(M):
        return [[x / math.fsum(row) for x in row] for row in M]

    for _ in range(iters):
        M = cols(rows(M)) if rows_first else rows(cols(M))
    return M


def _sinkhorn_tensor(M: torch.Tensor, iters: int, rows_first: bool = False) -> torch.Tensor:
    flat = M.reshape(-1, M.shape[-2], M.shape[-1])
    out = [second_sinkhorn(m.tolist(), iters, rows_first) for m in flat]
    return torch.tensor(out, dtype=F64).reshape(M.shape)


def second_first_projection(v: torch.Tensor, r: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor,
                            n: int, iters: int = 20, res_col_major: bool = False,
                            post_times_two: bool = True):
    """Per token and logit k: ``l_k = sum_i (v_i r) Phi[i, k] + bias_k``; closed-form sigmoids;
    ``H_res = sinkhorn(exp(l_res))`` with ``l_res[i, j] = l[2n + i n + j]`` (no max shift)."""
    phi_cols = phi.T.tolist()
    b = bias.tolist()
    pre, post, res = [], [], []
    for t in range(v.shape[0]):
        vr = [x * float(r[t]) for x in v[t].tolist()]
        lg = [_dot(vr, col) + bk for col, bk in zip(phi_cols, b)]
        pre.append([_sigmoid(x) for x in lg[:n]])
        post.append([(2.0 if post_times_two else 1.0) * _sigmoid(x) for x in lg[n:2 * n]])
        if res_col_major:
            m = [[math.exp(lg[2 * n + j * n + i]) for j in range(n)] for i in range(n)]
        else:
            m = [[math.exp(lg[2 * n + i * n + j]) for j in range(n)] for i in range(n)]
        res.append(second_sinkhorn(m, iters))
    return (torch.tensor(pre, dtype=F64), torch.tensor(post, dtype=F64),
            torch.tensor(res, dtype=F64))


def second_hc_pre(X: torch.Tensor, h_pre: torch.Tensor, reverse_weights: bool = False) -> torch.Tensor:
    """Per (token, channel): ``x_in[c] = sum_i H_pre[i] X[i, c]``."""
    T, n, C = X.shape
    out = []
    for t in range(T):
        w = h_pre[t].tolist()[::-1] if reverse_weights else h_pre[t].tolist()
        xs = X[t].tolist()
        out.append([math.fsum(w[i] * xs[i][c] for i in range(n)) for c in range(C)])
    return torch.tensor(out, dtype=F64)


def second_up_projection(X: torch.Tensor, y: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor,
                         transpose_res: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, stream i, channel): ``X'[i, c] = sum_j H_res[i, j] X[j, c] + H_post[i] y[c]``;
    ``m[c] = mean_i X'[i, c]``."""
    T, n, C = X.shape
    streams, means = [], []
    for t in range(T):
        xs, ys, res, post = X[t].tolist(), y[t].tolist(), h_res[t].tolist(), h_post[t].tolist()
        new = []
        for i in range(n):
            coef = [res[j][i] if transpose_res else res[i][j] for j in range(n)]
            new.append([math.fsum([*(coef[j] * xs[j][c] for j in range(n)), post[i] * ys[c]])
                        for c in range(C)])
        streams.append(new)
        means.append([math.fsum(new[i][c] for i in range(n)) / n for c in range(C)])
    return torch.tensor(streams, dtype=F64), torch.tensor(means, dtype=F64)


@pytest.mark.second_formulation("spec.ops.hc:hc_inject_norm")
def test_hc_inject_norm_equals_per_token_loop():
    gen = _gen(301)
    X = torch.randn(5, 4, 6, generator=gen, dtype=F64)
    X[1] *= 1e-3   # a small-rms token, where eps weighs more
    v, r = hc_inject_norm(X)
    v2, r2 = second_inject_norm(X)
    assert v.dtype == r.dtype == F64
    assert torch.equal(v, v2)   # a reshape: exact
    assert _close(r2, r)
    assert not torch.equal(second_inject_norm(X, channel_major=True)[0], v)
    assert not _close(second_inject_norm(X, eps_outside_sqrt=True)[1], r)


@pytest.mark.second_formulation("spec.ops.hc:sinkhorn")
def test_sinkhorn_equals_alternating_normalisation_loop():
    gen = _gen(302)
    M = torch.exp(1.5 * torch.randn(3, 4, 4, generator=gen, dtype=F64))
    for iters in (1, 3, 20):
        spec = sinkhorn(M, iters)
        assert spec.dtype == F64
        assert _close(_sinkhorn_tensor(M, iters), spec)
        assert not _close(_sinkhorn_tensor(M, iters, rows_first=True), spec)
    spec = sinkhorn(M, 20)
    # Rows sum to 1 after every round (rows are normalised last); columns after convergence.
    assert torch.allclose(spec.sum(dim=-1), torch.ones(3, 4, dtype=F64), rtol=0, atol=1e-14)
    assert torch.allclose(spec.sum(dim=-2), torch.ones(3, 4, dtype=F64), rtol=0, atol=1e-6)
    one_round = sinkhorn(M, 1)
    assert not torch.allclose(one_round.sum(dim=-2), torch.ones(3, 4, dtype=F64), atol=1e-6)


@pytest.mark.second_formulation("spec.ops.hc:hc_first_projection")
def test_hc_first_projection_equals_per_token_logits():
    gen = _gen(303)
    n, C, T = 4, 3, 4
    width = 2 * n + n * n
    v = torch.randn(T, n * C, generator=gen, dtype=F64)
    r = 0.5 + torch.rand(T, generator=gen, dtype=F64)
    phi = 0.4 * torch.randn(n * C, width, generator=gen, dtype=F64)
    bias = 0.3 * torch.randn(width, generator=gen, dtype=F64)
    spec = hc_first_projection(v, r, phi, bias, n=n)
    pre, post, res = second_first_projection(v, r, phi, bias, n)
    assert spec.h_res.dtype == F64
    assert _close(pre, spec.h_pre) and _close(post, spec.h_post) and _close(res, spec.h_res)
    assert not _close(second_first_projection(v, r, phi, bias, n, res_col_major=True)[2], spec.h_res)
    assert not _close(second_first_projection(v, r, phi, bias, n, post_times_two=False)[1],
                      spec.h_post)


@pytest.mark.second_formulation("spec.ops.hc:hc_pre")
def test_hc_pre_equals_per_channel_weighted_sum():
    gen = _gen(304)
    X = torch.randn(3, 4, 8, generator=gen, dtype=F64)
    h = torch.rand(3, 4, generator=gen, dtype=F64)
    spec = hc_pre(X, h)
    assert spec.dtype == F64   # float64 stays float64
    assert _close(second_hc_pre(X, h), spec)
    assert not _close(second_hc_pre(X, h, reverse_weights=True), spec)
    # fp32 streams: one cast to bf16 at the end; the float64 sum rounded once agrees but for rare
    # boundary cases, by one bf16 ulp.
    X32, h32 = X.float(), h.float()
    spec16 = hc_pre(X32, h32)
    assert spec16.dtype == torch.bfloat16
    mine16 = second_hc_pre(X32.double(), h32.double()).to(torch.bfloat16)
    assert (spec16 != mine16).double().mean().item() <= 0.05
    assert ((spec16.float() - mine16.float()).abs() <= mine16.float().abs() * 2 ** -7).all()


@pytest.mark.second_formulation("spec.ops.hc:hc_up_projection")
def test_hc_up_projection_equals_per_stream_loop():
    gen = _gen(305)
    X = torch.randn(3, 4, 5, generator=gen, dtype=F64)
    y = torch.randn(3, 5, generator=gen, dtype=F64)
    h_res = _sinkhorn_tensor(torch.exp(torch.randn(3, 4, 4, generator=gen, dtype=F64)), 20)
    h_post = 2.0 * torch.rand(3, 4, generator=gen, dtype=F64)
    streams, m = hc_up_projection(X, y, h_res, h_post)
    s2, m2 = second_up_projection(X, y, h_res, h_post)
    assert streams.dtype == m.dtype == F64
    assert _close(s2, streams) and _close(m2, m)
    assert not _close(second_up_projection(X, y, h_res, h_post, transpose_res=True)[0], streams)


# ---------------------------------------------------------------- PLE


def second_ngram_ids(ids: list[int], history: list) -> list[list[int]]:
    """``(id_t, id_{t-1}, id_{t-2})`` per row, newest first, from the list ``history ++ ids`` (or,
    per row, from that row's own two-id history)."""
    if history and isinstance(history[0], list):
        return [[ids[t], history[t][1], history[t][0]] for t in range(len(ids))]
    seq = list(history) + list(ids)
    return [[seq[t + 2], seq[t + 1], seq[t]] for t in range(len(ids))]


def second_ngram_rows(window: list[list[int]], cfg: NgramHashConfig, use_xor: bool = True
                      ) -> list[list[int]]:
    """Each head's row with Python integers: ``h = XOR_k (w_k m_k mod 2^64)``, ``row = h % p + off``."""
    out = []
    for w in window:
        row, offset = [], 0
        for n, mults, primes in zip(cfg.orders, cfg.multipliers, cfg.primes):
            for head, p in zip(mults, primes):
                h = 0
                for k in range(n):
                    term = ((w[k] & U64) * head[k]) & U64
                    h = (h ^ term) if use_xor else (h + term) & U64
                row.append(h % p + offset)
                offset += p
        out.append(row)
    return out


def _ple_cfg(seed: int) -> NgramHashConfig:
    rng = random.Random(seed)

    def odd() -> int:
        return rng.getrandbits(64) | 1

    return NgramHashConfig(multipliers=(((odd(), odd()), (odd(), odd())),
                                        ((odd(), odd(), odd()), (odd(), odd(), odd()))),
                           primes=((5, 7), (11, 13)), pad_id=3)


@pytest.mark.second_formulation("spec.ops.ple:ple_ngram_ids", "spec.ops.ple:ple_history_advance")
def test_ple_ngram_ids_and_history_equal_list_windows():
    gen = _gen(401)
    for T in (1, 4, 0):
        ids = torch.randint(0, 50, (T,), generator=gen)
        hist = torch.randint(0, 50, (2,), generator=gen)
        spec = ple_ngram_ids(ids, hist)
        mine = second_ngram_ids(ids.tolist(), hist.tolist())
        assert spec.dtype == torch.int64
        assert spec.tolist() == mine
        adv = ple_history_advance(hist, ids)
        assert adv.tolist() == (hist.tolist() + ids.tolist())[-2:]
        if T >= 2:
            assert spec.tolist() != [row[::-1] for row in mine]   # oldest first: wrong
            assert adv.tolist() != (hist.tolist() + ids.tolist())[:2]
    ids = torch.randint(0, 50, (3,), generator=gen)
    hist = torch.randint(0, 50, (3, 2), generator=gen)
    spec = ple_ngram_ids(ids, hist)
    mine = second_ngram_ids(ids.tolist(), hist.tolist())
    assert spec.tolist() == mine
    assert spec.tolist() != second_ngram_ids(ids.tolist(), [h[::-1] for h in hist.tolist()])


@pytest.mark.second_formulation("spec.ops.ple:ple_ngram_hash")
def test_ple_ngram_rows_equal_python_integer_hash():
    # Large ids (up to 2^62) make every product wrap modulo 2^64.
    cfg = _ple_cfg(402)
    gen = _gen(402)
    ids = torch.randint(0, 2 ** 62, (6,), generator=gen)
    hist = torch.randint(0, 2 ** 62, (2,), generator=gen)
    spec = ple_ngram_hash(ids, hist, cfg)
    window = second_ngram_ids(ids.tolist(), hist.tolist())
    assert spec.tolist() == second_ngram_rows(window, cfg)
    assert spec.tolist() != second_ngram_rows(window, cfg, use_xor=False)


def second_ple_embed(ids, history, x_emb, table, ngram_table, w_ple, norm_w, cfg,
                     ngram_before_scale: bool = False, norm_over_all: bool = False) -> torch.Tensor:
    """Per (token, layer l, element p), flat index f = l P + p: ``(sqrt(P) E[id, f] + G[row_k, f mod w]
    + context[l, p]) / sqrt(2)``, head k = f // w, context = rmsnorm over P of ``(x W_ple)[f] / sqrt(C)``."""
    T, C = x_emb.shape
    P = norm_w.shape[0]
    L = table.shape[1] // P
    width = ngram_table.shape[1]
    rows = second_ngram_rows(second_ngram_ids(ids.tolist(), history.tolist()), cfg)
    nw = norm_w.tolist()
    wcols = w_ple.T.tolist()
    out = []
    for t in range(T):
        tok = int(ids[t])
        x = x_emb[t].tolist()
        ctx_flat = [_dot(x, wcols[f]) / math.sqrt(C) for f in range(L * P)]
        if norm_over_all:
            ctx = _rms_list(ctx_flat, nw * L)
        else:
            ctx = [v for l in range(L) for v in _rms_list(ctx_flat[l * P:(l + 1) * P], nw)]
        per_layer = []
        for l in range(L):
            vals = []
            for p in range(P):
                f = l * P + p
                e_val = float(table[tok, f])
                g_val = float(ngram_table[rows[t][f // width], f % width])
                lookup = (math.sqrt(P) * (e_val + g_val) if ngram_before_scale
                          else math.sqrt(P) * e_val + g_val)
                vals.append((lookup + ctx[f]) / math.sqrt(2.0))
            per_layer.append(vals)
        out.append(per_layer)
    return torch.tensor(out, dtype=F64)


@pytest.mark.second_formulation("spec.ops.ple:ple_embed")
def test_ple_embed_equals_explicit_gather_per_token_and_layer():
    cfg = _ple_cfg(403)
    gen = _gen(403)
    T, C, L, P, V = 4, 6, 2, 4, 20
    ids = torch.randint(0, V, (T,), generator=gen)
    hist = torch.tensor([3, 3])   # a new request: [pad, pad]
    x_emb = torch.randn(T, C, generator=gen, dtype=F64)
    table = torch.randn(V, L * P, generator=gen, dtype=F64)
    G = torch.randn(cfg.table_rows, L * P // cfg.num_heads, generator=gen, dtype=F64)
    w_ple = torch.randn(C, L * P, generator=gen, dtype=F64)
    norm_w = 0.2 * torch.randn(P, generator=gen, dtype=F64)
    args = (ids, hist, x_emb, table, G, w_ple, norm_w, cfg)
    spec = ple_embed(*args)
    assert spec.dtype == F64 and spec.shape == (T, L, P)
    assert _close(second_ple_embed(*args), spec)
    assert not _close(second_ple_embed(*args, ngram_before_scale=True), spec)
    assert not _close(second_ple_embed(*args, norm_over_all=True), spec)


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_erf(x: float) -> float:
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def second_ple_apply(x, e_l, w_gate, w_out, norm_w, gelu=_gelu_tanh) -> torch.Tensor:
    """Per token: ``g_p = gelu(sum_c Wg[p, c] x_c)``, ``z_c = sum_p Wo[c, p] g_p e_p``,
    ``x + rmsnorm(z)`` (zero-centred weight)."""
    wg, wo, nw = w_gate.tolist(), w_out.tolist(), norm_w.tolist()
    out = []
    for t in range(x.shape[0]):
        xs, es = x[t].tolist(), e_l[t].tolist()
        u = [gelu(_dot(row, xs)) * ep for row, ep in zip(wg, es)]
        z = [_dot(row, u) for row in wo]
        out.append([a + b for a, b in zip(xs, _rms_list(z, nw))])
    return torch.tensor(out, dtype=F64)


@pytest.mark.second_formulation("spec.ops.ple:ple_apply")
def test_ple_apply_equals_per_token_gated_update():
    gen = _gen(404)
    T, C, P = 3, 8, 4
    x = torch.randn(T, C, generator=gen, dtype=F64)
    e_l = torch.randn(T, P, generator=gen, dtype=F64)
    w_gate = torch.randn(P, C, generator=gen, dtype=F64) / math.sqrt(C)
    w_out = torch.randn(C, P, generator=gen, dtype=F64)
    norm_w = 0.2 * torch.randn(C, generator=gen, dtype=F64)
    spec = ple_apply(x, e_l, w_gate, w_out, norm_w)
    assert spec.dtype == F64
    assert _close(second_ple_apply(x, e_l, w_gate, w_out, norm_w), spec)
    assert not _close(second_ple_apply(x, e_l, w_gate, w_out, norm_w, gelu=_gelu_erf), spec)


# ---------------------------------------------------------------- QSA


def _attend_one(q: list[float], keys: list[list[float]], values: list[list[float]],
                scale: float) -> list[float]:
    """Softmax attention of one query head over the listed keys: max-shifted exp, fsum sums."""
    if not keys:
        return [0.0] * len(q)
    s = [_dot(q, k) * scale for k in keys]
    mx = max(s)
    e = [math.exp(x - mx) for x in s]
    z = math.fsum(e)
    return [math.fsum(e[j] * values[j][d] for j in range(len(keys))) / z for d in range(len(q))]


def _gated_heads(q_row, gate_row, k, v, positions, group: int, interleaved_heads: bool) -> list:
    """One query row's heads: each attends to K and V [T, n_kv, D] at ``positions`` through its KV
    head (h // group, or h % n_kv for the wrong, interleaved mapping), then the sigmoid gate."""
    n_q, D = q_row.shape
    n_kv = k.shape[1]
    scale = 1.0 / math.sqrt(D)
    heads = []
    for h in range(n_q):
        kvh = h % n_kv if interleaved_heads else h // group
        keys = [k[j, kvh].tolist() for j in positions]
        vals = [v[j, kvh].tolist() for j in positions]
        o = _attend_one(q_row[h].tolist(), keys, vals, scale)
        heads.append([od * _sigmoid(g) for od, g in zip(o, gate_row[h].tolist())])
    return heads


def second_dense_gqa(q, k, v, gate, interleaved_heads: bool = False,
                     causal: bool = True) -> torch.Tensor:
    """Per (query i, head h): attend to tokens 0..i of KV head h // group, then ``o * sigmoid(gate)``."""
    T, n_q, D = q.shape
    n_kv = k.shape[1]
    group = n_q // n_kv
    out = []
    for i in range(T):
        out.append(_gated_heads(q[i], gate[i], k, v, range(i + 1 if causal else T),
                                group, interleaved_heads))
    return torch.tensor(out, dtype=F64)


@pytest.mark.second_formulation("spec.ops.qsa:dense_causal_gqa")
def test_dense_causal_gqa_equals_per_query_head_loop():
    gen = _gen(501)
    T, n_q, n_kv, D = 5, 4, 2, 8
    q = 2.0 * torch.randn(T, n_q, D, generator=gen, dtype=F64)
    k = torch.randn(T, n_kv, D, generator=gen, dtype=F64)
    v = torch.randn(T, n_kv, D, generator=gen, dtype=F64)
    gate = 2.0 * torch.randn(T, n_q, D, generator=gen, dtype=F64)
    spec = dense_causal_gqa(q, k, v, gate)
    assert spec.dtype == F64
    assert _close(second_dense_gqa(q, k, v, gate), spec)
    assert not _close(second_dense_gqa(q, k, v, gate, interleaved_heads=True), spec)
    assert not _close(second_dense_gqa(q, k, v, gate, causal=False), spec)


def second_sparse_gqa(q, gate, tokens, seq_ids, k_seq, v_seq, interleaved_heads: bool = False,
                      dense_upto: torch.Tensor | None = None) -> torch.Tensor:
    """Per query row and head: attend to the listed positions of the row's sequence, reading K and V
    from the per-sequence arrays by position (``dense_upto``: every position 0..t, the wrong variant)."""
    N, n_q, D = q.shape
    n_kv = k_seq[0].shape[1]
    group = n_q // n_kv
    out = []
    for r in range(N):
        s = int(seq_ids[r])
        if dense_upto is not None:
            toks = list(range(int(dense_upto[r]) + 1))
        else:
            toks = [int(j) for j in tokens[r].tolist() if j >= 0]
        out.append(_gated_heads(q[r], gate[r], k_seq[s], v_seq[s], toks, group,
                                interleaved_heads))
    return torch.tensor(out, dtype=F64)


@pytest.mark.second_formulation("spec.ops.qsa:qsa_sparse_gqa")
def test_qsa_sparse_gqa_equals_per_query_loop_over_selected_tokens():
    gen = _gen(502)
    n_q, n_kv, D, idx_dim = 4, 2, 8, 4
    lens = [80, 40]                                    # sequence 0: 3 blocks, sequence 1: 2
    block_table = torch.tensor([[4, 1, 2], [0, 5, -1]], dtype=torch.int32)
    planes = empty_planes(6, n_kv, D, idx_dim, dtype=F64)
    k_seq = [torch.randn(L, n_kv, D, generator=gen, dtype=F64) for L in lens]
    v_seq = [torch.randn(L, n_kv, D, generator=gen, dtype=F64) for L in lens]
    seq_all = torch.cat([torch.full((L,), s, dtype=torch.int64) for s, L in enumerate(lens)])
    pos_all = torch.cat([torch.arange(L) for L in lens])
    k_cache, v_cache, _ = qsa_kv_append(planes.k_cache, planes.v_cache, planes.pos_plane,
                                        block_table, seq_all, pos_all,
                                        torch.cat(k_seq), torch.cat(v_seq))
    # Rows: (sequence, position t, selected blocks); tokens of block b that are <= t, ascending.
    rows = [(0, 79, [0, 2]), (0, 50, [1]), (1, 39, [0, 1]), (1, 10, [0]), (0, 70, [])]
    tokens = torch.full((len(rows), 96), -1, dtype=torch.int64)
    for r, (_, t, blocks) in enumerate(rows):
        toks = [j for b in blocks for j in range(32 * b, 32 * b + 32) if j <= t]
        tokens[r, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
    seq_ids = torch.tensor([s for s, _, _ in rows])
    positions = torch.tensor([t for _, t, _ in rows])
    q = 2.0 * torch.randn(len(rows), n_q, D, generator=gen, dtype=F64)
    gate = 2.0 * torch.randn(len(rows), n_q, D, generator=gen, dtype=F64)
    spec = qsa_sparse_gqa(q, gate, tokens, seq_ids, block_table, k_cache, v_cache)
    assert spec.dtype == F64
    mine = second_sparse_gqa(q, gate, tokens, seq_ids, k_seq, v_seq)
    assert _close(mine, spec)
    assert torch.equal(spec[4], torch.zeros(n_q, D, dtype=F64))   # no selected token: zeros
    assert not _close(second_sparse_gqa(q, gate, tokens, seq_ids, k_seq, v_seq,
                                        interleaved_heads=True), spec)
    assert not _close(second_sparse_gqa(q, gate, tokens, seq_ids, k_seq, v_seq,
                                        dense_upto=positions), spec)


def second_index_scores(q_index, w_index, seq_ids, positions, block_table, block_keys,
                        relu_after_sum: bool = False) -> torch.Tensor:
    """Per (row, block b): ``-inf`` unless ``32(b+1) - 1 <= t``, else
    ``sum_h w[h] relu(q[h] . kbar_b)`` with kbar_b the key of the page holding block b."""
    out = []
    for r in range(q_index.shape[0]):
        t, s = int(positions[r]), int(seq_ids[r])
        row = []
        for b in range(block_table.shape[1]):
            if 32 * (b + 1) - 1 > t:
                row.append(float("-inf"))
                continue
            kbar = block_keys[int(block_table[s, b])].tolist()
            terms = [float(w_index[r, h]) * _dot(q_index[r, h].tolist(), kbar)
                     for h in range(q_index.shape[1])]
            if relu_after_sum:
                row.append(max(0.0, math.fsum(terms)))
            else:
                row.append(math.fsum(float(w_index[r, h]) * max(0.0, _dot(q_index[r, h].tolist(), kbar))
                                     for h in range(q_index.shape[1])))
        out.append(row)
    return torch.tensor(out, dtype=F64)


@pytest.mark.second_formulation("spec.ops.qsa:qsa_index_scores")
def test_qsa_index_scores_equal_per_block_head_loop():
    gen = _gen(503)
    block_table = torch.tensor([[3, 0, 2, 5], [1, 4, -1, -1]], dtype=torch.int32)
    block_keys = torch.randn(6, 8, generator=gen, dtype=F64)
    valid = torch.ones(6, dtype=torch.bool)
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 0])
    positions = torch.tensor([127, 63, 64, 62, 5, 31])
    q_index = torch.randn(6, 3, 8, generator=gen, dtype=F64)
    w_index = torch.randn(6, 3, generator=gen, dtype=F64)
    args = (q_index, w_index, seq_ids, positions, block_table, block_keys)
    spec = qsa_index_scores(*args, valid)
    assert spec.dtype == F64
    assert _close(second_index_scores(*args), spec)
    assert not _close(second_index_scores(*args, relu_after_sum=True), spec)


# ---------------------------------------------------------------- MTP


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def second_logits_cast(x: torch.Tensor, truncate: bool = False) -> torch.Tensor:
    """Per element, on the fp32 bit pattern: round to the top 16 bits (nearest even: add
    ``0x7FFF + lsb`` then clear the low half; ``truncate``: just clear it), read back as fp32."""
    out = []
    for val in x.float().flatten().tolist():
        b = _f32_bits(val)
        if not truncate:
            b += 0x7FFF + ((b >> 16) & 1)
        out.append(_bits_f32(b & 0xFFFF0000))
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


@pytest.mark.second_formulation("spec.ops.mtp:logits_cast")
def test_logits_cast_equals_bitwise_round_to_bf16():
    gen = _gen(601)
    x32 = 8.0 * torch.randn(6, 33, generator=gen)
    x32[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3.0e38])   # zeros, a subnormal, a large value
    x16 = x32.to(torch.bfloat16)
    for x in (x16, x32):
        spec = logits_cast(x)
        assert spec.dtype == torch.float32
        mine = second_logits_cast(x)
        assert torch.equal(spec.view(torch.int32), mine.view(torch.int32))
    assert not torch.equal(logits_cast(x32), second_logits_cast(x32, truncate=True))
    x64 = x32.double()
    assert torch.equal(logits_cast(x64), x64)


def second_argmax_row(row: list[float], highest: bool = False) -> int:
    """A linear scan: NaN is -inf; a later element wins only when strictly greater."""
    best, best_val = 0, None
    for i, v in enumerate(row):
        v = float("-inf") if math.isnan(v) else v
        if best_val is None or v > best_val or (highest and v == best_val):
            best, best_val = i, v
    return best


def second_argmax(x: torch.Tensor, highest: bool = False) -> torch.Tensor:
    rows = x.double().reshape(-1, x.shape[-1]).tolist()
    return torch.tensor([second_argmax_row(r, highest) for r in rows],
                        dtype=torch.int64).reshape(x.shape[:-1])


@pytest.mark.second_formulation("spec.ops.mtp:greedy_argmax")
def test_greedy_argmax_equals_linear_scan_with_lowest_index_ties():
    gen = _gen(602)
    x = torch.randint(-3, 3, (12, 7), generator=gen).double()   # small integers: many ties
    x[0] = float("nan")
    x[1] = float("-inf")
    x[2] = torch.tensor([-0.0, 0.0, -1.0, 0.0, -0.0, -5.0, -2.0])
    x[3, 2], x[3, 5] = float("nan"), float("inf")
    x[4, :] = torch.tensor([float("nan"), -1.0, 2.0, float("nan"), 2.0, 2.0, -3.0])
    for xx in (x, x.float(), x.to(torch.bfloat16)):
        spec = greedy_argmax(xx)
        assert spec.dtype == torch.int64
        assert torch.equal(spec, second_argmax(xx))
        assert not torch.equal(spec, second_argmax(xx, highest=True))


def second_verify(logits, drafts, draft_lens, off_by_one: bool = False):
    """Per request: p_i = argmax of row i; accept d_{a+1} while it equals p_a; emit d_1..d_a, p_a."""
    R, rows, _ = logits.shape
    preds, n_acc, emitted = [], [], []
    for r in range(R):
        k = int(draft_lens[r])
        p = [second_argmax_row(logits[r, i].tolist()) for i in range(k + 1)]
        d = drafts[r].tolist()
        a = 0
        while a < k and d[a] == (p[a + 1] if off_by_one and a + 1 <= k else p[a]):
            a += 1
        preds.append(p + [-1] * (rows - k - 1))
        em = d[:a] + [p[a]]
        emitted.append(em + [-1] * (rows - len(em)))
        n_acc.append(a + 1)
    return preds, n_acc, emitted


@pytest.mark.second_formulation("spec.ops.mtp:greedy_verify")
def test_greedy_verify_equals_per_request_accept_loop():
    gen = _gen(603)
    R, K, V = 6, 4, 5
    logits = torch.randint(-2, 3, (R, K + 1, V), generator=gen).double()   # ties too
    lens = torch.tensor([4, 4, 2, 0, 3, 4])
    # Drafts agreeing with the argmax for the first `agree[r]` tokens, then a different token.
    agree = [4, 1, 2, 0, 0, 2]
    drafts = torch.zeros(R, K, dtype=torch.int64)
    for r in range(R):
        p = [second_argmax_row(logits[r, i].tolist()) for i in range(K + 1)]
        for i in range(K):
            drafts[r, i] = p[i] if i < agree[r] else (p[i] + 1) % V
    spec = greedy_verify(logits, drafts, lens)
    preds, n_acc, emitted = second_verify(logits, drafts, lens)
    assert spec.predictions.tolist() == preds
    assert spec.num_accepted.tolist() == n_acc
    assert spec.emitted.tolist() == emitted
    assert n_acc == [min(a, int(k)) + 1 for a, k in zip(agree, lens)]
    assert spec.num_accepted.tolist() != second_verify(logits, drafts, lens, off_by_one=True)[1]


@pytest.mark.second_formulation("spec.ops.mtp:acceptance_length")
def test_acceptance_length_is_the_fsum_mean():
    values = [1, 3, 2, 5, 1, 1, 4]
    al = acceptance_length(torch.tensor(values))
    assert al == math.fsum(values) / len(values)
    assert acceptance_length(values) == al
    assert al != math.fsum(v - 1 for v in values) / len(values)   # mean of a: wrong


def second_draft_input(next_token, h_prev, embed, norm_emb_w, norm_h_w, fc_w,
                       hidden_first: bool = False) -> torch.Tensor:
    """Per token: ``u = rmsnorm(embed[tok]) ++ rmsnorm(h_prev)``, ``h'_c = sum_k fc[c, k] u_k``."""
    fc = fc_w.tolist()
    out = []
    for t in range(h_prev.shape[0]):
        e = _rms_list(embed[int(next_token[t])].tolist(), norm_emb_w.tolist())
        h = _rms_list(h_prev[t].tolist(), norm_h_w.tolist())
        u = h + e if hidden_first else e + h
        out.append([_dot(row, u) for row in fc])
    return torch.tensor(out, dtype=F64)


@pytest.mark.second_formulation("spec.ops.mtp:mtp_draft_input")
def test_mtp_draft_input_equals_per_token_concat_projection():
    gen = _gen(604)
    T, C, V = 3, 6, 11
    tok = torch.randint(0, V, (T,), generator=gen)
    h_prev = torch.randn(T, C, generator=gen, dtype=F64)
    embed = torch.randn(V, C, generator=gen, dtype=F64)
    wn_e = 0.2 * torch.randn(C, generator=gen, dtype=F64)
    wn_h = 0.2 * torch.randn(C, generator=gen, dtype=F64)
    fc_w = torch.randn(C, 2 * C, generator=gen, dtype=F64) / math.sqrt(2 * C)
    args = (tok, h_prev, embed, wn_e, wn_h, fc_w)
    spec = mtp_draft_input(*args)
    assert spec.dtype == F64
    assert _close(second_draft_input(*args), spec)
    assert not _close(second_draft_input(*args, hidden_first=True), spec)


# ---------------------------------------------------------------- linear, nvfp4_linear


def second_linear(x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """``y[t, o] = sum_i x[t, i] w[o, i]`` per output (``transposed``: w[i, o], the wrong layout)."""
    xs, ws = x.double().tolist(), w.double().tolist()
    n_out = w.shape[1] if transposed else w.shape[0]
    cols = [[ws[i][o] for i in range(len(ws))] for o in range(n_out)] if transposed else ws
    return torch.tensor([[_dot(row, col) for col in cols] for row in xs], dtype=F64)


@pytest.mark.second_formulation("spec.ops.linear:linear")
def test_linear_equals_per_output_fsum_dot():
    gen = _gen(701)
    x = torch.randn(4, 6, generator=gen, dtype=F64)
    w = torch.randn(6, 6, generator=gen, dtype=F64)
    spec = linear(x, w)
    assert spec.dtype == F64
    assert _close(second_linear(x, w), spec)
    assert not _close(second_linear(x, w, transposed=True), spec)
    w2 = torch.randn(3, 6, generator=gen, dtype=F64)
    assert _close(second_linear(x, w2), linear(x, w2))
    # bf16: fp32 accumulation, one cast; equal to the float64 dot rounded once but for a rare ulp.
    xb = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    wb = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    specb = linear(xb, wb)
    assert specb.dtype == torch.bfloat16
    mineb = second_linear(xb, wb).to(torch.bfloat16)
    assert (specb != mineb).double().mean().item() <= 0.02
    assert ((specb.float() - mineb.float()).abs() <= mineb.float().abs() * 2 ** -7 + 1e-6).all()


def _nvfp4_element(packed: torch.Tensor, sf: torch.Tensor, gs: float, row: int, i: int,
                   high_first: bool = False) -> float:
    """Element i of a row: its nibble (element 2j low, 2j+1 high), e2m1 value, times scale times gs."""
    byte = int(packed[row, i // 2])
    low_half = (i % 2 == 0) != high_first
    code = byte & 0xF if low_half else byte >> 4
    mag = E2M1_GRID[code & 0x7]
    val = -mag if code & 0x8 else mag
    return val * float(sf[row, i // 16].to(F64)) * gs


def second_nvfp4_linear(x, w_packed, w_sf, w_gs, x_gs, high_first: bool = False) -> torch.Tensor:
    """x quantised with the spec's quantiser, both operands decoded per element, fsum dot per output
    (``high_first``: the weight's nibbles read high first, the wrong variant; swapping both operands
    alike would only permute the sum)."""
    x_packed, x_sf = nvfp4_quantize(x, x_gs)
    n_in = x.shape[1]
    xd = [[_nvfp4_element(x_packed, x_sf, float(x_gs), t, i) for i in range(n_in)]
          for t in range(x.shape[0])]
    wd = [[_nvfp4_element(w_packed, w_sf, float(w_gs), o, i, high_first) for i in range(n_in)]
          for o in range(w_packed.shape[0])]
    return torch.tensor([[_dot(xr, wr) for wr in wd] for xr in xd], dtype=F64)


@pytest.mark.second_formulation("spec.ops.moe:nvfp4_linear")
def test_nvfp4_linear_equals_per_element_decode_and_fsum_dot():
    gen = _gen(702)
    x = torch.randn(3, 32, generator=gen, dtype=F64)
    w = torch.randn(5, 32, generator=gen, dtype=F64)
    w_gs = nvfp4_global_scale(w.abs().max())
    x_gs = nvfp4_global_scale(x.abs().max())
    w_packed, w_sf = nvfp4_quantize(w.float(), w_gs)
    spec = nvfp4_linear(x, w_packed, w_sf, w_gs, x_gs)
    assert spec.dtype == F64
    assert _close(second_nvfp4_linear(x, w_packed, w_sf, w_gs, x_gs), spec)
    assert not _close(second_nvfp4_linear(x, w_packed, w_sf, w_gs, x_gs, high_first=True), spec)
