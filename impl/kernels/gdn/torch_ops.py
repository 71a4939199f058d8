"""Torch compositions of the GDN ops, as the engine runs them on the CPU (and as the GPU fallback).

These are the implementation, certified against spec/ops/gdn.py: fp32 math on batched heads with
in-place pool updates, not a copy of the row-at-a-time spec. The calling convention of every variant:
inputs by name, then the output buffers by name; each output buffer is written completely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6
NORM_EPS = 1e-6


def _gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """One token's heads per call: a whole-tensor launch finishes its last partial SIMD vector (and
    each thread's chunk) in scalar code on the CPU, so a gate's last bit would depend on how many
    tokens share the launch (measured: 2.7% of g differ by an ulp at 4096 x 48)."""
    hv = a.shape[-1]
    a_rows, b_rows = a.float().reshape(-1, hv), b.float().reshape(-1, hv)
    neg_a, dtb = -A_log.float().exp(), dt_bias.float()
    g, beta = torch.empty_like(a_rows), torch.empty_like(b_rows)
    for r in range(a_rows.shape[0]):
        g[r] = neg_a * F.softplus(a_rows[r] + dtb, threshold=20.0)
        beta[r] = torch.sigmoid(b_rows[r])
    return g.view(a.shape), beta.view(b.shape)


def _l2n(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _gated_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    r = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    normed = (w.float() * (o * r)).to(z.dtype).float()
    return (normed * F.silu(z.float())).to(z.dtype)


def gdn_gates(a, b, A_log, dt_bias, *, g, beta) -> None:
    gg, bb = _gates(a, b, A_log, dt_bias)
    g.copy_(gg)
    beta.copy_(bb)


def gated_rmsnorm(o, z, w, *, out) -> None:
    out.copy_(_gated_norm(o.float(), z, w))


def gdn_conv_prefill(x, weight, conv_state, *, y, new_conv_state) -> None:
    """Depthwise causal conv as one conv1d over [state | x] (the engine's prefill path)."""
    B, T, C = x.shape
    window = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=2).float()  # [B, C, 3+T]
    acc = F.conv1d(window, weight.float().unsqueeze(1), groups=C)                    # [B, C, T]
    y.copy_(F.silu(acc).transpose(1, 2).to(y.dtype))
    new_conv_state.copy_(window[:, :, -3:].to(new_conv_state.dtype))


def gdn_conv_update(x, weight, conv_state, *, y) -> None:
    """One decode step; the conv state [B, C, 3] is rolled in place."""
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1).float()  # [B, C, 4]
    y.copy_(F.silu((window * weight.float()).sum(-1)).to(y.dtype))
    conv_state.copy_(window[:, :, 1:].to(conv_state.dtype))


def _recurrent_rows(q, k, v, a, b, A_log, dt_bias, S, store_dtype, record=None):
    """Run T rows from state S (fp32, [B, HV, K, V]); optionally record each row's stored state.

    Every per-row quantity is computed inside the row loop on [B, ...] slices, so a row's result does
    not depend on how many rows the launch holds (torch's CPU reductions pick their summation order
    from the whole tensor's shape, and elementwise exp / log1p differ between their vector body and
    scalar tail; the replay oracle needs row t to be the same in a T-row launch and a (t+1)-row one).
    """
    HV = v.shape[2]
    rep = HV // q.shape[2]
    scale = q.shape[-1] ** -0.5
    outs = []
    for t in range(v.shape[1]):
        qn = _l2n(q[:, t]).repeat_interleave(rep, dim=1) * scale
        kn = _l2n(k[:, t]).repeat_interleave(rep, dim=1)
        g, beta = _gates(a[:, t], b[:, t], A_log, dt_bias)
        S.mul_(g.exp()[..., None, None])
        u = beta[..., None] * (v[:, t].float() - (kn.unsqueeze(-2) @ S).squeeze(-2))
        S.add_(kn[:, :, :, None] * u[:, :, None, :])
        if store_dtype != torch.float32:
            S.copy_(S.to(store_dtype).float())  # each row is a stored step (spec's rounding point)
        outs.append((qn.unsqueeze(-2) @ S).squeeze(-2))
        if record is not None:
            record[:, t].copy_(S.to(record.dtype))
    return torch.stack(outs, dim=1)


def gdn_verify(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out, states) -> None:
    S = state_pool[slots.long()].float()
    o = _recurrent_rows(q, k, v, a, b, A_log, dt_bias, S, state_pool.dtype, record=states)
    out.copy_(_gated_norm(o, z, norm_w))


def gdn_decode(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out) -> None:
    """One row per request; the pool rows at ``slots`` are updated in place."""
    idx = slots.long()
    S = state_pool[idx].float()
    o = _recurrent_rows(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), a.unsqueeze(1),
                        b.unsqueeze(1), A_log, dt_bias, S, state_pool.dtype)
    state_pool[idx] = S.to(state_pool.dtype)
    out.copy_(_gated_norm(o[:, 0], z, norm_w))


def gdn_prefill_recurrent(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, *, out, final_state):
    S = state.float().clone()
    o = _recurrent_rows(q, k, v, a, b, A_log, dt_bias, S, torch.float32)
    out.copy_(_gated_norm(o, z, norm_w))
    final_state.copy_(S)


def gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, *, out, final_state,
                        chunk: int = 64) -> None:
    """Chunked (chunk 64) prefill in fp32: intra-chunk triangular solve, inter-chunk state carry."""
    g, beta = _gates(a, b, A_log, dt_bias)
    B, T, HV, V = v.shape
    rep = HV // q.shape[2]
    qn = (_l2n(q).repeat_interleave(rep, dim=2) * (q.shape[-1] ** -0.5)).transpose(1, 2)
    kn = _l2n(k).repeat_interleave(rep, dim=2).transpose(1, 2)     # [B, HV, T, K]
    vf, gt, bt = v.float().transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2)
    S = state.float().clone()
    o = torch.empty(B, HV, T, V, dtype=torch.float32, device=v.device)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        qc, kc, vc, bc = qn[:, :, c0:c1], kn[:, :, c0:c1], vf[:, :, c0:c1], bt[:, :, c0:c1]
        G = gt[:, :, c0:c1].cumsum(-1)
        L = c1 - c0
        lower = torch.tril(torch.ones(L, L, dtype=torch.bool, device=v.device))
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        A = (bc[..., None] * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ S))
        U = torch.linalg.solve_triangular(A + torch.eye(L, device=v.device), rhs, upper=False,
                                          unitriangular=True)
        o[:, :, c0:c1] = G.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ U
        S = G[..., -1:].exp()[..., None] * S + (kc * (G[..., -1:] - G).exp()[..., None]
                                                ).transpose(-1, -2) @ U
    out.copy_(_gated_norm(o.transpose(1, 2), z, norm_w))
    final_state.copy_(S)
