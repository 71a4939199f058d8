"""The dense projection as one BLAS GEMM (cuBLAS on sm_90, oneDNN / the CPU BLAS on the CPU).

``linear(x, w, *, out)`` writes ``x @ w^T`` into ``out`` (the activation dtype): bf16 operands, products
exact in fp32, fp32 accumulation and one rounding to bf16 in the GEMM's epilogue, which are the spec's
rounding points in another summation order (``impl.kernels.gemm.bf16_matmul``: no bf16 split-K
reduction on cuda).

A row's result may depend on the launch's row count (the library picks its kernel and blocking from
the shape): this variant is not batch-invariant, and batch-invariant mode runs the spec's path.
"""

from __future__ import annotations

import torch

from impl.kernels.gemm import bf16_matmul


def linear(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor) -> None:
    bf16_matmul(x, w.T, out=out)
