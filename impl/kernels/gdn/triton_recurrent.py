"""Triton kernels of the GDN decode and verify steps, two variants (their names in the cell files):

- ``triton_fused`` (``gdn_decode``, ``gdn_verify``): gates + l2norm + recurrence + gated RMSNorm in
  one launch, one program per (request, value head) holding the whole [K, V] state in registers;
- ``triton_split`` (``gdn_decode_split``, ``gdn_verify_split``): the state split into tiles of 32
  value columns, one program each, then the gated norm as a second launch.

- decode (one row a request): reads the pool row at ``slots[b]`` and writes it back in place;
- verify (T rows a request): reads the pool, never writes it, and records the state after every row
  into ``states`` (the cached replay that rollback commits from).
A bf16 pool keeps fp32 math and rounds the state to bf16 after every row, as the spec does.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.triton_support import round_to_bf16, softplus


@triton.jit
def _row_step(S, q_row, k_row, v_row, a_row, b_row, offs_k, offs_v, neg_A, dtb, scale, l2_eps,
              STATE_BF16: tl.constexpr):
    """One row of the gated delta rule on a [K, BV] state tile: gates, l2norm, update, output.

    The pointers address this row's q and k (key head), v (this tile's columns), a and b (value
    head). Returns the new state tile and o = S^T q^ over the tile's columns, both fp32."""
    qv = tl.load(q_row + offs_k).to(tl.float32)
    kv = tl.load(k_row + offs_k).to(tl.float32)
    vv = tl.load(v_row + offs_v).to(tl.float32)
    decay = tl.exp(neg_A * softplus(tl.load(a_row).to(tl.float32) + dtb))
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_row).to(tl.float32)))
    qn = qv / tl.sqrt(tl.sum(qv * qv, axis=0) + l2_eps) * scale
    kn = kv / tl.sqrt(tl.sum(kv * kv, axis=0) + l2_eps)
    S = S * decay
    u = beta * (vv - tl.sum(kn[:, None] * S, axis=0))
    S = S + kn[:, None] * u[None, :]
    if STATE_BF16:
        S = round_to_bf16(S)
    return S, tl.sum(qn[:, None] * S, axis=0)


@triton.jit
def _gated_norm(o, w, zz, norm_eps, V: tl.constexpr):
    """The gated RMSNorm of one whole row of V: two bf16 rounding points, returned as fp32."""
    normed = round_to_bf16(w * (o / tl.sqrt(tl.sum(o * o, axis=0) / V + norm_eps)))
    return round_to_bf16(normed * (zz / (1.0 + tl.exp(-zz))))


@triton.jit
def _gdn_rows_kernel(q, k, v, a, b, A_log, dt_bias, z, norm_w, pool, slots, out, states,
                     T, scale, l2_eps, norm_eps,
                     HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     RECORD: tl.constexpr, STATE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    i_b = pid // HV
    i_hv = pid % HV
    i_hk = i_hv // (HV // HK)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    slot = tl.load(slots + i_b).to(tl.int64)
    tile = offs_k[:, None] * V + offs_v[None, :]
    pool_row = pool + (slot * HV + i_hv) * (K * V)
    S = tl.load(pool_row + tile).to(tl.float32)
    neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    dtb = tl.load(dt_bias + i_hv).to(tl.float32)
    w = tl.load(norm_w + offs_v).to(tl.float32)
    for t in range(T):
        row = i_b * T + t
        S, o = _row_step(S, q + (row * HK + i_hk) * K, k + (row * HK + i_hk) * K,
                         v + (row * HV + i_hv) * V, a + row * HV + i_hv, b + row * HV + i_hv,
                         offs_k, offs_v, neg_A, dtb, scale, l2_eps, STATE_BF16)
        zz = tl.load(z + (row * HV + i_hv) * V + offs_v).to(tl.float32)
        gated = _gated_norm(o, w, zz, norm_eps, V)
        tl.store(out + (row * HV + i_hv) * V + offs_v, gated.to(out.dtype.element_ty))
        if RECORD:
            rec = states + (row.to(tl.int64) * HV + i_hv) * (K * V)
            tl.store(rec + tile, S.to(states.dtype.element_ty))
    if not RECORD:
        tl.store(pool_row + tile, S.to(pool.dtype.element_ty))


def _launch(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, states, T, record):
    B = slots.shape[0]
    HK, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    for t in (q, k, v, a, b, z, state_pool):
        assert t.is_contiguous(), "the GDN row kernel reads contiguous tensors"
    if z.dtype != torch.bfloat16:
        raise ValueError("the GDN row kernel's gated norm rounds to bf16: z must be bf16")
    if state_pool.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"unsupported state dtype {state_pool.dtype} (fp32 or bf16)")
    _gdn_rows_kernel[(B * HV,)](
        q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, states,
        T, K ** -0.5, 1e-6, 1e-6, HK=HK, HV=HV, K=K, V=V, RECORD=record,
        STATE_BF16=state_pool.dtype == torch.bfloat16, num_warps=8)


def gdn_decode(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out) -> None:
    """One row a request; the pool rows at ``slots`` are updated in place."""
    _launch(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, state_pool, 1, False)


def gdn_verify(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out, states) -> None:
    """T rows a request from the pool state; the state after each row goes to ``states``."""
    _launch(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, states, q.shape[1],
            True)


# ---------------------------------------------------------------- variant triton_split
#
# The delta rule couples the state's columns only through the gated norm: column v of S needs k, q,
# beta, g and v[v] alone. So the state can be split into V tiles, one program each, which keeps a
# quarter of the state in registers and puts four times more programs in flight to hide the pool's
# load latency; the norm, which needs the whole row, runs as a second small launch over o.


@triton.jit
def _gdn_rows_split_kernel(q, k, v, a, b, A_log, dt_bias, pool, slots, o_buf, states,
                           T, scale, l2_eps,
                           HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BV: tl.constexpr, RECORD: tl.constexpr, STATE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    i_vt = pid % (V // BV)
    i_bh = pid // (V // BV)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_hk = i_hv // (HV // HK)
    offs_k = tl.arange(0, K)
    offs_v = i_vt * BV + tl.arange(0, BV)
    slot = tl.load(slots + i_b).to(tl.int64)
    tile = offs_k[:, None] * V + offs_v[None, :]
    pool_row = pool + (slot * HV + i_hv) * (K * V)
    S = tl.load(pool_row + tile).to(tl.float32)
    neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    dtb = tl.load(dt_bias + i_hv).to(tl.float32)
    for t in range(T):
        row = i_b * T + t
        S, o = _row_step(S, q + (row * HK + i_hk) * K, k + (row * HK + i_hk) * K,
                         v + (row * HV + i_hv) * V, a + row * HV + i_hv, b + row * HV + i_hv,
                         offs_k, offs_v, neg_A, dtb, scale, l2_eps, STATE_BF16)
        tl.store(o_buf + (row * HV + i_hv) * V + offs_v, o)
        if RECORD:
            rec = states + (row.to(tl.int64) * HV + i_hv) * (K * V)
            tl.store(rec + tile, S.to(states.dtype.element_ty))
    if not RECORD:
        tl.store(pool_row + tile, S.to(pool.dtype.element_ty))


@triton.jit
def _gated_norm_rows_kernel(o_buf, z, norm_w, out, norm_eps, V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (token, value head) row of V elements
    offs = tl.arange(0, V)
    o = tl.load(o_buf + row * V + offs)
    w = tl.load(norm_w + offs).to(tl.float32)
    zz = tl.load(z + row * V + offs).to(tl.float32)
    gated = _gated_norm(o, w, zz, norm_eps, V)
    tl.store(out + row * V + offs, gated.to(out.dtype.element_ty))


SPLIT_BV = 32


def _launch_split(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, states, T,
                  record):
    B = slots.shape[0]
    HK, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    for t in (q, k, v, a, b, z, state_pool):
        assert t.is_contiguous(), "the GDN row kernels read contiguous tensors"
    if z.dtype != torch.bfloat16:
        raise ValueError("the gated norm rounds to bf16: z must be bf16")
    bv = min(SPLIT_BV, V)
    o_buf = torch.empty(B * T * HV * V, dtype=torch.float32, device=v.device)
    _gdn_rows_split_kernel[(B * HV * (V // bv),)](
        q, k, v, a, b, A_log, dt_bias, state_pool, slots, o_buf, states, T, K ** -0.5, 1e-6,
        HK=HK, HV=HV, K=K, V=V, BV=bv, RECORD=record,
        STATE_BF16=state_pool.dtype == torch.bfloat16, num_warps=4)
    _gated_norm_rows_kernel[(B * T * HV,)](o_buf, z, norm_w, out, 1e-6, V=V, num_warps=1)


def gdn_decode_split(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out) -> None:
    """Variant ``triton_split`` of gdn_decode: state tiles of 32 columns a program, then the gated
    norm in a second launch."""
    _launch_split(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, state_pool, 1,
                  False)


def gdn_verify_split(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out,
                     states) -> None:
    """Variant ``triton_split`` of gdn_verify."""
    _launch_split(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, states,
                  q.shape[1], True)
