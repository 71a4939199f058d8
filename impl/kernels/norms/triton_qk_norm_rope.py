"""Triton QK norm + RoPE (plain or interleaved mRoPE) in one launch for q and k.

One program per token holds all of its heads, q and k, as [heads, head_dim] tiles: the zero-centred
rmsnorm of every head row (fp32 math, one rounding to bf16: spec/ops/rope.py rounding point 1), the
pass-through dims stored from that rounded norm, and the NeoX rotate-half rotation of the first
``rotary_dim`` dims computed in fp32 from the same rounded values (rounding point 2, one final bf16
rounding). Roundings go through ``round_to_bf16`` so the interpreter and the GPU round alike.

cos / sin come from a table indexed by position: the spec's float64 angle ``position * inv_freq``,
its cos and sin rounded to fp32 (rounding point 3), built once per (device, rotary_dim, theta,
max_position) for every position up to ``max_position`` (the model's longest context), so a call
reads no value on the host (no synchronisation, and a CUDA graph can hold it). A token's frequency j
reads the table at its plain position or, for mRoPE, at its position row ``mrope_freq_rows[j]`` (t, h
or w), so one gather serves both modes. Positions are the engine's (0 .. max_position); the kernel
clamps them into the table so that a bad one can never read outside it, and a host-side range check
runs when the positions live on the host.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.triton_support import round_to_bf16
from spec.ops.rope import EPS, MROPE_SECTIONS, ROTARY_DIM, THETA, inv_freq, mrope_freq_rows

MAX_POSITION = 131071  # the longest context the model serves (131072 tokens), its last position

_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_FREQ_ROWS: dict[tuple, torch.Tensor] = {}


def cos_sin_table(max_position: int, device: torch.device, rotary_dim: int = ROTARY_DIM,
                  theta: float = THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [max_position + 1, rotary_dim // 2] cos and sin of the float64 angles ``p * inv_freq_j``,
    built once per (device, rotary_dim, theta, max_position)."""
    key = (str(device), rotary_dim, theta, max_position)
    have = _TABLES.get(key)
    if have is not None:
        return have
    pos = torch.arange(max_position + 1, dtype=torch.float64, device=device)
    angles = pos[:, None] * inv_freq(rotary_dim, theta, device=device)[None, :]
    table = (torch.cos(angles).to(torch.float32).contiguous(),
             torch.sin(angles).to(torch.float32).contiguous())
    _TABLES[key] = table
    return table


@triton.jit
def _norm_rope_heads(x, w, out, cos, sin, pos, freq_row, token, n_tokens, max_pos, eps,
                     H: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                     MROPE: tl.constexpr):
    """All H heads of one token: x, out [T, H, D] bf16; w [D]."""
    heads = tl.arange(0, BH)
    dims = tl.arange(0, D)
    hmask = heads < H
    base = token * (H * D)
    offs = base + heads[:, None] * D + dims[None, :]
    xv = tl.load(x + offs, mask=hmask[:, None], other=0.0).to(tl.float32)
    wv = tl.load(w + dims).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(xv * xv, axis=1) / D + eps)                      # [BH]
    y = round_to_bf16(xv * r[:, None] * (1.0 + wv[None, :]))
    # Pass-through dims: the rounded norm itself.
    tl.store(out + offs, y.to(out.dtype.element_ty), mask=hmask[:, None] & (dims[None, :] >= 2 * HALF))

    # The rotated pairs (j, j + HALF), recomputed from x with the same arithmetic as y above.
    j = tl.arange(0, HALF)
    lo = base + heads[:, None] * D + j[None, :]
    x1 = tl.load(x + lo, mask=hmask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(x + lo + HALF, mask=hmask[:, None], other=0.0).to(tl.float32)
    w1 = tl.load(w + j).to(tl.float32)
    w2 = tl.load(w + j + HALF).to(tl.float32)
    y1 = round_to_bf16(x1 * r[:, None] * (1.0 + w1[None, :]))
    y2 = round_to_bf16(x2 * r[:, None] * (1.0 + w2[None, :]))
    if MROPE:
        row = tl.load(freq_row + j)                                               # 0, 1 or 2
        p = tl.load(pos + row.to(tl.int64) * n_tokens + token)
    else:
        p = tl.load(pos + token + j * 0)
    p = tl.minimum(tl.maximum(p.to(tl.int64), 0), max_pos)   # never read outside the table
    t_off = p * HALF + j
    c = tl.load(cos + t_off)[None, :]
    s = tl.load(sin + t_off)[None, :]
    o1 = round_to_bf16(y1 * c - y2 * s)
    o2 = round_to_bf16(y2 * c + y1 * s)
    tl.store(out + lo, o1.to(out.dtype.element_ty), mask=hmask[:, None])
    tl.store(out + lo + HALF, o2.to(out.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _qk_norm_rope_kernel(q, k, w_q, w_k, q_out, k_out, cos, sin, pos, freq_row, n_tokens, max_pos,
                         eps,
                         HQ: tl.constexpr, BHQ: tl.constexpr, HK: tl.constexpr, BHK: tl.constexpr,
                         D: tl.constexpr, HALF: tl.constexpr, MROPE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    _norm_rope_heads(q, w_q, q_out, cos, sin, pos, freq_row, token, n_tokens, max_pos, eps,
                     HQ, BHQ, D, HALF, MROPE)
    _norm_rope_heads(k, w_k, k_out, cos, sin, pos, freq_row, token, n_tokens, max_pos, eps,
                     HK, BHK, D, HALF, MROPE)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor,
                 positions: torch.Tensor, *, q_out: torch.Tensor, k_out: torch.Tensor,
                 rotary_dim: int = ROTARY_DIM, theta: float = THETA, eps: float = EPS,
                 sections: tuple[int, int, int] = MROPE_SECTIONS,
                 max_position: int = MAX_POSITION) -> None:
    """q [T, Hq, D], k [T, Hk, D] bf16; w_q, w_k [D]; positions int [T] or [3, T] (mRoPE), each in
    0 .. max_position -> q_out, k_out (written completely)."""
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        raise ValueError("the Triton QK norm + RoPE rounds to bf16: q and k must be bf16")
    T, HQ, D = q.shape
    HK = k.shape[1]
    if D & (D - 1) or rotary_dim & (rotary_dim - 1) or rotary_dim > D:
        raise ValueError(f"head_dim {D} and rotary_dim {rotary_dim} must be powers of two, "
                         "rotary_dim <= head_dim")
    if T == 0:
        return
    mrope = positions.dim() == 2
    if mrope and positions.shape[0] != 3:
        raise ValueError(f"positions must be [T] or [3, T], got {tuple(positions.shape)}")
    if positions.device.type == "cpu" and positions.numel() and (
            int(positions.min()) < 0 or int(positions.max()) > max_position):
        raise ValueError(f"positions must lie in 0 .. {max_position}")
    cos, sin = cos_sin_table(max_position, q.device, rotary_dim, theta)
    # the mRoPE position row of every frequency; plain positions read none (any rotary_dim)
    key = (str(q.device), rotary_dim, sections if mrope else None)
    if key not in _FREQ_ROWS:
        _FREQ_ROWS[key] = (mrope_freq_rows(rotary_dim, sections) if mrope
                           else torch.zeros(1)).to(torch.int32).to(q.device)
    rows = _FREQ_ROWS[key]
    pos = positions.to(torch.int64).contiguous()
    _qk_norm_rope_kernel[(T,)](
        q.contiguous(), k.contiguous(), w_q.contiguous(), w_k.contiguous(), q_out, k_out, cos, sin,
        pos, rows, T, max_position, eps, HQ=HQ, BHQ=triton.next_power_of_2(HQ), HK=HK,
        BHK=triton.next_power_of_2(HK), D=D, HALF=rotary_dim // 2, MROPE=mrope, num_warps=8)
