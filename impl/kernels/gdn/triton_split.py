"""Variant ``triton_split`` of gdn_decode and gdn_verify (certify/cells/gdn_decode.yaml,
gdn_verify.yaml): the state split into tiles of 32 value columns, one program each, then the gated
RMSNorm as a second launch.

The delta rule couples the state's columns only through the gated norm: column v of S needs k, q,
beta, g and v[v] alone. So the state can be split into V tiles, one program each, which keeps a
quarter of the state in registers and puts four times more programs in flight to hide the pool's
load latency; the norm, which needs the whole row, runs as a second small launch over o. The row's
math is ``triton_fused``'s (``row_step``, ``gated_norm_row``), so both variants compute the same
values; decode writes the pool rows at ``slots`` in place, verify records the state after every row
into ``states`` and leaves the pool as it is.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.gdn.triton_fused import gated_norm_row, row_step
from impl.kernels.layout import require_contiguous


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
        S, o = row_step(S, q + (row * HK + i_hk) * K, k + (row * HK + i_hk) * K,
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
    gated = gated_norm_row(o, w, zz, norm_eps, V)
    tl.store(out + row * V + offs, gated.to(out.dtype.element_ty))


SPLIT_BV = 32


def _launch_split(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, states, T,
                  record):
    B = slots.shape[0]
    HK, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    require_contiguous("the GDN row kernels", q=q, k=k, v=v, a=a, b=b, A_log=A_log,
                       dt_bias=dt_bias, z=z, norm_w=norm_w, state_pool=state_pool, slots=slots)
    if z.dtype != torch.bfloat16:
        raise ValueError("the gated norm rounds to bf16: z must be bf16")
    bv = min(SPLIT_BV, V)
    o_buf = torch.empty(B * T * HV * V, dtype=torch.float32, device=v.device)
    _gdn_rows_split_kernel[(B * HV * (V // bv),)](
        q, k, v, a, b, A_log, dt_bias, state_pool, slots, o_buf, states, T, K ** -0.5, 1e-6,
        HK=HK, HV=HV, K=K, V=V, BV=bv, RECORD=record,
        STATE_BF16=state_pool.dtype == torch.bfloat16, num_warps=4)
    _gated_norm_rows_kernel[(B * T * HV,)](o_buf, z, norm_w, out, 1e-6, V=V, num_warps=1)


def gdn_decode(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out) -> None:
    """One row a request; the pool rows at ``slots`` are updated in place."""
    _launch_split(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, state_pool, 1,
                  False)


def gdn_verify(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out, states) -> None:
    """T rows a request from the pool state; the state after each row goes to ``states``."""
    _launch_split(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, out, states,
                  q.shape[1], True)
