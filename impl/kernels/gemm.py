"""The GEMM forms the torch variants use, each with the spec's rounding points.

- ``bf16_matmul(a, b, out=None)``: bf16 operands, exact products, fp32 accumulation and one rounding to
  bf16 (the spec's projection). cuBLAS may otherwise reduce split-K partial sums in bf16
  (``allow_bf16_reduced_precision_reduction``, on by default), a rounding point the spec does not
  have, so the first call on cuda turns it off for the process.
- ``fp32_matmul(a, b)``: fp32 operands, fp32 products and sums. On cuda TF32 is off for the call: TF32
  would round each fp32 operand to 10 mantissa bits.
- ``widened_matmul(a, b)``: bf16 operands widened exactly, fp32 products (exact) and sums, an fp32
  result. On cuda it is one bf16 GEMM with an fp32 output (``torch.mm(..., out_dtype=float32)``), so the
  operands are never copied to fp32; elsewhere the operands are widened first.

The library picks its kernel and summation order from the shape, so a row's last bits may depend on
the rows sharing the launch: none of these is batch-invariant.
"""

from __future__ import annotations

import torch

_exact_bf16_reduction = False


def bf16_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    global _exact_bf16_reduction
    if a.device.type == "cuda" and not _exact_bf16_reduction:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        _exact_bf16_reduction = True
    return torch.matmul(a, b, out=out)


def fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.device.type != "cuda" or not torch.backends.cuda.matmul.allow_tf32:
        return a.float() @ b.float()
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.float() @ b.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True


def widened_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cuda" and a.dtype == b.dtype == torch.bfloat16 and a.dim() == b.dim() == 2:
        return torch.mm(a, b, out_dtype=torch.float32)
    return fp32_matmul(a, b)
