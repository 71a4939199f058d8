"""Triton kernels of the chunked (chunk 64, WY form) GDN prefill: gates + l2norm + the gated delta rule
+ the gated RMSNorm, certified against ``spec.ops.gdn.gdn_prefill`` (certify/cells/gdn_prefill.yaml).

The chunked form (``spec.ops.gdn.gdn_chunked``): inside a chunk with start state S and cumulative log
decay G_t = sum_{i<=t} g_i, the deltas solve ``(I + A) U = diag(beta) (V - e^G (K^ S))`` with
``A[t, i] = beta_t e^{G_t - G_i} (k^_t . k^_i)`` (i < t); then ``o_t = e^{G_t} q^_t S + sum_{i<=t}
e^{G_t - G_i} (q^_t . k^_i) u_i`` and ``S' = e^{G_C} S + sum_i e^{G_C - G_i} k^_i u_i^T``.

Three launches:
1. ``_prep_kernel``, one program per (chunk, value head), all chunks in parallel: the gates, the
   l2norm factors, ``Aib = (I + A)^{-1} diag(beta)`` (the four 16 x 16 diagonal blocks D by forward
   substitution in fp32, then ``(I + A)^{-1} = (I - N + N^2 - N^3) D`` with N = D A_offdiag strictly
   block-lower, tf32x3 dots) and the decayed causal score matrix ``QKD[t, i] = e^{G_t - G_i}
   (q^_t . k^_i)`` (i <= t), which only the output reads.
2. ``_state_pass_kernel``, one program per (sequence, value head, tile of BV = 16 state columns), sequential
   over the chunks: ``U = Aib (V - e^G (K^ S))``, the output, and the state carry. The state's columns
   are independent (only the gated norm couples them), so V splits into tiles for parallelism.
3. ``_gated_norm_kernel``: the gated RMSNorm over whole rows of o (fused into 2. when BV == V).

Numerics (the cell bands are fp32-tight on the state, 64 eps RMS, and 2 bf16 ulp on out; see
gdn_prefill.yaml): every product is fp32-accurate. The tensor-core dots use tf32 only on operands that
are exact in tf32 or split into two tf32 halves: q and k enter as their bf16 values (exact in tf32) and
the l2norm factors are applied to the dot's result; the fp32 operand x of such a dot is split as
``x = hi + lo`` with hi = x rounded to tf32 (relative error of the pair about 2^-22); dots of two fp32
operands (Aib times the right-hand side, QKD times U, the block products of the inverse) are
``tf32x3``. The output's dots were first one-tf32-operand (2^-11 relative on o): on the H200 that
flipped enough first roundings of the gated norm for one element of long_t8192 to land 2.01 ulp off
(band 2), so o is fp32-accurate too. QKD stays fp32 in memory: an fp16 copy lost rows whose o is tiny
(strong decay, the norm's eps regime), 3 ulp measured. Under the interpreter every dot is an fp32
numpy matmul.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.triton_support import round_to_bf16, softplus

CHUNK = 64
L2_EPS = 1e-6
NORM_EPS = 1e-6


@triton.jit
def _round_tf32(x):
    """fp32 -> nearest tf32 value (10 mantissa bits, ties to even), as fp32; x - result is exact."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def _prep_kernel(q, k, a, b, A_log, dt_bias, gbuf, rbuf, ai_buf, qkd_buf, T, NT, scale, l2_eps,
                 HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    i_b = bh // HV
    i_h = bh % HV
    i_hk = i_h // (HV // HK)
    rc = tl.arange(0, 64)
    offs_k = tl.arange(0, K)
    t = c * 64 + rc
    m = t < T
    row_qk = (i_b * T + t).to(tl.int64) * HK + i_hk
    # keys and queries as their bf16 values (exact in tf32); the l2norm factors scale the dots.
    kf = tl.load(k + row_qk[:, None] * K + offs_k[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    qf = tl.load(q + row_qk[:, None] * K + offs_k[None, :], mask=m[:, None], other=0.0).to(tl.float32)
    rk = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) + l2_eps)
    rq = scale / tl.sqrt(tl.sum(qf * qf, axis=1) + l2_eps)
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
    causal = rc[:, None] >= rc[None, :]
    decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    KK = tl.dot(kf, tl.trans(kf), input_precision="tf32")
    QK = tl.dot(qf, tl.trans(kf), input_precision="tf32")
    sq = (bh * NT + c).to(tl.int64) * 4096 + rc[:, None] * 64 + rc[None, :]
    # QKD[t, i] = e^{G_t - G_i} q^_t . k^_i for i <= t (read by the output only)
    tl.store(qkd_buf + sq, rq[:, None] * rk[None, :] * decay * QK)
    # A[t, i] = beta_t e^{G_t - G_i} k^_t . k^_i for i < t
    A = tl.where(rc[:, None] > rc[None, :], (beta * rk)[:, None] * rk[None, :] * decay * KK, 0.0)
    tl.store(ai_buf + sq, A)
    tl.debug_barrier()
    # the four 16 x 16 diagonal blocks of (I + A)^{-1} at once, by forward substitution in fp32:
    # row i of block X_b is e_i - sum_{j<i} A_b[i, j] X_b[j]
    i4 = tl.arange(0, 4)
    r16 = tl.arange(0, 16)
    off3 = (bh * NT + c).to(tl.int64) * 4096 + (i4[:, None, None] * 16 + r16[None, :, None]) * 64 \
        + i4[:, None, None] * 16 + r16[None, None, :]
    Ad = tl.load(ai_buf + off3)
    sel = r16[None, :, None]
    X = tl.where(sel == r16[None, None, :], 1.0, 0.0) + tl.zeros([4, 16, 16], tl.float32)
    for i in tl.static_range(1, 16):
        a_i = tl.sum(tl.where(sel == i, Ad, 0.0), axis=1)                 # [4, 16]: A_b[i, :]
        row = tl.sum(a_i[:, :, None] * X, axis=1)                         # sum_j A_b[i, j] X_b[j, :]
        X = tl.where(sel == i, tl.where(r16 == i, 1.0, 0.0)[None, None, :] - row[:, None, :], X)
    tl.debug_barrier()
    tl.store(ai_buf + off3, X)
    tl.debug_barrier()
    # (I + A) = (I + A_d)(I + N) with D = (I + A_d)^{-1} and N = D A_o strictly block-lower (N^4 = 0):
    # (I + A)^{-1} = (I - N + N^2 - N^3) D
    diag = (rc[:, None] // 16) == (rc[None, :] // 16)
    D = tl.load(ai_buf + sq, mask=diag, other=0.0)
    N = tl.dot(D, tl.where(diag, 0.0, A), input_precision="tf32x3")
    N2 = tl.dot(N, N, input_precision="tf32x3")
    M = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0) - N + N2 - tl.dot(N, N2, input_precision="tf32x3")
    Aib = tl.dot(M, D, input_precision="tf32x3") * beta[None, :]
    tl.debug_barrier()
    tl.store(ai_buf + sq, Aib)


@triton.jit
def _gated_norm_rows(o, w, zz, norm_eps, V: tl.constexpr):
    """The gated RMSNorm of [R, V] rows of o: two bf16 rounding points (spec.ops.norms), as fp32."""
    r = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / V + norm_eps)
    normed = round_to_bf16(w[None, :] * (o * r[:, None]))
    return round_to_bf16(normed * (zz / (1.0 + tl.exp(-zz))))


@triton.jit
def _state_pass_kernel(q, k, v, z, norm_w, state, final_state, gbuf, rbuf, ai_buf, qkd_buf, o_buf, out,
                       T, NT, scale, l2_eps, norm_eps,
                       HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BV: tl.constexpr, FUSE_NORM: tl.constexpr, P_SPLIT: tl.constexpr,
                       P_FULL: tl.constexpr):
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
    tile = offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(state + bh.to(tl.int64) * (K * V) + tile).to(tl.float32)
    sq = 64 * 64
    for c in range(NT):
        t = c * 64 + rc
        m = t < T
        row_qk = (i_b * T + t).to(tl.int64) * HK + i_hk
        row_v = (i_b * T + t).to(tl.int64) * HV + i_h
        kf = tl.load(k + row_qk[:, None] * K + offs_k[None, :], mask=m[:, None],
                     other=0.0).to(tl.float32)
        qf = tl.load(q + row_qk[:, None] * K + offs_k[None, :], mask=m[:, None],
                     other=0.0).to(tl.float32)
        vv = tl.load(v + row_v[:, None] * V + offs_v[None, :], mask=m[:, None],
                     other=0.0).to(tl.float32)
        gp = gbuf + (bh * NT + c).to(tl.int64) * 64
        G = tl.load(gp + rc)
        G_C = tl.load(gp + 63)
        blk = (bh * NT + c).to(tl.int64) * sq + rc[:, None] * 64 + rc[None, :]
        Aib = tl.load(ai_buf + blk)
        QKD = tl.load(qkd_buf + blk)
        rk = tl.load(rbuf + 2 * (bh * NT + c).to(tl.int64) * 64 + rc)
        rq = tl.load(rbuf + 2 * (bh * NT + c).to(tl.int64) * 64 + 64 + rc)
        eG = tl.exp(G)
        S_hi = _round_tf32(S)
        S_lo = S - S_hi
        KS = tl.dot(kf, S_hi, input_precision=P_SPLIT)
        KS = tl.dot(kf, S_lo, KS, input_precision=P_SPLIT)
        rhs = vv - (eG * rk)[:, None] * KS
        U = tl.dot(Aib, rhs, input_precision=P_FULL)
        qS = tl.dot(qf, S_hi, input_precision=P_SPLIT)
        qS = tl.dot(qf, S_lo, qS, input_precision=P_SPLIT)
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
        U_hi = _round_tf32(Ud)
        U_lo = Ud - U_hi
        kT = tl.trans(kf)
        upd = tl.dot(kT, U_hi, input_precision=P_SPLIT)
        upd = tl.dot(kT, U_lo, upd, input_precision=P_SPLIT)
        S = tl.exp(G_C) * S + upd
    tl.store(final_state + bh.to(tl.int64) * (K * V) + tile, S)


@triton.jit
def _gated_norm_kernel(o_buf, z, norm_w, out, n_rows, norm_eps, V: tl.constexpr, R: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    m = rows < n_rows
    offs = tl.arange(0, V)
    ptr = rows[:, None].to(tl.int64) * V + offs[None, :]
    o = tl.load(o_buf + ptr, mask=m[:, None], other=0.0)
    zz = tl.load(z + ptr, mask=m[:, None], other=0.0).to(tl.float32)
    w = tl.load(norm_w + offs).to(tl.float32)
    tl.store(out + ptr, _gated_norm_rows(o, w, zz, norm_eps, V).to(out.dtype.element_ty),
             mask=m[:, None])


def default_config(V: int) -> dict:
    """Tile of state columns a program and launch shape of the state pass (tuned on the H200,
    reports/bench/gdn_prefill.md)."""
    return {"bv": min(V, 16), "num_warps": 4, "num_stages": 2, "prep_warps": 4, "exact": False}


def launch_plan(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, out, final_state,
                config: dict | None = None) -> list:
    """The launches of one prefill as [(name, callable)], in order (the benchmark times each)."""
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    for x in (q, k, v, a, b, z, state, out, final_state):
        assert x.is_contiguous(), "the chunked GDN kernels read and write contiguous tensors"
    if z.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError("the gated norm rounds to bf16: z and out must be bf16")
    if state.dtype != torch.float32 or final_state.dtype != torch.float32:
        raise ValueError("the chunked prefill keeps an fp32 state")
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
    qkd_buf = torch.empty(B * HV * NT * CHUNK * CHUNK, dtype=torch.float32, device=dev)
    scale = K ** -0.5
    fuse = bv == V
    o_buf = out if fuse else torch.empty(B * T * HV * V, dtype=torch.float32, device=dev)
    exact = cfg["exact"]
    rows = B * T * HV
    R = 16

    def prep():
        return _prep_kernel[(NT, B * HV)](q, k, a, b, A_log, dt_bias, gbuf, rbuf, ai_buf, qkd_buf, T, NT,
                                   scale, L2_EPS, HK=HK, HV=HV, K=K, num_warps=cfg["prep_warps"])

    def state_pass():
        return _state_pass_kernel[(B * HV * (V // bv),)](
            q, k, v, z, norm_w, state, final_state, gbuf, rbuf, ai_buf, qkd_buf, o_buf, out,
            T, NT, scale, L2_EPS, NORM_EPS, HK=HK, HV=HV, K=K, V=V, BV=bv, FUSE_NORM=fuse,
            P_SPLIT="ieee" if exact else "tf32", P_FULL="ieee" if exact else "tf32x3",
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])

    def norm():
        return _gated_norm_kernel[(triton.cdiv(rows, R),)](o_buf, z, norm_w, out, rows, NORM_EPS, V=V, R=R,
                                                    num_warps=4)

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
