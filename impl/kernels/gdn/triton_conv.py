"""Triton decode step of the GDN depthwise causal conv (kernel 4, no bias) + SiLU, the conv state
rolled in place (spec/ops/gdn.py:causal_conv1d_update).

One program per (request, block of channels): it loads the 3 stored inputs and the new one, sums the
4 taps oldest first in fp32 (``acc = acc + W[:, j] * window[j]``, the spec's order), applies SiLU, rounds
once to bf16 on the bits (``round_to_bf16``), and writes the state back shifted by one: all loads of a
program come before its stores and programs touch disjoint channels, so the in-place roll is safe. The
state holds stored values and is moved, never recomputed, so it is exact.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.layout import require_contiguous
from impl.kernels.triton_support import round_to_bf16

BLOCK_C = 256


@triton.jit
def _conv_update_kernel(x, weight, state, y, C, BLOCK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    srow = state + (i_b * C + offs) * 3
    s0 = tl.load(srow + 0, mask=mask, other=0.0)
    s1 = tl.load(srow + 1, mask=mask, other=0.0)
    s2 = tl.load(srow + 2, mask=mask, other=0.0)
    xv = tl.load(x + i_b * C + offs, mask=mask, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc = acc + tl.load(weight + offs * 4 + 0, mask=mask, other=0.0).to(tl.float32) * s0.to(tl.float32)
    acc = acc + tl.load(weight + offs * 4 + 1, mask=mask, other=0.0).to(tl.float32) * s1.to(tl.float32)
    acc = acc + tl.load(weight + offs * 4 + 2, mask=mask, other=0.0).to(tl.float32) * s2.to(tl.float32)
    acc = acc + tl.load(weight + offs * 4 + 3, mask=mask, other=0.0).to(tl.float32) * xv.to(tl.float32)
    out = round_to_bf16(acc / (1.0 + tl.exp(-acc)))
    tl.store(y + i_b * C + offs, out.to(y.dtype.element_ty), mask=mask)
    tl.store(srow + 0, s1, mask=mask)
    tl.store(srow + 1, s2, mask=mask)
    tl.store(srow + 2, xv.to(state.dtype.element_ty), mask=mask)


def gdn_conv_update(x, weight, conv_state, *, y) -> None:
    """x [B, C] bf16, weight [C, 4], conv_state [B, C, 3] (rolled in place) -> y [B, C] bf16."""
    B, C = x.shape
    if y.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        raise ValueError("the Triton conv update rounds to bf16: x and y must be bf16")
    if conv_state.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported conv state dtype {conv_state.dtype} (bf16 or fp32)")
    require_contiguous("the Triton conv update", x=x, weight=weight, conv_state=conv_state, y=y)
    if B == 0:
        return
    _conv_update_kernel[(B, triton.cdiv(C, BLOCK_C))](x, weight, conv_state, y, C, BLOCK=BLOCK_C,
                                                        num_warps=4)
