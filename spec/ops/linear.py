"""The dense projections of the model (docs/spec.md, "Norms and embeddings": every ``x @ W^T`` of the
GDN and QSA mixers and the LM head): one op, ``linear``.

Op defined here:
- ``linear``: ``linear``  y = x @ W^T, accumulated in the acc dtype, rounded once to x's dtype.

The product runs row by row (``spec.numerics.rowwise_matmul``), so a row's result does not depend on
the rows sharing its launch: the spec is batch-invariant by construction, and the engine's
batch-invariant mode runs this path. The fp32 summation order inside one row is the BLAS's; no
implementation is expected to reproduce it bit for bit, so fast variants are certified by tolerance.
"""

from __future__ import annotations

import torch

from spec.numerics import acc_dtype, is_reference_mode, out_cast, rowwise_matmul


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Op ``linear``: ``x @ w^T``.

    x: [T, in]; w: [out, in], both in the activation dtype (bf16, or float64 in reference mode).
    Products and sums in acc_dtype(x, w) (fp32, or float64), one rounding to x's dtype at the end
    (float64 stays float64). Returns [T, out].
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [T, in] and w [out, in], got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"x and w must share the activation dtype, got {x.dtype} and {w.dtype}")
    acc = acc_dtype(x, w)
    return out_cast(rowwise_matmul(x.to(acc), w.to(acc).T), x.dtype, is_reference_mode(x, w))
