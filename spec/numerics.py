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
    """An activation rounding point of MATH.md: cast to ``dtype`` and back to x's dtype.

    In reference (float64) mode it is the identity, so a float64 run computes the ideal result.
    """
    if reference:
        return x
    return x.to(dtype).to(x.dtype)


def out_cast(x: torch.Tensor, dtype: torch.dtype, reference: bool) -> torch.Tensor:
    """The final cast of an op to its output dtype; float64 mode keeps float64."""
    return x if reference else x.to(dtype)
