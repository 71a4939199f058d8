"""The vision tower as batched torch GEMMs: every group of frames in one launch per projection.

``vision_tower(frames, ..., heads, *, out)`` writes into ``out`` [F * gh * gw, out_width] (the frames'
dtype) what ``spec.ops.vision.vision_tower`` computes: the inputs widened exactly to fp32, the whole
tower in fp32 (``impl.kernels.gemm.fp32_matmul``: TF32 off on cuda), one rounding at the end. The
groups are a batch dimension [F / G, G gh gw, D], so attention still mixes the tokens of one group
only; the spec loops over groups and rows instead.

The library picks its GEMM kernels and summation order from the shape, so a frame's last bits may
depend on the number of groups in the call: this variant is not batch-invariant.
"""

from __future__ import annotations

import math

import torch

from impl.kernels.gemm import fp32_matmul
from spec.ops.vision import patchify

EPS = 1e-6


def _rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * (1.0 + w)


def vision_tower(frames: torch.Tensor, patch_w: torch.Tensor, pos_frame: torch.Tensor,
                 pos_patch: torch.Tensor, attn_norm: torch.Tensor, w_qkv: torch.Tensor,
                 w_o: torch.Tensor, mlp_norm: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, out_norm: torch.Tensor, w_out: torch.Tensor, heads: int, *,
                 out: torch.Tensor) -> None:
    y = tower_fp32(frames, patch_w, pos_frame, pos_patch, attn_norm, w_qkv, w_o, mlp_norm, w_up,
                   w_down, out_norm, w_out, heads)
    out.copy_(y)


def tower_fp32(frames: torch.Tensor, patch_w: torch.Tensor, pos_frame: torch.Tensor,
               pos_patch: torch.Tensor, attn_norm: torch.Tensor, w_qkv: torch.Tensor,
               w_o: torch.Tensor, mlp_norm: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               out_norm: torch.Tensor, w_out: torch.Tensor, heads: int) -> torch.Tensor:
    """The tower's fp32 rows [F gh gw, out_width], before the final rounding (differentiable: the
    frame task trains the tower through it, impl/train/train_frames.py)."""
    F, C = frames.shape[0], frames.shape[1]
    G, D = pos_frame.shape
    if F % G:
        raise ValueError(f"frame count {F} must be a multiple of the group {G}")
    patch = math.isqrt(patch_w.shape[1] // C)
    f32 = lambda t: t.to(torch.float32)  # noqa: E731 - bf16 -> fp32 is exact
    tokens = patchify(f32(frames), patch)
    per_group = tokens.shape[0] // (F // G)
    dh = D // heads
    pos = (f32(pos_frame)[:, None, :] + f32(pos_patch)[None, :, :]).reshape(per_group, D)
    x = fp32_matmul(tokens.reshape(F // G, per_group, -1), f32(patch_w).T) + pos
    for layer in range(attn_norm.shape[0]):
        h = _rmsnorm(x, f32(attn_norm[layer]))
        qkv = fp32_matmul(h, f32(w_qkv[layer]).T)
        q, k, v = (qkv[..., i * D:(i + 1) * D].unflatten(-1, (heads, dh)).transpose(1, 2)
                   for i in range(3))  # [groups, heads, tokens, dh]
        p = torch.softmax(fp32_matmul(q, k.transpose(-1, -2)) / math.sqrt(dh), dim=-1)
        o = fp32_matmul(p, v).transpose(1, 2).reshape(x.shape)
        x = x + fp32_matmul(o, f32(w_o[layer]).T)
        h = _rmsnorm(x, f32(mlp_norm[layer]))
        up = torch.nn.functional.gelu(fp32_matmul(h, f32(w_up[layer]).T), approximate="tanh")
        x = x + fp32_matmul(up, f32(w_down[layer]).T)
    y = fp32_matmul(_rmsnorm(x, f32(out_norm)), f32(w_out).T)
    return y.reshape(F * per_group // G, -1)
