"""Triton on both stacks: compiled on a GPU, interpreted (TRITON_INTERPRET=1, fp32 numpy) on the CPU.

Import this module before ``triton`` in a kernel module: Triton decides between compiling and
interpreting when a kernel is decorated, so the choice has to be made before the first ``@triton.jit``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

import triton  # noqa: E402  (after the interpret choice above)
import triton.language as tl  # noqa: E402


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), returned as fp32, the same on both stacks.

    Why not ``x.to(tl.bfloat16)``: Triton's interpreter truncates that cast (round toward zero), and
    its ``fp_downcast_rounding="rtne"`` path rounds half up without carrying into the exponent, while
    the compiled cast rounds to nearest even. Integer rounding on the bits gives one answer everywhere;
    a cast of the result to bf16 is then exact on every stack. Inputs are finite (NaN is not kept).
    """
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) & 0xFFFF0000
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def softplus(x):
    """softplus with torch's threshold 20, accurate for very negative x (where log(1 + e^x) in fp32
    would lose the whole of e^x): log1p(e) is e - e^2/2 to fp32 precision once e < 1e-4."""
    e = tl.exp(-tl.abs(x))
    log1p_e = tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_e)
