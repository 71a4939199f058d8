"""Seeded tensor helpers shared by the input builders."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32, device="cpu", scale=1.0,
          shift=0.0) -> torch.Tensor:
    """Normal draws on the CPU from ``gen`` (so a cell's inputs are the same on every device)."""
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype=dtype, device=device)


def uniform(gen: torch.Generator, *shape: int, lo: float, hi: float, dtype=torch.float32,
            device="cpu") -> torch.Tensor:
    return (torch.rand(*shape, generator=gen) * (hi - lo) + lo).to(dtype=dtype, device=device)


def distinct_slots(gen: torch.Generator, batch: int, pool: int, device="cpu") -> torch.Tensor:
    """``batch`` distinct pool rows in shuffled order, so a kernel that assumes slot == request fails."""
    return torch.randperm(pool, generator=gen)[:batch].to(dtype=torch.int32, device=device)
