"""The MTP draft layer's input with one batched fp32 GEMM (spec/ops/mtp.py; docs/spec.md, "Draft
input").

``mtp_draft_input(next_token, h_prev, embed, norm_emb_w, norm_h_w, fc_w, *, h_draft)`` writes
``h' = fc(cat[rmsnorm(embed(next_token)), rmsnorm(h_prev)])``. The fc product is one [T, 2C] @ [2C, C]
fp32 matmul over the launch's rows, where the spec runs one product per row
(``spec.numerics.rowwise_matmul``, a launch per row). The rest is the spec's: the gather, the two
zero-centred rmsnorms in fp32 each rounded to the activation dtype (the GEMM's inputs), the
concatenation embedding first, and one cast of h' to its buffer's dtype (bf16). The normed halves and
the bf16 weight are exact in fp32, so the products are exact and only the summation order differs from
the spec's (``impl.kernels.gemm.widened_matmul``: a bf16 GEMM with an fp32 result on cuda).

The library picks its GEMM kernel and summation order from the launch's shape (torch's CPU path
differs for 1 to 3 rows), so a row's last bits may depend on how many rows share the launch: this
variant is not batch-invariant, and batch-invariant mode runs the spec's path.
"""

from __future__ import annotations

import torch

from impl.kernels.gemm import widened_matmul

from spec.ops.norms import rmsnorm


def mtp_draft_input(next_token: torch.Tensor, h_prev: torch.Tensor, embed: torch.Tensor,
                    norm_emb_w: torch.Tensor, norm_h_w: torch.Tensor, fc_w: torch.Tensor, *,
                    h_draft: torch.Tensor) -> None:
    """next_token [T] int64, h_prev [T, C], embed [V, C], norm_emb_w, norm_h_w [C], fc_w [C, 2C] ->
    h_draft [T, C] (the activation dtype, written completely)."""
    f32, act = torch.float32, h_draft.dtype
    e = rmsnorm(embed[next_token].to(f32), norm_emb_w.to(f32)).to(act).to(f32)
    h = rmsnorm(h_prev.to(f32), norm_h_w.to(f32)).to(act).to(f32)
    h_draft.copy_(widened_matmul(torch.cat([e, h], dim=-1).to(fc_w.dtype), fc_w.T))
