"""Batched, differentiable forms of the spec ops the model is made of ([B, T, ...] tensors, fp32).

Each computes the function of its spec op (spec/ops/*) up to the order of floating-point sums, without
the spec's bf16 rounding points (training runs in fp32; the engine runs the exported weights in bf16).
tests/train/test_train_model.py holds the composition to spec/model.py's forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from spec.ops.kv_storage import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize

EPS = 1e-6


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """spec.ops.norms.rmsnorm: zero-centred weight (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """spec.ops.norms.gated_rmsnorm: plain weight, times silu(z)."""
    return w * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------ hyper-connections


def sinkhorn(M: torch.Tensor, iters: int) -> torch.Tensor:
    for _ in range(iters):
        M = M / M.sum(dim=-2, keepdim=True)
        M = M / M.sum(dim=-1, keepdim=True)
    return M


def hc_site(X: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, norm_w: torch.Tensor, sublayer,
            iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """spec.model._hc_site over X [B, T, n, C]: returns (new streams, their mean)."""
    B, T, n, C = X.shape
    v = X.reshape(B, T, n * C)
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
    logits = (v * r) @ phi + bias
    h_pre = torch.sigmoid(logits[..., :n])
    h_post = 2.0 * torch.sigmoid(logits[..., n:2 * n])
    l_res = logits[..., 2 * n:].reshape(B, T, n, n)
    h_res = sinkhorn(torch.exp(l_res - l_res.amax(dim=(-2, -1), keepdim=True)), iters)
    x_in = (h_pre[..., None] * X).sum(-2)
    y = sublayer(rmsnorm(x_in, norm_w))
    new = torch.einsum("btij,btjc->btic", h_res, X) + h_post[..., None] * y[..., None, :]
    return new, new.mean(-2)


# ------------------------------------------------------------------------------ GDN


def causal_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """spec.ops.gdn.causal_conv1d from a zero history: x [B, T, ch], w [ch, 4]; silu."""
    ch, k = w.shape
    y = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), w[:, None, :], groups=ch)
    return F.silu(y.transpose(1, 2))


def gdn_gates(a, b, A_log, dt_bias):
    g = -torch.exp(A_log) * F.softplus(a + dt_bias, beta=1.0, threshold=20.0)
    return g, torch.sigmoid(b)


def gdn_chunked(q, k, v, g, beta, chunk: int = 64) -> torch.Tensor:
    """The gated delta rule of spec.ops.gdn.gdn_recurrent from a zero state, in chunked (WY) form:
    every chunk's intra-chunk solve runs in parallel and only the chunk-to-chunk state recurrence
    ``S_{c+1} = M_c S_c + N_c`` is a loop. q, k [B, T, HK, K]; v [B, T, HV, V]; g, beta [B, T, HV].
    Returns o [B, T, HV, V].

    Per chunk with cumulative log decay G and T_inv = (I + A)^-1 (A[t, i] = beta_t e^{G_t - G_i}
    k_t . k_i, i < t): U = T_inv (beta v) - T_inv (beta e^G k) S_c = Wv - Wk S_c;
    o = e^G q S_c + (q k^T * decay) U; S_{c+1} = e^{G_C} S_c + (k e^{G_C - G})^T U.
    """
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // HK
    qh = l2norm(q).repeat_interleave(rep, dim=2) / math.sqrt(K)
    kh = l2norm(k).repeat_interleave(rep, dim=2)
    pad = (-T) % chunk
    if pad:  # zero rows: beta 0 writes nothing, g 0 decays nothing
        qh, kh, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (qh, kh, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    N = (T + pad) // chunk

    def blocks(t):  # [B, Tp, HV, D] -> [B, HV, N, C, D]
        return t.reshape(B, N, chunk, HV, -1).permute(0, 3, 1, 2, 4)

    qc, kc, vc = blocks(qh), blocks(kh), blocks(v)
    gc, bc = blocks(g[..., None])[..., 0], blocks(beta[..., None])[..., 0]
    G = gc.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")))
    strict = causal & ~torch.eye(chunk, dtype=torch.bool, device=q.device)
    A = (bc[..., :, None] * decay * (kc @ kc.transpose(-1, -2))).masked_fill(~strict, 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    T_inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    Wv = T_inv @ (bc[..., None] * vc)
    Wk = T_inv @ (bc[..., None] * torch.exp(G)[..., None] * kc)
    g_last = G[..., -1]
    Kt = kc * torch.exp(g_last[..., None] - G)[..., None]
    M = torch.exp(g_last)[..., None, None] * torch.eye(K, dtype=q.dtype, device=q.device) \
        - Kt.transpose(-1, -2) @ Wk
    Nm = Kt.transpose(-1, -2) @ Wv
    S = torch.zeros(B, HV, K, V, dtype=q.dtype, device=q.device)
    starts = []
    for c in range(N):
        starts.append(S)
        S = M[:, :, c] @ S + Nm[:, :, c]
    S_all = torch.stack(starts, dim=2)                                   # [B, HV, N, K, V]
    U = Wv - Wk @ S_all
    o = torch.exp(G)[..., None] * (qc @ S_all) + ((qc @ kc.transpose(-1, -2)) * decay) @ U
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * chunk, HV, V)
    return o[:, :T]


# ------------------------------------------------------------------------------ RoPE


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """spec.ops.rope NeoX rotation of the first ``rotary_dim`` dims; x [..., T, H, D], positions [T],
    or [3, T] for interleaved mRoPE with ``spec.ops.vision.mrope_sections(rotary_dim)`` (a frame
    prompt); angles in float64, as the spec builds its table."""
    if positions.dim() == 2:
        from spec.ops.rope import rope_angles
        from spec.ops.vision import mrope_sections

        ang = rope_angles(positions, rotary_dim, theta, mrope_sections(rotary_dim))
    else:
        j = torch.arange(rotary_dim // 2, dtype=torch.float64, device=x.device)
        inv = torch.pow(torch.tensor(theta, dtype=torch.float64, device=x.device),
                        -2.0 * j / rotary_dim)
        ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang).to(x.dtype)[:, None, :], torch.sin(ang).to(x.dtype)[:, None, :]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


# ------------------------------------------------------------------------------ NVFP4 (QAT)


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The spec's conventional nvfp4 global scale amax / (6 * 448), fp32 [] (amax floored at 1e-6)."""
    return nvfp4_global_scale(torch.clamp(amax.detach().double(), min=1e-6).cpu()).to(amax.device)


def fake_nvfp4(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """x through spec's nvfp4 quantiser and back (blocks of 16 along the last dim), with the
    straight-through gradient: forward = dequant(quant(x)), backward = identity."""
    with torch.no_grad():
        q = nvfp4_dequantize(*nvfp4_quantize(x.detach(), gs), gs, x.dtype)
    return x + (q - x).detach()


def fake_nvfp4_weight(w: torch.Tensor) -> torch.Tensor:
    """Each matrix of a stack [E, out, in] with its own global scale (``NvFp4Weight.from_dense``)."""
    return torch.stack([fake_nvfp4(w[e], global_scale(w[e].detach().abs().max()))
                        for e in range(w.shape[0])])
