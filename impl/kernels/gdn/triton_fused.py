"""Variant ``triton_fused`` of gdn_decode and gdn_verify (certify/cells/gdn_decode.yaml,
gdn_verify.yaml): gates + l2norm + the gated delta rule + the gated RMSNorm in one launch, one program
per (request, value head) holding the whole [K, V] state in registers.

- decode (one row a request): reads the pool row at ``slots[b]`` and writes it back in place;
- verify (T rows a request): reads the pool, never writes it, and records the state after every row
  into ``states`` (the cached replay that rollback commits from).
A bf16 pool keeps fp32 math and rounds the state to bf16 after every row, as the spec does.
``row_step`` and ``gated_norm_row`` are the row's math, shared with ``triton_split``.
"""
from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.layout import require_contiguous
from impl.kernels.triton_support import round_to_bf16, softplus


@triton.jit
def row_step(S, q_row, k_row, v_row, a_row, b_row, offs_k, offs_v, neg_A, dtb, scale, l2_eps,
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
def gated_norm_row(o, w, zz, norm_eps, V: tl.constexpr):
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
        S, o = row_step(S, q + (row * HK + i_hk) * K, k + (row * HK + i_hk) * K,
                        v + (row * HV + i_hv) * V, a + row * HV + i_hv, b + row * HV + i_hv,
                        offs_k, offs_v, neg_A, dtb, scale, l2_eps, STATE_BF16)
        zz = tl.load(z + (row * HV + i_hv) * V + offs_v).to(tl.float32)
        gated = gated_norm_row(o, w, zz, norm_eps, V)
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
    require_contiguous("the GDN row kernels", q=q, k=k, v=v, a=a, b=b, A_log=A_log,
                       dt_bias=dt_bias, z=z, norm_w=norm_w, state_pool=state_pool, slots=slots)
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
