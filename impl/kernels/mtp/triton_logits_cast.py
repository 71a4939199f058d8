"""Triton widening of bf16 logits to fp32, on the bits, as the spec writes it (spec/ops/mtp.py:logits_cast).

The bf16 pattern is loaded as int16, sign-extended to int32 and multiplied by 65536 (|result| <= 2^31,
no overflow, no shift of a negative number); the int32 is stored into the fp32 output viewed as int32.
No float arithmetic touches a value, so subnormals, -0.0 and inf survive on every stack, and the result
is bitwise the spec's.
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.layout import require_contiguous
from impl.kernels.triton_support import INTERPRETING


@triton.jit
def _widen_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(src + offs, mask=mask, other=0).to(tl.int32)
    tl.store(dst + offs, bits * 65536, mask=mask)


def logits_cast(logits: torch.Tensor, *, logits_fp32: torch.Tensor) -> None:
    """logits [..., V] bf16 -> logits_fp32 [..., V] fp32, written completely."""
    if logits.dtype != torch.bfloat16 or logits_fp32.dtype != torch.float32:
        raise ValueError("the Triton logits_cast widens bf16 to fp32")
    require_contiguous("the Triton logits_cast", logits=logits, logits_fp32=logits_fp32)
    n = logits.numel()
    if n == 0:
        return
    block = 1 << 16 if INTERPRETING else 4096  # the interpreter pays per program, the GPU per register
    _widen_kernel[(triton.cdiv(n, block),)](logits.view(torch.int16), logits_fp32.view(torch.int32),
                                            n, BLOCK=block, num_warps=4)
