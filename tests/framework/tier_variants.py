"""Test-only numerics tier of the standalone gated norm: its input o rounded to fp8 (e4m3) first,
as a kernel reading o from an fp8 buffer would compute it. The spec path of the tier and a variant
that keeps it."""

import torch

from impl.kernels.gdn import torch_ops
from spec.numerics import round_operand
from spec.ops.norms import gated_rmsnorm

FP8 = torch.float8_e4m3fn


def gated_rmsnorm_fp8_input(o, z, w):
    """The tier's spec path: o rounded once to e4m3, then the gated norm."""
    return gated_rmsnorm(round_operand(o, FP8), z, w)


def gated_rmsnorm_from_fp8(o, z, w, *, out) -> None:
    """A variant of that tier: reads o as fp8 codes."""
    torch_ops.gated_rmsnorm(o.to(FP8).float(), z, w, out=out)
