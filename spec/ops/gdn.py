"""Gated-DeltaNet (GDN) layer ops, Qwen3-Next layout (docs/spec.md, "GDN layer").

Public definitions followed: the gated delta rule of Yang, Kautz & Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule" (ICLR 2025); its Qwen3-Next form (transformers'
``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``: l2-normalised q and k, q scaled
by 1/sqrt(d_k), gate ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``); the naive
reference of flash-linear-attention (``fla/ops/gated_delta_rule/naive.py``).

Shapes (B requests, T rows a request, HK key heads, HV = 3 * HK value heads, K = d_k, V = d_v):
q, k [B, T, HK, K]; v, z [B, T, HV, V]; a, b [B, T, HV]; state S [B, HV, K, V] (S[k, v], o = S^T q).
Value head ``h`` reads key head ``h // (HV // HK)`` (grouped value attention).

Rounding points (non-reference mode), decided here where docs/spec.md leaves them open:
- gates, l2norm and the recurrence run in fp32 whatever the activation dtype;
- a state stored in bf16 is rounded to bf16 after *every* row of a decode or verify step: each such
  row is one stored step, so a verify of T rows equals T decode steps bit for bit (the
  speculative-equals-plain oracle needs exactly that);
- a prefill chunk is one step: its state stays fp32 across the chunk and a bf16 pool stores it
  rounded once at the end, so with bf16 storage a prefill of T tokens differs from T decode steps
  (and the chunking of a prefill changes the stored state): a property of bf16 storage, not a bug;
- the recurrence output o stays fp32 until the gated RMSNorm, which rounds it twice (spec.ops.norms).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from spec.numerics import acc_dtype, is_reference_mode, out_cast, round_operand, round_to
from spec.ops.norms import gated_rmsnorm

CONV_KERNEL = 4
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


# ---------------------------------------------------------------- gates


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus threshold 20).

    a, b [..., HV] activation dtype; A_log, dt_bias [HV] fp32. Returns (g, beta) in the acc dtype.
    """
    acc = acc_dtype(a, b, A_log, dt_bias)
    hv = a.shape[-1]
    neg_A = -torch.exp(A_log.to(acc))
    a_rows, b_rows = a.to(acc).reshape(-1, hv), b.to(acc).reshape(-1, hv)
    if a_rows.device.type == "meta":  # meta: shapes only; the per-row launches would only cost time
        g = neg_A * F.softplus(a_rows + dt_bias.to(acc), beta=1.0, threshold=SOFTPLUS_THRESHOLD)
        return g.view(a.shape), torch.sigmoid(b_rows).view(b.shape)
    g, beta = torch.empty_like(a_rows), torch.empty_like(b_rows)
    # One row (one token's heads) per call: CPU kernels finish a tensor's last partial SIMD vector
    # with scalar code, so an element's rounding would otherwise depend on its position in the
    # launch, i.e. on how many rows share it (rows of 6 heads at the tiny geometry do).
    for r in range(a_rows.shape[0]):
        g[r] = neg_A * F.softplus(a_rows[r] + dt_bias.to(acc), beta=1.0,
                                  threshold=SOFTPLUS_THRESHOLD)
        beta[r] = torch.sigmoid(b_rows[r])
    return g.view(a.shape), beta.view(b.shape)


# ---------------------------------------------------------------- causal conv


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (kernel 4, no bias) + SiLU over one sequence per batch row.

    ``y_t = silu(sum_{j=0..3} W[:, j] * x_{t-3+j})``; inputs before the sequence are 0, or the conv
    state when given. x [B, T, C]; weight [C, 4]; conv_state [B, C, 3] (the last 3 inputs, oldest
    first). Returns (y [B, T, C] in x's dtype, new conv state [B, C, 3] in x's dtype: the last 3
    inputs, which are stored values and so exact).
    """
    B, T, C = x.shape
    acc = acc_dtype(x, weight)
    hist = CONV_KERNEL - 1
    if conv_state is None:
        conv_state = torch.zeros(B, C, hist, dtype=x.dtype, device=x.device)
    window = torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, 3 + T, C]
    wf = weight.to(acc)
    acc_y = torch.zeros(B, T, C, dtype=acc, device=x.device)
    for j in range(CONV_KERNEL):  # fixed order: oldest tap first
        acc_y = acc_y + wf[:, j] * window[:, j:j + T].to(acc)
    y = out_cast(F.silu(acc_y), x.dtype, is_reference_mode(x, weight))
    new_state = window[:, -hist:].transpose(1, 2).contiguous()
    return y, new_state


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the causal conv: append x [B, C] to the state [B, C, 3], drop the oldest.

    Defined as ``causal_conv1d`` on a one-token sequence, so prefill-then-update equals prefill over the
    whole sequence by construction. Returns (y [B, C], new state [B, C, 3]).
    """
    y, new_state = causal_conv1d(x.unsqueeze(1), weight, conv_state)
    return y.squeeze(1), new_state


# ---------------------------------------------------------------- recurrence


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (eps inside the sqrt), in the acc dtype."""
    xf = x.to(acc_dtype(x))
    return xf * torch.rsqrt(xf.pow(2).sum(dim=-1, keepdim=True) + eps)


def _expand_kv_heads(t: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., HK, D] -> [..., HV, D]: value head h reads key head h // (HV // HK)."""
    return t.repeat_interleave(hv // t.shape[-2], dim=-2)


def _prepare(q, k, v, g, beta, state):
    acc = acc_dtype(q, k, v, g, beta, state)
    hv = v.shape[-2]
    d_k = q.shape[-1]
    qh = _expand_kv_heads(l2norm(q.to(acc)), hv) / (d_k ** 0.5)
    kh = _expand_kv_heads(l2norm(k.to(acc)), hv)
    return acc, qh, kh, v.to(acc), g.to(acc), beta.to(acc)


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor | None = None,
                  state_dtype: torch.dtype | None = None, record: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The gated delta rule, one row at a time (the definition every other form must equal).

    Per value head: ``S = exp(g_t) S; u = beta_t (v_t - S^T k^); S = S + k^ u^T; o_t = S^T q^`` with
    ``q^ = l2norm(q) / sqrt(d_k)``, ``k^ = l2norm(k)``.
    q, k [B, T, HK, K]; v [B, T, HV, V]; g, beta [B, T, HV] (from ``gdn_gates``);
    state [B, HV, K, V] or None (zeros). ``state_dtype`` is the storage dtype (default: the state's
    dtype, else fp32); outside reference mode the state is rounded to it after every row.
    Returns (o [B, T, HV, V] acc dtype, states after each row [B, T, HV, K, V] in the storage dtype
    or None when ``record`` is False (a long prefill would not fit), final state [B, HV, K, V] in the
    storage dtype).
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    acc, qh, kh, vf, gf, bf = _prepare(q, k, v, g, beta, state)
    store = state_dtype or (state.dtype if state is not None else torch.float32)
    reference = acc == torch.float64
    S = (torch.zeros(B, HV, K, V, dtype=acc, device=v.device) if state is None else state.to(acc))
    if v.device.type == "meta":  # meta: shapes only (the reach tracer); T rows of meta ops cost time
        held = acc if reference else store
        o = torch.empty(B, T, HV, V, dtype=acc, device=v.device)
        recorded = torch.empty(B, T, HV, K, V, dtype=held, device=v.device) if record else None
        return o, recorded, S.to(held)
    outs, states = [], []
    for t in range(T):
        S = S * torch.exp(gf[:, t])[..., None, None]
        kS = (kh[:, t].unsqueeze(-2) @ S).squeeze(-2)  # k^T S, [B, HV, V]
        u = bf[:, t][..., None] * (vf[:, t] - kS)
        S = S + kh[:, t][..., :, None] * u[..., None, :]
        S = round_to(S, store, reference)
        outs.append((qh[:, t].unsqueeze(-2) @ S).squeeze(-2))
        if record:
            states.append(S)
    o = torch.stack(outs, dim=1)
    all_states = out_cast(torch.stack(states, dim=1), store, reference) if record else None
    return o, all_states, out_cast(S, store, reference)


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor | None = None, chunk: int = 64,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function as ``gdn_recurrent`` in chunked (WY) form, chunk 64: (o, final state).

    Within a chunk with start state S0 and cumulative log decay G_t = sum_{i<=t} g_i, the deltas
    U = [u_1..u_C] solve the unit lower-triangular system ``(I + A) U = beta * (V - e^G * (K^ S0))``
    with ``A[t, i] = beta_t e^{G_t - G_i} (k^_t . k^_i)`` for i < t; then
    ``o_t = e^{G_t} S0^T q^_t + sum_{i<=t} e^{G_t - G_i} (q^_t . k^_i) u_i`` and
    ``S_C = e^{G_C} S0 + sum_i e^{G_C - G_i} k^_i u_i^T``. A fp32 state is assumed (no per-row
    storage rounding), so it is meant for the float64 and fp32 paths.
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    acc, qh, kh, vf, gf, bf = _prepare(q, k, v, g, beta, state)
    S = (torch.zeros(B, HV, K, V, dtype=acc, device=v.device) if state is None else state.to(acc))
    outs = []
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        # [B, HV, C, *] layout for the chunk.
        qc, kc, vc = (t[:, sl].transpose(1, 2) for t in (qh, kh, vf))
        gc, bc = gf[:, sl].transpose(1, 2), bf[:, sl].transpose(1, 2)
        C = qc.shape[2]
        G = gc.cumsum(dim=-1)                                   # [B, HV, C]
        decay = torch.exp(G[..., :, None] - G[..., None, :])    # e^{G_t - G_i}
        causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        decay = decay.masked_fill(~causal, 0.0)
        kk = kc @ kc.transpose(-1, -2)
        A = (bc[..., :, None] * decay * kk).masked_fill(causal.logical_not() | torch.eye(
            C, dtype=torch.bool, device=v.device), 0.0)
        rhs = bc[..., None] * (vc - torch.exp(G)[..., None] * (kc @ S))
        eye = torch.eye(C, dtype=acc, device=v.device)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = (qc @ kc.transpose(-1, -2)) * decay
        o = torch.exp(G)[..., None] * (qc @ S) + qk @ U
        outs.append(o.transpose(1, 2))
        tail = torch.exp(G[..., -1:] - G)                        # e^{G_C - G_i}
        S = torch.exp(G[..., -1])[..., None, None] * S + (kc * tail[..., None]).transpose(-1, -2) @ U
    return torch.cat(outs, dim=1), S


# ---------------------------------------------------------------- the bf16-operand tier

# The rounding points of the bf16_operands tier, in the order a chunk meets them (docs/spec.md,
# "Numerics tiers"); ``gdn_chunked_bf16_operands(skip=...)`` leaves named ones out, so a test can
# show each one is where the tier's kernel rounds.
BF16_OPERAND_POINTS = ("qk_operands", "kk_fp16", "inverse_fp16", "t_bf16", "state_operand",
                       "sk_bf16", "d_bf16", "v_new_bf16", "qk_scores_bf16", "v_decayed_bf16",
                       "o_bf16")
DECAY_FLOOR = 1e-10   # the tier takes the decay as alpha = exp(g) and reads log2(alpha + 1e-10)


INVERSE_BLOCK = 8     # the bf16_operands tier inverts 8 x 8 diagonal blocks, then merges pairs


def _unit_lower_inverse(A: torch.Tensor, rnd: Callable[[torch.Tensor], torch.Tensor]
                        ) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular A [..., C, C] (C <= 64), blockwise as the
    bf16_operands tier computes it, ``rnd`` applied where it rounds (fp16): each 8 x 8 diagonal
    block's inverse, then per merge of two blocks [[X, 0], [L, Y]] (8 -> 16 -> 32 -> 64) the
    lower-left block ``rnd(rnd(-(Y^-1 L)) X^-1)``; in the last merge that product's two halves of
    its inner dimension are rounded apart and added (rounded). A chunk shorter than 64 rows is
    padded with zero rows (its inverse is the identity there)."""
    C = A.shape[-1]
    n = 64 if C <= 64 else C
    pad = torch.zeros(*A.shape[:-2], n, n, dtype=A.dtype, device=A.device)
    pad[..., :C, :C] = A
    eye = torch.eye(INVERSE_BLOCK, dtype=A.dtype, device=A.device)
    inv = torch.zeros_like(pad)
    for b0 in range(0, n, INVERSE_BLOCK):
        blk = slice(b0, b0 + INVERSE_BLOCK)
        inv[..., blk, blk] = rnd(torch.linalg.solve_triangular(
            eye + pad[..., blk, blk], eye.expand_as(pad[..., blk, blk]), upper=False,
            unitriangular=True))
    size = INVERSE_BLOCK
    while size < n:
        for b0 in range(0, n, 2 * size):
            top, bottom = slice(b0, b0 + size), slice(b0 + size, b0 + 2 * size)
            dc = rnd(-(inv[..., bottom, bottom] @ pad[..., bottom, top]))
            x = inv[..., top, top]
            if 2 * size < n:
                inv[..., bottom, top] = rnd(dc @ x)
            else:
                h = size // 2
                inv[..., bottom, top] = rnd(rnd(dc[..., :, :h] @ x[..., :h, :])
                                            + rnd(dc[..., :, h:] @ x[..., h:, :]))
        size *= 2
    return inv[..., :C, :C]


def gdn_chunked_bf16_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor | None = None,
                              chunk: int = 64, skip: frozenset[str] = frozenset(),
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in the chunked form of the bf16_operands tier: (o, final state).

    Per chunk of 64 rows, with the state S [K, V] carried in the acc dtype, c_t the running sum of
    log2(exp(g) + 1e-10) within the chunk and gamma_t = 2^c_t (every gate applied in the acc dtype
    to a product's result, never to an operand), and Q, K the l2-normalised q, k rounded to bf16:

    - ``A = fp16(beta_t 2^(c_t - c_i) (K K^T)[t, i])`` below the diagonal; ``T = bf16(fp16((I +
      A)^-1) diag(beta))``;
    - ``D = bf16(v - bf16(gamma (K bf16(S))))``; ``v_new = bf16(T D)``;
    - ``o = scale gamma (Q bf16(S)) + bf16(scale 2^(c_t - c_i) (Q K^T)[t, i], i <= t) v_new``, then
      bf16(o), with scale = d_k^-1/2;
    - ``S = 2^c_C S + K^T bf16(2^(c_C - c_t) v_new)``.

    Every product accumulates in the acc dtype. Each rounding is one of ``BF16_OPERAND_POINTS``,
    applied in reference mode too (``round_operand``); ``skip`` leaves the named ones out. The
    inverse is exact before its fp16 rounding (the kernel's blockwise inverse rounds inside too: a
    difference the tier's bands absorb). o is returned in the acc dtype holding bf16 values.
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    acc = acc_dtype(q, k, v, g, beta, state)
    keep = set(BF16_OPERAND_POINTS) - set(skip)
    unknown = set(skip) - set(BF16_OPERAND_POINTS)
    if unknown:
        raise ValueError(f"unknown rounding points {sorted(unknown)} (known: {BF16_OPERAND_POINTS})")

    def rnd(point: str, x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return round_operand(x, dtype) if point in keep else x

    qh = rnd("qk_operands", _expand_kv_heads(l2norm(q.to(acc)), HV))
    kh = rnd("qk_operands", _expand_kv_heads(l2norm(k.to(acc)), HV))
    vf, bf = v.to(acc), beta.to(acc)
    log2a = torch.log2(torch.exp(g.to(acc)) + DECAY_FLOOR)
    scale = K ** -0.5
    S = (torch.zeros(B, HV, K, V, dtype=acc, device=v.device) if state is None else state.to(acc))
    outs = []
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        qc, kc, vc = (t[:, sl].transpose(1, 2) for t in (qh, kh, vf))   # [B, HV, C, *]
        bc = bf[:, sl].transpose(1, 2)
        C = qc.shape[2]
        c = log2a[:, sl].transpose(1, 2).cumsum(dim=-1)                # [B, HV, C]
        gamma = torch.exp2(c)
        lower = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        decay = torch.exp2(c[..., :, None] - c[..., None, :]).masked_fill(~lower, 0.0)
        strict = lower & ~torch.eye(C, dtype=torch.bool, device=v.device)
        A = rnd("kk_fp16", (bc[..., :, None] * decay * (kc @ kc.transpose(-1, -2)))
                .masked_fill(~strict, 0.0), torch.float16)
        inv = _unit_lower_inverse(A, lambda x: rnd("inverse_fp16", x, torch.float16))
        Tm = rnd("t_bf16", inv * bc[..., None, :])
        Sb = rnd("state_operand", S)
        sk = rnd("sk_bf16", gamma[..., None] * (kc @ Sb))
        D = rnd("d_bf16", vc - sk)
        v_new = rnd("v_new_bf16", Tm @ D)
        qk = rnd("qk_scores_bf16", scale * decay * (qc @ kc.transpose(-1, -2)))
        o = scale * gamma[..., None] * (qc @ Sb) + qk @ v_new
        outs.append(rnd("o_bf16", o).transpose(1, 2))
        vd = rnd("v_decayed_bf16", torch.exp2(c[..., -1:] - c)[..., None] * v_new)
        S = gamma[..., -1][..., None, None] * S + kc.transpose(-1, -2) @ vd
    return torch.cat(outs, dim=1), S


def gdn_prefill_bf16_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                              b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                              z: torch.Tensor, norm_w: torch.Tensor,
                              state: torch.Tensor | None = None,
                              skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """``gdn_prefill`` in the bf16_operands tier: the gates as in the exact tier, the recurrence by
    ``gdn_chunked_bf16_operands`` (o rounded to bf16), then the gated RMSNorm. Same shapes and
    outputs as ``gdn_prefill``; the final state is fp32 (float64 in reference mode)."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, final = gdn_chunked_bf16_operands(q, k, v, g, beta, state, skip=skip)
    reference = is_reference_mode(q, k, v, g, beta, state)
    return {"out": gated_rmsnorm(o, z, norm_w), "final_state": out_cast(final, torch.float32,
                                                                          reference)}


# ---------------------------------------------------------------- the layer's fused steps


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor,
               norm_w: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
               ) -> dict[str, torch.Tensor]:
    """One decode step per request over a state pool: gates + recurrence + gated RMSNorm.

    q, k [B, HK, K]; v, z [B, HV, V]; a, b [B, HV]; A_log, dt_bias [HV]; norm_w [V];
    state_pool [P, HV, K, V] (fp32 or bf16 storage); slots [B] int (distinct pool rows).
    Returns ``out`` [B, HV, V] in z's dtype and ``state_pool``: a new pool whose rows ``slots`` hold
    the states after the step (the other rows unchanged).
    """
    res = gdn_verify(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), a.unsqueeze(1),
                     b.unsqueeze(1), A_log, dt_bias, z.unsqueeze(1), norm_w, state_pool, slots)
    pool = state_pool.to(res["states"].dtype).clone()
    pool[slots.long()] = res["states"][:, 0]
    return {"out": res["out"][:, 0], "state_pool": pool}


def gdn_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor,
               norm_w: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
               ) -> dict[str, torch.Tensor]:
    """The MTP verify step: T rows a request from the pool state, recording the state after each row.

    Shapes as ``gdn_decode`` with a row axis: q, k [B, T, HK, K]; v, z [B, T, HV, V]; a, b [B, T, HV].
    The pool is read, never written: commit (rollback) later copies entry ``num_accepted - 1``.
    Returns ``out`` [B, T, HV, V] in z's dtype and ``states`` [B, T, HV, K, V] in the pool's dtype
    (float64 in reference mode).
    """
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    state = state_pool[slots.long()]
    o, states, _ = gdn_recurrent(q, k, v, g, beta, state, state_dtype=state_pool.dtype)
    out = gated_rmsnorm(o, z, norm_w)
    return {"out": out, "states": states}


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor,
                norm_w: torch.Tensor, state: torch.Tensor | None = None,
                ) -> dict[str, torch.Tensor]:
    """Prefill of whole sequences: gates + recurrence (recurrent form) + gated RMSNorm.

    q, k [B, T, HK, K]; v, z [B, T, HV, V]; a, b [B, T, HV]; state [B, HV, K, V] fp32 or None.
    Returns ``out`` [B, T, HV, V] in z's dtype and ``final_state`` [B, HV, K, V] (fp32, float64 in
    reference mode). The chunked form ``gdn_chunked`` computes the same function.
    """
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, _, final = gdn_recurrent(q, k, v, g, beta, state, state_dtype=torch.float32, record=False)
    return {"out": gated_rmsnorm(o, z, norm_w), "final_state": final}
