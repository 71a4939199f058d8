"""RMSNorm in its two forms used by the target (docs/spec.md, "Norms and embeddings").

Public definition: RMSNorm (Zhang & Sennrich, 2019), with the zero-centred weight ``(1 + w)`` of
Qwen3-Next (weights initialised to 0) for ``rmsnorm``, and the plain-weight gated form of the
Qwen3-Next / FLA gated RMSNorm for the Gated-DeltaNet output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec.numerics import acc_dtype, is_reference_mode, out_cast, round_to

EPS = 1e-6


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim; fp32 math, one cast at the end.

    x: [..., D] activation dtype; w: [D]. Returns x's dtype (float64 in reference mode).
    """
    acc = acc_dtype(x, w)
    xf = x.to(acc)
    r = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out_cast(xf * r * (1.0 + w.to(acc)), x.dtype, is_reference_mode(x, w))


def gated_rmsnorm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float = EPS,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The GDN output norm: ``w * (o * rsqrt(mean(o^2) + eps))`` cast to the activation dtype, times
    ``silu(z)`` computed in fp32, then cast.

    o: [..., Dv] (the recurrence output, fp32 or float64); z: [..., Dv] activation dtype; w: [Dv]
    (plain weight, initialised to 1). The activation dtype is ``out_dtype`` (default z's dtype).
    Two rounding points, both to the activation dtype: after the weighted norm, and at the end.
    """
    act = out_dtype or z.dtype
    reference = is_reference_mode(o, z, w)
    acc = acc_dtype(o, z, w)
    of = o.to(acc)
    normed = w.to(acc) * (of * torch.rsqrt(of.pow(2).mean(dim=-1, keepdim=True) + eps))
    normed = round_to(normed, act, reference)
    gate = F.silu(z.to(acc))
    return out_cast(normed * gate, act, reference)
