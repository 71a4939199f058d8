"""Triton kernels of the chunked (chunk 64, WY form) GDN prefill: gates + l2norm + the gated delta rule
+ the gated RMSNorm, certified against ``spec.ops.gdn.gdn_prefill`` (certify/cells/gdn_prefill.yaml).

The chunked form (``spec.ops.gdn.gdn_chunked``): inside a chunk with start state S and cumulative log
decay G_t = sum_{i<=t} g_i, the deltas solve ``(I + A) U = diag(beta) (V - e^G (K^ S))`` with
``A[t, i] = beta_t e^{G_t - G_i} (k^_t . k^_i)`` (i < t); then ``o_t = e^{G_t} q^_t S + sum_{i<=t}
e^{G_t - G_i} (q^_t . k^_i) u_i`` and ``S' = e^{G_C} S + sum_i e^{G_C - G_i} k^_i u_i^T``.

Three launches:
1. ``_prep_kernel``, one program per (chunk, key head), all chunks in parallel (from chunk C0, so a
   caller can launch it by ranges of chunks): the l2norm factors and the dot k.k (with PIECES also
   q.k) once, shared by the key head's value heads; then per value head (``_prep_head``) the gates
   and ``Aib = (I + A)^{-1} diag(beta)`` (the four 16 x 16 diagonal blocks D_i by the product form of
   their Neumann series, the blocks below them by block forward substitution, one sub-diagonal at a
   time; batched 16 x 16 tf32x3 dots throughout). With PIECES (gluon_chunked's launch) it also writes
   the bf16 pieces of Aib (three) and of the decayed q.k scores (two) for its state pass. One program
   a value head, with its own k.k and q.k, is slower (reports/bench/kernel-notes.md, "Prologue").
2. ``_state_pass_kernel``, one program per (sequence, value head, tile of BV = 32 state columns),
   sequential over the chunks: ``U = Aib (V - e^G (K^ S))``, the output (with the decayed causal score
   matrix ``QKD[t, i] = e^{G_t - G_i} (q^_t . k^_i)``, i <= t, recomputed from q and k: one bf16 dot,
   cheaper than a round trip through memory) and the state carry. The state's columns are independent
   (only the gated norm couples them), so V splits into tiles for parallelism.
3. ``_gated_norm_kernel``: the gated RMSNorm over whole rows of o (fused into 2. when BV == V), over
   a range of rows of each sequence.

Numerics (the cell bands are fp32-tight on the state, 64 eps RMS, and 2 bf16 ulp on out; see
gdn_prefill.yaml): every product is fp32-accurate. q and k enter every dot as their bf16 values (the
l2norm factors are applied to the dot's result), so a dot of q or k with a bf16 operand has exact
products and fp32 accumulation. The fp32 operand x of such a dot (the state S, the scaled deltas U) is
split into three bf16 pieces ``x = x1 + x2 + x3`` (each the nearest bf16 of what the previous left,
about 2^-24 relative together) and the dot is three bf16 tensor-core dots: fp32-accurate at half the
tensor-core time and half the operand registers of a tf32 hi/lo split (q and k held as fp32 tiles for
that split spill at the 255-register cap). Dots of two fp32 operands (Aib times the right-hand side,
QKD times U, the block products of the inverse) are ``tf32x3``. The output is fp32-accurate too: a
one-tf32-operand output (2^-11 relative on o) flips enough first roundings of the gated norm on the
H200 for one element of long_t8192 to land 2.01 ulp off (band 2).
Triton's interpreter multiplies bf16 tensors as raw 16-bit integers, so there the bf16 operands go
through fp32 (exact) and every dot is an fp32 numpy matmul.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.layout import require_contiguous
from impl.kernels.triton_support import INTERPRETING, round_to_bf16, softplus

CHUNK = 64
L2_EPS = 1e-6
NORM_EPS = 1e-6
# PIECES: the [64, 64] bf16 planes a (chunk, value head) of the prologue's pieces, [t, i]: Aib's three
# (planes 0-2), then QKD's two (3-4); gluon_chunked's state pass reads them by these offsets
AIB_PLANES = tl.constexpr(3)
QKD_PLANES = tl.constexpr(2)
PIECE_PLANES = tl.constexpr(AIB_PLANES.value + QKD_PLANES.value)


@triton.jit
def _bdot(a, b, acc, DOT: tl.constexpr):
    """acc + a @ b for bf16 a, b with fp32 accumulation (the products are exact). DOT "bf16": a bf16
    tensor-core dot; "tf32": the same exact values as a tf32 dot (twice the tensor-core time);
    "f32": through fp32 in full precision, for Triton's interpreter, which multiplies bf16 tensors as
    their raw 16-bit integers."""
    if DOT == "bf16":
        return tl.dot(a, b, acc)
    elif DOT == "tf32":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _split3_bf16(x):
    """fp32 -> three bf16 tensors whose sum is x to about 2^-24 relative (each piece the nearest bf16
    of what the previous ones left; every subtraction is exact). A bf16 dot of an exact bf16 operand
    with the three pieces, fp32-accumulated, is fp32-accurate."""
    x1 = round_to_bf16(x)
    r = x - x1
    x2 = round_to_bf16(r)
    x3 = round_to_bf16(r - x2)
    return x1.to(tl.bfloat16), x2.to(tl.bfloat16), x3.to(tl.bfloat16)


@triton.jit
def _block_offs(base, bi, bj, r16):
    """Offsets [4, 16, 16] of the 16 x 16 blocks (bi[b], bj[b]) of a 64 x 64 fp32 matrix at base."""
    return base + (bi[:, None, None] * 16 + r16[None, :, None]) * 64 + bj[:, None, None] * 16 \
        + r16[None, None, :]


@triton.jit
def _prep_kernel(q, k, a, b, A_log, dt_bias, gbuf, rbuf, ai_buf, pc_buf, T, NT, C0, scale, l2_eps,
                 HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, DOT: tl.constexpr,
                 TLOAD: tl.constexpr, PIECES: tl.constexpr):
    c = C0 + tl.program_id(0)     # chunks C0 .. C0 + the grid's first axis - 1
    bg = tl.program_id(1)         # (sequence, key head): the key head's value heads in turn
    i_b = bg // HK
    i_hk = bg % HK
    rc = tl.arange(0, 64)
    offs_k = tl.arange(0, K)
    t = c * 64 + rc
    m = t < T
    row_qk = (i_b * T + t).to(tl.int64) * HK + i_hk
    # keys as their bf16 values: the bf16 dot's products are exact and fp32-accumulated; the l2norm
    # factors scale the dot's result. k, q, their norms and the dots k.k, q.k are shared by the key
    # head's value heads (their decays and betas differ)
    kb = tl.load(k + row_qk[:, None] * K + offs_k[None, :], mask=m[:, None], other=0.0)
    kf = kb.to(tl.float32)
    rk = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) + l2_eps)
    qb = tl.load(q + row_qk[:, None] * K + offs_k[None, :], mask=m[:, None], other=0.0)
    qf = qb.to(tl.float32)
    rq = scale / tl.sqrt(tl.sum(qf * qf, axis=1) + l2_eps)
    if TLOAD:   # k^T as its own load (one use per loaded tile)
        kbT = tl.load(k + row_qk[None, :] * K + offs_k[:, None], mask=m[None, :], other=0.0)
    else:
        kbT = tl.trans(kb)
    KK = _bdot(kb, kbT, tl.zeros([64, 64], tl.float32), DOT) * (rk[:, None] * rk[None, :])
    if PIECES:
        QK = _bdot(qb, kbT, tl.zeros([64, 64], tl.float32), DOT) * (rq[:, None] * rk[None, :])
    strict = rc[:, None] > rc[None, :]
    for j in range(HV // HK):
        i_h = i_hk * (HV // HK) + j
        bh = i_b * HV + i_h
        _prep_head(a, b, A_log, dt_bias, gbuf, rbuf, ai_buf, pc_buf, KK, QK if PIECES else KK, rk, rq,
                   m, t, strict, c, bh, i_b, i_h, T, NT, HV, PIECES)


@triton.jit
def _prep_head(a, b, A_log, dt_bias, gbuf, rbuf, ai_buf, pc_buf, KK, QK, rk, rq, m, t, strict, c, bh,
               i_b, i_h, T, NT, HV: tl.constexpr, PIECES: tl.constexpr):
    """One value head of a prologue program: its gates, A and (I + A)^{-1} diag(beta) (and with
    PIECES the bf16 pieces of Aib and QKD). KK = rk rk^T (k.k), QK = rq rk^T (q.k), both [t, i]."""
    rc = tl.arange(0, 64)
    row_ab = (i_b * T + t).to(tl.int64) * HV + i_h
    aa = tl.load(a + row_ab, mask=m, other=0.0).to(tl.float32)
    bb = tl.load(b + row_ab, mask=m, other=0.0).to(tl.float32)
    neg_A = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
    dtb = tl.load(dt_bias + i_h).to(tl.float32)
    g = tl.where(m, neg_A * softplus(aa + dtb), 0.0)
    beta = tl.where(m, 1.0 / (1.0 + tl.exp(-bb)), 0.0)
    # chunk-local cumulative log decay (padded rows have g = 0, so G there stays at the last row's)
    G = tl.cumsum(g, axis=0)
    base = (bh * NT + c).to(tl.int64) * 64
    tl.store(gbuf + base + rc, G)
    tl.store(rbuf + 2 * base + rc, rk)
    tl.store(rbuf + 2 * base + 64 + rc, rq)
    sq = (bh * NT + c).to(tl.int64) * 4096 + rc[:, None] * 64 + rc[None, :]
    # A[t, i] = beta_t e^{G_t - G_i} k^_t . k^_i for i < t
    decay = tl.exp(tl.where(strict, G[:, None] - G[None, :], float("-inf")))
    A = tl.where(strict, beta[:, None] * decay * KK, 0.0)
    tl.store(ai_buf + sq, A)
    pc = (bh * NT + c).to(tl.int64) * (PIECE_PLANES * 4096) + rc[:, None] * 64 + rc[None, :]
    if PIECES:
        # for gluon_chunked's state pass: the bf16 pieces of the decayed scores QKD [t, i] =
        # e^{G_t - G_i} rq_t rk_i q^_t . k^_i (i <= t), planes 3-4 of five [64, 64] a (chunk, value head),
        # formed here (beside A, sharing its decays) rather than once a chunk on the sequential path. Two
        # pieces (at most 2^-17 relative): the state pass's output products read only those (its docstring)
        diag = rc[:, None] == rc[None, :]
        qkd = (decay + tl.where(diag, 1.0, 0.0)) * QK
        p1 = round_to_bf16(qkd)
        tl.store(pc_buf + pc + AIB_PLANES * 4096, p1.to(tl.bfloat16))
        tl.store(pc_buf + pc + (AIB_PLANES + 1) * 4096, round_to_bf16(qkd - p1).to(tl.bfloat16))
    tl.debug_barrier()
    # the four 16 x 16 diagonal blocks of (I + A)^{-1} at once
    i4 = tl.arange(0, 4)
    r16 = tl.arange(0, 16)
    diag_blocks = (bh * NT + c).to(tl.int64) * 4096 + (i4[:, None, None] * 16 + r16[None, :, None]) * 64 \
        + i4[:, None, None] * 16 + r16[None, None, :]
    Ad = tl.load(ai_buf + diag_blocks)
    # A_b is strictly lower (A_b^16 = 0): (I + A_b)^{-1} = (I - A_b)(I + A_b^2)(I + A_b^4)(I + A_b^8),
    # six batched 16 x 16 tf32x3 dots for the four blocks at once (X[b] = D_b below). A row-by-row
    # forward substitution (15 dependent steps of cross-thread reductions and barriers) gives the same
    # errors against float64 and is slower (reports/bench/kernel-notes.md, "Prologue")
    L2 = tl.dot(Ad, Ad, input_precision="tf32x3")
    L4 = tl.dot(L2, L2, input_precision="tf32x3")
    L8 = tl.dot(L4, L4, input_precision="tf32x3")
    X = tl.where(r16[None, :, None] == r16[None, None, :], 1.0, 0.0) - Ad
    X = X + tl.dot(X, L2, input_precision="tf32x3")
    X = X + tl.dot(X, L4, input_precision="tf32x3")
    X = X + tl.dot(X, L8, input_precision="tf32x3")
    # the rest of (I + A)^{-1} = X by block forward substitution over the 4 x 4 blocks of 16:
    # X[i, j] = -D_i sum_{k=j}^{i-1} A[i, k] X[k, j], one sub-diagonal at a time (i - j = 1, 2, 3),
    # each a batch of four 16 x 16 tf32x3 dots over the block rows i (rows i < i - j masked). Blocks
    # pass between steps through this program's part of ai_buf (A's sub-diagonal blocks are read
    # first, since X overwrites them). Dense 64 x 64 products of the nilpotent block form
    # (I - N + N^2 - N^3) D give the same errors against float64 on every cell and cost more time and
    # registers (255 against 154; reports/bench/kernel-notes.md, "Prologue").
    base = (bh * NT + c).to(tl.int64) * 4096
    m1 = (i4 >= 1)[:, None, None]
    m2 = (i4 >= 2)[:, None, None]
    m3 = (i4 >= 3)[:, None, None]
    As1 = tl.load(ai_buf + _block_offs(base, i4, i4 - 1, r16), mask=m1, other=0.0)
    As2 = tl.load(ai_buf + _block_offs(base, i4, i4 - 2, r16), mask=m2, other=0.0)
    As3 = tl.load(ai_buf + _block_offs(base, i4, i4 - 3, r16), mask=m3, other=0.0)
    tl.debug_barrier()
    tl.store(ai_buf + diag_blocks, X)
    tl.debug_barrier()
    D1 = tl.load(ai_buf + _block_offs(base, i4 - 1, i4 - 1, r16), mask=m1, other=0.0)
    X1 = -tl.dot(X, tl.dot(As1, D1, input_precision="tf32x3"), input_precision="tf32x3")
    tl.store(ai_buf + _block_offs(base, i4, i4 - 1, r16), X1, mask=m1)
    tl.debug_barrier()
    D2 = tl.load(ai_buf + _block_offs(base, i4 - 2, i4 - 2, r16), mask=m2, other=0.0)
    X1p = tl.load(ai_buf + _block_offs(base, i4 - 1, i4 - 2, r16), mask=m2, other=0.0)
    T2 = tl.dot(As1, X1p, tl.dot(As2, D2, input_precision="tf32x3"), input_precision="tf32x3")
    X2 = -tl.dot(X, T2, input_precision="tf32x3")
    tl.store(ai_buf + _block_offs(base, i4, i4 - 2, r16), X2, mask=m2)
    tl.debug_barrier()
    D3 = tl.load(ai_buf + _block_offs(base, i4 - 3, i4 - 3, r16), mask=m3, other=0.0)
    X1q = tl.load(ai_buf + _block_offs(base, i4 - 2, i4 - 3, r16), mask=m3, other=0.0)
    X2q = tl.load(ai_buf + _block_offs(base, i4 - 1, i4 - 3, r16), mask=m3, other=0.0)
    T3 = tl.dot(As3, D3, input_precision="tf32x3")
    T3 = tl.dot(As2, X1q, T3, input_precision="tf32x3")
    T3 = tl.dot(As1, X2q, T3, input_precision="tf32x3")
    X3 = -tl.dot(X, T3, input_precision="tf32x3")
    tl.store(ai_buf + _block_offs(base, i4, i4 - 3, r16), X3, mask=m3)
    tl.debug_barrier()
    lower = (rc[:, None] // 16) >= (rc[None, :] // 16)
    Aib = tl.load(ai_buf + sq, mask=lower, other=0.0) * beta[None, :]
    if PIECES:   # planes 0-2: Aib's pieces [t, i]
        a1 = round_to_bf16(Aib)
        r = Aib - a1
        a2 = round_to_bf16(r)
        tl.store(pc_buf + pc, a1.to(tl.bfloat16))
        tl.store(pc_buf + pc + 4096, a2.to(tl.bfloat16))
        tl.store(pc_buf + pc + 2 * 4096, round_to_bf16(r - a2).to(tl.bfloat16))
    else:
        tl.debug_barrier()
        tl.store(ai_buf + sq, Aib)


@triton.jit
def _gated_norm_rows(o, w, zz, norm_eps, V: tl.constexpr):
    """The gated RMSNorm of [R, V] rows of o: two bf16 rounding points (spec.ops.norms), as fp32."""
    r = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / V + norm_eps)
    normed = round_to_bf16(w[None, :] * (o * r[:, None]))
    return round_to_bf16(normed * (zz / (1.0 + tl.exp(-zz))))


@triton.jit
def _state_pass_kernel(q, k, v, z, norm_w, state, final_state, gbuf, rbuf, ai_buf, o_buf, out,
                       T, NT, norm_eps,
                       HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BV: tl.constexpr, FUSE_NORM: tl.constexpr, P_FULL: tl.constexpr,
                       DOT: tl.constexpr, TLOAD: tl.constexpr):
    pid = tl.program_id(0)
    NV: tl.constexpr = V // BV
    i_v = pid % NV
    bh = pid // NV
    i_b = bh // HV
    i_h = bh % HV
    i_hk = i_h // (HV // HK)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    rc = tl.arange(0, 64)
    causal = rc[:, None] >= rc[None, :]
    tile = offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(state + bh.to(tl.int64) * (K * V) + tile).to(tl.float32)
    sq = 64 * 64
    for c in range(NT):
        t = c * 64 + rc
        m = t < T
        row_qk = (i_b * T + t).to(tl.int64) * HK + i_hk
        row_v = (i_b * T + t).to(tl.int64) * HV + i_h
        # q and k stay bf16 (exact): every dot with them is a bf16 dot, fp32-accumulated
        kb = tl.load(k + row_qk[:, None] * K + offs_k[None, :], mask=m[:, None], other=0.0)
        qb = tl.load(q + row_qk[:, None] * K + offs_k[None, :], mask=m[:, None], other=0.0)
        vv = tl.load(v + row_v[:, None] * V + offs_v[None, :], mask=m[:, None],
                     other=0.0).to(tl.float32)
        gp = gbuf + (bh * NT + c).to(tl.int64) * 64
        G = tl.load(gp + rc)
        G_C = tl.load(gp + 63)
        blk = (bh * NT + c).to(tl.int64) * sq + rc[:, None] * 64 + rc[None, :]
        Aib = tl.load(ai_buf + blk)
        rk = tl.load(rbuf + 2 * (bh * NT + c).to(tl.int64) * 64 + rc)
        rq = tl.load(rbuf + 2 * (bh * NT + c).to(tl.int64) * 64 + 64 + rc)
        eG = tl.exp(G)
        s1, s2, s3 = _split3_bf16(S)
        KS = _bdot(kb, s3, tl.zeros([64, BV], tl.float32), DOT)
        KS = _bdot(kb, s2, KS, DOT)
        KS = _bdot(kb, s1, KS, DOT)
        rhs = vv - (eG * rk)[:, None] * KS
        U = tl.dot(Aib, rhs, input_precision=P_FULL)
        qS = _bdot(qb, s3, tl.zeros([64, BV], tl.float32), DOT)
        qS = _bdot(qb, s2, qS, DOT)
        qS = _bdot(qb, s1, qS, DOT)
        # QKD[t, i] = e^{G_t - G_i} q^_t . k^_i for i <= t
        if TLOAD:   # k^T as its own load (one use per loaded tile)
            kT = tl.load(k + row_qk[None, :] * K + offs_k[:, None], mask=m[None, :], other=0.0)
        else:
            kT = tl.trans(kb)
        QK = _bdot(qb, kT, tl.zeros([64, 64], tl.float32), DOT)
        QKD = (rq[:, None] * rk[None, :]) * tl.exp(tl.where(causal, G[:, None] - G[None, :],
                                                            float("-inf"))) * QK
        o = tl.dot(QKD, U, (eG * rq)[:, None] * qS, input_precision=P_FULL)
        if FUSE_NORM:
            zz = tl.load(z + row_v[:, None] * V + offs_v[None, :], mask=m[:, None],
                         other=0.0).to(tl.float32)
            w = tl.load(norm_w + offs_v).to(tl.float32)
            gated = _gated_norm_rows(o, w, zz, norm_eps, V)
            tl.store(out + row_v[:, None] * V + offs_v[None, :], gated.to(out.dtype.element_ty),
                     mask=m[:, None])
        else:
            tl.store(o_buf + row_v[:, None] * V + offs_v[None, :], o, mask=m[:, None])
        Ud = (rk * tl.exp(G_C - G))[:, None] * U
        u1, u2, u3 = _split3_bf16(Ud)
        upd = _bdot(kT, u3, tl.zeros([K, BV], tl.float32), DOT)
        upd = _bdot(kT, u2, upd, DOT)
        upd = _bdot(kT, u1, upd, DOT)
        S = tl.exp(G_C) * S + upd
    tl.store(final_state + bh.to(tl.int64) * (K * V) + tile, S)


@triton.jit
def _gated_norm_kernel(o_buf, z, norm_w, out, n_rows, row0, seq_rows, o_seq_rows, norm_eps,
                       V: tl.constexpr, R: tl.constexpr):
    """Rows row0 .. row0 + n_rows - 1 of each sequence (program_id(1); seq_rows rows apart in z and
    out, o_seq_rows in o_buf, which may pad each sequence)."""
    local = tl.program_id(0) * R + tl.arange(0, R)
    m = local < n_rows
    seq = tl.program_id(1).to(tl.int64)
    rows = seq * seq_rows + row0 + local
    offs = tl.arange(0, V)
    ptr = rows[:, None].to(tl.int64) * V + offs[None, :]
    o_ptr = (seq * o_seq_rows + row0 + local)[:, None].to(tl.int64) * V + offs[None, :]
    o = tl.load(o_buf + o_ptr, mask=m[:, None], other=0.0).to(tl.float32)
    zz = tl.load(z + ptr, mask=m[:, None], other=0.0).to(tl.float32)
    w = tl.load(norm_w + offs).to(tl.float32)
    tl.store(out + ptr, _gated_norm_rows(o, w, zz, norm_eps, V).to(out.dtype.element_ty),
             mask=m[:, None])


@triton.jit
def _l2norm_rows_kernel(x, out, n_rows, eps, D: tl.constexpr, R: tl.constexpr):
    """Rows of x scaled to unit norm, ``x * rsqrt(sum(x^2) + eps)`` in fp32 (spec.ops.gdn.l2norm),
    stored in out (bf16)."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    m = rows < n_rows
    ptr = rows[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :]
    xf = tl.load(x + ptr, mask=m[:, None], other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) + eps)
    # rounded to bf16 to nearest even first: the interpreter's cast alone truncates
    tl.store(out + ptr, round_to_bf16(xf * r[:, None]).to(out.dtype.element_ty), mask=m[:, None])


def l2norm_rows(x: torch.Tensor, *, out: torch.Tensor, eps: float = 1e-6) -> None:
    """``out`` (bf16) = the rows (last dim, a power of two) of contiguous ``x`` l2-normalised, one
    launch."""
    if out.dtype != torch.bfloat16:
        raise ValueError(f"l2norm_rows stores bf16, not {out.dtype}")
    require_contiguous("l2norm_rows", x=x, out=out)
    D = x.shape[-1]
    rows = x.numel() // D
    R = 16
    _l2norm_rows_kernel[(triton.cdiv(rows, R),)](x, out, rows, eps, D=D, R=R, num_warps=4)


def gated_norm(o: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, *, out: torch.Tensor
               ) -> None:
    """The gated RMSNorm of every row of contiguous ``o`` (bf16 or fp32) into ``out`` (bf16), the
    prefill's third launch on its own."""
    require_contiguous("gated_norm", o=o, z=z, norm_w=norm_w, out=out)
    V = o.shape[-1]
    rows = o.numel() // V
    R = 16
    _gated_norm_kernel[(triton.cdiv(rows, R), 1)](o, z, norm_w, out, rows, 0, rows, rows,
                                                  NORM_EPS, V=V, R=R, num_warps=4)


# tuned on the H200 (reports/bench/gdn_prefill.md); one line (the device probe rewrites it)
_DEFAULT_CONFIG = {"bv": 32, "num_warps": 4, "num_stages": 1, "prep_warps": 4, "tload": True, "dot": "bf16", "exact": False}  # noqa: E501


def default_config(V: int) -> dict:
    """Tile of state columns a program and launch shape of the state pass (tuned on the H200,
    reports/bench/gdn_prefill.md)."""
    return {**_DEFAULT_CONFIG, "bv": min(V, _DEFAULT_CONFIG["bv"])}


def check_prefill_args(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state) -> None:
    """What every chunked prefill kernel here (and gluon_chunked) needs of its tensors."""
    require_contiguous("the chunked GDN kernels", q=q, k=k, v=v, a=a, b=b, A_log=A_log,
                       dt_bias=dt_bias, z=z, norm_w=norm_w, state=state, out=out,
                       final_state=final_state)
    if z.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError("the gated norm rounds to bf16: z and out must be bf16")
    if state.dtype != torch.float32 or final_state.dtype != torch.float32:
        raise ValueError("the chunked prefill keeps an fp32 state")


def launch_plan(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state,
                config: dict | None = None) -> list:
    """The launches of one prefill as [(name, callable)], in order (the benchmark times each)."""
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    check_prefill_args(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state)
    if K % 16 or V % 16 or HV % HK:
        raise ValueError(f"unsupported geometry K={K} V={V} HK={HK} HV={HV}")
    cfg = {**default_config(V), **(config or {})}
    bv = cfg["bv"]
    assert V % bv == 0
    if T == 0:
        return [("copy", lambda: final_state.copy_(state))]
    NT = triton.cdiv(T, CHUNK)
    dev = v.device
    gbuf = torch.empty(B * HV * NT * CHUNK, dtype=torch.float32, device=dev)
    rbuf = torch.empty(2 * B * HV * NT * CHUNK, dtype=torch.float32, device=dev)
    ai_buf = torch.empty(B * HV * NT * CHUNK * CHUNK, dtype=torch.float32, device=dev)
    scale = K ** -0.5
    fuse = bv == V
    o_buf = out if fuse else torch.empty(B * T * HV * V, dtype=torch.float32, device=dev)
    exact = cfg["exact"]
    dot = "f32" if INTERPRETING or exact else cfg["dot"]
    rows = B * T * HV
    R = 16

    def prep():
        return _prep_kernel[(NT, B * HK)](q, k, a, b, A_log, dt_bias, gbuf, rbuf, ai_buf, ai_buf, T, NT,
                                   0, scale, L2_EPS, HK=HK, HV=HV, K=K, DOT=dot, TLOAD=cfg["tload"],
                                   PIECES=False, num_warps=cfg["prep_warps"])

    def state_pass():
        return _state_pass_kernel[(B * HV * (V // bv),)](
            q, k, v, z, norm_w, state, final_state, gbuf, rbuf, ai_buf, o_buf, out,
            T, NT, NORM_EPS, HK=HK, HV=HV, K=K, V=V, BV=bv, FUSE_NORM=fuse,
            P_FULL="ieee" if exact else "tf32x3", DOT=dot,
            TLOAD=cfg["tload"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])

    def norm():
        return _gated_norm_kernel[(triton.cdiv(rows, R), 1)](
            o_buf, z, norm_w, out, rows, 0, rows, rows, NORM_EPS, V=V, R=R, num_warps=4)

    plan = [("prep", prep), ("state_pass", state_pass)]
    return plan if fuse else plan + [("norm", norm)]


def gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, *, out, final_state,
                        _config: dict | None = None) -> None:
    """Chunked (chunk 64) GDN prefill of B equal-length sequences from ``state`` (fp32).

    q, k [B, T, HK, K] bf16; v, z [B, T, HV, V] bf16; a, b [B, T, HV]; A_log, dt_bias [HV];
    norm_w [V]; state [B, HV, K, V] fp32. Writes ``out`` [B, T, HV, V] (z's dtype, bf16) and
    ``final_state`` [B, HV, K, V] fp32 (it may be ``state`` itself)."""
    for _, launch in launch_plan(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state,
                                 _config):
        launch()
