"""The numerics convention shared by every spec function (see the package docstring)."""

from __future__ import annotations

import torch


def acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any floating input is float64, else float32: the accumulation dtype of the spec."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def is_reference_mode(*tensors: torch.Tensor | None) -> bool:
    """True when the spec runs as the float64 reference (activation rounding points are identities)."""
    return acc_dtype(*tensors) == torch.float64


def round_to(x: torch.Tensor, dtype: torch.dtype, reference: bool) -> torch.Tensor:
    """An activation rounding point of docs/spec.md: cast to ``dtype`` and back to x's dtype.

    In reference (float64) mode it is the identity, so a float64 run computes the ideal result.
    """
    if reference:
        return x
    return x.to(dtype).to(x.dtype)


def out_cast(x: torch.Tensor, dtype: torch.dtype, reference: bool) -> torch.Tensor:
    """The final cast of an op to its output dtype; float64 mode keeps float64."""
    return x if reference else x.to(dtype)


def rowwise_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a [T, K] and b [K, N] (same dtype), computed row by row.

    Each row is its own [1, K] @ [K, N] product on a freshly allocated copy of the row, so neither the
    number of rows nor a row's position in memory can change its result (BLAS kernels may pick a
    different summation order for different shapes or alignments). Returns [T, N] in a's dtype.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"expected [T, K] @ [K, N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.device.type == "meta":  # meta: shapes only (the reach tracer); the row loop would only cost time
        return a @ b
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    b = b.contiguous()
    for t in range(a.shape[0]):
        out[t] = (a[t:t + 1].clone() @ b)[0]
    return out


def round_operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An operand rounding point of a numerics tier (docs/spec.md, "Numerics tiers"): ``x`` rounded
    once to ``dtype`` (to nearest even) and returned in x's dtype, in reference mode too, since the
    rounding is the tier's contract, not a storage choice.

    A float64 ``x`` is rounded to fp32 *to odd* first (fp32 keeps at least two more bits than
    bf16 or fp16), so the result is the correctly rounded value, not the twice-rounded one that
    torch's float64 -> bf16 cast (through fp32) gives.
    """
    if x.dtype != torch.float64:
        return x.to(dtype).to(x.dtype)
    y = x.to(torch.float32)
    y64 = y.to(torch.float64)
    inexact = (y64 != x) & torch.isfinite(x) & torch.isfinite(y64)
    bits = y.view(torch.int32)
    bits = torch.where(inexact & (y64.abs() > x.abs()), bits - 1, bits)   # toward zero
    bits = torch.where(inexact, bits | 1, bits)                             # sticky last bit
    return bits.view(torch.float32).to(dtype).to(torch.float64)
