"""FlashInfer's GDN kernels (CuTe DSL, sm_90) as variants of gdn_decode and gdn_prefill.

FlashInfer computes the recurrence only: its inputs are laid out and gated here the way its API takes
them, and the gated RMSNorm is the torch composition's (torch_ops._gated_norm). What each call's
contract is, as measured on the H200 by bench/gdn_decode.py and bench/gdn_prefill.py (FlashInfer
0.7.2.post1):

- value heads are grouped: value head h reads key head h // (HV / H), the spec's mapping (the
  interleaved mapping h % H misses by 140 % relative);
- decode (``flashinfer.gdn_decode.gated_delta_rule_decode``): one row a request as ``[B, 1, ...]``,
  the fp32 state K-major ``[B, HV, K, V]`` (the pool's own layout) updated in place, the raw gate
  inputs (A_log, a, dt_bias, b) with the gates computed inside, q and k l2-normalised inside, scale
  K^-1/2, the output o in bf16;
- prefill (``flashinfer.gdn_prefill.chunk_gated_delta_rule``): tokens flattened to ``[B * T, ...]``
  with ``cu_seqlens``, the decay given as alpha = exp(g) and beta in fp32 (computed here), the fp32
  state V-major ``[N, HV, V, K]`` (the transpose of the spec's), q and k l2-normalised here (fp32,
  then bf16) with the kernel's normalisation off, o in bf16. Its numerics are the gdn_prefill tier
  ``bf16_operands`` (spec.ops.gdn.gdn_prefill_bf16_operands): chunks of 64, the state's and the
  chunk's products on bf16 operands, the triangular inverse in fp16.

Decode rounds o to bf16 before the norm, a rounding the spec does not have; its cells' bands decide
whether it fits. The package is imported inside the calls (``REQUIRES`` declares it): the catalog
loads without it, the certification skips these variants where it is not installed, and the engine
does not dispatch to them there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.kernels.gdn.torch_ops import _gated_norm
from impl.kernels.gdn.triton_chunked import gated_norm, l2norm_rows

REQUIRES = ("flashinfer",)
L2NORM_EPS = 1e-6   # the spec's (spec.ops.gdn.L2NORM_EPS), inside the square root


def gdn_decode(q, k, v, a, b, A_log, dt_bias, z, norm_w, state_pool, slots, *, out) -> None:
    """One decode step over the pool rows at ``slots`` (fp32 pool only: FlashInfer keeps an fp32
    state)."""
    from flashinfer.gdn_decode import gated_delta_rule_decode

    if state_pool.dtype != torch.float32:
        raise ValueError(f"flashinfer's GDN decode keeps an fp32 state; the pool is {state_pool.dtype}")
    idx = slots.long()
    state = state_pool[idx].contiguous()          # [B, HV, K, V]: FlashInfer's K-major layout
    rows = [x.unsqueeze(1).contiguous() for x in (q, k, v, a, b)]
    o, _ = gated_delta_rule_decode(q=rows[0], k=rows[1], v=rows[2], state=state,
                                   A_log=A_log.float().contiguous(), a=rows[3],
                                   dt_bias=dt_bias.float().contiguous(), b=rows[4], scale=None,
                                   use_qk_l2norm=True)
    state_pool[idx] = state                       # updated in place by the kernel
    out.copy_(_gated_norm(o[:, 0].float(), z, norm_w))


def gdn_prefill_chunked(q, k, v, a, b, A_log, dt_bias, z, norm_w, state, *, out,
                        final_state) -> None:
    """Whole sequences of equal length T, continuing from ``state`` [B, HV, K, V]."""
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    B, T, hk, K = q.shape
    hv, V = v.shape[2:]
    # l2norm here, in fp32, rounded to bf16 (the tier's first rounding point): the kernel's own
    # normalisation is a flag whose use varies between releases, so it is turned off
    qn, kn = torch.empty_like(q), torch.empty_like(k)
    l2norm_rows(q.contiguous(), out=qn, eps=L2NORM_EPS)
    l2norm_rows(k.contiguous(), out=kn, eps=L2NORM_EPS)
    # the spec's gates in fp32: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    alpha = g.exp().reshape(B * T, hv).contiguous()
    beta = torch.sigmoid(b.float()).reshape(B * T, hv).contiguous()
    s0 = state.float().transpose(-1, -2).contiguous()          # [B, HV, V, K]
    cu = torch.arange(0, B + 1, device=q.device, dtype=torch.int32) * T
    o = torch.empty(B * T, hv, V, dtype=v.dtype, device=v.device)
    fin = torch.empty_like(s0)
    chunk_gated_delta_rule(qn.reshape(B * T, hk, K), kn.reshape(B * T, hk, K),
                           v.reshape(B * T, hv, V).contiguous(), g=alpha, beta=beta, scale=None,
                           initial_state=s0, output_final_state=True, cu_seqlens=cu,
                           use_qk_l2norm_in_kernel=False, output=o, output_state=fin)
    gated_norm(o, z.contiguous(), norm_w, out=out)
    final_state.copy_(fin.transpose(-1, -2))
