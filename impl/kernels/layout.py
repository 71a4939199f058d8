"""The layout contract of the kernels that address their tensors by row-major offsets: a tensor of
another layout (a non-contiguous view) is refused with its name and strides, never read as if it
were contiguous. Offset views (a storage offset, contiguous from there) are taken."""

from __future__ import annotations

import torch


def require_contiguous(kernel: str, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming every tensor of ``tensors`` that is not contiguous."""
    bad = [f"{name} (shape {tuple(t.shape)}, strides {t.stride()})"
           for name, t in tensors.items() if t is not None and not t.is_contiguous()]
    if bad:
        raise ValueError(f"{kernel}: tensors read by row-major offsets must be contiguous; "
                         f"not contiguous: {', '.join(bad)} (pass contiguous copies)")
