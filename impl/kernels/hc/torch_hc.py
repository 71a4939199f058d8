"""The first projection of a hyper-connection site as one fp32 GEMM (spec/ops/hc.py;
docs/spec.md, "Hyper-connections" step 2).

``hc_first_projection(v, r, phi, bias, *, h_pre, h_post, h_res)`` computes the site's logits
``l = (v * r) @ Phi + bias`` for all tokens of the launch in one batched fp32 matmul, where the spec
runs one [1, n*C] @ [n*C, 2n + n^2] product per row (``spec.numerics.rowwise_matmul``, a launch per
row). The rest is the spec's: the split ``[l_pre | l_post | l_res]``, ``sigmoid``, ``2 sigmoid``, the
per-matrix shift of ``exp(l_res - max)`` and the spec's own (vectorised) ``sinkhorn``, 20 rounds, all in
fp32 with no rounding point. n is read from Phi's 2n + n^2 columns.

The GEMM is full fp32 (``impl.kernels.gemm.fp32_matmul``: no TF32).

The library picks its GEMM kernel and summation order from the launch's shape, so a row's last bits
may depend on how many rows share the launch: this variant is not batch-invariant, and
batch-invariant mode runs the spec's path.
"""

from __future__ import annotations

import math

import torch

from impl.kernels.gemm import fp32_matmul

from spec.ops.hc import SINKHORN_ITERS, sinkhorn


def first_projection_gates(v: torch.Tensor, r: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor,
                           h_pre: torch.Tensor, h_post: torch.Tensor) -> torch.Tensor:
    """The logits' GEMM, H_pre and H_post written; returns Sinkhorn's input exp(l_res - max)
    [T, n, n] fp32 (the step a kernel variant may take over)."""
    width = phi.shape[-1]
    n = math.isqrt(width + 1) - 1
    if 2 * n + n * n != width or bias.shape[-1] != width:
        raise ValueError(f"Phi and bias must have 2n + n^2 columns, got {width} and {bias.shape[-1]}")
    f32 = torch.float32
    logits = fp32_matmul(v.to(f32) * r.to(f32)[:, None], phi.to(f32)) + bias.to(f32)
    l_res = logits[:, 2 * n:].reshape(-1, n, n)
    shift = l_res.amax(dim=(-2, -1), keepdim=True)  # cancelled by Sinkhorn's first normalisation
    h_pre.copy_(torch.sigmoid(logits[:, :n]))
    h_post.copy_(2.0 * torch.sigmoid(logits[:, n:2 * n]))
    return torch.exp(l_res - shift)


def hc_first_projection(v: torch.Tensor, r: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, *,
                        h_pre: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> None:
    """v [T, n*C], r [T], phi [n*C, 2n + n^2], bias [2n + n^2] -> h_pre, h_post [T, n], h_res
    [T, n, n] (fp32 buffers, written completely)."""
    h_res.copy_(sinkhorn(first_projection_gates(v, r, phi, bias, h_pre, h_post), SINKHORN_ITERS))
