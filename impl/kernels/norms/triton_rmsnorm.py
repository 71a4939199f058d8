"""Triton RMSNorm (zero-centred weight): ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim.

One program per row holds the whole row (hidden up to 4096 after padding to a power of two). The
rounding points are the spec's (spec/ops/norms.py:rmsnorm): fp32 math, one rounding to bf16 at the end,
done with integer arithmetic on the bits (``round_to_bf16``) so the interpreter and the GPU round the
same way. The fp32 summation order of the mean square is Triton's tree, not torch's, so the result can
differ from the spec's bf16 path by a tie falling the other way (the cells' band covers it).
"""

from __future__ import annotations

from impl.kernels import triton_support  # noqa: F401  (compile vs interpret, before triton)
import torch
import triton
import triton.language as tl

from impl.kernels.layout import require_contiguous
from impl.kernels.triton_support import round_to_bf16

EPS = 1e-6  # spec/ops/norms.py:EPS


@triton.jit
def _rmsnorm_kernel(x, w, out, eps, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    xv = tl.load(x + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    wv = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(xv * xv, axis=0) / D + eps)
    y = round_to_bf16(xv * r * (1.0 + wv))
    tl.store(out + row * D + offs, y.to(out.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor, eps: float = EPS) -> None:
    """x [..., D] bf16, w [D] -> out [..., D] bf16, written completely."""
    if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError("the Triton rmsnorm rounds to bf16: x and out must be bf16")
    D = x.shape[-1]
    require_contiguous("the Triton rmsnorm", x=x, w=w, out=out)
    rows = x.numel() // D
    if rows == 0:
        return
    _rmsnorm_kernel[(rows,)](x, w, out, eps, D=D, BLOCK=triton.next_power_of_2(D),
                             num_warps=4 if D <= 1024 else 8)
